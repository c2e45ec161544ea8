"""Payload builders referenced by dotted path from the runtime tests."""

from __future__ import annotations

from typing import Any

_FULL_PAYLOAD_REPLACE_KEYS = frozenset({"model_outputs"})

CALLS: list[dict[str, Any]] = []


def stream(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any] | None:
    """Streaming builder: the output dict is the chunk; ``meta.finished`` from the request."""
    CALLS.append({"request": request.request_id, "is_finished": is_finished})
    if pooling_output is None:
        return None
    out = dict(pooling_output)
    meta = dict(out.get("meta", {}))
    meta.setdefault("finished", is_finished)
    out["meta"] = meta
    return out


def no_is_finished(transfer_manager: Any, pooling_output: Any, request: Any) -> dict[str, Any] | None:
    """A builder that does not take ``is_finished``: the runtime must not pass it."""
    return {"embed": {"decode": pooling_output}, "meta": {"finished": bool(request.done)}}


def whole(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any] | None:
    """Full-payload builder: wraps the accumulated output; None for requests marked skip."""
    if getattr(request, "skip", False):
        return None
    return {"engine_inputs": {"hidden": pooling_output, "meta": {"next_stage_prompt_len": 7}}, "finished": is_finished}


def crashing(transfer_manager: Any, pooling_output: Any, request: Any) -> dict[str, Any]:
    raise ValueError("builder bug")


# derivation targets: input func "prep" -> "prep_full_payload" is taken
def prep(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "prep"}


def prep_full_payload(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "prep_full_payload"}


# "only_batch": the _full_payload candidate has a wrong signature and must be skipped
def only_batch_full_payload(x: Any) -> Any:
    return {"which": "bad"}


def only_batch_batch(**kwargs: Any) -> Any:
    return {"which": "only_batch_batch"}


def only_batch(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "only_batch"}


# "both": every derived candidate exists; "_full_payload" must win over "_batch"
def both_full_payload(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "both_full_payload"}


def both_batch(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "both_batch"}


def both(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "both"}


# "plain_only": no derived variant exists, the input func itself is the builder
def plain_only(transfer_manager: Any, pooling_output: Any, request: Any) -> Any:
    return {"which": "plain_only"}


def kw_stream(**kwargs: Any) -> dict[str, Any] | None:
    """A ``**kwargs`` builder: it accepts ``is_finished`` and must get it."""
    CALLS.append({"request": kwargs["request"].request_id, "is_finished": kwargs.get("is_finished", "absent")})
    return {"x": [1], "meta": {"finished": bool(kwargs.get("is_finished"))}}
