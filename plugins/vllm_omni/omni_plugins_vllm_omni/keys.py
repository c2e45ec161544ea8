"""Backend keys for vLLM-Omni's keys, and which request a vLLM-Omni key belongs to.

vLLM-Omni's callers give each payload a key that is unique per edge only (the orchestrator uses the
bare request id on every edge), so the backend key adds the edge: ``<key>.<from>_<to>``. The ``.``
keeps it a readable name in every backend (the shm plugin hashes names with characters outside
``[A-Za-z0-9_.-]``, e.g. the ``@`` of ``OmniConnectorBase._make_key``), and the key still starts
with the request id, so per-request key patterns (leak checks, reclaims) match it.

``cleanup(request_id)`` frees what a request left; vLLM-Omni builds its keys from the request id in
these shapes (``kv_utils``, the chunk adapter, the orchestrator):

- ``<rid>``: the orchestrator's stage input;
- ``<rid>_<stage>_<chunk>``: a streamed chunk;
- ``<rid>_<stage>_<chunk>_<from rank>_<to rank>``: a KV shard for one TP rank;
- ``omni_<from>_to_<to>_kv_cache_<rid>``: a request's KV without TP.
"""

from __future__ import annotations

import re

_NUMBERED = re.compile(r"_\d+_\d+(?:_\d+_\d+)?")
_KV_WHOLE = re.compile(r"omni_\d+_to_\d+_kv_cache_")


def edge_key(key: str, from_stage: object, to_stage: object) -> str:
    """The backend key of vLLM-Omni key ``key`` on the edge ``from_stage -> to_stage``."""
    return f"{key}.{from_stage}_{to_stage}"


def belongs_to(key: str, request_id: str) -> bool:
    """Whether vLLM-Omni key ``key`` is one of request ``request_id``'s (see the module docstring)."""
    if key == request_id:
        return True
    if key.startswith(request_id) and _NUMBERED.fullmatch(key, len(request_id)):
        return True
    return key.endswith(request_id) and _KV_WHOLE.fullmatch(key, 0, len(key) - len(request_id)) is not None
