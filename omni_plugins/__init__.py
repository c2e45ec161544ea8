"""omni-plugins: plugin-based connectors for multi-stage inference pipelines.

This module only re-exports the public surface; see the submodules.
"""

from omni_plugins.commands import CommandSink
from omni_plugins.config import (
    ConnectorConfig,
    PipelineConfig,
    RankMapping,
    StageConfig,
    StageConnectorConfig,
    load_pipeline_config,
)
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult, PutTarget
from omni_plugins.errors import (
    BuilderError,
    ConfigError,
    ConnectorClosedError,
    ConnectorContractError,
    ConnectorError,
    ConnectorNotFoundError,
    DuplicateConnectorError,
    OmniPluginsError,
    PluginLoadError,
    TransientConnectorError,
    WireFormatError,
)
from omni_plugins.factory import available_connectors, create_connector, plugin_statuses
from omni_plugins.hookspecs import hookimpl, hookspec
from omni_plugins.registry import RegistrationSink
from omni_plugins.settings import ConnectorSettings

__version__ = "0.1.0"

__all__ = [
    "BuilderError",
    "Capabilities",
    "CommandSink",
    "ConfigError",
    "Connector",
    "ConnectorClosedError",
    "ConnectorConfig",
    "ConnectorContractError",
    "ConnectorError",
    "ConnectorNotFoundError",
    "ConnectorSettings",
    "DuplicateConnectorError",
    "GetResult",
    "OmniPluginsError",
    "PipelineConfig",
    "PluginLoadError",
    "PutResult",
    "PutTarget",
    "RankMapping",
    "RegistrationSink",
    "StageConfig",
    "StageConnectorConfig",
    "TransientConnectorError",
    "WireFormatError",
    "__version__",
    "available_connectors",
    "create_connector",
    "hookimpl",
    "hookspec",
    "load_pipeline_config",
    "plugin_statuses",
]
