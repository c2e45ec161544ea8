"""What both atheris harnesses share: arguments, seeding, the address-space cap, libFuzzer's loop."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable

import atheris


def limit_address_space(headroom_mib: int) -> None:
    """Cap the address space a little above what this process already maps (a lying size cannot allocate)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        vm_pages = int(f.read().split()[0])
    limit = vm_pages * os.sysconf("SC_PAGE_SIZE") + (headroom_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run(test_one_input: Callable[[bytes], None], write_seeds: Callable[[str], None], warm_up: Callable[[], None] | None = None) -> None:
    """Parse ``--as-headroom-mib=N`` (default 1024; 0 = no cap), seed empty corpus dirs, cap memory, then fuzz.

    ``warm_up`` runs after the cap and before libFuzzer's ``-timeout`` applies
    (slow first imports belong there).
    """
    headroom = 1024
    argv = []
    for arg in sys.argv:
        if arg.startswith("--as-headroom-mib="):
            headroom = int(arg.split("=", 1)[1])
        else:
            argv.append(arg)
    for arg in argv[1:]:
        if not arg.startswith("-") and (os.path.isdir(arg) or not os.path.exists(arg)):
            write_seeds(arg)
    if headroom > 0:  # --as-headroom-mib=0: no cap (an ASan build reserves terabytes of shadow memory)
        limit_address_space(headroom)
    if warm_up is not None:
        warm_up()
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
