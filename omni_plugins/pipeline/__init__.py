"""``omni-plugins run``: a pipeline of synthetic stages over real connectors, checked end to end.

Modules: ``spec`` (the ``synthetic`` schema and the chain plan), ``checksums``
(deterministic values), ``builders`` (the payload builder), ``inputs`` and
``kvsynth`` (receive-side checks), ``stage`` (one stage process),
``launcher`` (the orchestrator), ``local`` (the stage processes of one
host), ``stats``/``report`` (numbers and the table), ``leaks`` (backend
leftovers), ``servers`` (``--start-servers``), ``hostmetrics`` (one
Prometheus endpoint per host). Across hosts: ``control`` (the authenticated
control channel), ``hosts`` (the coordinating host's view of the others),
``agent`` (a joining host).
"""

from omni_plugins.pipeline.launcher import RunOptions, run_pipeline
from omni_plugins.pipeline.report import RunReport
from omni_plugins.pipeline.spec import PipelinePlan, SyntheticSpec, build_plan

__all__ = ["PipelinePlan", "RunOptions", "RunReport", "SyntheticSpec", "build_plan", "run_pipeline"]
