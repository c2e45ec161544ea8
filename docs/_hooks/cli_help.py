"""The ``--help`` text of an ``omni-plugins`` command, exactly as the command prints it."""

from __future__ import annotations

import contextlib
import io
import os

#: argparse wraps at the terminal width; a fixed one keeps the pages the same on every machine
COLUMNS = "80"


def help_text(command: str) -> str:
    """What ``omni-plugins COMMAND --help`` prints (``command`` may be empty, or several words)."""
    from omni_plugins.cli import main

    out = io.StringIO()
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main([*command.split(), "--help"])
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return out.getvalue()


def help_block(command: str) -> str:
    """A console block: the command line and its help."""
    line = " ".join(["omni-plugins", *command.split(), "--help"])
    return f"```text\n$ {line}\n{help_text(command).rstrip()}\n```\n"
