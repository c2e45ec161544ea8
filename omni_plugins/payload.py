"""The payload-builder contract.

A builder turns one step's model output into the payload sent to the next
stage::

    def build(transfer_manager, pooling_output, request, is_finished=False) -> dict | None

The model output may be named ``multimodal_output`` instead, as vLLM-Omni's streaming
(async-chunk) builders name it; a builder taking ``**kwargs`` gets ``pooling_output``.
A builder whose signature names ``to_stage`` is told the destination and is
called once per output edge it serves (a fan-out stage can send each
destination what it needs); any other builder is called once and its payload
goes to every edge it serves. It is named in the stage config by dotted path (``pkg.mod.func`` or
``pkg.mod:func``). Returning ``None`` sends nothing. The builder's module may
define ``_FULL_PAYLOAD_REPLACE_KEYS`` (an iterable of keys) whose values are
replaced, never concatenated, when full payloads are accumulated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from omni_plugins.errors import BuilderError
from omni_plugins.importing import import_string

REQUIRED_KWARGS: tuple[str, ...] = ("transfer_manager", "pooling_output", "request")
#: the names the model output goes by: omni-plugins' and vLLM-Omni's full-payload builders', vLLM-Omni's streaming builders'
OUTPUT_KWARGS: tuple[str, ...] = ("pooling_output", "multimodal_output")
REPLACE_KEYS_ATTR = "_FULL_PAYLOAD_REPLACE_KEYS"


class PayloadBuilder(Protocol):
    def __call__(self, *, transfer_manager: Any, pooling_output: Any, request: Any, **kwargs: Any) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class ResolvedBuilder:
    """A loaded builder with what the runtime needs to know about it."""

    path: str
    func: Callable[..., Any]
    accepts_is_finished: bool
    replace_keys: frozenset[str]
    #: the signature names ``to_stage``: called once per destination, told which
    per_destination: bool = False
    #: what the signature calls the model output (``pooling_output`` or vLLM-Omni's ``multimodal_output``)
    output_kwarg: str = "pooling_output"

    def __call__(
        self, *, transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False, to_stage: int | None = None
    ) -> Any:
        kwargs: dict[str, Any] = {"transfer_manager": transfer_manager, self.output_kwarg: pooling_output, "request": request}
        if self.accepts_is_finished:
            kwargs["is_finished"] = is_finished
        if self.per_destination:
            kwargs["to_stage"] = to_stage
        return self.func(**kwargs)


def _params(func: Callable[..., Any]) -> tuple[set[str], bool] | None:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    names = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def accepts_builder_kwargs(func: Callable[..., Any]) -> bool:
    """True when ``func`` can be called with transfer_manager, the model output and request by keyword."""
    return output_kwarg(func) is not None


def output_kwarg(func: Callable[..., Any]) -> str | None:
    """The name ``func`` takes the model output by (None: it is not a builder), as vLLM-Omni resolves it."""
    params = _params(func)
    if params is None:
        return None
    names, var_kw = params
    if var_kw:
        return "pooling_output"
    if not {"transfer_manager", "request"} <= names:
        return None
    return next((k for k in OUTPUT_KWARGS if k in names), None)


def accepts_is_finished(func: Callable[..., Any]) -> bool:
    params = _params(func)
    return params is not None and ("is_finished" in params[0] or params[1])


def names_to_stage(func: Callable[..., Any]) -> bool:
    """The signature names ``to_stage`` (``**kwargs`` alone does not count: such a builder is called once for every destination)."""
    params = _params(func)
    return params is not None and "to_stage" in params[0]


def _resolve(path: str, func: Any) -> ResolvedBuilder:
    module = inspect.getmodule(func)
    raw = getattr(module, REPLACE_KEYS_ATTR, ()) if module is not None else ()
    if isinstance(raw, str):
        raw = (raw,)
    return ResolvedBuilder(
        path, func, accepts_is_finished(func), frozenset(str(k) for k in raw), names_to_stage(func), output_kwarg(func) or "pooling_output"
    )


def load_builder(path: str) -> ResolvedBuilder:
    """Import the builder at ``path`` and check its signature; raises BuilderError saying what is wrong."""
    try:
        func = import_string(path)
    except ImportError as exc:
        raise BuilderError(f"payload builder {path!r} cannot be imported: {exc}") from exc
    except Exception as exc:
        raise BuilderError(f"payload builder {path!r} failed while importing: {type(exc).__name__}: {exc}") from exc
    if not callable(func):
        raise BuilderError(f"payload builder {path!r} is not callable")
    if not accepts_builder_kwargs(func):
        raise BuilderError(
            f"payload builder {path!r} has signature {_signature(func)}; it must accept "
            f"{', '.join(REQUIRED_KWARGS)} as keyword arguments (or **kwargs; pooling_output may be named multimodal_output)"
        )
    return _resolve(path, func)


def _signature(func: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(func))
    except (TypeError, ValueError):
        return "(unknown)"


def full_payload_candidates(custom_process_input_func: str) -> list[str]:
    """Derived builder names for full-payload mode: ``<f>_full_payload``, ``<f>_batch``, ``<f>``."""
    f = custom_process_input_func
    return [f"{f}_full_payload", f"{f}_batch", f]


def resolve_stage_builder(next_stage_func: str | None, input_func: str | None, *, full_payload: bool) -> ResolvedBuilder | None:
    """The builder a stage uses to make next-stage payloads.

    An explicit ``custom_process_next_stage_input_func`` wins (and must be valid).
    In full-payload mode without one, the first derived candidate that imports and
    takes the builder keywords is used; candidates that fail are skipped.
    """
    if next_stage_func:
        return load_builder(next_stage_func)
    if not (full_payload and input_func):
        return None
    for candidate in full_payload_candidates(input_func):
        try:
            return load_builder(candidate)
        except BuilderError:
            continue
    return None
