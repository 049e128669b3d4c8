"""The engine's erasure-coding parts alone (issue 42): the rebuildable rule, a shard's runs, the parity keeper over a fake
pool, and a shard solved from its group's parity and the other data shards' blocks."""

from __future__ import annotations

import numpy as np
import pytest

from memstore.core.erasure_layout import BLOCK, block_positions
from memstore.core.model import ErasurePlace, Holding, Manifest, ParityCover, ShardKey
from memstore.core.parts import next_offset, parity_columns, row_data_columns, runs
from memstore.core.rebuildable import REBUILD, with_rebuilt
from memstore.core.restorable import latest_restorable
from memstore.erasure.codec import Codec
from memstore.errors import ChecksumMismatch, InvalidArgument
from memstore.server.engine.encoding import Contributions
from memstore.server.engine.parity import ParityKeeper
from memstore.server.engine.rebuild import bad_chunks, chunks_of, spans_of
from memstore.server.engine.scrub import Scrubber
from memstore.v1.integrity import checksum
from tests.unit.engine_fakes import FakePool, config, make_catalog, room_of

pytestmark = pytest.mark.unit
GROUP = tuple(f"slot{i}" for i in range(5))  # ec:4+1


def key(rank: int, step: int = 1) -> ShardKey:
    return ShardKey("job", step, rank)


def cover(host: str, rank: int, row: int, needs: tuple[int, ...], spans: tuple[int, ...] = (1, 2)) -> Holding:
    place = ErasurePlace(GROUP, rank, 1, 0)
    return Holding(host, key(rank), 5, False, 1.0, ParityCover(row, place, spans, tuple(key(n) for n in needs)))


def copy(rank: int) -> Holding:
    return Holding(f"h{rank}", key(rank), 5, True, 1.0)


def test_a_shard_is_rebuildable_while_each_row_it_spans_lost_no_more_columns_than_it_has_parity() -> None:
    # Rank 0's shard spans rows 1 and 2; each row's parity host lists it with the other data shards at its positions.
    covers = [cover("h1", 0, 1, (2, 3)), cover("h2", 0, 2, (1, 3))]
    others = [copy(1), copy(2), copy(3), copy(4)]
    rebuilt = [h for h in with_rebuilt(covers + others, "job") if h.host == REBUILD]
    assert [h.key for h in rebuilt] == [key(0)] and rebuilt[0].verified
    assert latest_restorable(covers + others, "job") is not None  # every rank: four copies and one rebuildable
    # A second loss among the shards sharing its positions (rank 3 in both rows): M=1 cannot solve two columns.
    assert not [h for h in with_rebuilt([*covers, copy(1), copy(2), copy(4)], "job") if h.host == REBUILD]
    assert latest_restorable([*covers, copy(1), copy(2), copy(4)], "job") is None
    # A row's parity host lost with it: that row cannot be solved, however many others are there.
    assert not [h for h in with_rebuilt(covers[:1] + others, "job") if h.host == REBUILD]
    # A shard with a copy is never "rebuilt".
    assert not [h for h in with_rebuilt([*covers, copy(0), *others], "job") if h.host == REBUILD]


def test_runs_are_every_kth_block_of_the_shard_in_each_row() -> None:
    nbytes = 6 * BLOCK + 123  # seven blocks, the last short
    place = ErasurePlace(GROUP, 2, 1, next_offset([(0, 3 * BLOCK + 1)]))  # after a shard of four blocks
    assert place.offset == 4 * BLOCK
    got = {(r.row, r.first + i): r.start + i * r.stride for r in runs(place, nbytes) for i in range(r.count)}
    k = len(GROUP) - 1
    rows = [r for r in range(5) if r != 2]  # host 2's data rows (it keeps row 2's parity)
    want = {(rows[b.slot], b.position): b.start for b in block_positions(place.offset, nbytes, k, BLOCK)}
    assert got == want
    assert parity_columns(place, 0) == (0,) and 2 in row_data_columns(place, 0)


