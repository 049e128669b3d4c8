"""Unit tests for memstore.core.erasure_layout: rows of a group, blocks of a part, what a loss reads."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memstore.core.erasure_layout import (
    BLOCK,
    BlockPlace,
    Row,
    block_positions,
    can_rebuild,
    data_rows,
    padded_size,
    parity_rows,
    rebuild_sources,
    rows,
)
from memstore.errors import UnrecoverableLoss

pytestmark = pytest.mark.unit

SHAPES = [(g, m) for g in range(2, 10) for m in range(1, g)]


def test_the_worked_example_g5_m1():
    assert rows(5, 1) == (
        Row(0, data=(1, 2, 3, 4), parity=(0,)),
        Row(1, data=(0, 2, 3, 4), parity=(1,)),
        Row(2, data=(0, 1, 3, 4), parity=(2,)),
        Row(3, data=(0, 1, 2, 4), parity=(3,)),
        Row(4, data=(0, 1, 2, 3), parity=(4,)),
    )
    assert data_rows(0, 5, 1) == (1, 2, 3, 4)
    assert data_rows(2, 5, 1) == (0, 1, 3, 4)
    # host 2's blocks 0, 1, 2 go to rows 0, 1, 3 (columns 1, 1, 2 there); block 4 back to row 0 at position 1
    places = block_positions(0, 5 * BLOCK, k=4)
    assert [(data_rows(2, 5, 1)[p.slot], p.position) for p in places] == [(0, 0), (1, 0), (3, 0), (4, 0), (0, 1)]
    assert [rows(5, 1)[r].column(2) for r in (0, 1, 3)] == [1, 1, 2]


@pytest.mark.parametrize(("g", "m"), SHAPES)
def test_every_host_is_data_in_k_rows_and_parity_in_m_and_never_both(g, m):
    table = rows(g, m)
    assert [row.index for row in table] == list(range(g))
    for row in table:
        assert not set(row.data) & set(row.parity)
        assert sorted(row.data + row.parity) == list(range(g))
        assert list(row.data) == sorted(row.data)
        assert row.parity == tuple((row.index + j) % g for j in range(m))
    for host in range(g):
        as_data = tuple(row.index for row in table if host in row.data)
        as_parity = tuple(row.index for row in table if host in row.parity)
        assert data_rows(host, g, m) == as_data
        assert parity_rows(host, g, m) == as_parity
        assert len(as_data) == g - m
        assert len(as_parity) == m


@pytest.mark.parametrize(("g", "m"), [(5, 1), (6, 2), (7, 3)])
def test_a_rows_columns_number_data_then_parity(g, m):
    for row in rows(g, m):
        assert [row.column(h) for h in row.data] == list(range(g - m))
        assert [row.column(h) for h in row.parity] == list(range(g - m, g))
    with pytest.raises(ValueError, match="not in row"):
        rows(g, m)[0].column(g)


@pytest.mark.parametrize(("g", "m"), SHAPES)
def test_any_loss_of_at_most_m_hosts_is_rebuildable_and_m_plus_1_is_not(g, m):
    for size in range(g + 1):
        for lost in itertools.combinations(range(g), size):
            assert can_rebuild(lost, g, m) is (size <= m)


@pytest.mark.parametrize(("g", "m"), SHAPES)
def test_rebuild_reads_k_survivors_for_every_row_that_lost_data(g, m):
    k = g - m
    for size in range(1, m + 1):
        for lost in itertools.combinations(range(g), size):
            plan = {r.row: r for r in rebuild_sources(lost, g, m)}
            assert set(plan) == set(range(g))  # every host is in every row: each row lost a member
            for row in rows(g, m):
                got = plan[row.index]
                assert got.lost_data == tuple(h for h in row.data if h in lost)
                assert got.lost_parity == tuple(h for h in row.parity if h in lost)
                if got.lost_data:
                    assert len(got.read) == k == len(set(got.read))
                    assert not set(got.read) & set(lost)
                    assert set(got.read) >= {h for h in row.data if h not in lost}
                else:
                    assert got.read == ()


def test_rebuild_spreads_the_parity_reads_over_the_surviving_parity_hosts():
    # ec:4+2 in a group of 6, host 0 lost: each row where it is data reads one of the row's two parity hosts,
    # and the choice alternates with the row, so both parity hosts of a row are used across rows.
    parity_read = [r.read[-1] for r in rebuild_sources([0], 6, 2) if r.lost_data]
    assert len(parity_read) == 4
    chosen_second = [rows(6, 2)[r.row].parity.index(r.read[-1]) for r in rebuild_sources([0], 6, 2) if r.lost_data]
    assert set(chosen_second) == {0, 1}


def test_a_loss_beyond_m_is_refused_with_the_counts():
    with pytest.raises(UnrecoverableLoss, match="lost 2 hosts") as caught:
        rebuild_sources([1, 3], 5, 1)
    assert (caught.value.missing, caught.value.tolerated) == (2, 1)
    assert rebuild_sources([], 5, 1) == ()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rows(3, 0), "m >= 1"),
        (lambda: rows(2, 2), "at least 3"),
        (lambda: data_rows(5, 5, 1), "outside the group"),
        (lambda: can_rebuild([-1], 5, 1), "outside the group"),
        (lambda: block_positions(100, 10, 4), "multiple of the block"),
        (lambda: block_positions(0, -1, 4), "nbytes=-1"),
        (lambda: block_positions(0, 10, 0), "k >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_short_last_block_is_padded_and_the_next_shard_starts_on_a_boundary():
    assert padded_size(0) == 0
    assert padded_size(1) == BLOCK
    assert padded_size(BLOCK) == BLOCK
    assert padded_size(BLOCK + 1) == 2 * BLOCK
    assert block_positions(0, 0, 4) == ()
    assert block_positions(3 * BLOCK, BLOCK + 5, 2) == (
        BlockPlace(slot=1, position=1, start=0, stop=BLOCK),
        BlockPlace(slot=0, position=2, start=BLOCK, stop=BLOCK + 5),
    )


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(1, 8),
    block=st.sampled_from([1, 7, 64, 4096]),
    sizes=st.lists(st.integers(0, 3_000), min_size=1, max_size=6),
)
def test_block_positions_cover_each_shard_once_and_never_collide_across_a_part(k, block, sizes):
    taken: set[tuple[int, int]] = set()
    offset = 0
    for nbytes in sizes:
        places = block_positions(offset, nbytes, k, block)
        assert [(p.start, p.stop) for p in places] == [(s, min(s + block, nbytes)) for s in range(0, nbytes, block)]
        for i, p in enumerate(places):
            b = offset // block + i
            assert (p.slot, p.position) == (b % k, b // k)
            assert (p.slot, p.position) not in taken
            taken.add((p.slot, p.position))
        offset += padded_size(nbytes, block)
    # the part fills each slot's positions densely: slot s holds positions 0 .. ceil((blocks - s) / k) - 1
    blocks = offset // block
    for s in range(k):
        assert {p for slot, p in taken if slot == s} == set(range(-(-(blocks - s) // k)))
