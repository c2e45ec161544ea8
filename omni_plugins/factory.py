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


class ConnectorConfigError(ConfigError):
    """A connector's settings failed its plugin's config model.

    Besides the one-line message, keeps what a caller needs to place each error itself (the YAML
    loader gives every bad key inside ``extra`` its own line): the model, pydantic's ``errors``
    (locations relative to the settings) and the connector/plugin description.
    """

    def __init__(self, message: str, *, connector: str, origin: str, model: type[BaseModel], errors: list[Any]) -> None:
        super().__init__(message)
        self.connector = connector
        self.origin = origin
        self.model = model
        self.errors = errors


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
        origin = spec.origin
        fields = format_validation_error(exc, prefix=where)
        raise ConnectorConfigError(
            f"invalid config for connector {spec.name!r} from {origin}: {fields}", connector=spec.name, origin=origin, model=model, errors=exc.errors()
        ) from None


def create_connector(name: str, config: Mapping[str, Any] | BaseModel | None = None) -> Connector:
    """Create a connector by registered name with a validated config (a dict or the plugin's model)."""
    spec = resolve_connector(name)
    settings = validate_connector_config(name, config)
    cls = spec.load_class()  # checks the class can be created with the settings as its only argument
    connector = cls(settings)  # type: ignore[call-arg]  # what __init__ raises is the backend's own error: not rewrapped
    if getattr(connector, "_close_lock", None) is None:
        raise PluginLoadError(
            f"connector class {spec.connector!r} (connector {spec.name!r}, {spec.origin}): its __init__ does not call super().__init__()"
        )
    connector.name = spec.name
    return connector


def connector_schema(name: str) -> dict[str, Any]:
    """The JSON schema of connector ``name``'s settings model, with the connector's names in ``x-omni-connector``.

    What ``omni-plugins schema NAME`` prints, and what the documentation's settings tables are made from.
    """
    spec = resolve_connector(name)
    schema = spec.load_config_model().model_json_schema()
    schema.setdefault("title", spec.name)
    schema["x-omni-connector"] = {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "plugin": spec.plugin,
        "distribution": spec.distribution,
    }
    return schema


def available_connectors() -> dict[str, ConnectorSpec]:
    """Registered connectors by name (aliases not repeated)."""
    return {s.name: s for s in get_plugin_manager().registry.specs()}


def plugin_statuses() -> list[PluginStatus]:
    """Every plugin the loader saw, with its status (loaded / blocked / disabled / failed)."""
    return get_plugin_manager().plugin_statuses()
