"""Which users the tests can act as (the cross-user checks of private files and sockets)."""

from __future__ import annotations

import os

#: the user the cross-user tests act as (nobody) when they run as root
OTHER_UID = 65534


def other_user_available() -> bool:
    """Root, and uid/gid :data:`OTHER_UID` exist in this user namespace.

    The CI runs pytest in a private user namespace (loopback-only network) where only root is
    mapped; there a process cannot become another user, and the cross-user parts run as this user.
    """
    if os.getuid() != 0:
        return False
    for table in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            with open(table) as f:
                rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
        except OSError:
            return False
        if not any(inside <= OTHER_UID < inside + count for inside, _outside, count in rows):
            return False
    return True
