"""The ``omni-plugins`` command line.

Each core subcommand lives in its own module exposing ``add_parser(subparsers)``;
the module is imported only to build the parser, and heavy work is imported
inside its ``run`` function. Plugins add subcommands through the
``omni_register_commands`` hook (:mod:`omni_plugins.commands`): everything after
such a command's name goes to the plugin's own entry function.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
from collections.abc import Sequence

from omni_plugins.cli.interrupts import first_interrupt_only
from omni_plugins.commands import CommandSpec
from omni_plugins.errors import OmniPluginsError

#: subcommand modules, in the order ``--help`` lists them
COMMAND_MODULES: tuple[str, ...] = (
    "omni_plugins.cli.list_cmd",
    "omni_plugins.cli.validate_cmd",
    "omni_plugins.cli.schema_cmd",
    "omni_plugins.cli.run_cmd",
    "omni_plugins.cli.bench_cmd",
    "omni_plugins.cli.new_plugin_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    from omni_plugins import __version__

    parser = argparse.ArgumentParser(prog="omni-plugins", description="Plugin-based connectors for multi-stage inference pipelines.")
    parser.add_argument("--version", action="version", version=f"omni-plugins {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # command not part of this build
            raise
        module.add_parser(sub)
    for spec in _plugin_commands():
        origin = f"plugin {spec.plugin}" + (f", {spec.distribution}" if spec.distribution else "")
        p = sub.add_parser(spec.name, help=f"{spec.help} ({origin})" if spec.help else f"({origin})", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER, help=f"arguments of the plugin's command ('omni-plugins {spec.name} --help')")
    return parser


def _plugin_commands() -> list[CommandSpec]:
    from omni_plugins.plugins import get_plugin_manager

    return get_plugin_manager().commands.specs()


def _split_plugin_command(argv: list[str]) -> tuple[list[str], CommandSpec | None, list[str]]:
    """``[-v, shm, gc, --all]`` -> ``([-v, shm], <shm>, [gc, --all])`` when the first word names a plugin command."""
    from omni_plugins.plugins import get_plugin_manager

    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            spec = get_plugin_manager().commands.get(arg)
            return (argv[: i + 1], spec, argv[i + 1 :]) if spec is not None else (argv, None, [])
    return argv, None, []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command, rest = _split_plugin_command(argv)  # everything after a plugin command's name is the plugin's
    args = parser.parse_args(own)
    args.argv = own  # what was asked for, for commands that record it (``bench``'s results name their command)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)], format="%(levelname)s %(name)s: %(message)s"
    )
    if command is None and not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        with first_interrupt_only():  # a second Ctrl-C must not cut the cleanup short
            if command is not None:
                return int(command.load()(rest, prog=f"omni-plugins {command.name}") or 0)
            return int(args.handler(args) or 0)
    except OmniPluginsError as exc:
        print(f"omni-plugins: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("omni-plugins: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a connector's socket, not our reader
        # the reader went away (``omni-plugins list --json | head``): stop quietly, as a shell tool
        # does on SIGPIPE; stdout now points at /dev/null so the interpreter's last flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE


def _stdout_closed() -> bool:
    """True when stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno (captured), no poll (Windows)
        return False


if __name__ == "__main__":
    sys.exit(main())
