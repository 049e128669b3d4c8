"""The restorable floor's encoding (``trainer_client.floor``): the reduced vector never names a step some rank lacks."""

from __future__ import annotations

import random

import pytest

from trainer_client.floor import WINDOW, agreed_floor, encode

pytestmark = pytest.mark.unit


def reduce_min(*vectors: list[int]) -> list[int]:
    return [min(column) for column in zip(*vectors, strict=True)]


def test_ranks_that_saved_the_same_steps_agree_on_the_newest() -> None:
    assert agreed_floor(reduce_min(encode([1, 2, 3]), encode([3, 2, 1]), encode([2, 3, 1]))) == 3


def test_a_rank_behind_gives_the_floor_it_reached_or_none() -> None:
    assert agreed_floor(reduce_min(encode([1, 2, 3]), encode([1, 2]))) is None  # positions shifted: nothing agreed
    assert agreed_floor(reduce_min(encode([]), encode([5]))) is None
    assert len(encode(list(range(20)))) == 2 * WINDOW and encode(list(range(20)))[0] == 19


def test_a_rank_that_missed_a_save_still_agrees_on_a_step_both_hold() -> None:
    # rank 1 failed step 9 but saved 10: 10 is every rank's (restorable), 9 is not.
    assert agreed_floor(reduce_min(encode([8, 9, 10]), encode([8, 10]))) == 10
    assert agreed_floor(reduce_min(encode([8, 9]), encode([8, 10]))) == 8  # 9 and 10 are each missing somewhere


def test_the_floor_is_always_a_step_every_rank_saved() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        ranks = [sorted(rng.sample(range(12), rng.randint(0, 10))) for _ in range(rng.randint(1, 4))]
        floor = agreed_floor(reduce_min(*(encode(steps) for steps in ranks)))
        common = set.intersection(*(set(sorted(steps)[-WINDOW:]) for steps in ranks))
        assert floor is None or floor in common
        if all(steps == ranks[0] for steps in ranks) and ranks[0]:
            assert floor == max(ranks[0])  # the usual case: the newest step


def test_a_failed_all_reduce_gives_no_floor() -> None:
    """A collective that failed (a rank died) leaves this rank's own vector in the buffer: never read it as agreed."""
    import torch

    from trainer_client.floor import FloorAgreement, _Pending

    class Failed:
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer")

    class Done(Failed):
        def wait(self) -> None:
            return None

    agreement = FloorAgreement.__new__(FloorAgreement)  # no process group needed to test the harvest
    agreement.__dict__.update(_lock=__import__("threading").Lock(), _floors={}, _stream=None)
    mine = torch.tensor(encode([4, 5]), dtype=torch.int64)  # unreduced: it would read as "every rank saved 5"
    agreement._pending = [_Pending(6, "t", Failed(), mine, None)]
    agreement._harvest()
    assert agreement._floors == {} and agreement._pending == []
    agreement._pending = [_Pending(6, "t", Done(), mine, None)]
    agreement._harvest()
    assert agreement._floors == {"t": 5}


def test_a_saves_allocate_waits_briefly_for_its_own_agreement() -> None:
    """``agreed`` (the floor a save's Allocate sends when its store takes segments at save time) waits for this save's
    all-reduce, at most as long as it is told, then reads the floor known: the older one when it is not back."""
    import threading
    import time

    import torch

    from trainer_client.floor import FloorAgreement, _Pending

    class Work:
        def __init__(self) -> None:
            self.done = threading.Event()

        def is_completed(self) -> bool:
            return self.done.is_set()

        def wait(self) -> None:
            self.done.wait()

    agreement = FloorAgreement.__new__(FloorAgreement)
    agreement.__dict__.update(_lock=threading.Lock(), _floors={"t": 4}, _stream=None)
    work = Work()
    agreement._pending = [_Pending(6, "t", work, torch.tensor(reduce_min(encode([4, 5]), encode([5])), dtype=torch.int64), None)]
    started = time.monotonic()
    assert agreement.agreed("t", 6, wait=0.05) == 4  # not back in time: the floor known (the ring grows for this save)
    assert time.monotonic() - started < 5
    threading.Timer(0.05, work.done.set).start()
    assert agreement.agreed("t", 6, wait=10.0) == 5  # back: every rank committed step 5


def test_a_closed_agreement_lets_go_of_the_process_group() -> None:
    """A client can sit in a reference cycle until the garbage collector runs: once closed, its floor agreement must
    not keep the job's process group (a connection to every rank) open until then. 32 ranks in one test process
    kept ~1,000 descriptors that way, which broke a later test's proxy."""
    import gc
    import os

    from tools.thread_ranks import on_every_rank
    from trainer_client.floor import FloorAgreement

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    kept: list[FloorAgreement] = []  # held on, as a cycle would hold a closed client

    def rank(r: int, group: object) -> None:
        agreement = FloorAgreement(group, r, 4, lambda *_: (None, False))  # type: ignore[arg-type,return-value]
        agreement.close()
        kept.append(agreement)

    gc.collect()
    gc.disable()
    try:
        before = descriptors()
        results, _ = on_every_rank(4, rank, timeout=60)
        assert results == [None] * 4
        assert descriptors() <= before + 1, (before, descriptors())  # the groups' 12 sockets are closed already
    finally:
        gc.enable()
