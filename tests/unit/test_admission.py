"""Admission alone: inbound transfers counted per sender within --max-streams-per-peer, each ended once."""

from __future__ import annotations

import threading

import pytest

from memstore.errors import TooManyStreams
from memstore.server.engine.admission import Admission

pytestmark = pytest.mark.unit


def test_each_sender_has_its_own_count_within_the_limit() -> None:
    admission = Admission("h0", max_streams=2)
    admission.admit("peer:h1")
    admission.admit("peer:h1")
    with pytest.raises(TooManyStreams) as err:
        admission.admit("peer:h1")
    assert (err.value.sender, err.value.active, err.value.max_streams) == ("peer:h1", 2, 2)
    assert "peer 'h1' already have 2 transfers open to store h0" in str(err.value) and "--max-streams-per-peer 2" in str(err.value)
    admission.admit("peer:h2")  # another sender has its own
    assert admission.open_streams() == {"peer:h1": 2, "peer:h2": 1}  # the refused one counted nothing


def test_an_ended_transfer_gives_its_slot_back_and_an_idle_sender_is_forgotten() -> None:
    admission = Admission("h0", max_streams=1)
    admission.admit("job:train")
    with pytest.raises(TooManyStreams, match="the clients of job 'train'"):
        admission.admit("job:train")
    admission.end("job:train")
    assert admission.open_streams() == {}
    admission.admit("job:train")
    assert admission.open_streams() == {"job:train": 1}


def test_zero_means_unlimited() -> None:
    admission = Admission("h0", max_streams=0)
    for _ in range(100):
        admission.admit("peer:h1")
    assert admission.open_streams() == {"peer:h1": 100}


def test_busy_while_any_transfer_is_open() -> None:
    """What the store's foreground_busy adds to the catalog's: bytes arriving from a peer or a client."""
    admission = Admission("h0", max_streams=4)
    assert not admission.busy()
    admission.admit("peer:h1")
    assert admission.busy()
    admission.end("peer:h1")
    assert not admission.busy()


def test_concurrent_admissions_never_pass_the_limit() -> None:
    admission = Admission("h0", max_streams=5)
    admitted: list[int] = []
    start = threading.Barrier(20)

    def one(i: int) -> None:
        start.wait()
        try:
            admission.admit("peer:h1")
        except TooManyStreams:
            return
        admitted.append(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(admitted) == 5 and admission.open_streams() == {"peer:h1": 5}
