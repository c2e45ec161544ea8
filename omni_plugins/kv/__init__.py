"""KV cache transfer between pipeline stages with different tensor-parallel sizes.

Modules: :mod:`~omni_plugins.kv.ranks` (routing and keys),
:mod:`~omni_plugins.kv.layout` (reading paged caches),
:mod:`~omni_plugins.kv.payload` (payload structure and validation),
:mod:`~omni_plugins.kv.shards` (merge / slice on the head dim),
:mod:`~omni_plugins.kv.manager` (:class:`KVTransferManager`). See ``docs/runtime/kv.md``.
"""

from omni_plugins.kv import ranks
from omni_plugins.kv.errors import KVLayoutError, KVPayloadError
from omni_plugins.kv.layout import KVLayout, PagedCaches, normalize_caches
from omni_plugins.kv.manager import KV_CHUNK, KVTransferManager
from omni_plugins.kv.payload import KVPayload, validate_payload
from omni_plugins.kv.shards import merge_shards, slice_for_rank

__all__ = [
    "KV_CHUNK",
    "KVLayout",
    "KVLayoutError",
    "KVPayload",
    "KVPayloadError",
    "KVTransferManager",
    "PagedCaches",
    "merge_shards",
    "normalize_caches",
    "ranks",
    "slice_for_rank",
    "validate_payload",
]
