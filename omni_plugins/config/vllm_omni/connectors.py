"""A vLLM-Omni connector definition (``name`` + ``extra``) read as an omni-plugins connector.

The plugins say how (:class:`omni_plugins.registry.VllmOmniName`, declared with
``registry.register_vllm_omni``); this module only applies what they declared, in this order:

1. a plugin declares the name: its translation;
2. the name is an omni-plugins connector (``shm``, an alias, ``dist:name``, ``pkg.mod:Class``):
   taken as it is, its ``extra`` checked by its plugin as in any file;
3. a plugin declares ``*`` (every name no plugin declares): its translation (the ``vllm-omni``
   connector, which wraps vLLM-Omni's own connectors), for names of vLLM-Omni's connector classes
   (``...Connector``; one that looks like a misspelling of a served name is an error instead);
4. one of vLLM-Omni's own connectors nobody serves: refused, saying what to install;
5. anything else: left as written (the unknown-connector error, with its hints, follows).

Whatever the translation, the ``extra`` as written is kept whole for the payload builders
(``builder_settings``): vLLM-Omni's builders read their knobs (``codec_chunk_frames`` ...) from
their connector's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_plugins.config.hints import model_field_names
from omni_plugins.errors import OmniPluginsError
from omni_plugins.importing import import_string
from omni_plugins.naming import KNOWN_BACKENDS, close_matches, is_import_path
from omni_plugins.registry import VllmOmniName

#: the connectors vLLM-Omni's factory has built in (0.30), for the refusal's wording
VLLM_OMNI_BUILTINS = frozenset(
    {
        "SharedMemoryConnector",
        "MooncakeStoreConnector",
        "MooncakeConnector",
        "MooncakeTransferEngineConnector",
        "YuanrongConnector",
        "YuanrongTransferEngineConnector",
        "MoriTransferEngineConnector",
        "NixlConnector",
    }
)
#: what serves vLLM-Omni's own connectors in omni-plugins, for the refusal
WRAPPER_HINT = (
    "it is one of vLLM-Omni's own connectors, which omni-plugins runs through its 'vllm-omni' connector: "
    f"pip install {KNOWN_BACKENDS['vllm_omni']} together with vllm-omni and the vLLM build for this machine"
)


@dataclass
class Translated:
    """One connector as omni-plugins reads it."""

    name: str
    extra: Any
    #: omni-plugins setting -> the vLLM-Omni ``extra`` key it was read from
    renamed: dict[str, str] = field(default_factory=dict)
    #: ``(key, why)`` of the ``extra`` keys the backend has no use for
    unused: list[tuple[str, str]] = field(default_factory=list)
    #: ``(key, closest setting)`` of builder-only keys that look like a misspelled setting
    near: list[tuple[str, str]] = field(default_factory=list)


def translate_connector(name: Any, extra: Any) -> Translated:
    """Read one vLLM-Omni connector; ``ValueError`` says why it cannot be served (and what to install)."""
    if not isinstance(name, str) or not isinstance(extra, Mapping):
        return Translated(name, extra)  # the models report the wrong types
    from omni_plugins.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    decl = registry.vllm_omni_name(name, catch_all=False)
    if decl is None:
        if _is_ours(name):
            return Translated(name, dict(extra))
        decl = registry.vllm_omni_name(name) if name.endswith("Connector") else None
        if decl is None:
            if name in VLLM_OMNI_BUILTINS:
                raise ValueError(f"connector {name!r}: {WRAPPER_HINT}")
            return Translated(name, dict(extra))
        near = close_matches(name, [d.name for d in registry.vllm_omni_names() if d.name != "*"] + registry.names(), cutoff=0.8)
        if near and name not in VLLM_OMNI_BUILTINS:
            raise ValueError(f"unknown connector {name!r}; did you mean {', '.join(map(repr, near))}?")
    return _apply(decl, name, dict(extra))


def _is_ours(name: str) -> bool:
    from omni_plugins.factory import resolve_connector

    if is_import_path(name):
        return True
    try:
        resolve_connector(name)
    except OmniPluginsError:
        return False
    return True


def _apply(decl: VllmOmniName, name: str, extra: dict[str, Any]) -> Translated:
    if decl.translate is not None:
        func = import_string(decl.translate)
        connector, settings = func(name, dict(extra))
        return Translated(connector, dict(settings))
    assert decl.connector is not None  # registration checks: exactly one of connector= and translate=
    from omni_plugins.factory import resolve_connector

    fields = model_field_names(resolve_connector(decl.connector).load_config_model())
    out = Translated(decl.connector, {})
    for key, value in extra.items():
        if key in decl.keys:
            out.extra[decl.keys[key]] = value
            out.renamed[decl.keys[key]] = key
        elif key in decl.unused:
            out.unused.append((key, decl.unused[key]))
        elif key in fields:
            out.extra[key] = value
            out.renamed[key] = key
        else:
            near = close_matches(key, [*decl.keys, *decl.unused, *fields], n=1, cutoff=0.8)
            if near:
                out.near.append((key, near[0]))
    return out
