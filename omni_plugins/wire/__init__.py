"""Safe, zero-copy wire format for omni-plugins payloads.

``encode(obj)`` returns an :class:`Encoded` that references tensor memory;
``decode(buffer)`` rebuilds the payload with tensors as views over ``buffer``
(or owned copies with ``copy=True``). The header is msgpack, never pickle, and
the decoder treats every byte as untrusted: see ``docs/plugins/wire-format.md``.
``encode_into(obj, dest)`` writes the encoding straight into a caller's buffer (no :class:`Encoded`).
``empty_bytes(n)`` is the owned, uninitialised receive buffer the decoder's copies use
(huge pages above 32 MiB), for backends that read a message into memory of their own.
``IMPLEMENTATION`` is ``"native"`` when the compiled header path (``_native.c``) is active,
``"python"`` when it is not built or ``OMNI_WIRE_PURE=1`` was set at import.
"""

from omni_plugins.errors import WireFormatError
from omni_plugins.wire._alloc import empty_bytes
from omni_plugins.wire._codec import IMPLEMENTATION, decode, encode, encode_into, native_c_api, native_encode_into
from omni_plugins.wire._dtypes import ALLOWED_NUMPY_DTYPES, ALLOWED_TORCH_DTYPES
from omni_plugins.wire._encode import OOB_BYTES_THRESHOLD
from omni_plugins.wire._encoded import Encoded
from omni_plugins.wire._format import ALIGNMENT, DEFAULT_LIMITS, FORMAT_VERSION, MAGIC, PREFIX_SIZE, Limits, peek_nbytes

__all__ = [
    "ALIGNMENT",
    "ALLOWED_NUMPY_DTYPES",
    "ALLOWED_TORCH_DTYPES",
    "DEFAULT_LIMITS",
    "FORMAT_VERSION",
    "IMPLEMENTATION",
    "MAGIC",
    "OOB_BYTES_THRESHOLD",
    "PREFIX_SIZE",
    "Encoded",
    "Limits",
    "WireFormatError",
    "decode",
    "empty_bytes",
    "encode",
    "encode_into",
    "native_c_api",
    "native_encode_into",
    "peek_nbytes",
]
