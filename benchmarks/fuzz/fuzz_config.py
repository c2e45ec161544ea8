"""Coverage-guided fuzzing of the YAML pipeline loader (``parse_pipeline_config``) with atheris.

Contract under test: any text yields a ``PipelineConfig`` or a ``ConfigError`` --
never another exception, never a hang (libFuzzer ``-timeout``), never a blow-up
from YAML aliases (``RLIMIT_AS`` = current address space + ``--as-headroom-mib``).

The first input byte picks a mode: ``raw`` (the rest as UTF-8 text) or
``splice`` (a fuzzer-chosen span of a valid pipeline file replaced by fuzzer
text, so most inputs get past the YAML parser into validation). Builder paths
are not imported (``check_builders=False``): importing an arbitrary module the
fuzzer names would run its code.

    python benchmarks/fuzz/fuzz_config.py -runs=1000000 -timeout=10 -rss_limit_mb=4096 [corpus_dir]
    python benchmarks/fuzz/fuzz_config.py -max_total_time=5
"""

from __future__ import annotations

import os
import resource
import sys

import atheris

with atheris.instrument_imports(include=["omni_plugins.config", "yaml"]):
    from omni_plugins.config import PipelineConfig, parse_pipeline_config
    from omni_plugins.errors import ConfigError

TEMPLATE = """\
connectors:
  fast: {name: memory, extra: {namespace: "${NS:-pipeline}"}}
  other: {name: memory}
default_connector: fast
stages:
  - stage_id: 0
    worker_type: ar
    model_stage: thinker
    custom_process_next_stage_input_func: omni_plugins.testing.builders.passthrough
    output_connectors: {to_stage_1: fast}
    rank_mapping: {from_tp: 2, to_tp: 1}
  - stage_id: 1
    async_chunk: true
    worker_type: generation
    recv_timeout_s: 30
    input_connectors: {from_stage_0: fast}
    output_connectors: {to_stage_2: other}
  - {stage_id: 2, final_output: true, input_connectors: {from_stage_1: other}}
"""
ENV = {"NS": "n", "PORT": "6379", "WEIRD": "[1, *a"}


def make_text(data: bytes) -> str:
    if not data:
        return ""
    fdp = atheris.FuzzedDataProvider(data[1:])
    if data[0] % 2 == 0:
        return fdp.ConsumeUnicodeNoSurrogates(len(data))
    start = fdp.ConsumeIntInRange(0, len(TEMPLATE))
    cut = fdp.ConsumeIntInRange(0, 80)
    return TEMPLATE[:start] + fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes()) + TEMPLATE[start + cut :]


def test_one_input(data: bytes) -> None:
    text = make_text(data)
    try:
        result = parse_pipeline_config(text, env=ENV, check_builders=False)
    except ConfigError as exc:
        if not str(exc).strip():
            raise AssertionError("ConfigError with an empty message") from exc
        return
    if not isinstance(result, PipelineConfig):
        raise AssertionError(f"returned {type(result).__name__}")


def write_seeds(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    if not os.listdir(directory):
        with open(os.path.join(directory, "seed-template"), "wb") as f:
            f.write(b"\x00" + TEMPLATE.encode())


def main() -> None:
    headroom = 1024
    argv = []
    for arg in sys.argv:
        if arg.startswith("--as-headroom-mib="):
            headroom = int(arg.split("=", 1)[1])
        else:
            argv.append(arg)
    for arg in argv[1:]:
        if not arg.startswith("-") and (os.path.isdir(arg) or not os.path.exists(arg)):
            write_seeds(arg)
    with open(f"/proc/{os.getpid()}/statm") as f:
        limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (headroom << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # warm up outside libFuzzer's -timeout: a first parse imports the plugin registry, and a connector
    # name such as "memory" or "pkg.mod:Class" imports its module (torch with it): seconds on a busy machine
    import importlib

    for module in ("torch", "omni_plugins.memory", "omni_plugins_shm.config", "omni_plugins_redis.config", "omni_plugins_mooncake.config"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    for seed in (b"\x00" + TEMPLATE.encode(), b"\x00;"):
        test_one_input(seed)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
