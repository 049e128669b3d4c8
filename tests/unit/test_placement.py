"""Unit tests for memstore.core.placement (mixed/ring placement, failure domains, recovery odds)."""

from __future__ import annotations

import itertools
import pickle
import random
from collections import Counter
from fractions import Fraction
from math import comb

import pytest

from memstore.core.placement import (
    Placement,
    PlacementError,
    brute_force_recovery_probability,
    domain_violations,
    erasure_group_sizes,
    gemini_mixed_closed_form,
    make_placement,
    mixed_placement,
    recovery_probability,
    recovery_probability_exact,
    ring_placement,
)
from memstore.core.redundancy import Redundancy

pytestmark = pytest.mark.unit

STRATEGIES = ("mixed", "ring")


def hosts(n: int) -> list[str]:
    return [f"h{i}" for i in range(n)]


def racks(n_racks: int, per_rack: int) -> tuple[list[str], dict[str, str]]:
    """Hosts listed rack-major (naive grouping would put a whole group in one rack)."""
    hs = [f"r{r}-h{i}" for r in range(n_racks) for i in range(per_rack)]
    return hs, {h: h.split("-")[0] for h in hs}


def assert_well_formed(p: Placement) -> None:
    assert set(p.holders_by_owner) == set(p.hosts)
    for owner in p.hosts:
        hs = p.holders(owner)
        assert hs[0] == owner
        assert len(hs) == p.replicas == len(set(hs))
        assert set(hs) <= set(p.hosts)
        assert p.peers_of(owner) == hs[1:]
    for host in p.hosts:
        held = p.owners_held_by(host)
        assert held[0] == host
        assert set(held) == {o for o in p.hosts if host in p.holders(o)}
    assert sum(len(p.owners_held_by(h)) for h in p.hosts) == len(p.hosts) * p.replicas


# --- layout ----------------------------------------------------------------------------------------


def test_mixed_n5_r2_groups_and_ring_tail() -> None:
    p = mixed_placement(hosts(5), 2)
    assert dict(p.holders_by_owner) == {
        "h0": ("h0", "h1"),
        "h1": ("h1", "h0"),
        "h2": ("h2", "h3"),
        "h3": ("h3", "h4"),
        "h4": ("h4", "h2"),
    }
    assert p.groups() == (("h0", "h1"), ("h2", "h3"), ("h3", "h4"), ("h4", "h2"))
    assert p.strategy == "mixed" and p.hosts == tuple(hosts(5)) and p.replicas == 2
    assert_well_formed(p)


def test_mixed_divisible_is_disjoint_groups() -> None:
    p = mixed_placement(hosts(6), 3)
    assert p.groups() == (("h0", "h1", "h2"), ("h3", "h4", "h5"))
    # Owner first, then the other members in list order.
    assert p.holders("h4") == ("h4", "h3", "h5")
    assert p.owners_held_by("h4") == ("h4", "h3", "h5")


def test_mixed_small_n_is_all_ring() -> None:
    # R < N < 2R: no disjoint group fits, the whole list is the ring tail.
    p = mixed_placement(hosts(5), 3)
    assert p.holders("h3") == ("h3", "h4", "h0")
    assert len(p.groups()) == 5


def test_ring_holders_exact() -> None:
    p = ring_placement(hosts(5), 3)
    assert dict(p.holders_by_owner) == {
        "h0": ("h0", "h1", "h2"),
        "h1": ("h1", "h2", "h3"),
        "h2": ("h2", "h3", "h4"),
        "h3": ("h3", "h4", "h0"),
        "h4": ("h4", "h0", "h1"),
    }
    assert p.owners_held_by("h0") == ("h0", "h3", "h4")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invariants_and_determinism(strategy: str) -> None:
    for n in range(1, 14):
        for r in range(1, n + 1):
            p = make_placement(strategy, hosts(n), r)
            assert_well_formed(p)
            assert p == make_placement(strategy, list(hosts(n)), r)
            assert hash(p) == hash(make_placement(strategy, hosts(n), r))


