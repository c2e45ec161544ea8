"""``omni-plugins validate FILE...``: load pipeline YAML files with every check on.

A file with ``synthetic:`` stages is meant for ``omni-plugins run``; it also gets
run's own checks (the synthetic blocks, the chain, KV edges, cross-process
connectors), so ``validate`` never passes a file ``run`` rejects. A file with a
``placement`` section also gets the cross-host check: no edge over a host-local
connector between stages on different hosts.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help="validate pipeline YAML files (connectors, stages, builders; files with synthetic stages: everything 'run' checks)",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--no-builders", action="store_true", help="do not import payload builders")
    p.add_argument("--platform", metavar="NAME", help="vLLM-Omni files: apply their platforms section for this platform (npu, rocm, xpu ...); without it, platform sections are not applied")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.errors import ConfigError

    failed = 0
    for path in args.files:
        try:
            cfg = load_pipeline_config(path, check_builders=not args.no_builders, platform=args.platform)
            if any(s.synthetic is not None for s in cfg.stages):
                from omni_plugins.pipeline.checks import plan_for_run  # imports torch: only for run files

                plan_for_run(cfg, filename=str(path))
            else:
                from omni_plugins.config.placement import placement_errors

                errors = placement_errors(cfg, str(path))
                if errors:
                    raise ConfigError("\n".join(errors))
        except ConfigError as exc:
            failed += 1
            for line in str(exc).splitlines():
                print(line, file=sys.stderr)
            continue
        edges = sorted(cfg.edges())
        print(f"{path}: ok ({len(cfg.stages)} stages, {len(edges)} edges, connectors: {', '.join(sorted(cfg.connectors)) or 'none'})")
    return 1 if failed else 0
