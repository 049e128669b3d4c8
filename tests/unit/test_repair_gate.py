"""RepairGate: a repair pass's pulls start in order, small ones together, a large one alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from memstore.server.engine.recovery import RepairGate


def _run(sizes: list[int], budget: int) -> tuple[list[int], list[set[int]]]:
    gate = RepairGate(budget)
    started: list[int] = []
    running: set[int] = set()
    overlaps: list[set[int]] = []
    lock = threading.Lock()
    release = [threading.Event() for _ in sizes]

    def pull(i: int) -> int:
        with lock:
            started.append(i)
            running.add(i)
            overlaps.append(set(running))
        if i + 1 < len(sizes):
            release[i].wait(0.05)  # give the next ones a chance to overlap, if the gate lets them
        with lock:
            running.discard(i)
        return i

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: gate.run(i, sizes[i], lambda: pull(i)), range(len(sizes))))
    assert results == list(range(len(sizes)))
    return started, overlaps


def test_pulls_start_in_order_and_a_large_one_runs_alone() -> None:
    mib = 1 << 20
    started, overlaps = _run([mib, mib, 512 * mib, mib, mib], budget=256 * mib)
    assert started == [0, 1, 2, 3, 4]
    alone = next(o for o in overlaps if 2 in o)
    assert alone == {2}  # nothing else in flight while the large pull runs
    assert any(len(o) >= 2 for o in overlaps)  # the small ones did overlap


def test_small_pulls_fill_the_workers() -> None:
    started, overlaps = _run([1] * 8, budget=100)
    assert started == list(range(8))
    assert max(len(o) for o in overlaps) >= 2
