"""Validated configuration: connector, stage and pipeline models and the YAML loader."""

from omni_plugins.config.loader import load_pipeline_config, parse_pipeline_config
from omni_plugins.config.models import ConnectorConfig, PipelineConfig, RankMapping, StageConfig, StageConnectorConfig

__all__ = [
    "ConnectorConfig",
    "PipelineConfig",
    "RankMapping",
    "StageConfig",
    "StageConnectorConfig",
    "load_pipeline_config",
    "parse_pipeline_config",
]
