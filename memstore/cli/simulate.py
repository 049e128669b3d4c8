"""``memstore simulate``: the scale simulator's command (flags and run in :mod:`memstore.sim.cli`; the ``protocol`` mode in
:mod:`memstore.sim.protocol_cli`)."""

from __future__ import annotations

import argparse

from memstore.sim import cli as sim_cli

HELP = "scale simulator: ETTR and wasted GPU-hours, memstore vs storage checkpoints; `simulate protocol`: restore messages at scale"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = sim_cli.DESCRIPTION
    p.formatter_class = sim_cli.FORMATTER
    sim_cli.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return sim_cli.run(args)
