"""Stripe descriptors (issue 27): validated, converted, kept in sidecars and spilled manifests, counted once by the CLI."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from memstore import survey
from memstore.cli import render
from memstore.core.model import Manifest, ShardInfo, ShardKey, ShardState, Stripe
from memstore.errors import InvalidArgument, LayoutError, ManifestTooLarge
from memstore.server.convert import manifest_from_pb, manifest_to_pb, sidecar_bytes, sidecar_info
from memstore.spill.layout import SpilledManifest
from memstore.v1 import store_pb2 as pb
from memstore.v1.keys import MAX_WORLD_SIZE
from memstore.v1.streams import shard_manifest_problem, stripe_problem
from tests.unit.engine_fakes import adoption_of, captured, make_catalog, manifest_of

pytestmark = pytest.mark.unit
DATA = bytes(range(256)) * 32  # 8 KiB: two chunks
GOOD = Stripe((0, 1, 2, 3), 2, 4 * 4096, 4096, slices_only=True)  # rank 2's stripe of a group of 4, no own part
SPILLED = {"group": [0, 1, 2, 3], "index": 2, "logical_nbytes": 4 * 4096, "stripe_nbytes": 4096}  # GOOD in a spilled manifest


@pytest.mark.parametrize(
    ("stripe", "rank", "world", "message"),
    [
        (Stripe((), 0, 10, 1), 0, 4, "stripe.group has 0 ranks: expected 1..world_size (4)"),
        (Stripe((0, 1, 2, 3, 4), 0, 10, 1), 0, 4, "stripe.group has 5 ranks"),
        (Stripe((0, 1), 2, 10, 1), 0, 4, "stripe.index 2 is out of range"),
        (Stripe((0, 7), 0, 10, 1), 0, 4, "stripe.group names rank 7: expected ranks 0..3"),
        (Stripe((0, 1, 1), 0, 10, 1), 0, 4, "stripe.group names rank 1 twice"),
        (Stripe((0, 1), 1, 10, 1), 0, 4, "stripe.group[1] (stripe.index) is rank 1, but the shard is rank 0"),
        (Stripe((0, 1), 0, 10, 11), 0, 4, "stripe.stripe_nbytes 11 is more than stripe.logical_nbytes 10"),
        (Stripe((0, 1), 0, 1 << 40, 9000), 0, 4, "stripe.stripe_nbytes 9000 is more than the shard's nbytes 8192"),
    ],
)
def test_a_stripe_that_cannot_describe_its_shard_is_named(stripe: Stripe, rank: int, world: int, message: str) -> None:
    assert message in (stripe_problem(stripe, rank, world, len(DATA)) or "")
    m = replace(manifest_of(ShardKey("job", 1, rank), DATA, world_size=world), stripe=stripe)
    assert message in (shard_manifest_problem(m) or "")  # every transfer header is checked the same way


def test_good_stripes_pass() -> None:
    assert stripe_problem(GOOD, 2, 4, 8192) is None
    assert stripe_problem(Stripe((3,), 0, 0, 0), 3, 4, 0) is None  # a group of one rank, nothing replicated
    assert stripe_problem(Stripe((3, 1), 1, 5, 5), 1, 4, 5) is None  # stripe order need not be rank order


def test_the_wire_carries_a_stripe_and_an_unset_one_is_an_ordinary_shard() -> None:
    m = replace(manifest_of(ShardKey("job", 1, 2), DATA, world_size=4), stripe=GOOD)
    wire = manifest_to_pb(m)
    assert list(wire.stripe.group) == [0, 1, 2, 3] and wire.stripe.index == 2 and wire.stripe.slices_only
    assert manifest_from_pb(pb.Manifest.FromString(wire.SerializeToString())) == m
    ordinary = manifest_to_pb(replace(m, stripe=None))
    assert not ordinary.HasField("stripe") and manifest_from_pb(ordinary).stripe is None
    huge = pb.Manifest(key=wire.key, stripe=pb.Stripe(group=range(MAX_WORLD_SIZE + 1)))
    with pytest.raises(ManifestTooLarge, match="replica group of 1000001 ranks"):
        manifest_from_pb(huge)  # refused before it is converted


def test_a_commit_keeps_its_stripe_and_a_bad_one_is_refused_keeping_the_lease() -> None:
    catalog, _, _ = make_catalog()
    key = ShardKey("job", 1, 2)
    entry = captured(catalog, key, DATA)
    entry.world_size = 4
    lease = catalog.lease_allocation(entry, ahead=False)
    with pytest.raises(InvalidArgument, match=r"stripe.group\[2\] \(stripe.index\) is rank 3, but the shard is rank 2"):
        catalog.commit_lease(lease, None, 0, {}, 1, "", Stripe((0, 1, 3, 2), 2, 10, 1))
    assert catalog.get(key) is None  # nothing registered
    committed = catalog.commit_lease(lease, None, 0, {}, 1, "", GOOD)  # the same lease, still held
    assert committed.info().manifest.stripe == GOOD  # known before its checksums are


def test_adoption_after_a_restart_keeps_the_stripe() -> None:
    catalog, pool, _ = make_catalog()
    key = ShardKey("job", 1, 2)
    entry = captured(catalog, key, DATA)
    entry.world_size = 4
    committed = catalog.commit_lease(catalog.lease_allocation(entry, ahead=False), None, 0, {}, 1, "", GOOD)
    catalog.take_up(committed)
    catalog.checksummed(committed, replace(manifest_of(key, DATA, world_size=4), stripe=GOOD))
    catalog.settle(committed, copies=1, errors=[])
    meta = pool.described[id(committed.segment)]
    assert sidecar_info(meta).manifest.stripe == GOOD
    fresh, fresh_pool, _ = make_catalog()
    segment = fresh_pool.acquire(len(DATA), "job")
    fresh_pool.used = 0
    segment.view(len(DATA))[:] = DATA
    fresh_pool.adoptable = [(segment, meta)]
    assert adoption_of(fresh).adopt() == 1
    adopted = fresh.get(key)
    assert adopted is not None and adopted.state is ShardState.COMMITTED and adopted.manifest is not None
    assert adopted.manifest.stripe == GOOD and adopted.stripe == GOOD


def test_a_sidecar_with_an_impossible_stripe_is_not_adopted() -> None:
    key = ShardKey("job", 1, 2)
    info = sidecar_info(sidecar_bytes(_info(replace(manifest_of(key, DATA, world_size=4), stripe=replace(GOOD, index=0)))))
    fresh, fresh_pool, _ = make_catalog()
    segment = fresh_pool.acquire(len(DATA), "job")
    fresh_pool.used = 0
    segment.view(len(DATA))[:] = DATA
    fresh_pool.adoptable = [(segment, sidecar_bytes(info))]
    assert adoption_of(fresh).adopt() == 0


def _info(m: Manifest) -> ShardInfo:
    return ShardInfo(m, ShardState.COMMITTED, True, copies=1)


def _spilled(stripe: Stripe | None) -> SpilledManifest:
    return SpilledManifest("job", 1, 2, 4, len(DATA), 4096, [1, 2], "h0", stored_chunks=[4096, 4096], stripe=stripe)


def test_a_spilled_manifest_keeps_the_stripe_and_older_ones_still_load() -> None:
    m = _spilled(GOOD)
    doc = json.loads(m.encode())
    assert doc["stripe"] == SPILLED  # as before slices_only (which older stores refuse): a restore decodes the stripe
    assert SpilledManifest.decode(m.encode()) == replace(m, stripe=replace(GOOD, slices_only=False))
    plain = _spilled(None).encode()
    assert "stripe" not in json.loads(plain)  # an ordinary shard's manifest is as it was before stripes
    assert SpilledManifest.decode(plain).stripe is None


@pytest.mark.parametrize(
    ("stripe", "message"),
    [
        ({"group": [0, 1, 2, 3], "index": 2}, "stripe must be an object of group, index, logical_nbytes, stripe_nbytes"),
        ({**SPILLED, "group": "0123"}, "stripe.group must be a list"),
        ({**SPILLED, "index": -1}, "must be non-negative ints"),
        ({**SPILLED, "index": 1}, "stripe.group[1] (stripe.index) is rank 1, but the shard is rank 2"),
    ],
)
def test_a_spilled_manifest_with_a_bad_stripe_is_refused(stripe: object, message: str) -> None:
    doc = json.loads(_spilled(None).encode())
    with pytest.raises(LayoutError, match=re.escape(message)):
        SpilledManifest.decode(json.dumps({**doc, "stripe": stripe}).encode(), where="m.json")


def _row(rank: int, nbytes: int, stripe: Stripe | None) -> dict[str, object]:
    s = None if stripe is None else {"group": list(stripe.group), "index": stripe.index,
                                     "logical_bytes": stripe.logical_nbytes, "stripe_bytes": stripe.stripe_nbytes}  # fmt: skip
    return {"rank": rank, "bytes": nbytes, "stripe": s}


def test_logical_bytes_count_each_group_once_and_per_rank_parts_each() -> None:
    stripes = [_row(r, 1000 + 10 * r, Stripe((0, 1, 2, 3), r, 4000, 1000)) for r in range(4)]
    assert survey.logical_bytes(stripes) == (4000 + 0 + 10 + 20 + 30, [[0, 1, 2, 3]])
    two_groups = [_row(r, 600, Stripe((r % 2, r % 2 + 2), r // 2, 1000, 500)) for r in range(4)]  # HSDP-like: {0,2} and {1,3}
    assert survey.logical_bytes(two_groups) == (2 * 1000 + 4 * 100, [[0, 2], [1, 3]])
    assert survey.logical_bytes([_row(0, 700, None), _row(1, 800, None)]) == (1500, [])


def test_ranks_and_stripes_render_compactly() -> None:
    assert render.ranks([0, 1, 2, 3, 8, 6]) == "0-3,8,6"
    assert render.ranks([4, 5]) == "4,5"
    assert render.stripe({"group": [0, 1, 2, 3], "index": 1, "logical_bytes": 4 << 20, "stripe_bytes": 1 << 20}) == (
        "1/4 of ranks 0-3: 1.00 MiB of 4.00 MiB"
    )
    assert render.stripe(None) == "-" and render.groups([]) == "-" and render.groups([[0, 2], [1, 3]]) == "ranks 0,2; ranks 1,3"
