"""Public entry points: create connectors by name and inspect what is installed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from omni_plugins.contract import Connector
from omni_plugins.errors import ConfigError, PluginLoadError
from omni_plugins.naming import is_import_path
from omni_plugins.plugins import PluginStatus, get_plugin_manager
from omni_plugins.registry import ConnectorSpec


def resolve_connector(name: str) -> ConnectorSpec:
    """The registered spec for ``name`` (alias, ``dist:name``, or ``pkg.mod:Class`` path)."""
    if is_import_path(name):
        return ConnectorSpec(name=name, connector=name, plugin="(import path)")
    return get_plugin_manager().registry.resolve(name)


def format_validation_error(exc: ValidationError, *, prefix: str = "") -> str:
    """One line per error: ``prefix.field.path: message``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        where = ".".join(p for p in (prefix, loc) if p)
        lines.append(f"{where or '(root)'}: {err.get('msg', 'invalid')}")
    return "; ".join(lines)


def validate_connector_config(name: str, config: Mapping[str, Any] | BaseModel | None, *, where: str = "") -> BaseModel:
    """Phase two of validation: the plugin's own model checks ``extra``.

    Errors name the connector, the plugin providing it and each bad field.
    """
    spec = resolve_connector(name)
    model = spec.load_config_model()
    if isinstance(config, model):
        return config
    if isinstance(config, BaseModel):
        config = config.model_dump()
    try:
        return model.model_validate(dict(config or {}))
    except ValidationError as exc:
        origin = f"plugin {spec.plugin!r}" + (f" ({spec.distribution} {spec.version})" if spec.distribution else "")
        fields = format_validation_error(exc, prefix=where)
        raise ConfigError(f"invalid config for connector {spec.name!r} from {origin}: {fields}") from None


def create_connector(name: str, config: Mapping[str, Any] | BaseModel | None = None) -> Connector:
    """Create a connector by registered name with a validated config (a dict or the plugin's model)."""
    spec = resolve_connector(name)
    settings = validate_connector_config(name, config)
    cls = spec.load_class()
    try:
        connector = cls(settings)  # type: ignore[call-arg]
    except TypeError as exc:
        raise PluginLoadError(f"connector class {spec.connector!r} must accept its config model as the only argument: {exc}") from exc
    connector.name = spec.name
    return connector


def available_connectors() -> dict[str, ConnectorSpec]:
    """Registered connectors by name (aliases not repeated)."""
    return {s.name: s for s in get_plugin_manager().registry.specs()}


def plugin_statuses() -> list[PluginStatus]:
    """Every plugin the loader saw, with its status (loaded / blocked / disabled / failed)."""
    return get_plugin_manager().plugin_statuses()
