"""Shared-memory connector for omni-plugins (``shm``, alias ``SharedMemoryConnector``).

Payloads live in files under ``/dev/shm`` named after their key, so a
consumer that knows only the key finds them. See ``docs/backends/shm.md`` for the
design and measured numbers.
"""

from omni_plugins_shm.config import ShmConfig

__all__ = ["ShmConfig"]
