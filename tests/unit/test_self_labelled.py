"""SelfLabelled: members of a source without labels (DNS) take the label each store tells of itself."""

from __future__ import annotations

import pytest

from memstore.errors import DiscoveryError
from memstore.membership import FedMembers, Member
from memstore.membership.self_labelled import SelfLabelled


def setup(own_domain: str = "zone-a") -> tuple[FedMembers, dict[str, str | None], list[str], SelfLabelled]:
    fed = FedMembers("dns")
    said: dict[str, str | None] = {}  # host id -> what its store answers (None: does not answer)
    asked: list[str] = []

    def ask(m: Member) -> str | None:
        asked.append(m.host_id)
        return said.get(m.host_id)

    return fed, said, asked, SelfLabelled(fed, "me", own_domain, ask)


def test_members_join_once_they_tell_their_label() -> None:
    fed, said, asked, source = setup()
    fed.set([Member("me", "10.0.0.1:7070"), Member("b", "10.0.0.2:7070")])
    assert source.members() == {"me": Member("me", "10.0.0.1:7070", "zone-a")}  # b does not answer: left out
    said["b"] = "zone-b"
    assert source.members()["b"] == Member("b", "10.0.0.2:7070", "zone-b")
    said["b"] = None  # an answer is kept while b lives at that address: a slow peer keeps its slot
    assert source.members()["b"].domain == "zone-b"
    assert asked == ["b", "b"]
    fed.set([Member("me", "10.0.0.1:7070"), Member("b", "10.0.0.9:7070")])  # b moved: asked again
    assert "b" not in source.members()


def test_a_store_without_a_label_joins_unlabelled_and_labelled_sources_pass() -> None:
    fed, said, _, source = setup()
    said["c"] = ""
    fed.set([Member("me", "10.0.0.1:7070"), Member("c", "10.0.0.3:7070"), Member("d", "10.0.0.4:7070", "zone-d")])
    assert {h: m.domain for h, m in source.members().items()} == {"me": "zone-a", "c": "", "d": "zone-d"}


def test_without_a_label_of_our_own_nothing_is_asked() -> None:
    fed, _, asked, source = setup(own_domain="")
    fed.set([Member("me", "10.0.0.1:7070"), Member("b", "10.0.0.2:7070")])
    assert set(source.members()) == {"me", "b"} and asked == []


def test_nobody_labelled_is_a_discovery_error() -> None:
    fed, _, _, source = setup()
    fed.set([Member("b", "10.0.0.2:7070")])  # this store is not listed yet and b does not answer
    with pytest.raises(DiscoveryError, match="none of the 1 members listed has told its failure-domain label yet"):
        source.members()
