"""Config model of the ``shm`` connector (validated by the core registry)."""

from __future__ import annotations

from pydantic import Field

from omni_plugins.settings import ConnectorSettings

MIB = 1 << 20
GIB = 1 << 30


class ShmConfig(ConnectorSettings):
    """Settings of :class:`omni_plugins_shm.connector.ShmConnector`.

    Producers and consumers must use the same ``namespace`` (and ``shm_dir``) to see each other.
    """

    namespace: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9_-]{1,48}$",
        description="segment names start with 'omnishm.<namespace>.'; gc and leak checks work per namespace",
    )
    shm_dir: str = Field(default="/dev/shm", min_length=1, description="a tmpfs directory holding the segments")
    zero_copy: bool = Field(
        default=False,
        description="get returns tensors that are views over shared memory (valid while referenced) instead of owned copies",
    )
    pool_bytes: int = Field(
        default=2 * GIB,
        ge=0,
        description="bytes of pre-faulted segments one producer keeps for reuse (held until close); 0 = no pool",
    )
    pool_max_segment_bytes: int = Field(
        default=512 * MIB, ge=0, description="payloads larger than this get a segment of their own, freed after the get"
    )
    map_cache_bytes: int = Field(
        default=4 * GIB, ge=0, description="address space a consumer keeps mapped for pooled segments it has read before"
    )
    hugepage_copies: bool = Field(
        default=True, description="back owned copies of large payloads with transparent huge pages (one page fault per 2 MiB instead of per 4 KiB)"
    )
    recycle_bytes: int = Field(
        default=1 * GIB,
        ge=0,
        description="private memory of garbage-collected owned results kept for reuse (already faulted in); 0 = never recycle",
    )
    ttl_seconds: float = Field(
        default=0.0,
        ge=0,
        description="a producer frees its published payloads still unclaimed after this many seconds "
        "(checked on put, at most every ttl/8 s; a late get then finds nothing); 0 = keep until close",
    )
    futex_wait: bool = Field(
        default=True,
        description="a blocked get sleeps on a futex word in the namespace's wake file (C extension) instead of inotify; "
        "ignored (inotify) when the extension is not built",
    )
    slot_count: int = Field(
        default=256,
        ge=0,
        le=1 << 20,
        description="slots in the namespace's slot table (small payloads handed off by compare-and-swap, no file syscalls; "
        "needs the C extension and futex_wait); 0 = off (every payload takes the file path). The first instance "
        "of a namespace sets the table's geometry",
    )
    slot_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * MIB,
        description="largest encoded payload a slot holds; larger ones take the file path",
    )
    reclaim_on_start: bool = Field(default=True, description="free segments of dead producers in this namespace when an instance starts")
