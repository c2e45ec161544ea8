"""Accumulating outputs across steps.

* Sender side, full-payload mode: :class:`FullPayloadAccumulator` keeps the
  per-step outputs of one request as a list of parts and concatenates them
  once, at flush.
* Receiver side, streaming mode for ``"ar"`` workers: :func:`merge_chunk`
  folds a newly arrived chunk into what arrived before. With ``lazy=True``
  (what the runtime's receive thread uses) a tensor that concatenates is not
  concatenated yet: it becomes a :class:`PendingCat` of its parts, and
  :func:`resolve_pending` joins them once, when someone reads the payload.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from omni_plugins.runtime.spans import get_span, merge_spans

logger = logging.getLogger(__name__)

#: (section, tensor, start, end) groups merged as token spans, not concatenated.
SPAN_GROUPS: tuple[tuple[str, str, str, str], ...] = (("embed", "decode", "decode_token_start", "decode_token_end"),)
_NO_SPANS: tuple[tuple[str, str, str], ...] = ()
#: :data:`SPAN_GROUPS` by section: (tensor, start, end) triples
_SPANS_BY_SECTION: dict[str, tuple[tuple[str, str, str], ...]] = {
    sec: tuple((t, st, e) for s2, t, st, e in SPAN_GROUPS if s2 == sec) for sec, *_ in SPAN_GROUPS
}


def _is_token_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2


class FullPayloadAccumulator:
    """One request's outputs across steps (full-payload mode, sender side).

    Tensors with two or more dims are collected per key and concatenated on
    dim 0 at :meth:`materialize`, as long as their trailing dims match (a
    mismatch restarts the key); other values keep the latest. Keys in
    ``replace_keys`` always keep only the latest value. ``None`` values are
    ignored. A non-mapping output replaces everything (it is sent as is).
    """

    __slots__ = ("latest", "parts", "raw", "replace_keys", "request")

    def __init__(self, replace_keys: Iterable[str] = ()) -> None:
        self.replace_keys = frozenset(replace_keys)
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.latest: dict[str, Any] = {}
        self.raw: Any = None
        self.request: Any = None

    def add(self, output: Any, request: Any = None) -> None:
        if request is not None:
            self.request = request
        if not isinstance(output, Mapping):
            self.raw, self.parts, self.latest = output, {}, {}
            return
        self.raw = None
        for key, value in output.items():
            if value is None:
                continue
            key = str(key)
            if _is_token_tensor(value):
                parts = self.parts.get(key)
                if key in self.replace_keys or not parts or parts[0].shape[1:] != value.shape[1:]:
                    self.parts[key] = [value]
                else:
                    parts.append(value)
                self.latest.pop(key, None)
            else:
                self.parts.pop(key, None)
                self.latest[key] = value

    @property
    def steps(self) -> dict[str, int]:
        """Number of parts held per concatenated key (introspection)."""
        return {k: len(v) for k, v in self.parts.items()}

    def materialize(self) -> Any:
        """The accumulated output: parts concatenated once, latest values as they are."""
        if self.raw is not None:
            return self.raw
        out: dict[str, Any] = dict(self.latest)
        for key, parts in self.parts.items():
            out[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out


#: what :func:`override_keys_of` returns for the usual chunk (none named): shared, never mutated
_NO_OVERRIDES: frozenset[Any] = frozenset()


def override_keys_of(chunk: Mapping[str, Any]) -> AbstractSet[Any]:
    """``meta.override_keys`` as a set of top-level keys and ``(section, field)`` tuples."""
    meta = chunk.get("meta")
    raw = meta.get("override_keys") if type(meta) is dict or isinstance(meta, Mapping) else None
    if raw is None:
        return _NO_OVERRIDES
    out: set[Any] = set()
    if isinstance(raw, (list, tuple)):
        for k in raw:
            if isinstance(k, (list, tuple)) and len(k) == 2 and all(type(p) is str for p in k):
                out.add(tuple(k))
            elif type(k) is str:
                out.add(k)
            else:  # the chunk came from another process: say what is wrong, not "unhashable type"
                raise ValueError(f"meta.override_keys entries must be a key or a [section, field] pair of strings, not {k!r:.80}")
    elif isinstance(raw, str):
        out.add(raw)
    return out


def _same_trailing_dims(a: torch.Size, b: torch.Size) -> bool:
    """``a[1:] == b[1:]`` for shapes of one dim or more, without building two ``torch.Size`` slices
    (the slice compare is ~0.7 us; this runs for every tensor of every received chunk)."""
    n = len(a)
    if n != len(b) or n == 0:
        return False
    if n == 1:
        return True
    if n == 2:
        return a[1] == b[1]
    return a[1:] == b[1:]


class PendingCat:
    """Tensors of one field that concatenate on dim 0, joined only when the payload is read.

    Why: a ``torch.cat`` per received chunk on the receive thread was the
    largest single cost of a streamed chunk (cold dispatcher code at the chunk
    rhythm, and the GIL held around it); the consumer's receive thread is the
    bottleneck of a burst, so every microsecond there queues the chunks behind
    it. Appending to a list costs next to nothing; the one ``cat`` per read
    runs on the reading (model) thread, over all parts at once. The parts
    share their trailing dims (checked as they are added). Never mutated: an
    added part makes a new instance, so a merge leaves its inputs as they were.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def added(self, new: torch.Tensor) -> PendingCat:
        return PendingCat([*self.parts, new])

    def resolve(self) -> torch.Tensor:
        """The concatenation the eager merge would have made, chunk by chunk."""
        parts = self.parts
        try:
            return torch.cat(parts)
        except RuntimeError:
            pass
        # the eager merge's rules, part by part: a part on another device moves to the accumulation's;
        # a part that still cannot be joined is dropped (the eager merge failed on that chunk alone)
        out = parts[0]
        for part in parts[1:]:
            try:
                out = torch.cat((out, part if part.device == out.device else part.to(out.device)))
            except RuntimeError:
                logger.error(
                    "cannot concatenate a received %s tensor onto the accumulated %s one; part dropped",
                    tuple(part.shape),
                    tuple(out.shape),
                    exc_info=True,
                )
        return out

    def __repr__(self) -> str:
        return f"PendingCat({len(self.parts)} parts)"


