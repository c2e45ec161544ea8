"""The dtype allowlist: one small integer code per accepted tensor / array / bytes type.

Decoding never resolves a dtype by name: a code is looked up in :data:`BY_CODE` and
anything else is refused. Each entry knows the numpy *carrier* dtype used to move the
raw bytes (numpy has no bfloat16 / float8, so those travel as int16 / uint8 and are
re-viewed as the torch dtype).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("omni_plugins.wire stores little-endian data and supports only little-endian hosts")


_CARRIER_TORCH = {"|u1": torch.uint8, "<i2": torch.int16}


class Kind(Enum):
    TORCH = "torch"
    NUMPY = "numpy"
    BYTES = "bytes"


@dataclass(frozen=True)
class DtypeSpec:
    """One allowed element type."""

    code: int
    kind: Kind
    carrier: np.dtype  # numpy dtype the bytes are read as
    torch_dtype: torch.dtype | None  # final torch dtype (TORCH kind)
    needs_view: bool  # carrier is not the final dtype: .view(torch_dtype) after from_numpy
    itemsize: int = field(init=False)
    is_bool: bool = field(init=False)
    is_bytes: bool = field(init=False)
    is_complex: bool = field(init=False)
    carrier_torch: torch.dtype | None = field(init=False)  # set when needs_view: torch dtype of the carrier

    def __post_init__(self) -> None:
        object.__setattr__(self, "itemsize", int(self.carrier.itemsize))
        object.__setattr__(self, "is_bool", self.carrier.kind == "b")
        object.__setattr__(self, "is_bytes", self.kind is Kind.BYTES)
        object.__setattr__(self, "is_complex", self.carrier.kind == "c")
        object.__setattr__(self, "carrier_torch", _CARRIER_TORCH[self.carrier.str] if self.needs_view else None)


def _torch_specs() -> list[DtypeSpec]:
    plain: list[tuple[int, torch.dtype, type]] = [
        (1, torch.bool, np.bool_),
        (2, torch.uint8, np.uint8),
        (3, torch.int8, np.int8),
        (4, torch.int16, np.int16),
        (5, torch.int32, np.int32),
        (6, torch.int64, np.int64),
        (7, torch.float16, np.float16),
        (9, torch.float32, np.float32),
        (10, torch.float64, np.float64),
        (11, torch.complex64, np.complex64),
        (12, torch.complex128, np.complex128),
    ]
    specs = [DtypeSpec(c, Kind.TORCH, np.dtype(n), t, False) for c, t, n in plain]
    specs.append(DtypeSpec(8, Kind.TORCH, np.dtype(np.int16), torch.bfloat16, True))
    for code, name in (
        (13, "float8_e4m3fn"),
        (14, "float8_e4m3fnuz"),
        (15, "float8_e5m2"),
        (16, "float8_e5m2fnuz"),
        (17, "float8_e8m0fnu"),
    ):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype):
            specs.append(DtypeSpec(code, Kind.TORCH, np.dtype(np.uint8), dt, True))
    return specs


def _numpy_specs() -> list[DtypeSpec]:
    types: list[tuple[int, type]] = [
        (33, np.bool_),
        (34, np.uint8),
        (35, np.int8),
        (36, np.int16),
        (37, np.int32),
        (38, np.int64),
        (39, np.float16),
        (41, np.float32),
        (42, np.float64),
        (43, np.complex64),
        (44, np.complex128),
        (45, np.uint16),
        (46, np.uint32),
        (47, np.uint64),
    ]
    return [DtypeSpec(c, Kind.NUMPY, np.dtype(t), None, False) for c, t in types]


BYTES_SPEC = DtypeSpec(64, Kind.BYTES, np.dtype(np.uint8), None, False)

_ALL = [*_torch_specs(), *_numpy_specs(), BYTES_SPEC]
BY_CODE: dict[int, DtypeSpec] = {s.code: s for s in _ALL}
BY_TORCH: dict[torch.dtype, DtypeSpec] = {s.torch_dtype: s for s in _ALL if s.kind is Kind.TORCH and s.torch_dtype is not None}
# keyed by dtype.str of a native-order dtype ("<f4", "|b1", ...)
BY_NUMPY: dict[str, DtypeSpec] = {s.carrier.str: s for s in _ALL if s.kind is Kind.NUMPY}

ALLOWED_TORCH_DTYPES = frozenset(BY_TORCH)
ALLOWED_NUMPY_DTYPES = frozenset(np.dtype(s.carrier) for s in BY_NUMPY.values())
