"""Failure-domain labels for a source that has none (DNS): each store says its own label.

A DNS answer names addresses, not racks or zones. Each store knows its own label (``--failure-domain``, or
its Kubernetes Node's labels), so :class:`SelfLabelled` wraps such a source and asks every member it lists
without a label what its label is (``ask``: in the store server, the member's Hello). The answer is kept per
(host id, address): a store's label does not change while it lives at one address.

A member that has not told its label yet is left out, so it takes no slot until it has: a slot table with
one unlabelled slot makes placement ignore every domain, and the label arriving a poll later would then
move every group twice. A store that answers with no label joins unlabelled (the placement logs a warning).
Without a label of our own the wrapper passes the source through: the cluster runs without domains.

Plain Python (no gRPC): ``ask`` is whatever the caller passes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from memstore.errors import DiscoveryError
from memstore.membership.members import DiscoverySource, Member, Members

log = logging.getLogger(__name__)

ASK_THREADS = 8  # members asked at once (a new cluster lists many that do not answer yet)


class SelfLabelled:
    """``source``'s members, each labelled with the failure domain it reports itself (see the module)."""

    def __init__(self, source: DiscoverySource, host_id: str, own_domain: str, ask: Callable[[Member], str | None]) -> None:
        """``ask(member)``: the member's own label ("" = it has none), or None when it did not answer."""
        self.source = source
        self.description = source.description
        self.host_id = host_id
        self.own_domain = own_domain
        self._ask = ask
        self._known: dict[tuple[str, str], str] = {}  # (host id, address) -> the label it told
        self._waiting: set[str] = set()  # members left out, logged once each
        self._lock = threading.Lock()

    def members(self) -> Members:
        members = self.source.members()
        if not self.own_domain:
            return members
        with self._lock:
            known = {k: v for k, v in self._known.items() if k[0] in members}  # forget members that are gone
        todo = [m for h, m in members.items() if not m.domain and h != self.host_id and (h, m.address) not in known]
        if todo:
            with ThreadPoolExecutor(max_workers=min(ASK_THREADS, len(todo)), thread_name_prefix="ask-domain") as pool:
                for m, label in zip(todo, pool.map(self._ask, todo), strict=True):
                    if label is not None:
                        known[(m.host_id, m.address)] = label
        out: Members = {}
        waiting: set[str] = set()
        for h, m in members.items():
            label = m.domain or (self.own_domain if h == self.host_id else known.get((h, m.address)))
            if label is None:
                waiting.add(h)
                continue
            out[h] = replace(m, domain=label) if label != m.domain else m
        with self._lock:
            self._known = known
            for h in sorted(waiting - self._waiting):
                log.info("%s lists %s, which has not told its failure-domain label yet: it joins once it answers", self.description, h)
            self._waiting = waiting
        if not out:
            raise DiscoveryError(
                f"{self.description}: none of the {len(members)} members listed has told its failure-domain label yet "
                "(their stores do not answer)"
            )
        return out