#: sections always merged eagerly: the receive thread reads them for every chunk (scheduling metadata)
EAGER_SECTIONS: frozenset[str] = frozenset({"meta", "codes"})


def resolve_pending(payload: Any) -> None:
    """Replace every :class:`PendingCat` in the sections of ``payload`` by its tensor, in place."""
    if type(payload) is not dict and not isinstance(payload, dict):
        return
    for section in payload.values():
        if type(section) is dict or isinstance(section, dict):
            for key, value in section.items():
                if type(value) is PendingCat:
                    section[key] = value.resolve()


def _merge_lazy(old: Any, new: Any) -> Any:
    """:func:`merge_value` with tensor concatenation left pending."""
    if type(new) is torch.Tensor or isinstance(new, torch.Tensor):
        if type(old) is PendingCat:
            return old.added(new) if _same_trailing_dims(old.parts[0].shape, new.shape) else new
        if isinstance(old, torch.Tensor):
            return PendingCat([old, new]) if _same_trailing_dims(old.shape, new.shape) else new
        return merge_value(old, new)
    return new if type(old) is PendingCat else merge_value(old, new)


def merge_value(old: Any, new: Any) -> Any:
    """Default merge of two values: tensors concatenate on dim 0, lists extend, dicts merge per key."""
    if type(old) is list and type(new) is list:
        return old + new
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if _same_trailing_dims(old.shape, new.shape):
            try:  # the devices are compared only when cat refuses (each torch call is cold code per chunk)
                return torch.cat((old, new))
            except RuntimeError:
                if new.device == old.device:
                    raise
            return torch.cat((old, new.to(old.device)))
        return new
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for k, v in new.items():
            merged[k] = merge_value(merged[k], v) if k in merged else v
        return merged
    return new


def _merge_section(
    name: str, old: dict[str, Any], new: Mapping[str, Any], overrides: AbstractSet[Any], lazy: bool = False
) -> dict[str, Any]:
    merged = dict(old)
    handled: tuple[str, ...] | set[str] = ()
    for tkey, skey, ekey in _SPANS_BY_SECTION.get(name, _NO_SPANS):
        if tkey not in new or skey not in new or (name, tkey) in overrides:
            continue  # without a start the new side is no span (``get_span`` would say None)
        new_span = get_span(new, tkey, skey, ekey)
        if new_span is None:
            continue  # no usable span on the new side: default merge below
        if type(merged.get(tkey)) is PendingCat:  # a span merge needs the accumulated rows joined
            merged[tkey] = merged[tkey].resolve()
        span = merge_spans(get_span(merged, tkey, skey, ekey), new_span)
        assert span is not None
        merged[tkey], merged[skey], merged[ekey] = span.tensor, span.start, span.end
        handled = {*handled, tkey, skey, ekey}
    is_meta = name == "meta"
    merge = _merge_lazy if lazy and name not in EAGER_SECTIONS else merge_value
    for field_name, value in new.items():
        if handled and field_name in handled:
            continue
        if (is_meta and field_name in ("finished", "override_keys")) or (overrides and (name, field_name) in overrides):
            merged[field_name] = value
        elif field_name in merged:
            merged[field_name] = merge(merged[field_name], value)
        else:
            merged[field_name] = value
    return merged


def merge_chunk(accumulated: Mapping[str, Any] | None, chunk: Mapping[str, Any], *, lazy: bool = False) -> dict[str, Any]:
    """Fold ``chunk`` into ``accumulated`` (``"ar"`` workers) and return a new dict.

    Tensors concatenate on dim 0, lists extend, sections merge per key;
    ``meta.finished`` and the keys named in ``meta.override_keys`` (top-level
    names or ``[section, field]`` pairs) replace; ``embed.decode`` with its
    ``decode_token_start/end`` merges as a token span. Neither input is mutated.

    ``lazy``: a tensor field of a section (other than :data:`EAGER_SECTIONS`)
    that concatenates becomes a :class:`PendingCat`; :func:`resolve_pending`
    on the result (or on a dict sharing its sections) gives exactly what the
    eager merge gives.
    """
    if accumulated is None:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in chunk.items()}
    overrides = override_keys_of(chunk)
    merged: dict[str, Any] = dict(accumulated)
    for key, value in chunk.items():
        old = merged.get(key)
        if (type(value) is dict or isinstance(value, Mapping)) and key not in overrides:
            merged[key] = _merge_section(key, old if isinstance(old, dict) else {}, value, overrides, lazy)
        elif key in overrides or key not in merged:
            merged[key] = dict(value) if isinstance(value, dict) else value
        else:
            merged[key] = merge_value(old, value)
    return merged
