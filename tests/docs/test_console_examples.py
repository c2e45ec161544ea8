"""Every ```console block of the docs is real output of the current code.

Each ``$ command`` line of a console block in ``docs/`` or ``README.md`` runs from the
repository root (``omni-plugins`` from this interpreter's environment, stdout and stderr
together, as a terminal shows them); its output must match the lines below it. Numbers
with a decimal point (timings, throughput) match any number; counts, names and messages
must be equal. A console block may only hold cheap commands (see ``CHEAP``): slow or
server-starting commands belong in ``bash`` blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md"])
#: the subcommands a console example may run (each takes seconds at most)
CHEAP = {"list", "validate", "schema", "run"}
FENCE = re.compile(r"^```console\n(.*?)^```", re.MULTILINE | re.DOTALL)
DECIMAL = re.compile(r"\d+\.\d+")


@dataclass
class Example:
    page: Path
    line: int
    command: str
    expected: list[str]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in FENCE.finditer(text):
            first_line = text.count("\n", 0, block.start(1)) + 1
            current: Example | None = None
            for offset, line in enumerate(block.group(1).splitlines()):
                if line.startswith("$ "):
                    current = Example(page, first_line + offset, line[2:], [])
                    found.append(current)
                elif current is None:
                    raise AssertionError(f"{page.relative_to(ROOT)}:{first_line + offset}: console block does not start with '$ '")
                else:
                    current.expected.append(line)
    return found


def normalize(lines: list[str]) -> list[str]:
    """What a terminal shows (the text after a line's last carriage return), decimals masked, spacing collapsed."""
    shown = [line.rsplit("\r", 1)[-1] for line in lines]
    out = [" ".join(DECIMAL.sub("<decimal>", line).split()) for line in shown]
    while out and not out[-1]:
        out.pop()
    return out


EXAMPLES = examples()


def test_the_docs_have_console_examples() -> None:
    assert len(EXAMPLES) >= 5, [e.id for e in EXAMPLES]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_console_example_output_matches(example: Example, tmp_path: Path) -> None:
    argv = shlex.split(example.command)
    assert argv[0] == "omni-plugins" and len(argv) > 1 and argv[1] in CHEAP, (
        f"{example.id}: only cheap omni-plugins commands ({', '.join(sorted(CHEAP))}) belong in a console block: {example.command}"
    )
    assert "--start-servers" not in argv, f"{example.id}: a console example must not start servers"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        # the example pipelines take their shm namespace from here: one of their own per test
        "OMNI_SHM_NAMESPACE": f"docs-{uuid.uuid4().hex[:10]}",
    }
    # bytes, not text=True: universal newlines would turn a progress bar's carriage returns into lines
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
    output = proc.stdout.decode("utf-8", "replace")
    got = normalize(output.split("\n"))
    want = normalize(example.expected)
    assert got == want, (
        f"{example.id}: `{example.command}` (exit {proc.returncode}) no longer prints what the docs show.\n"
        "Update the page with the real output:\n" + output
    )
    if example.command.split()[1] == "run":
        from omni_plugins_shm.testing import assert_namespace_empty

        assert_namespace_empty(env["OMNI_SHM_NAMESPACE"])
