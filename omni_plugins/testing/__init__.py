"""Testing kit for plugin authors.

- :func:`isolated_plugin_manager`: a context manager that swaps in a plugin
  manager with entry-point autoloading off, restoring the previous one after.
- :func:`register_plugin`: register a plugin object for the duration of a
  ``with`` block (it undoes itself).
- :class:`ConnectorContract`: the conformance suite; subclass it in your tests
  and provide a ``connector_spec`` fixture returning ``(name, config_dict)``.
- :class:`ServicesContract`: the same for the connector's services (census,
  reclaim, private server, raw baseline, preload).

The pytest plugin (:mod:`omni_plugins.testing.pytest_plugin`, loaded by pytest
wherever the core is installed) adds the fixtures ``omni_plugin_manager``,
``omni_connector`` and ``omni_server``.

Names are imported lazily so that ``omni_plugins.testing.builders`` can be
used without importing pytest or torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

if "pytest" in sys.modules:
    # the kit is imported from a plugin's tests, outside the test files pytest rewrites: without this its plain
    # asserts fail as a bare "AssertionError", with none of the values compared
    sys.modules["pytest"].register_assert_rewrite(
        "omni_plugins.testing.contract", "omni_plugins.testing.payloads", "omni_plugins.testing.services"
    )

_EXPORTS = {
    "ConnectorContract": "omni_plugins.testing.contract",
    "ConnectorFactory": "omni_plugins.testing.pytest_plugin",
    "ServerFactory": "omni_plugins.testing.pytest_plugin",
    "ServicesContract": "omni_plugins.testing.services",
    "sample_payload": "omni_plugins.testing.contract",
    "isolated_plugin_manager": "omni_plugins.testing.isolation",
    "register_plugin": "omni_plugins.testing.isolation",
    "assert_payload_equal": "omni_plugins.testing.payloads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omni_plugins.testing' has no attribute {name!r}")
