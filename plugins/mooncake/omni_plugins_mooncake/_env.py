"""Process environment Mooncake reads at engine start."""

from __future__ import annotations

import os


def prepare_environment(local_hostname: str) -> None:
    """Bind Mooncake's TCP transport to the advertised address unless the user chose one.

    Without ``MC_TCP_BIND_ADDRESS`` the engine advertises the first non-loopback
    interface when a metadata server is used, which breaks loopback-only setups.
    """
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
