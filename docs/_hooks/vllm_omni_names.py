"""The table of vLLM-Omni connector names: what each reads as in omni-plugins, made from the plugins' declarations."""

from __future__ import annotations

from omni_plugins.plugins import get_plugin_manager
from omni_plugins.registry import ANY_VLLM_OMNI_NAME


def names_table() -> str:
    """One row per name a plugin declares (``registry.register_vllm_omni``): the connector, its keys, the keys it does not use."""
    rows = ["| vLLM-Omni `name` | omni-plugins connector | `extra` keys read as | `extra` keys not used | plugin |", "|---|---|---|---|---|"]
    for decl in get_plugin_manager().registry.vllm_omni_names():
        name = "any other (`NixlConnector`, `MoriTransferEngineConnector`, `YuanrongConnector` ...)" if decl.name == ANY_VLLM_OMNI_NAME else f"`{decl.name}`"
        target = f"`{decl.connector}`" if decl.connector else decl.description
        keys = ", ".join(f"`{k}` → `{v}`" for k, v in decl.keys.items())
        if decl.connector:
            keys = (keys + "; " if keys else "") + f"its own settings as they are (`omni-plugins schema {decl.connector}`)"
        unused = "; ".join(f"`{k}`: {why}" for k, why in decl.unused.items()) or "none"
        rows.append(f"| {name} | {target} | {keys or '—'} | {unused} | {decl.distribution or decl.plugin} |")
    return "\n".join(rows) + "\n"