def test_order_of_host_list_fixes_placement() -> None:
    a = mixed_placement(["a", "b", "c", "d"], 2)
    b = mixed_placement(["a", "c", "b", "d"], 2)
    assert a.holders("a") == ("a", "b") and b.holders("a") == ("a", "c")


def test_replicas_one_and_replicas_n() -> None:
    p = mixed_placement(hosts(3), 1)
    assert all(p.holders(h) == (h,) for h in p.hosts)
    q = ring_placement(hosts(3), 3)
    assert q.holders("h2") == ("h2", "h0", "h1")
    assert len(q.groups()) == 1


def test_placement_pickles_and_is_immutable() -> None:
    p = mixed_placement(hosts(7), 3)
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(TypeError):
        p.holders_by_owner["h0"] = ("h0", "h1", "h2")  # type: ignore[index]


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("hs", "r"),
    [
        (["a", "b"], 0),
        (["a", "b"], 3),
        (["a", "b", "a"], 2),
        (["a", ""], 1),
        ([], 1),
    ],
)
def test_bad_inputs(strategy: str, hs: list[str], r: int) -> None:
    with pytest.raises(PlacementError):
        make_placement(strategy, hs, r)


def test_unknown_strategy_and_host() -> None:
    with pytest.raises(PlacementError, match="strategy"):
        make_placement("striped", hosts(4), 2)
    p = mixed_placement(hosts(4), 2)
    with pytest.raises(PlacementError, match="nope"):
        p.holders("nope")
    with pytest.raises(PlacementError):
        p.owners_held_by("nope")


def test_placement_error_is_value_error() -> None:
    assert issubclass(PlacementError, ValueError)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_domain_label_errors(strategy: str) -> None:
    with pytest.raises(PlacementError, match="h3"):
        make_placement(strategy, hosts(4), 2, {"h0": "a", "h1": "a", "h2": "b"})
    with pytest.raises(PlacementError, match="ghost"):
        make_placement(strategy, hosts(2), 2, {"h0": "a", "h1": "b", "ghost": "c"})
    p = make_placement(strategy, hosts(2), 2)
    with pytest.raises(PlacementError, match="h1"):
        domain_violations(p, {"h0": "a"})


def test_hand_built_placement_is_validated() -> None:
    owner_not_first = {"a": ("a", "b"), "b": ("a", "b")}
    missing_owner = {"a": ("a", "b")}
    unknown_holder = {"a": ("a", "c"), "b": ("b", "a")}
    for bad in (owner_not_first, missing_owner, unknown_holder):
        with pytest.raises(PlacementError):
            Placement("mixed", ("a", "b"), 2, bad)


# --- failure domains -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("n_racks", "per_rack", "r"), [(3, 4, 3), (2, 4, 2), (4, 3, 2), (3, 5, 3)])
def test_groups_span_distinct_racks(strategy: str, n_racks: int, per_rack: int, r: int) -> None:
    hs, dom = racks(n_racks, per_rack)
    p = make_placement(strategy, hs, r, dom)
    assert_well_formed(p)
    assert p.hosts == tuple(hs)  # the given order is kept; only the grouping changes
    for owner in hs:
        assert len({dom[h] for h in p.holders(owner)}) == r
    assert domain_violations(p, dom) == 0
    assert p == make_placement(strategy, hs, r, dict(reversed(list(dom.items()))))


def test_without_domains_rack_major_order_violates() -> None:
    hs, dom = racks(3, 4)
    assert domain_violations(mixed_placement(hs, 3), dom) == 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_rack_works_and_reports_violations(strategy: str) -> None:
    hs, dom = racks(1, 6)
    p = make_placement(strategy, hs, 2, dom)
    assert_well_formed(p)
    expected = 3 if strategy == "mixed" else 6
    assert domain_violations(p, dom) == expected == len(p.groups())


