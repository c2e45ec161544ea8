"""A test plugin whose hook name has a typo: loading must fail loudly, not silently register nothing."""

from omni_plugins import hookimpl


@hookimpl
def omni_register_connector(registry):  # missing trailing 's'
    registry.register("typo", connector="omni_plugins.memory:MemoryConnector")
