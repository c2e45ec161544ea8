"""The good plugin's connector: the in-process memory connector under another name."""

from omni_plugins.memory import MemoryConfig, MemoryConnector


class DummyConfig(MemoryConfig):
    label: str = "dummy"


class DummyConnector(MemoryConnector):
    config_model = DummyConfig
