"""A test plugin registering the same name as omni-test-good ('dummy')."""

from omni_plugins import hookimpl


@hookimpl
def omni_register_connectors(registry):
    registry.register("Dummy", connector="omni_plugins.memory:MemoryConnector", config="omni_plugins.memory:MemoryConfig")
