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

import atheris
from _harness import run

with atheris.instrument_imports(include=["omni_plugins.config", "yaml"]):
    from omni_plugins.config import PipelineConfig, parse_pipeline_config
    from omni_plugins.errors import ConfigError
from omni_plugins.testing.configs import SAMPLE_PIPELINE_YAML

TEMPLATE = SAMPLE_PIPELINE_YAML
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


def warm_up() -> None:
    """Outside libFuzzer's -timeout: a first parse imports the plugin registry, and a connector name
    such as "memory" or "pkg.mod:Class" imports its module (torch with it): seconds on a busy machine."""
    import importlib

    for module in ("torch", "omni_plugins.memory", "omni_plugins_shm.config", "omni_plugins_redis.config", "omni_plugins_mooncake.config"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    for seed in (b"\x00" + TEMPLATE.encode(), b"\x00;"):
        test_one_input(seed)


def main() -> None:
    run(test_one_input, write_seeds, warm_up)


if __name__ == "__main__":
    main()
