"""The namespace's publish directory ``<shm_dir>/omnishm.<namespace>.d`` (mode 0700).

Published payloads (``k.``/``h.``) and liveness markers (``o.``) live here; segments being
written, claimed or free live in the shm directory itself. A waiting ``get`` watches only
this directory with inotify, so it is woken by publications in its namespace and by
nothing else: a claim moves a name *out* of the directory (``IN_MOVED_FROM``, not
watched) and a return happens elsewhere. With one watch on the whole shm directory every
claim and return woke every waiter; on a loaded two-core machine each such wake-up
preempted the process doing the work (a publish ``rename`` took 318 us of wall time in a
profiled ping-pong, against 5-7 us without a watcher).

Lifecycle without a lock: every live instance keeps its marker in the directory, so it is
never empty while one lives and ``rmdir`` (which only removes an empty directory) by the
last instance to close -- or by gc -- cannot pull it from under a live one. An instance
that starts while another removes the directory sees its marker creation fail with
``ENOENT`` and creates the directory again.
"""

from __future__ import annotations

import errno
import os
import stat

from omni_plugins.errors import ConnectorError

_ATTEMPTS = 16


def ensure(path: str) -> None:
    """Create the publish directory (0700) or check that the existing one is ours and private.

    The last other instance may remove it between our ``mkdir`` and ``lstat`` (its close): then we create it again.
    """
    for _ in range(_ATTEMPTS):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        break
    else:
        raise ConnectorError(f"shm publish directory {path} keeps disappearing (is gc --all running?)")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConnectorError(f"shm publish directory {path} exists but is not a directory of this user; remove it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def create_marker(path: str, marker: str) -> str:
    """Create the empty liveness file ``marker`` (0600) in the publish directory ``path``; its full path."""
    full = f"{path}/{marker}"
    for _ in range(_ATTEMPTS):
        ensure(path)
        try:
            fd = os.open(full, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            continue  # the last other instance removed the directory just now
        os.close(fd)
        return full
    raise ConnectorError(f"shm publish directory {path} keeps disappearing (is gc --all running?)")


def remove_if_empty(path: str) -> bool:
    """Remove the publish directory if nothing is left in it; True if it was removed."""
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.EBUSY):
            return False
        raise
    return True
