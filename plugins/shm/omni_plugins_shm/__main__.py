"""``python -m omni_plugins_shm gc ...``: see :mod:`omni_plugins_shm.cli`."""

from omni_plugins_shm.cli import main

raise SystemExit(main(prog="python -m omni_plugins_shm"))
