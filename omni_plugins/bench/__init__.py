"""``omni-plugins bench``: connector throughput and latency against raw backend baselines, measured in the same run.

``drivers`` (per-backend raw baselines and connector configs), ``harness``
(the two-process put+get loop), ``runner`` (servers, table, JSON, plot).
"""

from omni_plugins.bench.runner import BACKENDS, BenchOptions, BenchResult, format_size, parse_size, plot, run_bench, write_json

__all__ = ["BACKENDS", "BenchOptions", "BenchResult", "format_size", "parse_size", "plot", "run_bench", "write_json"]
