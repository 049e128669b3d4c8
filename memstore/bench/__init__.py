"""``memstore bench``: save stall, replication, restore and memory of memstore against baselines.

A run measures one or more *scenarios* (state size x hosts x replication factor R). Each runs on an
embedded :class:`~memstore.devtools.cluster.LocalCluster` on 127.0.0.1 (or, with ``--endpoints``, on an
already running cluster addressed by a JSON endpoints file) and measures:

* every save from the first one of a fresh job on freshly started stores (no warm-up), each timed from the ``save()``
  call: the trainer's stall (call -> return) and call -> committed (R copies), against a memcpy of the same bytes right
  before it and raw TCP; save 1, saves 2..keep+2 and the steady state reported apart,
* the replication throughput derived from them,
* restore from local RAM after a trainer-process crash: a NEW process connects and loads,
* restore from peer RAM after a host loss: the owner store is SIGKILLed and replaced (empty RAM) and a
  new process on the replacement loads, timed from its load call; and, for diagnosis, the pure pull path (owner up, its
  copy deleted) and the store's pull timed alone,
* the memory of every store process (RSS, PSS, shared/anonymous parts) against the shard bytes it holds and its pool,

and, once per run for the headline scenario (issue 16, :mod:`memstore.bench.first_save`): the same saves from the first
on fresh stores with memory pre-faulted (``--prefault``, (keep+2)x the state unless given), the fixed cost per save of small
states (1 MiB, 16 MiB), the cost per tensor of a save and a load (10,000 x 4 KiB against one tensor), the path without
shared memory (``use_shared_memory=False``), and the restore from durable storage (a ``file://`` spill);
and, once per run, the RSS growth of the stores and of the saving client over ``--leak-saves`` (100)
consecutive saves. In the same run and on the same bytes it measures the baselines they are compared with:
a torch ``copy_`` into pre-faulted memory (also right before every measured save, so both see the same
background load), raw TCP between two Python processes on loopback, ``torch.save`` + fsync /
``torch.load``, and ``torch.distributed.checkpoint.async_save`` (blocking part and total, fsynced; reported as
unavailable, with the reason, where this torch's DCP cannot do it). For
diagnosis it also measures gRPC-Python streaming and an in-process cost model of the save and
replication paths, and records the machine's CPU pressure and the CPU time other processes took.

Results: rich tables, ``--json PATH`` (every raw number) and ``--plot PATH.png`` (matplotlib, the ``[bench]``
extra; written next to the JSON by default).

Modules, by role: ``options`` (flags and the run configuration), ``plan`` (scenarios, RAM need), ``floors``,
``floors_disk`` and ``floors_dcp`` (baselines; ``senders``: the child processes that send for the TCP/gRPC floors), ``costmodel``
(diagnosis), ``cluster`` and ``rpc`` (the stores), ``series`` (saves from the first), ``scenario``, ``restores``,
``durable``, ``first_save_runs``, ``small_states`` and ``leak`` (the measurements; ``workers``: the restore and
leak-check processes, ``child``: how the bench talks to them), ``state`` and ``sysinfo`` (the benchmarked state; the
machine and its processes), ``results``, ``scenario_results``, ``first_save_results``, ``first_save``, ``target``,
``targets``, ``run_result`` and ``method`` (typed results, ratios, PASS/MISS; ``jsonable`` writes them as JSON),
``runner`` (a whole run), ``render``, ``render_first_save`` and ``render_details`` (rich tables; ``fmt``: number
formats), ``plot``, ``plot_first_save`` and ``plot_common`` (matplotlib), ``units``.
Two stand-alone spill benchmarks live here too: ``compression`` and ``spill_impact`` (``python -m memstore.bench.X``).

Entry points: :func:`add_arguments` and :func:`run` for the ``memstore`` command line, :func:`main` for a list of
arguments (``python -m memstore.bench``, ``benchmarks/bench.py``). This package's ``__init__`` and ``options`` only
import the standard library; torch, numpy, grpc, rich and matplotlib are imported when a run starts.
"""

from __future__ import annotations

import argparse
import sys

from memstore.bench.options import add_arguments

__all__ = ["add_arguments", "main", "run"]


def run(args: argparse.Namespace) -> int:
    """Run ``memstore bench`` with flags parsed by a parser that :func:`add_arguments` filled; the exit code."""
    from memstore.bench.runner import run_from_args

    return run_from_args(args, argv=_invocation_argv())


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) as ``memstore bench`` flags and run; the exit code."""
    from memstore.bench.runner import run_from_args

    parser = argparse.ArgumentParser(prog="memstore bench", description="Measure memstore's save stall, replication, restore and memory.")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `memstore bench -- --size 1GiB`: the CLI hands its REMAINDER over with the separator
        argv = argv[1:]
    args = parser.parse_args(argv)
    return run_from_args(args, argv=argv)


def _invocation_argv() -> list[str]:
    """The bench's own arguments on this process's command line (after ``bench``), recorded as ``bench_argv``."""
    argv = sys.argv[1:]
    if "bench" in argv:
        argv = argv[argv.index("bench") + 1 :]
    return argv[1:] if argv[:1] == ["--"] else argv
