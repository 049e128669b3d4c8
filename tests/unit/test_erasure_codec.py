"""Unit tests for memstore.erasure.codec: XOR (m = 1) and Reed-Solomon (m >= 2) round trips, bit-exact."""

from __future__ import annotations

import itertools
import random
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memstore.erasure.codec import MAX_COLUMNS, XOR_SLICE, Codec
from memstore.errors import ErasureUnavailable, UnrecoverableLoss

pytestmark = pytest.mark.unit

SHAPES = [(k, m) for m in (1, 2, 3) for k in (1, 2, 3, 4, 5)] + [(8, 2), (10, 4)]


def random_blocks(count: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(count)]


def columns(codec: Codec, data: list[np.ndarray]) -> dict[int, np.ndarray]:
    return {**dict(enumerate(data)), **{codec.k + j: p for j, p in enumerate(codec.encode(data))}}


@pytest.mark.parametrize(("k", "m"), SHAPES)
def test_every_loss_of_up_to_m_columns_rebuilds_the_data_bit_exactly(k, m):
    codec = Codec(k, m)
    length = 1000  # not a multiple of any alignment: the library's padding must not show
    data = random_blocks(k, length, seed=k * 10 + m)
    everything = columns(codec, data)
    for size in range(m + 1):
        for lost in itertools.combinations(range(k + m), size):
            present = {c: b for c, b in everything.items() if c not in lost}
            rebuilt = codec.decode(present, length)
            assert sorted(rebuilt) == [c for c in lost if c < k]
            for c, block in rebuilt.items():
                assert block.dtype == np.uint8
                assert np.array_equal(block, data[c]), (k, m, lost, c)


def test_m1_parity_is_xor_and_a_lost_block_is_the_xor_of_the_rest():
    a, b, c = random_blocks(3, 3 * XOR_SLICE + 17, seed=1)  # several slices and a ragged end
    (parity,) = Codec(3, 1).encode([a, b, c])
    assert np.array_equal(parity, a ^ b ^ c)
    assert np.array_equal(Codec(3, 1).decode({0: a, 2: c, 3: parity}, len(a))[1], b)


def test_k1_m1_parity_is_a_copy():
    (block,) = random_blocks(1, 64, seed=2)
    (parity,) = Codec(1, 1).encode([block])
    assert np.array_equal(parity, block) and parity is not block
    assert np.array_equal(Codec(1, 1).decode({1: parity}, 64)[0], block)


@pytest.mark.parametrize(("k", "m"), [(1, 1), (4, 1), (4, 2), (3, 3)])
def test_contributions_added_in_any_order_equal_encode(k, m):
    codec = Codec(k, m)
    data = random_blocks(k, 4096, seed=3)
    expected = codec.encode(data)
    for order in ([*range(k)], [*reversed(range(k))], random.Random(k).sample(range(k), k)):
        parity = [np.zeros(4096, np.uint8) for _ in range(m)]
        for index in order:
            for j, add in enumerate(codec.contribution(index, data[index])):
                codec.accumulate(parity[j], add)
        for got, want in zip(parity, expected, strict=True):
            assert np.array_equal(got, want)


def test_a_contribution_may_cover_several_positions_at_once():
    codec = Codec(4, 2)
    rows = [random_blocks(4, 512, seed=s) for s in (4, 5)]  # two positions of one row
    whole = codec.contribution(1, np.concatenate([rows[0][1], rows[1][1]]))
    for j in range(2):
        one = [codec.contribution(1, rows[t][1])[j] for t in range(2)]
        assert np.array_equal(whole[j], np.concatenate(one))


def test_a_missing_data_block_counts_as_zeros():
    # the design's rows: a data host whose part is shorter adds nothing at a position, which is a zero block
    codec = Codec(3, 2)
    a, c = random_blocks(2, 256, seed=6)
    zero = np.zeros(256, np.uint8)
    parity = [np.zeros(256, np.uint8) for _ in range(2)]
    for index, block in ((0, a), (2, c)):
        for j, add in enumerate(codec.contribution(index, block)):
            codec.accumulate(parity[j], add)
    for got, want in zip(parity, codec.encode([a, zero, c]), strict=True):
        assert np.array_equal(got, want)


