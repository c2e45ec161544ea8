"""Validated configuration: connector, stage and pipeline models and the YAML loader."""

from omni_plugins.config.loader import load_pipeline_config, parse_pipeline_config
from omni_plugins.config.models import ConnectorConfig, EdgeConfig, PipelineConfig, RankMapping, StageConfig, StageConnectorConfig
from omni_plugins.config.topology import Edge, StageTopology

__all__ = [
    "ConnectorConfig",
    "Edge",
    "EdgeConfig",
    "PipelineConfig",
    "RankMapping",
    "StageConfig",
    "StageConnectorConfig",
    "StageTopology",
    "load_pipeline_config",
    "parse_pipeline_config",
]
