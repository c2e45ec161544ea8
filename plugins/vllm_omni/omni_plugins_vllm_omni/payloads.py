"""vLLM-Omni payloads to and from what omni-plugins' wire format carries. Never pickle.

The wire format takes dicts with ``str`` keys, lists, tuples, scalars, ``bytes``, tensors and
numeric arrays (``docs/wire-format.md``). vLLM-Omni's payloads also hold other objects; each kind is
handled the way vLLM-Omni's own serializer (``OmniSerializer``, msgpack) delivers it, so a receiver
sees what it would see with vLLM-Omni's connectors:

| object | sent as | received as |
|---|---|---|
| ``msgspec.Struct`` (``SamplingParams``, ``OmniPayloadStruct``...), dataclass | dict of its fields | dict (``OmniSerializer`` is type-erased for these too) |
| ``set`` / ``frozenset`` | list | list |
| ``bytearray`` / ``memoryview`` | bytes | bytes |
| ``slice`` | ``(start, stop, step)`` | tuple |
| ``Enum`` (not an int/str one), numpy scalar | its value | value |
| vLLM's ``RequestOutput`` / ``CompletionOutput``, ``PIL.Image``, dict with non-``str`` keys, anything else | ``OmniSerializer`` bytes | what ``OmniSerializer`` rebuilds (``RequestOutput``, ``Image`` ...) |

Tensors, arrays and ``bytes`` stay out-of-band buffers of the wire format (no serializer copy).
Payloads that needed ``OmniSerializer`` travel in an envelope, so others are returned untouched.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from typing import Any

import numpy as np
import torch

from omni_plugins.errors import WireFormatError

#: marks a payload holding ``OmniSerializer`` blobs (and a blob itself, inside one)
ENVELOPE = "__omni_plugins_vllm_omni__"
BLOB = "__omni_serializer__"
_SCALARS = (str, int, float, bool, type(None), bytes, torch.Tensor)


def to_wire(payload: Any) -> Any:
    """``payload`` in types the wire format carries. ``TypeError`` names what neither it nor ``OmniSerializer`` takes."""
    blobs: list[str] = []  # paths of the objects that went through OmniSerializer
    converted = _convert(payload, "payload", blobs)
    return {ENVELOPE: 1, "payload": converted} if blobs else converted


def from_wire(data: Any) -> Any:
    """Undo :func:`to_wire` on a decoded payload (blobs back through ``OmniSerializer``)."""
    if isinstance(data, dict) and len(data) == 2 and data.get(ENVELOPE) == 1 and "payload" in data:
        return _restore(data["payload"])
    return data


def _convert(obj: Any, path: str, blobs: list[str]) -> Any:
    if isinstance(obj, _SCALARS) or (isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc"):
        return obj
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {k: _convert(v, f"{path}[{k!r}]", blobs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_convert(v, f"{path}[{i}]", blobs) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_convert(v, f"{path}[{i}]", blobs) for i, v in enumerate(obj))
    if _rebuilt_by_serializer(obj):
        return _blob(obj, path, blobs)
    struct = _struct_fields(obj)
    if struct is not None:
        return {name: _convert(getattr(obj, name), f"{path}.{name}", blobs) for name in struct}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _convert(getattr(obj, f.name), f"{path}.{f.name}", blobs) for f in dataclasses.fields(obj)}
    if isinstance(obj, (set, frozenset)):
        return [_convert(v, f"{path}[]", blobs) for v in obj]
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, slice):
        return (obj.start, obj.stop, obj.step)
    if isinstance(obj, enum.Enum):
        return _convert(obj.value, path, blobs)
    if isinstance(obj, np.generic):
        return obj.item()
    return _blob(obj, path, blobs)


def _rebuilt_by_serializer(obj: Any) -> bool:
    """vLLM's output objects and images: ``OmniSerializer``'s decoder rebuilds them, so they go as its bytes."""
    outputs = sys.modules.get("vllm.outputs")
    if outputs is not None and isinstance(obj, (outputs.RequestOutput, outputs.CompletionOutput)):
        return True
    image = sys.modules.get("PIL.Image")
    return image is not None and isinstance(obj, image.Image)


def _struct_fields(obj: Any) -> list[str] | None:
    """The fields of a ``msgspec.Struct`` that msgspec itself would encode (None: not a Struct).

    With ``omit_defaults`` msgspec leaves out a field whose value *is* its default (identity, as
    msgspec checks), or an empty container where the default is a factory; receivers may test for
    a key's presence, so the dict has the keys vLLM-Omni's own serializer would send.
    """
    msgspec = sys.modules.get("msgspec")  # not imported: no object can be a Struct
    if msgspec is None or not isinstance(obj, msgspec.Struct):
        return None
    names = list(obj.__struct_fields__)
    if not obj.__struct_config__.omit_defaults:
        return names
    defaults = obj.__struct_defaults__
    first_default = len(names) - len(defaults)
    kept = names[:first_default]
    for name, default in zip(names[first_default:], defaults, strict=True):
        value = getattr(obj, name)
        if value is default:
            continue
        factory = getattr(default, "factory", None) if type(default).__name__ == "Factory" else None
        if factory is not None and type(value) in (list, dict, set, bytearray) and not value and type(value) is type(factory()):
            continue
        kept.append(name)
    return kept


def _blob(obj: Any, path: str, blobs: list[str]) -> dict[str, bytes]:
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    try:
        data = OmniSerializer.serialize(obj)
    except TypeError as exc:
        raise TypeError(f"{path}: {type(obj).__module__}.{type(obj).__qualname__} cannot be sent: {exc}") from None
    blobs.append(path)
    return {BLOB: data}


def _restore(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and isinstance(obj.get(BLOB), bytes):
            from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

            try:
                return OmniSerializer.deserialize(obj[BLOB])
            except Exception as exc:  # untrusted bytes: whatever the decoder raises, the payload is corrupt
                raise WireFormatError(f"payload: a part sent through vLLM-Omni's serializer does not decode: {exc}") from None
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_restore(v) for v in obj)
    return obj
