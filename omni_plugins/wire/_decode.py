"""``decode``: validate untrusted bytes completely, then build views (or copies) over them.

Order matters for safety: the prefix, the header size and checksum, and the whole
buffer table (dtype allowlist, shape x itemsize == length, alignment, bounds, no
overlap, total size) are checked before any tensor or array is created, so a lying
header can never make the decoder allocate more than the buffer it was given.
"""

from __future__ import annotations

import gc
import threading
import warnings
import zlib
from typing import Any

import msgpack
import numpy as np
import torch

from omni_plugins.errors import WireFormatError
from omni_plugins.wire._alloc import copy_out
from omni_plugins.wire._dtypes import BY_CODE, DtypeSpec
from omni_plugins.wire._format import (
    ALIGNMENT,
    EXT_REF,
    EXT_TUPLE,
    FORMAT_VERSION,
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    Limits,
    check_prefix,
)

_unpackb = msgpack.unpackb  # defaults: raw=False (str is utf-8), strict_map_key=True (str/bytes keys only)
_frombuffer = np.frombuffer
_from_numpy = torch.from_numpy
_ALIGN_MASK = ALIGNMENT - 1
_NESTED = (dict, list)
_MAX_EXTENT = 2**62  # below numpy's intp limit for size x itemsize
_GC_PAUSE_HEADER_BYTES = 1 << 20  # headers above this are parsed with the cyclic GC paused

# torch warns (once per process) when a tensor is built over read-only memory. The
# decoder documents that such views must not be written, so the first read-only decode
# consumes that one-time warning inside a catch_warnings block; later ones need nothing.
_readonly_warning_consumed = False
_readonly_lock = threading.Lock()


# One validated buffer-table row: (spec, absolute offset, nbytes, shape).
_Row = tuple[DtypeSpec, int, int, list[int]]


def _check_table(raw: Any, data_start: int, total: int, limits: Limits) -> list[_Row]:
    if type(raw) is not list:
        raise WireFormatError("header buffer table is not a list")
    if len(raw) > limits.max_items:
        raise WireFormatError(f"buffer table has {len(raw)} entries > max_items={limits.max_items}")
    rows: list[_Row] = []
    end = 0  # end of the previous buffer, relative to data_start
    data_len = total - data_start
    max_ndim = limits.max_ndim
    for i, row in enumerate(raw):
        if type(row) is not list or len(row) != 4:
            raise WireFormatError(f"buffer table entry {i} is not [code, offset, nbytes, shape]")
        code, off, nbytes, shape = row
        if type(code) is not int or type(off) is not int or type(nbytes) is not int or type(shape) is not list:
            raise WireFormatError(f"buffer table entry {i} has fields of the wrong type")
        spec = BY_CODE.get(code)
        if spec is None:
            raise WireFormatError(f"buffer {i}: dtype code {code} is not in the allowlist")
        if len(shape) == 1:  # the common case, and the only one for bytes
            count = shape[0]
            if type(count) is not int or count < 0:
                raise WireFormatError(f"buffer {i}: shape {shape!r} has a dimension that is not a non-negative int")
            extent = spec.itemsize * (count or 1)
        else:
            if spec.is_bytes:
                raise WireFormatError(f"buffer {i}: bytes entry must have a 1-d shape, got {shape!r}")
            if len(shape) > max_ndim:
                raise WireFormatError(f"buffer {i}: {len(shape)} dimensions > max_ndim={max_ndim}")
            count = 1
            extent = spec.itemsize  # numpy refuses shapes whose non-zero dimensions overflow, even with zero elements
            for d in shape:
                if type(d) is not int or d < 0:
                    raise WireFormatError(f"buffer {i}: shape {shape!r} has a dimension that is not a non-negative int")
                count *= d
                extent *= d or 1
        if extent > _MAX_EXTENT:
            raise WireFormatError(f"buffer {i}: shape {shape!r} is too large for any array")
        if count * spec.itemsize != nbytes:
            raise WireFormatError(
                f"buffer {i}: shape {shape!r} x itemsize {spec.itemsize} = {count * spec.itemsize} != declared length {nbytes}"
            )
        if off & _ALIGN_MASK:
            raise WireFormatError(f"buffer {i}: offset {off} is not {ALIGNMENT}-byte aligned")
        if off < end:
            raise WireFormatError(f"buffer {i}: offset {off} overlaps the previous buffer (ends at {end})")
        end = off + nbytes
        if end > data_len:
            raise WireFormatError(f"buffer {i}: bytes [{off}, {end}) of the data section lie outside the message ({data_len} data bytes)")
        rows.append((spec, data_start + off, nbytes, shape))
    return rows