def contribution(manifest: Manifest, place: ErasurePlace, data: bytes, row: int) -> tuple[int, int, memoryview, int]:
    """(first, blocks, bytes, checksum) of ``data``'s contribution to ``row`` (M=1: its blocks)."""
    run = next(r for r in runs(place, len(data)) if r.row == row)
    c = Contributions(memoryview(data), len(data), place, Codec(4, 1))
    joined = np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in c.blocks(run, 0)])
    return run.first, run.count, joined.data, c.checksum(run, 0)


def manifest(rank: int, nbytes: int) -> Manifest:
    return Manifest(key(rank), 5, nbytes, 4096, (0,) * -(-nbytes // 4096), f"h{rank}")


def keeper_of(slot: str = "slot0") -> tuple[ParityKeeper, FakePool]:
    catalog, pool, _ = make_catalog(config(capacity="64MiB"))
    return ParityKeeper("h0", room_of(catalog), pool, lambda: slot), pool  # type: ignore[arg-type]


def test_the_keeper_adds_each_shard_once_and_the_fragment_solves_a_lost_one() -> None:
    keeper, _pool = keeper_of()
    rng = np.random.default_rng(7)
    shards = {r: rng.integers(0, 256, size=BLOCK + 5000 * r, dtype=np.uint8).tobytes() for r in (1, 2, 3, 4)}
    places = {r: ErasurePlace(GROUP, r, 1, 0) for r in shards}
    for r, data in shards.items():  # row 0 (host 0's parity): its first block of every data host, at position 0
        first, blocks, bytes_, sent = contribution(manifest(r, len(data)), places[r], data, 0)
        assert keeper.add(manifest(r, len(data)), places[r], 0, first, blocks, bytes_, sent)
    first, blocks, bytes_, sent = contribution(manifest(1, len(shards[1])), places[1], shards[1], 0)
    assert not keeper.add(manifest(1, len(shards[1])), places[1], 0, first, blocks, bytes_, sent)  # a retry adds nothing
    contributors, parity = keeper.read(("job", 1, ""), 0, 0, 1)
    assert sorted(i.manifest.key.rank for i in contributors) == [1, 2, 3, 4]
    # Rank 3 lost: its block at position 0 of row 0 is the parity XOR the other three (decode, M=1).
    block = {r: np.frombuffer(shards[r][:BLOCK], dtype=np.uint8) for r in shards}
    present = {0: block[1], 1: block[2], 3: block[4], 4: np.frombuffer(parity, dtype=np.uint8)}  # row 0's columns: hosts 1..4
    assert Codec(4, 1).decode(present, BLOCK)[2].tobytes() == shards[3][:BLOCK]
    listed = keeper.listing("job")
    assert {(i.manifest.key.rank, i.parity.row) for i in listed if i.parity} == {(r, 0) for r in (1, 2, 3, 4)}
    assert keeper.bytes_by_job() == {"job": BLOCK}


def test_a_corrupt_fragment_is_dropped_never_read_and_a_wrong_contribution_is_refused() -> None:
    keeper, pool = keeper_of()
    data = bytes(range(256)) * (BLOCK // 256)
    place = ErasurePlace(GROUP, 1, 1, 0)
    first, blocks, bytes_, sent = contribution(manifest(1, len(data)), place, data, 0)
    with pytest.raises(ChecksumMismatch):
        keeper.add(manifest(1, len(data)), place, 0, first, blocks, bytes_, sent ^ 1)  # damaged on the way: nothing added
    with pytest.raises(InvalidArgument):
        keeper.add(manifest(1, len(data)), place, 2, first, blocks, bytes_, sent)  # row 2's parity is host 2's, not ours
    assert keeper.add(manifest(1, len(data)), place, 0, first, blocks, bytes_, sent)
    fragment = keeper._fragments[(("job", 1, ""), 0)]
    fragment.extents[0].segment.view()[17] ^= 0xFF  # a bit flips in RAM
    with pytest.raises(ChecksumMismatch):
        keeper.read(("job", 1, ""), 0, 0, 1)
    assert keeper.listing("job") == [] and keeper.corrupt == 1 and keeper.bytes_by_job() == {}  # dropped: repair refills it
    assert pool.released  # its memory went back


def test_a_bit_flipped_before_a_contribution_lands_is_not_folded_into_a_fresh_checksum() -> None:
    keeper, pool = keeper_of()
    rng = np.random.default_rng(3)
    shards = {r: rng.integers(0, 256, size=BLOCK, dtype=np.uint8).tobytes() for r in (1, 2)}
    places = {r: ErasurePlace(GROUP, r, 1, 0) for r in shards}
    first, blocks, bytes_, sent = contribution(manifest(1, BLOCK), places[1], shards[1], 0)
    assert keeper.add(manifest(1, BLOCK), places[1], 0, first, blocks, bytes_, sent)
    keeper._fragments[(("job", 1, ""), 0)].extents[0].segment.view()[5] ^= 0x01  # a bit flips in RAM
    first, blocks, bytes_, sent = contribution(manifest(2, BLOCK), places[2], shards[2], 0)
    assert keeper.add(manifest(2, BLOCK), places[2], 0, first, blocks, bytes_, sent)  # lands in a fresh fragment
    assert keeper.corrupt == 1 and pool.released  # the corrupt one went, with its memory
    contributors, parity = keeper.read(("job", 1, ""), 0, 0, 1)
    assert [i.manifest.key.rank for i in contributors] == [2]  # rank 1's comes back with the repair's refill
    assert parity == shards[2]  # M=1: the fragment is rank 2's block alone, not rank 1's with a flipped bit


def test_the_scrub_drops_a_corrupt_parity_fragment_and_leaves_sound_ones() -> None:
    keeper, _pool = keeper_of()
    data = bytes(range(256)) * (BLOCK // 256)
    for step in (1, 2):
        place = ErasurePlace(GROUP, 1, 1, 0)
        first, blocks, bytes_, sent = contribution(manifest(1, len(data)), place, data, 0)
        m = Manifest(key(1, step), 5, len(data), 4096, (0,) * (len(data) // 4096), "h1")
        assert keeper.add(m, place, 0, first, blocks, bytes_, sent)
    keeper._fragments[(("job", 2, ""), 0)].extents[0].segment.view()[BLOCK - 1] ^= 0x80
    catalog, _, stop = make_catalog(config(capacity="64MiB"))
    now = [0.0]
    scrub = Scrubber(catalog, catalog.busy, rate=1 << 40, interval=60.0, stop=stop, wall=lambda: now[0])
    scrub.parity = keeper
    assert scrub.pass_once() == 0 and scrub.scrubbed_bytes == 0  # fragments younger than the interval: verified as they landed
    now[0] = 1e12  # long after
    assert scrub.pass_once() == 1
    assert scrub.corrupt == 1 and keeper.corrupt == 1 and scrub.scrubbed_bytes == 2 * BLOCK
    assert {i.manifest.key.step for i in keeper.listing("job")} == {1}  # step 2's fragment dropped: repair refills it
    assert keeper.check(("job", 1, ""), 0, 0) is True and keeper.check(("job", 2, ""), 0, 0) is None


def test_a_rebuilds_chunks_are_those_its_runs_blocks_fall_in() -> None:
    nbytes = 6 * BLOCK + 123
    m = Manifest(key(2), 5, nbytes, 4 << 20, tuple(0 for _ in range(2)), "h2")
    place = ErasurePlace(GROUP, 2, 1, 0)
    by_row = {r.row: r for r in runs(place, nbytes)}
    assert spans_of(by_row[0], nbytes) == [(0, BLOCK), (4 * BLOCK, 5 * BLOCK)]  # blocks 0 and 4: chunks 0 and 1
    assert chunks_of(by_row[0], m) == {0, 1} and chunks_of(by_row[4], m) == {0}  # block 3 only
    assert spans_of(by_row[3], nbytes) == [(2 * BLOCK, 3 * BLOCK), (6 * BLOCK, nbytes)]  # the last block short
    data = np.random.default_rng(1).integers(0, 256, size=nbytes, dtype=np.uint8)
    sums = tuple(checksum(data[i : i + (4 << 20)].tobytes()) for i in range(0, nbytes, 4 << 20))
    good = Manifest(key(2), 5, nbytes, 4 << 20, sums, "h2")
    assert bad_chunks(data.data, good) == set()
    data[5 * BLOCK] ^= 1
    assert bad_chunks(data.data, good) == {1}
