"""``memstore bench``: the benchmark's command (flags and run in :mod:`memstore.bench`, which imports torch only to run)."""

from __future__ import annotations

import argparse

import memstore.bench

HELP = "measure save stall, replication and restore against the hardware floors"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Measure memstore's save stall, replication, restore and memory."
    memstore.bench.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return memstore.bench.run(args)
