"""Testing kit for plugin authors.

- :func:`isolated_plugin_manager`: a context manager that swaps in a plugin
  manager with entry-point autoloading off, restoring the previous one after.
- :func:`register_plugin`: register a plugin object for the duration of a
  ``with`` block (it undoes itself).
- :class:`ConnectorContract`: the conformance suite; subclass it in your tests
  and provide a ``connector_spec`` fixture returning ``(name, config_dict)``.
"""

from omni_plugins.testing.contract import ConnectorContract, sample_payload
from omni_plugins.testing.isolation import isolated_plugin_manager, register_plugin
from omni_plugins.testing.payloads import assert_payload_equal

__all__ = ["ConnectorContract", "assert_payload_equal", "isolated_plugin_manager", "register_plugin", "sample_payload"]
