"""A well-behaved test plugin: registers 'dummy' (alias 'DummyConnector') backed by the memory connector."""

from omni_plugins import hookimpl


@hookimpl
def omni_register_connectors(registry):
    registry.register(
        "dummy",
        connector="omni_test_good.connector:DummyConnector",
        config="omni_test_good.connector:DummyConfig",
        aliases=["DummyConnector"],
        description="test fixture",
    )
