"""``encode``: walk a payload, keep references to its buffers, pack a msgpack header."""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from omni_plugins.errors import WireFormatError
from omni_plugins.wire._dtypes import BY_NUMPY, BY_TORCH, BYTES_SPEC, DtypeSpec
from omni_plugins.wire._encoded import Encoded, Segment
from omni_plugins.wire._format import (
    ALIGNMENT,
    DEFAULT_LIMITS,
    EXT_REF,
    EXT_TUPLE,
    FORMAT_VERSION,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    Limits,
)

logger = logging.getLogger(__name__)

REF = msgpack.ExtType(EXT_REF, b"")
TUPLE = msgpack.ExtType(EXT_TUPLE, b"")

#: ``bytes`` values at least this long travel as out-of-band buffers, not inside the header.
OOB_BYTES_THRESHOLD = 4096

_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1
_SCALARS = frozenset({str, float, bool, type(None)})
_Tensor = torch.Tensor
_STRIDED = torch.strided
_ZERO_PAD = bytes(ALIGNMENT)
_BASE_CONVERSIONS: tuple[tuple[type, Any], ...] = (
    (int, int.__int__),
    (float, float.__float__),
    (str, str.__str__),
    (bytes, lambda b: bytes.__getitem__(b, slice(None))),
)


_local = threading.local()


def _packer() -> msgpack.Packer:
    """A per-thread msgpack packer (creating one per call costs more than packing a small header)."""
    try:
        return _local.packer  # type: ignore[no-any-return]
    except AttributeError:
        _local.packer = msgpack.Packer(use_bin_type=True)
        return _local.packer  # type: ignore[no-any-return]


