"""Config model of the ``shm`` connector (validated by the core registry)."""

from __future__ import annotations

import itertools
from typing import Annotated

from pydantic import Field, model_validator

from omni_plugins.settings import ConnectorSettings

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
#: the table's larger size classes at most (the C extension's header has room for four classes in all)
MAX_LARGER_CLASSES = 3
SlotCount = Annotated[int, Field(ge=1, le=1 << 20)]
SlotBytes = Annotated[int, Field(ge=1024, le=GIB)]


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
        description="slots of the small class of the namespace's slot table (payloads handed off by compare-and-swap, no "
        "file syscalls; needs the C extension and futex_wait); 0 = no table (every payload takes the file path). The "
        "first instance of a namespace sets the table's geometry",
    )
    slot_bytes: int = Field(
        default=68 * KIB,
        ge=1024,
        le=16 * MIB,
        description="largest encoded payload a slot of the small class holds (the default: 64 KiB of tensors and their header)",
    )
    slot_classes: list[tuple[SlotCount, SlotBytes]] = Field(
        default_factory=lambda: [(16, MIB + 64 * KIB), (8, 4 * MIB + 64 * KIB), (4, 16 * MIB + 64 * KIB)],
        max_length=MAX_LARGER_CLASSES,
        description="the table's classes of larger slots as [count, bytes] pairs, ascending above slot_bytes: a payload "
        "takes a free slot of the smallest class that holds it (else of a larger one), and only payloads larger than "
        "the largest slot (or finding every class full) take the file path. Puts take a class's lowest free slot, so "
        "only about as many slots hold memory as payloads are in flight at once",
    )
    slot_idle_seconds: float = Field(
        default=5.0,
        ge=0,
        description="a free slot of a larger class left unused this long gives its memory back (puts, waits that run out "
        "and gc check a few times per period; the next payload in it faults its pages in again); 0 = keep it until the "
        "table goes",
    )
    reclaim_on_start: bool = Field(default=True, description="free segments of dead producers in this namespace when an instance starts")

    @model_validator(mode="after")
    def _classes_ascend(self) -> ShmConfig:
        sizes = [self.slot_bytes] + [size for _, size in self.slot_classes]
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ValueError(f"slot_classes must ascend above slot_bytes={self.slot_bytes}, got {self.slot_classes}")
        return self
