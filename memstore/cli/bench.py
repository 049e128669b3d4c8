"""``memstore bench``: the benchmark's command (flags and run in :mod:`memstore.bench`, which imports torch only to run)."""

from __future__ import annotations

import argparse

import memstore.bench

HELP = "measure save stall, replication and restores against the baselines of the same machine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Measure memstore's save stall, replication and restores as ratios over baselines measured in the same run."
    memstore.bench.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return memstore.bench.run(args)
