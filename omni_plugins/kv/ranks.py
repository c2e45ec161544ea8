"""Rank routing for KV shards between two tensor-parallel stages.

Every TP rank of a stage holds the KV of ``num_heads / tp`` attention heads.
When the sending stage (``from_tp`` ranks) and the receiving stage (``to_tp``
ranks) differ in size, shards are routed by the ratio ``r = larger // smaller``:

* ``from_tp > to_tp`` (e.g. 4 -> 2): receiver rank ``j`` collects the shards of
  sender ranks ``j*r .. j*r + r-1`` and concatenates them on the head dim;
* ``from_tp < to_tp`` (e.g. 2 -> 4): sender rank ``i`` sends its whole shard to
  receiver ranks ``i*r .. i*r + r-1``; each receiver narrows it to its slice.

Keys are ``{request_id}_{from_stage}_{chunk}_{from_rank}_{to_rank}``.
All functions here are pure.
"""

from __future__ import annotations

from typing import Literal

from omni_plugins.errors import ConfigError

Role = Literal["send", "recv"]


def validate_topology(from_tp: int, to_tp: int, local_rank: int, *, role: Role | None = None) -> None:
    """Raise :class:`ConfigError` unless the mapping can be routed losslessly.

    Both TP sizes must be positive ints and the larger divisible by the smaller.
    ``local_rank`` must be a rank of the side it plays: ``role="send"`` checks
    ``0 <= local_rank < from_tp``, ``role="recv"`` checks ``< to_tp``; without a
    role (a process that may do either) it must be below ``max(from_tp, to_tp)``.
    """
    for name, value in (("from_tp", from_tp), ("to_tp", to_tp), ("local_rank", local_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"KV rank mapping: {name} must be an int, got {value!r}")
    if from_tp <= 0 or to_tp <= 0:
        raise ConfigError(f"KV rank mapping: TP sizes must be positive, got from_tp={from_tp}, to_tp={to_tp}")
    larger, smaller = max(from_tp, to_tp), min(from_tp, to_tp)
    if larger % smaller:
        raise ConfigError(f"KV rank mapping: the larger TP size must be divisible by the smaller, got from_tp={from_tp}, to_tp={to_tp}")
    if role == "send":
        bound, side = from_tp, "from_tp (sending stage)"
    elif role == "recv":
        bound, side = to_tp, "to_tp (receiving stage)"
    elif role is None:
        bound, side = larger, "max(from_tp, to_tp)"
    else:
        raise ConfigError(f"KV rank mapping: role must be 'send', 'recv' or None, got {role!r}")
    if not 0 <= local_rank < bound:
        raise ConfigError(f"KV rank mapping: local_rank={local_rank} is out of range for {side}={bound} (from_tp={from_tp}, to_tp={to_tp})")


def remote_ranks_for_recv(from_tp: int, to_tp: int, local_rank: int) -> list[int]:
    """Sender ranks whose shards receiver rank ``local_rank`` needs, in head order."""
    validate_topology(from_tp, to_tp, local_rank, role="recv")
    r = max(from_tp, to_tp) // min(from_tp, to_tp)
    if from_tp == to_tp:
        return [local_rank]
    if from_tp > to_tp:
        return [local_rank * r + i for i in range(r)]
    return [local_rank // r]


def target_ranks_for_send(from_tp: int, to_tp: int, local_rank: int) -> list[int]:
    """Receiver ranks that sender rank ``local_rank`` must send its shard to."""
    validate_topology(from_tp, to_tp, local_rank, role="send")
    r = max(from_tp, to_tp) // min(from_tp, to_tp)
    if from_tp == to_tp:
        return [local_rank]
    if from_tp > to_tp:
        return [local_rank // r]
    return [local_rank * r + i for i in range(r)]


def kv_key(request_id: str, from_stage: int | str, chunk: int, from_rank: int, to_rank: int) -> str:
    """The connector key of one KV shard: ``{request_id}_{from_stage}_{chunk}_{from_rank}_{to_rank}``."""
    return f"{request_id}_{from_stage}_{chunk}_{from_rank}_{to_rank}"
