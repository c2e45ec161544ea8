"""The stage transfer runtime: the data plane between a model runner and its connector.

See ``docs/runtime/``. Modules: ``core`` (:class:`StageTransferRuntime`),
``state`` (one object per request), ``sender``/``receiver`` (I/O threads),
``delivery`` (receive-side rules), ``accumulate``/``spans`` (merging),
``consumable`` (payload predicates), ``tp`` (TP groups), ``kvbridge`` (KV),
``signals``, ``tuning``.
"""

from omni_plugins.runtime.accumulate import FullPayloadAccumulator, merge_chunk
from omni_plugins.runtime.consumable import payload_finished, payload_is_consumable, scheduling_metadata
from omni_plugins.runtime.core import StageTransferRuntime
from omni_plugins.runtime.signals import ConnectorSignals
from omni_plugins.runtime.state import KVPhase, RequestState
from omni_plugins.runtime.tp import SingleRankGroup, TorchDistributedGroup, TPGroup
from omni_plugins.runtime.tuning import RuntimeTuning

__all__ = [
    "ConnectorSignals",
    "FullPayloadAccumulator",
    "KVPhase",
    "RequestState",
    "RuntimeTuning",
    "SingleRankGroup",
    "StageTransferRuntime",
    "TPGroup",
    "TorchDistributedGroup",
    "merge_chunk",
    "payload_finished",
    "payload_is_consumable",
    "scheduling_metadata",
]
