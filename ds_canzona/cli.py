"""The ``ds-canzona`` command line: one subcommand per task, each imported only when it runs.

A subcommand is either a :class:`Command` (its arguments and its ``run``) named as
``"module:ATTRIBUTE"``, or a plain module with a ``main(argv) -> int``, named as ``"module"``.
The registry holds only names, so ``ds-canzona plan`` never imports torch just because another
subcommand does. Adding one is a single registry line::

    "consolidate": ("ds_canzona.zero.consolidate", "merge a checkpoint into one file"),

Any :class:`~ds_canzona.plan.specs.PlanError`, ``OSError`` or ``ValueError`` a command raises is
reported as one ``prog: error: ...`` line with exit status 2, never a traceback (set
``DS_CANZONA_DEBUG=1`` to get the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["COMMANDS", "Command", "OneLineParser", "dispatch", "main"]


@dataclass(frozen=True, kw_only=True)
class Command:
    """A subcommand: a description, how to add its arguments, and what to run."""

    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line (the usage stays behind ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# name -> ("module:attribute" of its Command, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("ds_canzona.plan_command:COMMAND", "plan DP ownership offline and report the load balance"),
    "consolidate": ("ds_canzona.consolidate:COMMAND", "write a checkpoint's full model (and optimizer) as safetensors"),
}


def dispatch(prog: str, commands: Mapping[str, tuple[str, str]], argv: Sequence[str] | None = None) -> int:
    """Run the subcommand ``argv[0]`` of ``commands``, importing only its module."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        width = max(len(name) for name in commands)
        listing = "\n".join(f"  {name:<{width}}  {help_text}" for name, (_, help_text) in commands.items())
        usage = f"usage: {prog} {{{','.join(commands)}}} ...\n\ncommands:\n{listing}\n"
        if argv and argv[0] in ("-h", "--help"):
            sys.stdout.write(usage)
            return 0
        problem = f"unknown command {argv[0]!r}" if argv else "a command is required"
        sys.stderr.write(f"{prog}: error: {problem} (choose from {', '.join(commands)})\n")
        return 2
    name = argv[0]
    target, _ = commands[name]
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    if not attribute:  # a module with its own ``main(argv) -> int``
        try:
            return _guarded(f"{prog} {name}", lambda: module.main(argv[1:]))
        except SystemExit as exit:
            return exit.code if isinstance(exit.code, int) else 2
    command: Command = getattr(module, attribute)
    parser = OneLineParser(prog=f"{prog} {name}", description=command.description)
    command.add_arguments(parser)
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exit:  # --help, or a usage error already printed on one line
        return exit.code if isinstance(exit.code, int) else 2
    return _guarded(f"{prog} {name}", lambda: command.run(args))


def _guarded(prog: str, run: Callable[[], int]) -> int:
    """Run a command, turning a user-facing error into one line and exit status 2."""
    try:
        return run()
    except (OSError, ValueError) as error:
        if os.environ.get("DS_CANZONA_DEBUG"):
            raise
        sys.stderr.write(f"{prog}: error: {_one_line(error)}\n")
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ds-canzona`` console script."""
    return dispatch("ds-canzona", COMMANDS, argv)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
