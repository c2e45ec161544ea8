"""``base_config`` overlays: a file that names another one and changes some of it, merged as vLLM-Omni merges.

vLLM-Omni's deploy files inherit (``base_config: qwen3_omni_moe.yaml``, resolved relative to the
file that names it, recursively). The merge follows vLLM-Omni's ``resolve_deploy_yaml``:

- top-level keys: the overlay's value replaces the base's, except the three structured sections:
- ``connectors``: merged recursively (a mapping in both is merged key by key; anything else is
  replaced);
- ``stages``: merged by ``stage_id``: a stage in both gets the overlay's keys, its
  ``default_sampling_params``, ``default_pooling_params``, ``subtalker_sampling_params``,
  ``engine_extras`` and ``engine_args`` merged recursively; a new ``stage_id`` is appended;
- ``platforms``: per platform, its keys replaced and its ``stages`` merged as above.

Unlike vLLM-Omni, a cycle (a file that is its own base) and a missing base are errors naming the
file and line of the ``base_config`` that leads there, and every merged value keeps the file and
line it came from for later errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_plugins.config.yamldoc import Loc, YamlDoc
from omni_plugins.errors import ConfigError

#: the sections vLLM-Omni merges instead of replacing
_STRUCTURED = ("connectors", "stages", "platforms")
#: a stage's mappings merged key by key when both the base and the overlay set them
_DEEP_STAGE_KEYS = frozenset({"default_sampling_params", "default_pooling_params", "subtalker_sampling_params", "engine_extras", "engine_args"})
#: files in one chain of overlays, the top one included
MAX_DEPTH = 32

Sources = dict[Loc, tuple[YamlDoc, Loc]]


def resolve_overlays(doc: YamlDoc, env: Mapping[str, str] | None) -> tuple[dict[Any, Any], Sources] | None:
    """The document ``doc`` overlays, merged: ``(data, sources)``; None when it names no ``base_config``.

    ``sources`` maps locations of the merged data to the file and location that provided them
    (:attr:`omni_plugins.config.origins.Origins.files`).
    """
    if not isinstance(doc.data, dict) or "base_config" not in doc.data:
        return None
    return _resolve(doc, env, (_identity(doc.filename),), [doc.filename])


def _identity(filename: str) -> Path | str:
    path = Path(filename)
    return path.resolve() if path.exists() else filename


def _resolve(doc: YamlDoc, env: Mapping[str, str] | None, seen: tuple[Path | str, ...], names: list[str]) -> tuple[dict[Any, Any], Sources]:
    own = {k: v for k, v in doc.data.items() if k != "base_config"}
    ref = doc.data.get("base_config")
    if ref is None:
        return own, {(): (doc, ())}
    at = doc.where(("base_config",))
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigError(f"{at}: base_config names the file this one overlays (a path relative to this file), got {ref!r}")
    path = Path(doc.filename).parent / ref.strip()
    key = path.resolve() if path.exists() else path
    if key in seen:
        raise ConfigError(f"{at}: cycle of overlays: {' -> '.join([*names, str(path)])}")
    if len(seen) >= MAX_DEPTH:
        raise ConfigError(f"{at}: more than {MAX_DEPTH} overlays deep: {' -> '.join([*names, str(path)])}")
    if not path.is_file():
        why = "no such file" if not path.exists() else "not a file"
        raise ConfigError(f"{at}: {ref!r}: {why} ({path}, relative to the file naming it)")
    base_doc = YamlDoc.read(path, env)
    if not isinstance(base_doc.data, dict):
        raise ConfigError(f"{base_doc.filename}: the top level must be a mapping (the base_config at {at.removesuffix(': base_config')})")
    base, base_sources = _resolve(base_doc, env, (*seen, key), [*names, str(path)])
    return _Merge(base, base_sources, doc).merge(own)


class _Merge:
    """One overlay merged onto its (already merged) base, recording where every value came from."""

    def __init__(self, base: dict[Any, Any], base_sources: Sources, doc: YamlDoc) -> None:
        self.base = base
        self.base_sources = base_sources
        self.doc = doc
        self.sources: Sources = {(): (doc, ())}

    # -- provenance ---------------------------------------------------------------------------
    def _from_base(self, loc: Loc, base_loc: Loc) -> None:
        """The value at ``loc`` is the base's at ``base_loc`` (with everything recorded under it)."""
        self._drop(loc)
        for n in range(len(base_loc), -1, -1):
            hit = self.base_sources.get(base_loc[:n])
            if hit is not None:
                self.sources[loc] = (hit[0], (*hit[1], *base_loc[n:]))
                break
        k = len(base_loc)
        for path, hit in self.base_sources.items():
            if len(path) > k and path[:k] == base_loc:
                self.sources[(*loc, *path[k:])] = hit

    def _from_own(self, loc: Loc, own_loc: Loc) -> None:
        self._drop(loc)
        self.sources[loc] = (self.doc, own_loc)

    def _drop(self, loc: Loc) -> None:
        k = len(loc)
        for path in [p for p in self.sources if len(p) >= k and p[:k] == loc]:
            del self.sources[path]

    # -- merging ------------------------------------------------------------------------------
    def merge(self, own: dict[Any, Any]) -> tuple[dict[Any, Any], Sources]:
        merged: dict[Any, Any] = {}
        for k, v in self.base.items():
            merged[k] = v
            self._from_base((k,), (k,))
        for k, v in own.items():
            if k not in _STRUCTURED:
                merged[k] = v
                self._from_own((k,), (k,))
        base_conn, own_conn = self.base.get("connectors"), own.get("connectors")
        if isinstance(base_conn, dict) and isinstance(own_conn, dict):
            merged["connectors"] = self._dicts(base_conn, own_conn, ("connectors",), ("connectors",))
        elif own_conn is not None:
            merged["connectors"] = own_conn
            self._from_own(("connectors",), ("connectors",))
        if "stages" in self.base or "stages" in own:
            merged["stages"] = self._stage_lists(self.base.get("stages"), own.get("stages"), ("stages",), ("stages",), ("stages",))
        platforms = self._platforms(self.base.get("platforms"), own.get("platforms"))
        if platforms is not None:
            merged["platforms"] = platforms
        return merged, self.sources

    def _dicts(self, base: dict[Any, Any], over: dict[Any, Any], loc: Loc, own_loc: Loc) -> dict[Any, Any]:
        """vLLM-Omni's recursive merge: mappings in both are merged key by key, anything else is replaced."""
        out = dict(base)
        for k, v in over.items():
            if isinstance(out.get(k), dict) and isinstance(v, dict):
                out[k] = self._dicts(out[k], v, (*loc, k), (*own_loc, k))
            else:
                out[k] = v
                self._from_own((*loc, k), (*own_loc, k))
        return out

    def _stage_lists(self, base: Any, over: Any, loc: Loc, base_loc: Loc, own_loc: Loc) -> list[Any]:
        """Stages merged by ``stage_id`` (the overlay's keys win; the deep keys are merged)."""
        base_list = self._stage_list(base, base_loc, self._base_where)
        over_list = self._stage_list(over, own_loc, self.doc.where)
        by_id: dict[Any, tuple[dict[Any, Any], int]] = {}
        for i, stage in enumerate(base_list):
            by_id[stage["stage_id"]] = (stage, i)
        order = list(by_id)
        merged: dict[Any, dict[Any, Any]] = {}
        for sid in order:
            stage, i = by_id[sid]
            merged[sid] = stage
            self._from_base((*loc, order.index(sid)), (*base_loc, i))
        for j, stage in enumerate(over_list):
            sid = stage["stage_id"]
            if sid not in merged:
                order.append(sid)
                merged[sid] = stage
                self._from_own((*loc, order.index(sid)), (*own_loc, j))
                continue
            at, own_at = (*loc, order.index(sid)), (*own_loc, j)
            out = dict(merged[sid])
            for k, v in stage.items():
                if k in _DEEP_STAGE_KEYS and isinstance(out.get(k), dict) and isinstance(v, dict):
                    out[k] = self._dicts(out[k], v, (*at, k), (*own_at, k))
                else:
                    out[k] = v
                    self._from_own((*at, k), (*own_at, k))
            merged[sid] = out
        return [merged[sid] for sid in order]

    def _platforms(self, base: Any, over: Any) -> Any:
        """Per platform: its keys replaced by the overlay's, its ``stages`` merged by ``stage_id``."""
        if not isinstance(base, dict) or not isinstance(over, dict):
            if over is None:
                return base
            self._from_own(("platforms",), ("platforms",))
            return over
        out: dict[Any, Any] = {}
        for name in {**base, **over}:
            at = ("platforms", name)
            bp, op = base.get(name), over.get(name)
            if not isinstance(bp, dict) or not isinstance(op, dict):
                out[name] = op if name in over else bp
                (self._from_own if name in over else self._from_base)(at, at)
                continue
            plat: dict[Any, Any] = {}
            for k, v in bp.items():
                plat[k] = v
                self._from_base((*at, k), (*at, k))
            for k, v in op.items():
                if k != "stages":
                    plat[k] = v
                    self._from_own((*at, k), (*at, k))
            plat["stages"] = self._stage_lists(bp.get("stages"), op.get("stages"), (*at, "stages"), (*at, "stages"), (*at, "stages"))
            out[name] = plat
        return out

    def _base_where(self, loc: Loc) -> str:
        for n in range(len(loc), -1, -1):
            hit = self.base_sources.get(loc[:n])
            if hit is not None:
                return hit[0].where((*hit[1], *loc[n:]))
        return self.doc.where(loc)

    @staticmethod
    def _stage_list(stages: Any, loc: Loc, where: Any) -> list[dict[Any, Any]]:
        """The stages of one side of a merge: each a mapping with a ``stage_id``, no id twice."""
        if stages is None:
            return []
        if not isinstance(stages, list):
            raise ConfigError(f"{where(loc)}: a list of stages, each a mapping with a stage_id, is needed to merge base_config overlays")
        seen: dict[Any, int] = {}
        for i, stage in enumerate(stages):
            if not isinstance(stage, dict) or "stage_id" not in stage:
                raise ConfigError(f"{where((*loc, i))}: a stage is a mapping with a stage_id (needed to merge base_config overlays)")
            sid = stage["stage_id"]
            try:
                hash(sid)
            except TypeError:
                raise ConfigError(f"{where((*loc, i, 'stage_id'))}: stage_id must be an integer, got {sid!r}") from None
            if sid in seen:
                raise ConfigError(f"{where((*loc, i, 'stage_id'))}: duplicate stage_id [{sid}] (also {loc[-1]}[{seen[sid]}])")
            seen[sid] = i
        return stages