class _Builder:
    """Turns the header tree into the payload: checks depth and items, resolves buffer refs.

    msgpack (with :func:`_ext_hook` and ``max_ext_len=0``, which also refuses its built-in
    Timestamp extension) can only produce dicts with str/bytes keys, lists, str, bytes, int,
    float, bool, None and the two markers, so the walk checks just the key type, the tuple
    marker's position, the depth and the item budget.
    """

    __slots__ = ("copy", "items", "max_depth", "max_items", "mv", "next_ref", "readonly", "table")

    def __init__(self, mv: memoryview, table: list[_Row], copy: bool, limits: Limits) -> None:
        self.mv = mv
        self.readonly = mv.readonly
        self.table = table
        self.copy = copy
        self.max_depth = limits.max_depth
        self.max_items = limits.max_items
        self.items = len(table)
        self.next_ref = 0

    def walk(self, node: Any, depth: int) -> Any:
        """The payload for the header tree's root ``node`` (a leaf comes back as it is)."""
        if node is _REF or type(node) in _NESTED or node is _TUPLE:
            return self._value(node, depth)
        return node

    def _enter(self, node: Any, depth: int) -> int:
        depth += 1
        if depth > self.max_depth:
            raise WireFormatError(f"nesting depth exceeds max_depth={self.max_depth}")
        self.items += len(node)
        if self.items > self.max_items:
            raise WireFormatError(f"more than max_items={self.max_items} elements")
        return depth

    def _dict(self, node: dict[Any, Any], depth: int) -> Any:
        depth = self._enter(node, depth)
        for k, v in node.items():
            if type(k) is not str:
                raise WireFormatError(f"dict key of type {type(k).__name__} (only str keys are allowed)")
            if v is _REF or type(v) in _NESTED or v is _TUPLE:  # leaves (most values) stay as they are
                node[k] = self._value(v, depth)
        return node

    def _list(self, node: list[Any], depth: int) -> Any:
        depth = self._enter(node, depth)
        is_tuple = bool(node) and node[0] is _TUPLE
        if is_tuple:
            node = node[1:]
        for i, v in enumerate(node):
            if v is _REF or type(v) in _NESTED or v is _TUPLE:
                node[i] = self._value(v, depth)
        return tuple(node) if is_tuple else node

    def _value(self, v: Any, depth: int) -> Any:
        """A non-leaf value inside a container at ``depth``: a buffer, a nested container, or an error."""
        if v is _REF:
            return self._ref()
        if type(v) is dict:
            return self._dict(v, depth)
        if type(v) is list:
            return self._list(v, depth)
        raise _unsupported(v)

    def _ref(self) -> Any:
        """Build the value of the next buffer-table row (a view, or a copy with ``copy=True``)."""
        i = self.next_ref
        if i >= len(self.table):
            raise WireFormatError(f"header references buffer {i} but the table has {len(self.table)}")
        self.next_ref = i + 1
        spec, off, nbytes, shape = self.table[i]
        if spec.is_bytes:
            return bytes(self.mv[off : off + nbytes])
        arr = _frombuffer(self.mv, spec.carrier, nbytes // spec.itemsize, off)
        if len(shape) != 1:
            arr = arr.reshape(shape)
        if spec.is_bool and nbytes and bool((arr.view(np.uint8) > 1).any()):
            raise WireFormatError(f"buffer {i}: bool data holds bytes other than 0 and 1")
        if self.copy:
            arr = copy_out(arr)
        elif self.readonly:
            if spec.torch_dtype is None:
                return arr
            tensor = _from_readonly(arr)
            return tensor.view(spec.torch_dtype) if spec.needs_view else tensor
        torch_dtype = spec.torch_dtype
        if torch_dtype is None:
            return arr
        return _from_numpy(arr).view(torch_dtype) if spec.needs_view else _from_numpy(arr)


class _Marker:
    """A header extension value (buffer reference or tuple marker) after ``_ext_hook``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_REF = _Marker("<buffer ref>")
_TUPLE = _Marker("<tuple marker>")


def _ext_hook(code: int, data: bytes) -> _Marker:
    """msgpack ext_hook: map our two extension values to singletons, refuse anything else."""
    if not data:
        if code == EXT_REF:
            return _REF
        if code == EXT_TUPLE:
            return _TUPLE
    raise WireFormatError(f"unknown msgpack extension type {code} ({len(data)} data bytes)")


def _unsupported(v: Any) -> WireFormatError:
    if v is _TUPLE:
        return WireFormatError("tuple marker outside the first position of an array")
    return WireFormatError(f"header holds an unsupported msgpack value of type {type(v).__name__}")


def _from_readonly(arr: np.ndarray) -> torch.Tensor:
    global _readonly_warning_consumed
    if _readonly_warning_consumed:
        return torch.from_numpy(arr)
    with _readonly_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        tensor = torch.from_numpy(arr)
        _readonly_warning_consumed = True
    return tensor


def decode_py(buffer: Any, copy: bool, limits: Limits) -> Any:
    """The pure-Python decoder (the reference); may raise any exception, see ``omni_plugins.wire.decode``."""
    try:
        mv = memoryview(buffer)
    except TypeError:
        raise WireFormatError(f"cannot decode a {type(buffer).__name__}: not a buffer-protocol object") from None
    if not mv.c_contiguous:
        raise WireFormatError("buffer is not C-contiguous")
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError:
            raise WireFormatError("buffer is not C-contiguous") from None
    size = mv.nbytes
    if size < PREFIX_SIZE:
        raise WireFormatError(f"truncated message: {size} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, flags, reserved, hlen, crc, total = PREFIX.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION or flags or reserved:
        check_prefix(magic, version, flags, reserved)
    if hlen > limits.max_header_bytes:
        raise WireFormatError(f"header length {hlen} exceeds max_header_bytes={limits.max_header_bytes}")
    if total > size:
        raise WireFormatError(f"truncated message: prefix declares {total} bytes but the buffer holds {size}")
    data_start = (PREFIX_SIZE + hlen + ALIGNMENT - 1) & -ALIGNMENT
    if data_start > total:
        raise WireFormatError(f"header length {hlen} does not fit in the declared message length {total}")
    if total < size:
        mv = mv[:total]
    header = mv[PREFIX_SIZE : PREFIX_SIZE + hlen]
    if zlib.crc32(header) != crc:
        raise WireFormatError("header checksum mismatch (corrupted or truncated header)")
    # A big header can hold millions of tiny containers; the cyclic GC, triggered again and again
    # while msgpack allocates them, made a crafted 6 MiB header cost seconds. msgpack holds the GIL
    # throughout, so pausing the collector here is invisible to other threads.
    pause_gc = hlen > _GC_PAUSE_HEADER_BYTES and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        doc = _unpackb(header, max_array_len=limits.max_items, max_map_len=limits.max_items, max_ext_len=0, ext_hook=_ext_hook)
    except WireFormatError:
        raise
    except Exception as exc:
        raise WireFormatError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    finally:
        if pause_gc:
            gc.enable()
    if type(doc) is not list or len(doc) != 2:
        raise WireFormatError("header is not a [tree, table] pair")
    tree, raw_table = doc
    if type(raw_table) is list and type(tree) in _NESTED and limits.max_depth >= 1 and len(raw_table) + len(tree) > limits.max_items:
        # what the builder's first step would say, before a per-row check of a table that cannot pass
        raise WireFormatError(f"more than max_items={limits.max_items} elements")
    table = _check_table(raw_table, data_start, total, limits)
    builder = _Builder(mv, table, copy, limits)
    obj = builder._dict(tree, 0) if type(tree) is dict else builder.walk(tree, 0)
    if builder.next_ref != len(table):
        raise WireFormatError(f"header references {builder.next_ref} buffers but the table has {len(table)}")
    return obj
