"""Predicates over received payloads: finished? consumable? what does the scheduler need?

Payloads are dicts of sections (``meta``, ``embed``, ``ids``, ``codes`` ...).
Older producers put some fields at the top level; those *legacy flat keys*
are still accepted, with one warning per key per process.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: (section, field) pairs that describe a payload rather than carry model input.
NON_CONSUMABLE_FIELDS: frozenset[tuple[str, str]] = frozenset(
    {
        ("meta", "finished"),
        ("meta", "override_keys"),
        ("meta", "next_stage_prompt_len"),
        ("meta", "left_context_size"),
        ("ids", "output"),
        ("embed", "decode_token_start"),
        ("embed", "decode_token_end"),
    }
)

#: legacy flat key -> where it lives now
LEGACY_FLAT_KEYS: dict[str, str] = {
    "finished": "meta.finished",
    "next_stage_prompt_len": "meta.next_stage_prompt_len",
    "left_context_size": "meta.left_context_size",
    "code_predictor_codes": "codes.audio",
}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_legacy_key(key: str) -> None:
    """Log one warning per legacy flat key per process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning("legacy flat %r key in payload; expected %r (accepted, but update the producer)", key, LEGACY_FLAT_KEYS[key])


def reset_legacy_warnings() -> None:
    """Forget which legacy warnings were logged (tests)."""
    with _warned_lock:
        _warned.clear()


def _section(payload: Any, name: str) -> dict[str, Any]:
    sec = payload.get(name) if isinstance(payload, dict) else None
    return sec if isinstance(sec, dict) else {}


def _flag(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.item())
    return bool(value)


def payload_finished(payload: Any) -> bool:
    """``meta.finished`` as a bool (a bool or a one-element tensor); legacy flat ``finished`` accepted."""
    if not isinstance(payload, dict):
        return False
    meta = _section(payload, "meta")
    if "finished" in meta:
        value = meta["finished"]
        return value if type(value) is bool else _flag(value)  # runs per chunk: the plain bool needs no call
    if "finished" in payload:
        warn_legacy_key("finished")
        return _flag(payload["finished"])
    return False


def payload_audio_codes(payload: Any) -> Any:
    """``codes.audio`` (legacy flat ``code_predictor_codes`` accepted), or None."""
    if not isinstance(payload, dict):
        return None
    codes = _section(payload, "codes")
    if "audio" in codes:
        return codes["audio"]
    if "code_predictor_codes" in payload:
        warn_legacy_key("code_predictor_codes")
        return payload["code_predictor_codes"]
    return None


def has_content(value: Any) -> bool:
    """A value that can drive a forward step: not None, not an empty tensor/container."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, (list, tuple, dict, set, str, bytes)):
        return len(value) > 0
    return True


def payload_is_consumable(payload: Any) -> bool:
    """True when the payload carries model input, not only metadata.

    Non-empty ``embed.decode``, non-empty audio codes, or any other non-metadata
    value with content. A widened token span without new embeddings is *not*
    consumable: waking a request for it would force an empty decode step.
    """
    if not isinstance(payload, dict) or not payload:
        return False
    decode = _section(payload, "embed").get("decode")
    if isinstance(decode, torch.Tensor):
        return decode.ndim == 0 or (decode.numel() > 0 and decode.shape[0] > 0)
    codes = payload_audio_codes(payload)
    if codes is not None:
        return has_content(codes) if isinstance(codes, (torch.Tensor, list, tuple, dict, set)) else True
    for key, value in payload.items():
        if key in LEGACY_FLAT_KEYS:
            continue
        if isinstance(value, dict):
            if any((key, sub) not in NON_CONSUMABLE_FIELDS and has_content(v) for sub, v in value.items()):
                return True
        elif has_content(value):
            return True
    return False


def chunk_flags(chunk: dict[str, Any]) -> tuple[bool, bool]:
    """``(payload_finished(chunk), payload_is_consumable(chunk))`` of a dict chunk in one pass.

    Runs for every received chunk: the usual layout (a plain ``meta`` dict
    with ``finished``, a plain ``embed`` dict with a ``decode`` tensor) is
    read directly; anything else takes the two general predicates (legacy
    keys, other sections), so the answers are always theirs.
    """
    meta = chunk.get("meta")
    if type(meta) is dict and "finished" in meta:
        value = meta["finished"]
        finished = value if type(value) is bool else _flag(value)
    else:
        finished = payload_finished(chunk)
    embed = chunk.get("embed")
    if type(embed) is dict:
        decode = embed.get("decode")
        if type(decode) is torch.Tensor:
            # payload_is_consumable's ``ndim == 0 or (numel() > 0 and shape[0] > 0)`` from one call into
            # torch (each is cold code at the chunk rhythm): no dim, or none of them 0
            shape = decode.shape
            return finished, not shape or 0 not in shape
    return finished, payload_is_consumable(chunk)


def scheduling_metadata(payload: Any) -> dict[str, Any]:
    """The few fields a scheduler needs: prompt length, audio codes, left context."""
    out: dict[str, Any] = {}
    if not isinstance(payload, dict):
        return out
    meta = _section(payload, "meta")
    for name in ("next_stage_prompt_len", "left_context_size"):
        if name in meta:
            out[name] = meta[name]
        elif name in payload:
            warn_legacy_key(name)
            out[name] = payload[name]
    codes = payload_audio_codes(payload)
    if codes is not None:
        out["code_predictor_codes"] = codes
    return out
