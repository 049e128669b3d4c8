"""The ``memstore`` command line is one parser: every subcommand is a module of memstore.cli with add_arguments and run."""

from __future__ import annotations

import argparse
import inspect
import os
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import memstore.cli
from memstore.cli import COMMANDS, HELPERS, build_parser, command_module, main

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "serve",
    "local-cluster",
    "demo",
    "status",
    "ls",
    "inspect",
    "delete",
    "bench",
    "simulate",
    "chaos",
    "export",
    "reclaim-shm",
    "drain",
}


def test_every_command_is_registered() -> None:
    assert set(COMMANDS) == EXPECTED


def test_the_package_holds_the_commands_and_nothing_else() -> None:
    modules = {m.name for m in pkgutil.iter_modules(memstore.cli.__path__)}
    assert modules == {*COMMANDS.values(), *HELPERS}


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_each_command_module_has_help_add_arguments_and_run(command: str) -> None:
    module = command_module(command)
    assert isinstance(module.HELP, str) and module.HELP and "\n" not in module.HELP
    assert len(inspect.signature(module.add_arguments).parameters) == 1  # (parser)
    assert len(inspect.signature(module.run).parameters) == 1  # (args)
    parser = argparse.ArgumentParser(prog=f"memstore {command}")
    module.add_arguments(parser)  # fills a fresh parser on its own


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_each_command_parses_its_own_flags(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: memstore {command} ")


def test_help_lists_every_command_with_its_line() -> None:
    env = {**os.environ, "COLUMNS": "400"}  # no wrapping: each command and its line on one line
    proc = subprocess.run([sys.executable, "-m", "memstore", "--help"], capture_output=True, text=True, timeout=60, check=True, env=env)
    out = proc.stdout
    lines = [" ".join(line.split()) for line in out.splitlines()]
    for command in EXPECTED:
        assert f"{command} {command_module(command).HELP}" in lines, out


def test_building_the_parser_imports_neither_torch_nor_grpc() -> None:
    code = (
        "import sys; from memstore.cli import build_parser; build_parser(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'grpc'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_usage_errors_exit_2_without_raising(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    # flags that parse but do not fit together: reported by the subcommand's parser
    assert main(["simulate", "--checkpoint-gb", "1", "--checkpoint-gb-per-host", "1"]) == 2
    err = capsys.readouterr().err
    assert "usage: memstore simulate" in err and "memstore simulate: error: give either --checkpoint-gb" in err


def test_console_script_points_at_the_package() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["memstore"] == "memstore.cli:main"
    assert isinstance(build_parser(), argparse.ArgumentParser)
