"""``omni-plugins new-plugin``: write a complete, installable connector plugin distribution."""

from omni_plugins.scaffold.generate import PluginNames, generate, plugin_names

__all__ = ["PluginNames", "generate", "plugin_names"]
