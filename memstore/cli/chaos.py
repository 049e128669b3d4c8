"""``memstore chaos``: a real DDP training job under seeded random SIGKILLs must end bit-identical.

The job (the demo's tiny transformer LM, W ranks over N hosts, one store per host, R=2, a durable
tier on a local directory) runs once without faults as the reference. Then it runs again while a
seeded schedule SIGKILLs, at random steps, either a store (its host's RAM is gone; a replacement
starts empty), a store process alone ("crash": the host and its shared memory survive; the restart
adopts its verified segments), a trainer rank (the job restarts), or both stores of a group at once
(RAM copies of that group are gone: recovery must come from the durable tier). After every fault the job is
restarted the way a scheduler would: every rank restores ``latest_step()`` and trains on.

At the end the loss curve and the final weights of every rank must equal the reference bit for
bit. The report lists every fault, the step each restart resumed from and where every rank's
state came from (local RAM, peer RAM, durable storage). The same seed gives the same schedule.
"""

from __future__ import annotations

import argparse

HELP = "seeded random kills of stores and trainers during real training; checks bit-exactness"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--faults", type=int, default=4)
    p.add_argument("--model-size", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--report", default=None, help="write the report as JSON here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any phase may take before the run counts as hung")


def run(args: argparse.Namespace) -> int:
    from memstore.demo.chaos_run import run_chaos

    return run_chaos(
        args.seed, args.hosts, args.ranks, args.steps, args.faults, args.model_size, timeout=args.timeout, report_path=args.report
    )
