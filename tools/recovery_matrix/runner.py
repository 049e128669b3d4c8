"""One row of the recovery matrix, run for real: start a :class:`Scenario`, inject the fault during saves, recover,
restore every rank and measure RPO, RTO and exactness (what each means: :mod:`.scenario`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tools.recovery_matrix.fault import Fault, NotRunHere
from tools.recovery_matrix.scenario import Config, RowResult, Scenario


def run_row(fault: Fault, config: Config, steps: int = 6, workdir: Path | None = None) -> RowResult:
    """Run ``fault`` in ``config`` once, for real, and measure it (see the module's docstring). Raises
    :class:`.fault.NotRunHere` (before starting anything) where this machine cannot inject the fault."""
    why_not = fault.needs()
    if why_not:
        raise NotRunHere(why_not)
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix=f"memstore-matrix-{fault.id}-"))
    work.mkdir(parents=True, exist_ok=True)
    scenario = Scenario(config, fault.hosts(config), work, fault.store_env, fault.discovery, fault.proxied, fault.kib)
    try:
        fault.setup(scenario)
        scenario.start()
        scenario.wait_committed(steps)
        committed = scenario.committed()
        t0 = time.monotonic()
        problems = _attempt("the fault", fault.inject, scenario)
        scenario.stop_workers()  # a lost rank stops the data-parallel job: every rank restarts and restores
        problems += _attempt("the recovery", fault.recover, scenario)
        try:
            restores = scenario.restore()
        except Exception as exc:  # the row fails, the run goes on (and keeps the other rows)
            problems.append(f"the restore failed: {type(exc).__name__}: {str(exc)[:300]}")
            restores = [(0, None, "")]
        rto = time.monotonic() - t0
    finally:
        scenario.close()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    steps_restored = {step for step, _, _ in restores}
    problems += [d for _, d, _ in restores if d]
    if len(steps_restored) > 1:
        problems.append(f"mixed step: ranks restored steps {sorted(steps_restored)}")
    restored = max(steps_restored)
    note = "; ".join(problems) or ("nothing restorable" if restored == 0 else "")
    return RowResult(fault.id, config.label, committed, restored, max(0, committed - restored), round(rto, 2), not problems,
                     fault.max_rpo(config), note, [s for _, _, s in restores])  # fmt: skip


def _attempt(what: str, action: Callable[[Scenario], None], scenario: Scenario) -> list[str]:
    """Run one step of a fault; what went wrong (e.g. a store that did not come back) goes into the row."""
    try:
        action(scenario)
        return []
    except Exception as exc:
        return [f"{what} failed: {type(exc).__name__}: {str(exc)[:300]}"]
