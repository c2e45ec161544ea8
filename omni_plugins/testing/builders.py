"""Small payload builders for tests and examples (valid and deliberately invalid ones)."""

from __future__ import annotations

from typing import Any

#: keys replaced, never concatenated, when full payloads accumulate
_FULL_PAYLOAD_REPLACE_KEYS = ("meta",)


def passthrough(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any] | None:
    """Send the model output as the payload (None output sends nothing)."""
    if pooling_output is None:
        return None
    payload = dict(pooling_output) if isinstance(pooling_output, dict) else {"embed": {"decode": pooling_output}}
    meta = dict(payload.get("meta", {}))
    meta["finished"] = bool(is_finished)
    payload["meta"] = meta
    return payload


def passthrough_full_payload(transfer_manager: Any, pooling_output: Any, request: Any) -> dict[str, Any] | None:
    """Full-payload variant: no ``is_finished`` parameter."""
    return passthrough(transfer_manager, pooling_output, request, is_finished=True)


def via_kwargs(**kwargs: Any) -> Any:
    """Accepts everything through ``**kwargs``."""
    return kwargs.get("pooling_output")


def wrong_signature(output: Any) -> Any:
    """Deliberately invalid: cannot take the builder keywords."""
    return output


NOT_CALLABLE = 42