def test_mixed_tail_with_domains() -> None:
    # N=7, R=2: two groups plus a 3-host ring tail, which needs 3 distinct racks.
    hs, dom = racks(3, 2)
    hs.append("r3-h0")
    dom["r3-h0"] = "r3"
    p = mixed_placement(hs, 2, dom)
    assert_well_formed(p)
    assert domain_violations(p, dom) == 0
    assert recovery_probability_exact(p, 3) == recovery_probability_exact(mixed_placement(hs, 2), 3)


def test_unbalanced_domains_minimise_violations() -> None:
    # 6 hosts in rack a, 2 in b, 2 in c, R=2: 5 pairs, at least one must be a-a.
    hs = [f"a{i}" for i in range(6)] + ["b0", "b1", "c0", "c1"]
    dom = {h: h[0] for h in hs}
    assert domain_violations(mixed_placement(hs, 2, dom), dom) == 1
    # A ring of 10 cannot avoid adjacent a-a pairs either: 6 a's in a 10-cycle => >= 2 adjacencies.
    assert domain_violations(ring_placement(hs, 2, dom), dom) == 2


def test_ring_with_uneven_domains_alternates() -> None:
    hs = [f"a{i}" for i in range(5)] + ["b0", "b1", "b2", "c0", "c1"]
    dom = {h: h[0] for h in hs}
    p = ring_placement(hs, 2, dom)
    assert domain_violations(p, dom) == 0


def test_ring_small_skewed_domains() -> None:
    dom = {"a0": "a", "b0": "b", "c0": "c", "c1": "c"}
    p = ring_placement(list(dom), 2, dom)
    assert domain_violations(p, dom) == 0
    assert p.holders("c0")[1] != "c1" and p.holders("c1")[1] != "c0"