class _Refused(Exception):
    """Internal: an object cannot be encoded; ``path`` is filled in while unwinding."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []


class _Encoder:
    """State of one ``encode`` call: the buffer table, its segments and the item budget.

    Buffer offsets are relative to the start of the data section, so the table does not
    depend on the header's own length.
    """

    __slots__ = ("cursor", "items", "limits", "segments", "table")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.table: list[list[Any]] = []  # [code, offset, nbytes, shape] per buffer
        self.segments: list[Segment] = []
        self.items = 0
        self.cursor = 0  # end of the data section so far

    def walk(self, obj: Any, depth: int) -> Any:
        t = type(obj)
        if t in _SCALARS:
            return obj
        if t is int:
            if not _INT_MIN <= obj <= _INT_MAX:
                raise _Refused(f"int {obj} does not fit in 64 bits")
            return obj
        if t is dict or t is list or t is tuple:
            return self._container(obj, t, depth)
        if t is bytes:
            return self._bytes(obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if t is np.ndarray:
            return self._ndarray(obj)
        return self._other(obj, depth)

    def _container(self, obj: Any, t: type, depth: int) -> Any:
        depth += 1
        limits = self.limits
        if depth > limits.max_depth:
            raise _Refused(f"nesting deeper than max_depth={limits.max_depth}")
        self.items += len(obj)
        if self.items > limits.max_items:
            raise _Refused(f"more than max_items={limits.max_items} elements")
        walk = self.walk
        if t is dict:
            out: dict[str, Any] = {}
            for k, v in obj.items():
                if type(k) is not str:
                    raise _Refused(f"dict key {k!r} is a {type(k).__name__}; only str keys are supported")
                tv = type(v)
                if tv in _SCALARS or (tv is int and _INT_MIN <= v <= _INT_MAX):  # fast paths skip walk()
                    out[k] = v
                    continue
                try:
                    out[k] = self._tensor(v) if tv is _Tensor else walk(v, depth)
                except _Refused as exc:
                    exc.path.append(f"[{k!r}]")
                    raise
            return out
        items: list[Any] = [TUPLE] if t is tuple else []
        for i, v in enumerate(obj):
            tv = type(v)
            if tv in _SCALARS or (tv is int and _INT_MIN <= v <= _INT_MAX):
                items.append(v)
                continue
            try:
                items.append(walk(v, depth))
            except _Refused as exc:
                exc.path.append(f"[{i}]")
                raise
        return items

    def _bytes(self, obj: bytes) -> Any:
        n = len(obj)
        if n < OOB_BYTES_THRESHOLD:
            return obj
        return self._add(BYTES_SPEC, [n], n, obj)

    def _add(self, spec: DtypeSpec, shape: Sequence[int], nbytes: int, source: Any) -> Any:
        self.items += 1
        if self.items > self.limits.max_items:
            raise _Refused(f"more than max_items={self.limits.max_items} elements")
        off = (self.cursor + ALIGNMENT - 1) & -ALIGNMENT
        self.table.append([spec.code, off, nbytes, shape])
        self.segments.append(Segment(off, nbytes, source))
        self.cursor = off + nbytes
        return REF

    def _tensor(self, t: torch.Tensor) -> Any:
        spec = BY_TORCH.get(t.dtype)
        if spec is None:
            raise _Refused(f"tensor dtype {t.dtype} is not in the wire allowlist")
        # The common case (a plain, dense, contiguous CPU tensor with no autograd or lazy
        # conj/neg bit) is tested in one expression: each torch attribute costs ~0.15 us.
        if not (
            type(t) is _Tensor
            and t.is_cpu
            and t.layout is _STRIDED
            and not t.requires_grad
            and t.is_contiguous()
            and not t.is_neg()
            and not (spec.is_complex and t.is_conj())
        ):
            t = self._normalise(t, spec)
        shape = t.shape
        if len(shape) > self.limits.max_ndim:
            raise _Refused(f"tensor has {len(shape)} dimensions > max_ndim={self.limits.max_ndim}")
        if spec.carrier_torch is not None:
            t = t.view(spec.carrier_torch)
        return self._add(spec, shape, t.nbytes, t)

    @staticmethod
    def _normalise(t: torch.Tensor, spec: DtypeSpec) -> torch.Tensor:
        """A plain, dense, contiguous CPU tensor with the values of ``t`` (copies only when needed)."""
        if t.layout is not _STRIDED:
            raise _Refused(f"tensor layout {t.layout} is not supported (only dense/strided tensors; call .to_dense())")
        if not t.is_cpu:
            if t.is_meta:
                raise _Refused("meta tensors have no data")
            logger.debug("copying a %s tensor of %d bytes to host for encoding", t.device, t.nbytes)
            t = t.cpu()
        if t.requires_grad:
            t = t.detach()
        if type(t) is not _Tensor:
            t = t.as_subclass(_Tensor)
        if spec.is_complex and t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        return t

    def _ndarray(self, a: np.ndarray) -> Any:
        dt = a.dtype
        if not dt.isnative:
            dt = dt.newbyteorder("=")
            a = a.astype(dt)
        spec = BY_NUMPY.get(dt.str)
        if spec is None:
            raise _Refused(f"numpy dtype {a.dtype} is not in the wire allowlist (numeric arrays only)")
        if a.ndim > self.limits.max_ndim:
            raise _Refused(f"array has {a.ndim} dimensions > max_ndim={self.limits.max_ndim}")
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        return self._add(spec, list(a.shape), a.nbytes, a)

    def _other(self, obj: Any, depth: int) -> Any:
        # Subclasses of the builtin types travel as the builtin type (IntEnum -> int,
        # OrderedDict -> dict, namedtuple -> tuple, np.float64 -> float). The base type's
        # own conversion is used, so a subclass's __str__ / __int__ cannot change the value.
        for base, convert in _BASE_CONVERSIONS:
            if isinstance(obj, base):
                return self.walk(convert(obj), depth)
        container: type
        for container in (dict, list, tuple):
            if isinstance(obj, container):
                return self._container(obj, container, depth)
        if isinstance(obj, np.ndarray):
            raise _Refused(f"numpy array subclass {type(obj).__name__} is not supported; pass np.asarray(x)")
        if isinstance(obj, np.generic):
            raise _Refused(f"numpy scalar {type(obj).__name__} is not supported; use .item() or np.asarray(x)")
        raise _Refused(f"objects of type {type(obj).__module__}.{type(obj).__qualname__} are not supported")


def encode_py(obj: Any, *, limits: Limits = DEFAULT_LIMITS) -> Encoded:
    """The pure-Python encoder (the reference; ``omni_plugins.wire.encode`` may take the compiled path).

    Encode a payload; tensors and arrays are referenced, not copied.

    Accepts dict (str keys), list, tuple, str, bytes, int (64-bit), float, bool, None,
    torch tensors and numeric numpy arrays of an allowed dtype. Non-contiguous tensors
    are made contiguous and non-CPU tensors copied to host. Raises
    :class:`WireFormatError` (naming the path, e.g. ``payload['a'][3]``) for anything else.
    """
    enc = _Encoder(limits)
    try:
        tree = enc._container(obj, dict, 0) if type(obj) is dict else enc.walk(obj, 0)
    except _Refused as exc:
        path = "payload" + "".join(reversed(exc.path))
        raise WireFormatError(f"cannot encode {path}: {exc.message}") from None
    try:
        header = _packer().pack([tree, enc.table])
    except (ValueError, OverflowError, UnicodeError) as exc:
        raise WireFormatError(f"cannot encode payload header: {exc}") from None
    hlen = len(header)
    if hlen > limits.max_header_bytes:
        raise WireFormatError(f"encoded header is {hlen} bytes > max_header_bytes={limits.max_header_bytes}")
    data_start = (PREFIX_SIZE + hlen + ALIGNMENT - 1) & -ALIGNMENT
    total = data_start + enc.cursor
    head = b"".join((PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0, hlen, zlib.crc32(header), total), header, _ZERO_PAD[: data_start - PREFIX_SIZE - hlen]))
    return Encoded(head, data_start, enc.segments, total)
