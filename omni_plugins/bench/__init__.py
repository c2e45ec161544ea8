"""``omni-plugins bench``: connector throughput and latency against raw backend baselines, measured in the same run.

``drivers`` (a backend's connector config and its plugin's raw baseline), ``harness``
(the two-process put+get loop), ``runner`` (servers, table, JSON, plot).
"""

from omni_plugins.bench.runner import BenchOptions, BenchResult, backends, format_size, parse_size, plot, run_bench, write_json

__all__ = ["BenchOptions", "BenchResult", "backends", "format_size", "parse_size", "plot", "run_bench", "write_json"]