@pytest.mark.parametrize(("k", "m"), [(4, 1), (4, 2), (3, 3)])
def test_more_than_m_losses_are_refused_with_the_counts(k, m):
    codec = Codec(k, m)
    everything = columns(codec, random_blocks(k, 64, seed=7))
    present = {c: b for c, b in everything.items() if c > m}  # m + 1 lost, data column 0 among them
    with pytest.raises(UnrecoverableLoss, match=f"{m + 1} of the {k + m} columns .* at most {m}") as caught:
        codec.decode(present, 64)
    assert (caught.value.missing, caught.value.tolerated) == (m + 1, m)


def test_with_every_data_column_present_nothing_is_decoded():
    codec = Codec(2, 2)
    assert codec.decode(dict(enumerate(random_blocks(2, 8, seed=8))), 8) == {}


def test_blocks_may_be_bytes_memoryviews_or_arrays():
    codec = Codec(2, 1)
    a, b = (bytes(x) for x in random_blocks(2, 100, seed=9))
    (parity,) = codec.encode([a, memoryview(b)])
    assert parity.flags.writeable
    assert codec.decode({1: b, 2: parity.tobytes()}, 100)[0].tobytes() == a


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Codec(0, 1), "k >= 1"),
        (lambda: Codec(4, 0), "m >= 1"),
        (lambda: Codec(MAX_COLUMNS, 1), f"k \\+ m <= {MAX_COLUMNS}"),
        (lambda: Codec(2, 1).encode([b"ab"]), "expected 2 data blocks"),
        (lambda: Codec(2, 1).encode([b"ab", b"abc"]), "one length"),
        (lambda: Codec(2, 1).contribution(2, b"ab"), "data column 2"),
        (lambda: Codec(2, 1).decode({3: b"ab"}, 2), "column 3 is outside"),
        (lambda: Codec(2, 1).decode({0: b"ab"}, 3), "column 0 has 2 bytes"),
        (lambda: Codec(2, 1).accumulate(np.zeros(3, np.uint8), b"ab"), "2 bytes cannot be added"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_without_the_library_m2_names_the_extra_and_m1_still_works(monkeypatch):
    for name in [n for n in sys.modules if n == "pyeclib" or n.startswith("pyeclib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyeclib", None)  # import pyeclib raises ImportError
    with pytest.raises(ErasureUnavailable, match=r"memstore\[erasure\]"):
        Codec(4, 2)
    assert Codec(4, 1).encode([b"\x01", b"\x02", b"\x04", b"\x08"])[0].tobytes() == b"\x0f"


def test_one_codec_decodes_from_several_threads_at_once():
    codec = Codec(4, 2)
    data = random_blocks(4, 1 << 16, seed=10)
    everything = columns(codec, data)
    patterns = list(itertools.combinations(range(6), 2))
    failures: list[object] = []

    def work(lost: tuple[int, ...]) -> None:
        for _ in range(5):
            got = codec.decode({c: b for c, b in everything.items() if c not in lost}, 1 << 16)
            if any(not np.array_equal(b, data[c]) for c, b in got.items()):
                failures.append(lost)

    threads = [threading.Thread(target=work, args=(lost,)) for lost in patterns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (3, 1), (6, 1), (2, 2), (4, 2), (5, 3)]),
    length=st.integers(1, 3000),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_random_bytes_any_survivors_round_trip(shape, length, seed, data):
    k, m = shape
    codec = Codec(k, m)
    blocks = random_blocks(k, length, seed)
    lost = data.draw(st.sets(st.integers(0, k + m - 1), max_size=m))
    present = {c: b for c, b in columns(codec, blocks).items() if c not in lost}
    rebuilt = codec.decode(present, length)
    assert sorted(rebuilt) == sorted(c for c in lost if c < k)
    assert all(np.array_equal(b, blocks[c]) for c, b in rebuilt.items())


@pytest.mark.parametrize(("k", "m"), [(3, 1), (3, 2)])
def test_encode_writes_into_given_parity_blocks(k, m):
    codec = Codec(k, m)
    data = random_blocks(k, 3000, seed=11)
    out = [np.full(3000, 0xAA, np.uint8) for _ in range(m)]  # old bytes must not leak into the parity
    got = codec.encode(data, out=out)
    assert all(g is o for g, o in zip(got, out, strict=True))
    for o, want in zip(out, codec.encode(data), strict=True):
        assert np.array_equal(o, want)
    with pytest.raises(ValueError, match="cannot hold"):
        codec.encode(data, out=[np.zeros(10, np.uint8)] * m)
