"""Rank routing and keys: every topology the brief names, send and receive side."""

from __future__ import annotations

import pytest

from omni_plugins.errors import ConfigError
from omni_plugins.kv import ranks

# (from_tp, to_tp) -> ({sender rank: targets}, {receiver rank: sources})
ROUTES = {
    (1, 1): ({0: [0]}, {0: [0]}),
    (2, 1): ({0: [0], 1: [0]}, {0: [0, 1]}),
    (1, 2): ({0: [0, 1]}, {0: [0], 1: [0]}),
    (4, 2): ({0: [0], 1: [0], 2: [1], 3: [1]}, {0: [0, 1], 1: [2, 3]}),
    (2, 4): ({0: [0, 1], 1: [2, 3]}, {0: [0], 1: [0], 2: [1], 3: [1]}),
    (2, 2): ({0: [0], 1: [1]}, {0: [0], 1: [1]}),
}


@pytest.mark.parametrize(("from_tp", "to_tp"), list(ROUTES))
def test_routes(from_tp: int, to_tp: int) -> None:
    send, recv = ROUTES[(from_tp, to_tp)]
    assert {r: ranks.target_ranks_for_send(from_tp, to_tp, r) for r in range(from_tp)} == send
    assert {r: ranks.remote_ranks_for_recv(from_tp, to_tp, r) for r in range(to_tp)} == recv


@pytest.mark.parametrize(("from_tp", "to_tp"), list(ROUTES))
def test_send_and_receive_keys_pair_up(from_tp: int, to_tp: int) -> None:
    """Every key a sender puts is read by exactly one receiver, and every key a receiver reads is put."""
    put = [ranks.kv_key("req-1", 3, 0, s, t) for s in range(from_tp) for t in ranks.target_ranks_for_send(from_tp, to_tp, s)]
    read = [ranks.kv_key("req-1", 3, 0, s, r) for r in range(to_tp) for s in ranks.remote_ranks_for_recv(from_tp, to_tp, r)]
    assert len(put) == len(set(put))
    assert sorted(put) == sorted(read)


def test_key_format() -> None:
    assert ranks.kv_key("req_a", 0, 2, 1, 3) == "req_a_0_2_1_3"


@pytest.mark.parametrize(
    ("from_tp", "to_tp", "rank", "match"),
    [
        (0, 1, 0, "positive"),
        (1, -2, 0, "positive"),
        (3, 2, 0, "divisible"),
        (4, 6, 0, "divisible"),
        (2, 1, 2, "out of range"),
        (2, 1, -1, "out of range"),
        (1.0, 1, 0, "int"),
        (True, 1, 0, "int"),
    ],
)
def test_invalid_topologies_rejected(from_tp: object, to_tp: object, rank: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ranks.validate_topology(from_tp, to_tp, rank)  # type: ignore[arg-type]


def test_role_checks_the_right_side() -> None:
    ranks.validate_topology(2, 1, 1)  # a rank of the larger side
    ranks.validate_topology(2, 1, 1, role="send")
    with pytest.raises(ConfigError, match="to_tp"):
        ranks.validate_topology(2, 1, 1, role="recv")
    with pytest.raises(ConfigError, match="from_tp"):
        ranks.validate_topology(1, 2, 1, role="send")
    with pytest.raises(ConfigError, match="from_tp"):
        ranks.target_ranks_for_send(1, 2, 1)
    with pytest.raises(ConfigError, match="to_tp"):
        ranks.remote_ranks_for_recv(2, 1, 1)
    with pytest.raises(ConfigError, match="divisible"):
        ranks.remote_ranks_for_recv(3, 2, 0)