def test_domains_separated_whenever_sizes_allow() -> None:
    """Randomised (seeded): if no domain has more hosts than there are holder sets it could be spread
    over (N // R), ring and divisible mixed placement must have zero violations."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 120)
        r = rng.randint(1, min(n, 5))
        n_dom = rng.randint(r, 30)
        hs = hosts(n)
        dom = {h: f"d{rng.randrange(n_dom)}" for h in hs}
        fits = max(Counter(dom.values()).values()) <= n // r
        strategies = ["ring"] + (["mixed"] if n % r == 0 else [])
        for strategy in strategies:
            p = make_placement(strategy, hs, r, dom)
            assert_well_formed(p)
            if fits:
                assert domain_violations(p, dom) == 0, (strategy, n, r, dom)


# --- recovery probability --------------------------------------------------------------------------


def test_gemini_example_n16_r2_k2() -> None:
    p = mixed_placement(hosts(16), 2)
    assert recovery_probability_exact(p, 2) == Fraction(14, 15)
    assert recovery_probability(p, 2) == pytest.approx(0.9333, abs=1e-4)
    assert recovery_probability(p, 2) == pytest.approx(gemini_mixed_closed_form(16, 2, 2))
    # Ring loses data on any of the 16 adjacent pairs instead of the 8 groups.
    assert recovery_probability_exact(ring_placement(hosts(16), 2), 2) == 1 - Fraction(16, comb(16, 2))


@pytest.mark.parametrize(("n", "m"), [(16, 2), (12, 3), (12, 4), (20, 5), (9, 3), (4, 4), (1000, 2)])
def test_closed_form_matches_exact(n: int, m: int) -> None:
    p = mixed_placement(hosts(n), m)
    for k in range(min(2 * m, n + 1)):
        assert recovery_probability(p, k) == pytest.approx(gemini_mixed_closed_form(n, m, k), rel=1e-12)


@pytest.mark.parametrize(("n", "m", "k"), [(16, 2, 4), (15, 2, 2), (16, 0, 1), (4, 2, -1), (4, 5, 1)])
def test_closed_form_domain(n: int, m: int, k: int) -> None:
    with pytest.raises(ValueError):
        gemini_mixed_closed_form(n, m, k)


def test_fast_matches_brute_force_exhaustively() -> None:
    for strategy in STRATEGIES:
        for n in range(1, 13):
            for r in range(1, min(n, 4) + 1):
                p = make_placement(strategy, hosts(n), r)
                for k in range(n + 1):
                    fast = recovery_probability_exact(p, k)
                    assert fast == brute_force_recovery_probability(p, k), (
                        strategy,
                        n,
                        r,
                        k,
                    )


def test_fast_matches_brute_force_with_domains() -> None:
    hs = [f"a{i}" for i in range(5)] + ["b0", "b1", "c0", "c1", "d0", "d1"]
    dom = {h: h[0] for h in hs}
    for strategy in STRATEGIES:
        for r in (2, 3, 4):
            p = make_placement(strategy, hs, r, dom)
            for k in range(len(hs) + 1):
                assert recovery_probability_exact(p, k) == brute_force_recovery_probability(p, k)


def _ring_survivors_dp(n: int, r: int, k: int) -> int:
    """Independent check: k-subsets of an n-cycle with no r cyclically consecutive chosen.

    Fix the length ``a`` of the run of chosen hosts at the start and ``b`` at the end (a + b < r), then
    count the linear middle with a DP over (position, current run, chosen count).
    """
    if k >= n:
        return 0
    total = 0
    for a in range(r):
        for b in range(r - a):
            if a + b > k or a + b + 2 > n:
                continue
            # layout: a chosen, 1 free, middle of length n - a - b - 2 (no r-run), 1 free, b chosen
            mid = n - a - b - 2
            need = k - a - b
            dp = {(0, 0): 1}  # (run, chosen) -> ways
            for _ in range(mid):
                nxt: dict[tuple[int, int], int] = {}
                for (run, c), w in dp.items():
                    nxt[(0, c)] = nxt.get((0, c), 0) + w
                    if run + 1 < r and c + 1 <= need:
                        nxt[(run + 1, c + 1)] = nxt.get((run + 1, c + 1), 0) + w
                dp = nxt
            total += sum(w for (_, c), w in dp.items() if c == need)
    return total


@pytest.mark.parametrize(("n", "r"), [(40, 2), (37, 3), (30, 4)])
def test_ring_matches_independent_dp(n: int, r: int) -> None:
    p = ring_placement(hosts(n), r)
    for k in range(n + 1):
        assert recovery_probability_exact(p, k) == Fraction(_ring_survivors_dp(n, r, k), comb(n, k))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("n", "r"), [(16, 2), (17, 3), (50, 4), (9, 9)])
def test_monotonic_in_k(strategy: str, n: int, r: int) -> None:
    p = make_placement(strategy, hosts(n), r)
    probs = [recovery_probability_exact(p, k) for k in range(n + 1)]
    assert probs[0] == 1
    assert probs[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(probs))
    assert all(probs[k] == 1 for k in range(r))  # fewer than R failures never lose data


def test_mixed_beats_ring_when_r_divides_n() -> None:
    for n, r in [(16, 2), (12, 3), (24, 4)]:
        mixed, ring = mixed_placement(hosts(n), r), ring_placement(hosts(n), r)
        for k in range(n + 1):
            assert recovery_probability_exact(mixed, k) >= recovery_probability_exact(ring, k)


def test_k_bounds() -> None:
    p = mixed_placement(hosts(4), 2)
    assert recovery_probability(p, 0) == 1.0
    assert recovery_probability(p, 4) == 0.0
    with pytest.raises(ValueError):
        recovery_probability(p, -1)
    with pytest.raises(ValueError):
        recovery_probability(p, 5)


def test_brute_force_refuses_large_n() -> None:
    with pytest.raises(ValueError):
        brute_force_recovery_probability(mixed_placement(hosts(21), 3), 2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_scale_smoke_n16384(strategy: str) -> None:
    p = make_placement(strategy, hosts(16384), 2)
    value = recovery_probability(p, 8)
    assert 0.0 <= value <= 1.0
    assert 0.99 < value < 1.0
    assert recovery_probability(p, 9) <= value


# --------------------------------------------------------------------------------------------------
# Erasure coding (ec:K+M): disjoint groups, each owner its only holder (issue 42)
# --------------------------------------------------------------------------------------------------

EC41 = Redundancy.parse("ec:4+1")


@pytest.mark.parametrize(
    ("n", "group", "sizes"),
    [(5, 5, [5]), (9, 5, [9]), (10, 5, [5, 5]), (11, 5, [5, 6]), (14, 5, [7, 7]), (13, 4, [4, 4, 5]), (17, 3, [3, 3, 3, 4, 4])],
)
def test_erasure_group_sizes(n: int, group: int, sizes: list[int]) -> None:
    assert erasure_group_sizes(n, group) == sizes
    assert sum(sizes) == n and min(sizes) >= group and max(sizes) - min(sizes) <= 1


def test_too_few_hosts_for_one_group_names_both_numbers() -> None:
    with pytest.raises(PlacementError, match=r"groups of 5 hosts \(K\+M\) needs at least 5 hosts, got 4"):
        make_placement("mixed", hosts(4), EC41)


def test_ec_placement_cuts_disjoint_groups_and_keeps_shards_with_their_owner() -> None:
    p = make_placement("mixed", hosts(11), EC41)
    assert p.scheme == EC41 and p.replicas == 1
    assert p.erasure_groups == p.groups() == (tuple(hosts(5)), tuple(hosts(11)[5:]))  # the remainder joined the last group
    for h in hosts(11):
        assert p.holders(h) == (h,) and p.peers_of(h) == () and p.owners_held_by(h) == (h,)
    assert p.group_of("h3") == tuple(hosts(5)) and p.group_of("h10") == ("h5", "h6", "h7", "h8", "h9", "h10")
    with pytest.raises(PlacementError, match="unknown host"):
        p.group_of("h99")


def test_ec_placement_is_deterministic_and_pickles() -> None:
    hs, dom = racks(5, 4)
    a, b = make_placement("mixed", hs, EC41, dom), make_placement("mixed", list(hs), EC41, dict(dom))
    assert a == b and a.erasure_groups == b.erasure_groups
    assert pickle.loads(pickle.dumps(a)) == a and pickle.loads(pickle.dumps(a)).erasure_groups == a.erasure_groups


def test_ec_groups_span_failure_domains() -> None:
    hs, dom = racks(5, 4)  # listed rack-major: consecutive cutting would put 4 hosts of one rack in a group
    naive = make_placement("mixed", hs, EC41)
    assert domain_violations(naive, dom) == 4
    p = make_placement("mixed", hs, EC41, dom)
    assert domain_violations(p, dom) == 0
    assert all(len({dom[h] for h in g}) == 5 for g in p.erasure_groups)
    assert sorted(h for g in p.erasure_groups for h in g) == sorted(hs)


def test_replicas_placements_are_unchanged_by_the_scheme_argument() -> None:
    for strategy in STRATEGIES:
        for n, r in [(7, 2), (9, 3), (4, 4)]:
            as_int = make_placement(strategy, hosts(n), r)
            as_scheme = make_placement(strategy, hosts(n), Redundancy.of_replicas(r))
            assert as_int == as_scheme and as_int.holders_by_owner == as_scheme.holders_by_owner
            assert as_int.scheme == Redundancy.of_replicas(r) and as_int.erasure_groups == ()
            assert as_int.group_of("h0") == as_int.holders("h0")


def test_ring_does_not_apply_to_ec() -> None:
    with pytest.raises(PlacementError, match="does not apply to ec:4\\+1"):
        make_placement("ring", hosts(10), EC41)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ((("h0", "h1", "h2", "h3", "h4"),), "cover every host"),
        ((tuple(hosts(5)), ("h5", "h6", "h7", "h8", "h9", "h9")), "cover every host"),
        ((tuple(hosts(4)), tuple(hosts(10)[4:])), "at least 5 hosts"),
        ((("h5", "h6", "h7", "h8", "h9"), tuple(hosts(5))), "host order"),
        ((("h1", "h0", "h2", "h3", "h4"), tuple(hosts(10)[5:])), "host order"),
    ],
)
def test_hand_built_ec_placements_are_validated(groups: tuple[tuple[str, ...], ...], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement("mixed", tuple(hosts(10)), 1, {h: (h,) for h in hosts(10)}, EC41, groups)


def test_hand_built_placements_must_match_their_scheme() -> None:
    with pytest.raises(PlacementError, match="replicas 1"):
        Placement("mixed", tuple(hosts(5)), 2, mixed_placement(hosts(5), 2).holders_by_owner, EC41, (tuple(hosts(5)),))
    with pytest.raises(PlacementError, match="no erasure groups"):
        Placement("mixed", tuple(hosts(4)), 2, mixed_placement(hosts(4), 2).holders_by_owner, None, (tuple(hosts(4)),))


def _ec_loses(placement: Placement, failed: set[str]) -> bool:
    return any(len(failed & set(g)) > placement.scheme.m for g in placement.erasure_groups)


@pytest.mark.parametrize(("n", "text"), [(5, "ec:4+1"), (7, "ec:4+1"), (10, "ec:4+1"), (11, "ec:3+2"), (12, "ec:2+2"), (9, "ec:1+1")])
def test_ec_recovery_probability_is_exact(n: int, text: str) -> None:
    p = make_placement("mixed", hosts(n), Redundancy.parse(text))
    for k in range(n + 1):
        exact = recovery_probability_exact(p, k)
        assert exact == brute_force_recovery_probability(p, k)
        survivors = sum(1 for failed in itertools.combinations(hosts(n), k) if not _ec_loses(p, set(failed)))
        assert exact == Fraction(survivors, comb(n, k))  # an independent count, straight from the definition
    assert recovery_probability(p, 0) == 1.0 and recovery_probability(p, n) == 0.0


def test_ec_recovery_probability_closed_form_for_one_parity() -> None:
    """ec:K+1 over q groups of G: no two failures in one group; for k=2 that is 1 - q*C(G,2)/C(N,2)."""
    p = make_placement("mixed", hosts(10), EC41)
    assert recovery_probability_exact(p, 1) == 1
    assert recovery_probability_exact(p, 2) == 1 - Fraction(2 * comb(5, 2), comb(10, 2))  # 25/45 = 5/9
    assert recovery_probability_exact(p, 3) == 0  # 3 failures over 2 groups: one group loses two


def test_ec_against_replicas_at_ten_hosts() -> None:
    """ec:4+1 holds 1.25x the state where replicas:2 holds 2x; both survive any one loss; at two losses replicas:2
    (5 pairs of hosts can be wiped out of C(10,2) = 45) survives more often than ec:4+1 (20 pairs in a group)."""
    ec = make_placement("mixed", hosts(10), EC41)
    r2 = make_placement("mixed", hosts(10), 2)
    assert recovery_probability_exact(ec, 1) == recovery_probability_exact(r2, 1) == 1
    assert recovery_probability_exact(r2, 2) == Fraction(40, 45)
    assert recovery_probability_exact(ec, 2) == Fraction(25, 45)
    assert EC41.ram_multiple_per_step == 1.25 and Redundancy.of_replicas(2).ram_multiple_per_step == 2


def test_ec_recovery_probability_at_scale_is_fast() -> None:
    p = make_placement("mixed", hosts(16384), Redundancy.parse("ec:8+2"))
    assert len(p.erasure_groups) == 1638
    value = recovery_probability(p, 40)
    assert 0.0 < value < 1.0
