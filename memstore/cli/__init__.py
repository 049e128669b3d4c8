"""The ``memstore`` command line: one argparse parser, one subcommand per module of this package.

Every command module ``memstore/cli/<module>.py`` (:data:`COMMANDS`) provides

* ``HELP``: the one line ``memstore --help`` shows for it,
* ``add_arguments(parser)``: its flags (and, where it has them, the parser's description and help formatter),
* ``run(args) -> int``: the command, with the flags parsed; returns the exit code.

:func:`main` parses the whole command line with :func:`build_parser` and hands the namespace to the command's
``run``. A :class:`~memstore.errors.StoreError` out of ``run`` prints ``memstore <command>: error: ...`` and exits 2;
an :class:`argparse.ArgumentError` (flags that parse but do not fit together) is reported by the subcommand's
parser: its usage, ``memstore <command>: error: ...``, exit code 2.

The package also holds :data:`HELPERS`, which are not commands: ``common`` (flags and logging set-up) and ``render``
(the read commands' tables and JSON, over a ``memstore.survey``).

Building the parser imports every command module, so they import only the standard library and light memstore
modules at the top (no torch, no grpc); what a command needs beyond that is imported when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from memstore.children import die_with_parent
from memstore.cli.common import apply_credential_arguments
from memstore.errors import StoreError

#: subcommand -> its module in this package, in the order ``memstore --help`` lists them.
COMMANDS: dict[str, str] = {
    "serve": "serve",
    "local-cluster": "local_cluster",
    "demo": "demo",
    "chaos": "chaos",
    "simulate": "simulate",
    "bench": "bench",
    "export": "export",
    "reclaim-shm": "reclaim_shm",
    "status": "status",
    "ls": "ls",
    "inspect": "inspect",
    "delete": "delete",
    "drain": "drain",
}

#: modules of this package that are not commands: what the commands share
HELPERS = ("common", "render")

DESCRIPTION = "In-memory replicated checkpoint store for PyTorch training."


def command_module(command: str) -> ModuleType:
    """The module of ``command`` (a key of :data:`COMMANDS`)."""
    return importlib.import_module(f"{__name__}.{COMMANDS[command]}")


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="memstore", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for command in COMMANDS:
        module = command_module(command)
        subparsers[command] = p = sub.add_parser(command, help=module.HELP)
        module.add_arguments(p)
    return parser, subparsers


def build_parser() -> argparse.ArgumentParser:
    """The ``memstore`` parser: one subparser per command, each filled by its module's ``add_arguments``."""
    return _build()[0]


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Report ``message`` the way argparse reports a bad flag (usage, ``prog: error: ...``); exit code 2."""
    try:
        parser.error(message)
    except SystemExit as exc:
        return _exit_code(exc)


def main(argv: list[str] | None = None) -> int:
    """Run ``memstore`` with ``argv`` (default: ``sys.argv[1:]``); the exit code."""
    die_with_parent()  # when started by a LocalCluster or the demo: die with it
    parser, subparsers = _build()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help (0) or a usage error (2), printed by argparse
        return _exit_code(exc)
    if args.command != "serve":  # serve's --auth-token-file etc. are the store's own (memstore.config)
        apply_credential_arguments(args)
    try:
        return int(command_module(args.command).run(args))
    except argparse.ArgumentError as exc:
        return _usage_error(subparsers[args.command], str(exc))
    except StoreError as exc:
        print(f"memstore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
