"""What ``OmniPlugins`` reads from its vLLM-Omni ``extra``, and what it leaves to others.

vLLM-Omni hands a connector one flat dict: the YAML ``extra`` (which also carries knobs other
components read, such as the payload builders' ``codec_chunk_frames``) plus keys its factory and
initialisation code inject (``stage_id``, ``role``, ``from_stage``/``to_stage``, ports). omni-plugins'
backend settings models refuse unknown keys, so the split is explicit:

- ``backend``: the omni-plugins connector to use (``shm``, ``redis``, ``mooncake-store``, a
  ``dist:name`` or ``pkg.mod:Class``); default ``shm``.
- ``backend_config``: that connector's settings, validated by its plugin's model as in an
  omni-plugins pipeline (``${VAR}`` / ``${VAR:-default}`` are expanded in its strings).
- the injected keys :data:`INJECTED_KEYS`: accepted; ``stage_id`` is exposed as the connector's
  ``stage_id`` (vLLM-Omni's chunk adapter reads it), the others appear in ``health()``.
- every other key: not read (it belongs to another component); a key that looks like a misspelling
  of one of ours is named in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_plugins.config.interpolate import MalformedReferenceError, MissingVariableError, interpolate
from omni_plugins.naming import close_matches

log = logging.getLogger(__name__)

OWN_KEYS = ("backend", "backend_config")
#: keys vLLM-Omni's factory, ``resolve_connector_spec`` and ``get_connectors_config_for_stage`` put into ``extra``
INJECTED_KEYS = frozenset({"stage_id", "role", "from_stage", "to_stage", "zmq_port", "sender_host", "sender_zmq_port"})
DEFAULT_BACKEND = "shm"


@dataclass(frozen=True)
class AdapterSettings:
    """The parts of one ``extra`` that ``OmniPlugins`` uses."""

    backend: str = DEFAULT_BACKEND
    backend_config: dict[str, Any] = field(default_factory=dict)
    stage_id: int | str = -1
    injected: dict[str, Any] = field(default_factory=dict)
    #: keys neither ours nor injected (other components' knobs), for the record
    ignored: tuple[str, ...] = ()


def split_extra(extra: Mapping[str, Any] | None) -> AdapterSettings:
    """Split ``extra``; ``ValueError`` (vLLM-Omni's factory reports it) names the bad key."""
    extra = dict(extra or {})
    backend = extra.get("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f"extra.backend must be an omni-plugins connector name (e.g. 'shm', 'redis'), got {backend!r}")
    raw_config = extra.get("backend_config") or {}
    if not isinstance(raw_config, Mapping):
        raise ValueError(f"extra.backend_config must be a mapping of {backend!r} settings, got {type(raw_config).__name__}")
    config = {str(k): _expand(v, f"extra.backend_config.{k}") for k, v in raw_config.items()}
    injected = {k: extra[k] for k in INJECTED_KEYS if k in extra}
    ignored = tuple(sorted(k for k in extra if k not in INJECTED_KEYS and k not in OWN_KEYS))
    for key in ignored:
        near = close_matches(key, OWN_KEYS, n=1, cutoff=0.75)
        if near:
            log.warning("OmniPlugins connector: extra key %r is not read (did you mean %r?)", key, near[0])
    return AdapterSettings(backend.strip(), config, _stage_id(injected.get("stage_id", -1)), injected, ignored)


def _stage_id(value: Any) -> int | str:
    """vLLM-Omni's chunk adapter does arithmetic on ``connector.stage_id``: digits become an int."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"extra.stage_id must be an int, got {value!r}")
    return value


def _expand(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return interpolate(value)
        except MissingVariableError as exc:
            raise ValueError(f"{where}: environment variable {exc.variable!r} is not set and has no default") from None
        except MalformedReferenceError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if isinstance(value, Mapping):
        return {str(k): _expand(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value
