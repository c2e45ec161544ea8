"""``encode`` / ``decode``: the compiled header path when it is built, the pure-Python one otherwise.

``omni_plugins.wire._native`` (``_native.c``, built by the core's setuptools build and
optional) is an accelerator, not a second definition of the format: its encoder either
produces the bytes :func:`encode_py` would or returns ``None`` so that the Python encoder
runs and raises its path-naming error; its decoder either returns exactly what
:func:`decode_py` would, raises :class:`WireFormatError` from the prefix / checksum /
msgpack-structure / buffer-table checks, or returns ``DEFER`` so that the Python decoder
decides (tree walk refusals, duplicate keys, ...). ``OMNI_WIRE_PURE=1`` in the environment
at import time forces the pure-Python path; :data:`IMPLEMENTATION` says which one was chosen.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import torch

from omni_plugins.errors import WireFormatError
from omni_plugins.wire import _decode as _dec
from omni_plugins.wire import _encode as _enc
from omni_plugins.wire._alloc import copy_out
from omni_plugins.wire._dtypes import BY_CODE, BY_TORCH, Kind
from omni_plugins.wire._encoded import Encoded, Segment
from omni_plugins.wire._format import DEFAULT_LIMITS, Limits

logger = logging.getLogger(__name__)

_KIND_CODES = {Kind.TORCH: 0, Kind.NUMPY: 1, Kind.BYTES: 2}
PURE_ENV = "OMNI_WIRE_PURE"


def _load_native() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from omni_plugins.wire import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        logger.debug("omni_plugins.wire._native is not built (%s); using the pure-Python codec", exc)
        return None
    _native.configure(
        WireFormatError=WireFormatError,
        Refused=_enc._Refused,
        REF=_enc.REF,
        TUPLE=_enc.TUPLE,
        Encoded=Encoded,
        Encoder=_enc._Encoder,
        Tensor=torch.Tensor,
        default_limits=DEFAULT_LIMITS,
        frombuffer=np.frombuffer,
        from_numpy=torch.from_numpy,
        copy_out=copy_out,
        from_readonly=_dec._from_readonly,
        torch_frombuffer=torch.frombuffer,
        crc32=zlib.crc32,
        Segment=Segment,
        strided=torch.strided,
        torch_specs={dt: (s.code, s.carrier_torch, s.is_complex) for dt, s in BY_TORCH.items()},
        specs=[(s.code, _KIND_CODES[s.kind], s.itemsize, s.carrier, s.torch_dtype, s.needs_view, s.is_bool) for s in BY_CODE.values()],
    )
    return _native


_NATIVE_MODULE = _load_native()
_native = _NATIVE_MODULE  # the active one; switched by use()
_DEFER = getattr(_NATIVE_MODULE, "DEFER", object())

#: ``"native"`` when the compiled header path was loaded at import, else ``"python"``.
IMPLEMENTATION = "native" if _NATIVE_MODULE is not None else "python"


def active_implementation() -> str:
    """``"native"`` or ``"python"``: what :func:`encode` / :func:`decode` use right now."""
    return "native" if _native is not None else "python"


@contextmanager
def use(implementation: str) -> Iterator[None]:
    """Switch the implementation inside a ``with`` block (tests and benchmarks compare the two).

    ``"native"`` raises :class:`RuntimeError` when the extension is not built.
    """
    global _native
    if implementation == "native":
        if _NATIVE_MODULE is None:
            raise RuntimeError("omni_plugins.wire._native is not built (or OMNI_WIRE_PURE is set)")
        chosen: ModuleType | None = _NATIVE_MODULE
    elif implementation == "python":
        chosen = None
    else:
        raise ValueError(f"unknown implementation {implementation!r} (native or python)")
    previous, _native = _native, chosen
    try:
        yield
    finally:
        _native = previous


def encode(obj: Any, *, limits: Limits = DEFAULT_LIMITS) -> Encoded:
    """Encode a payload; tensors and arrays are referenced, not copied.

    Accepts dict (str keys), list, tuple, str, bytes, int (64-bit), float, bool, None,
    torch tensors and numeric numpy arrays of an allowed dtype. Non-contiguous tensors
    are made contiguous and non-CPU tensors copied to host. Raises
    :class:`WireFormatError` (naming the path, e.g. ``payload['a'][3]``) for anything else.
    """
    native = _native
    if native is not None:
        out = native.encode(obj, limits)
        if out is not None:
            return out  # type: ignore[no-any-return]
    return _enc.encode_py(obj, limits=limits)


def encode_into(obj: Any, dest: Any, *, limits: Limits = DEFAULT_LIMITS) -> int:
    """Encode ``obj`` straight into ``dest`` (a writable C-contiguous buffer) and return the message length.

    The message is written to ``dest[:n]`` only when it fits (``n <= len(dest)`` in bytes); otherwise
    ``dest`` is left untouched and the caller needs a larger destination (or :func:`encode`). The bytes
    are exactly :func:`encode`'s; the compiled path copies tensors from their memory without building
    an :class:`Encoded` or its buffer views. Raises :class:`WireFormatError` like :func:`encode`.
    """
    native = _native
    if native is not None:
        n = native.encode_into(obj, limits, dest)
        if n is not None:
            return n  # type: ignore[no-any-return]
    enc = _enc.encode_py(obj, limits=limits)
    try:
        size = memoryview(dest).nbytes
    except TypeError as exc:
        raise WireFormatError(f"encode_into needs a writable buffer, got {type(dest).__name__}") from exc
    if enc.nbytes <= size:
        enc.write_into(dest)
    return enc.nbytes


def native_encode_into() -> Any:
    """The compiled ``encode_into(obj, limits, dest) -> int | None`` while the native codec is active, else None.

    For backends that call it from C (the shm connector's slot table): ``None`` from the function
    means "let the Python encoder decide" (call :func:`encode_into` or :func:`encode`).
    """
    native = _native
    return None if native is None else native.encode_into


def native_c_api() -> Any:
    """The compiled encoder's C API (a ``PyCapsule``) while the native codec is active, else None.

    For extensions that encode straight into memory of their own without Python objects in
    between (the shm connector's slot table passes it where it takes :func:`native_encode_into`);
    the capsule's layout is documented in ``_native.c`` (``WireCAPI``, version 1).
    """
    native = _native
    return None if native is None else native.C_API


def decode(buffer: Any, *, copy: bool = False, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode a message produced by :func:`encode` from any buffer-protocol object.

    With ``copy=False`` tensors and arrays are views over ``buffer`` (zero copy): they
    keep it alive, and must not be written when ``buffer`` is read-only (``bytes``).
    With ``copy=True`` they own their memory. Large ``bytes`` values are always copied.
    Bytes after the message's declared length are ignored. Raises only
    :class:`WireFormatError`, whose message names the check that failed.
    """
    native = _native
    try:
        if native is not None:
            out = native.decode(buffer, copy, limits)
            if out is not _DEFER:
                return out
        return _dec.decode_py(buffer, copy, limits)
    except WireFormatError:
        raise
    except RecursionError:
        raise WireFormatError("header nesting too deep") from None
    except Exception as exc:  # safety net: the contract is "only WireFormatError on bad input"
        raise WireFormatError(f"malformed message ({type(exc).__name__}: {exc})") from exc
