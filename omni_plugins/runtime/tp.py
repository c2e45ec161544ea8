"""Tensor-parallel groups: how the ranks of one stage share what rank 0 received.

Only TP rank 0 talks to the connector for ordinary (non-KV) payloads; it
broadcasts what arrived so every rank sees the same payloads at the same step.
The runtime needs only :class:`TPGroup`; the caller injects one.

Trust boundary: a broadcast travels between the ranks of ONE stage, processes
started together by the same launcher. :class:`TorchDistributedGroup` encodes
packets with :mod:`omni_plugins.wire` (no pickle) by default; ``codec="pickle"``
uses ``torch.distributed.broadcast_object_list``, which unpickles what it
receives -- acceptable only on this trusted intra-stage control path, never for
bytes that came from a backend.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

from omni_plugins import wire


@runtime_checkable
class TPGroup(Protocol):
    """The tensor-parallel group of one stage."""

    @property
    def rank_in_group(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank calls it; returns ``src``'s ``obj`` on every rank."""
        ...


class SingleRankGroup:
    """The default: one rank, broadcasting is the identity."""

    rank_in_group = 0
    world_size = 1

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj


class TorchDistributedGroup:
    """A :class:`TPGroup` over an initialised ``torch.distributed`` process group (gloo works).

    ``codec="wire"`` (default) sends a length then the :mod:`omni_plugins.wire`
    bytes; objects must be wire-encodable (dicts, lists, scalars, strings,
    tensors -- everything a connector can deliver is). ``codec="pickle"``
    accepts any object but unpickles on receipt: trusted ranks only.
    """

    def __init__(self, group: Any = None, *, codec: Literal["wire", "pickle"] = "wire") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        if codec not in ("wire", "pickle"):
            raise ValueError(f"codec must be 'wire' or 'pickle', got {codec!r}")
        self._dist = dist
        self._group = group
        self._codec = codec

    @property
    def rank_in_group(self) -> int:
        return int(self._dist.get_rank(self._group))

    @property
    def world_size(self) -> int:
        return int(self._dist.get_world_size(self._group))

    def _global(self, src: int) -> int:
        return src if self._group is None else int(self._dist.get_global_rank(self._group, src))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        root = self._global(src)
        if self._codec == "pickle":
            box = [obj]
            self._dist.broadcast_object_list(box, src=root, group=self._group)
            return box[0]
        is_src = self.rank_in_group == src
        blob = wire.encode(obj).to_bytes() if is_src else b""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        self._dist.broadcast(size, src=root, group=self._group)
        n = int(size.item())
        buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
        if n:
            self._dist.broadcast(buf, src=root, group=self._group)
        if is_src:
            return obj
        return wire.decode(buf.numpy().tobytes(), copy=True)
