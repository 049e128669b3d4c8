"""Following the cluster's membership: the discovery watcher, gossip of slot tables, and the checks before serving.

Who calls what, in which order (``memstore.server.app`` drives it):

1. ``join(timeout)`` before serving: one poll of the discovery source (a source that gives no good answer
   at start is a ConfigError naming it), one gossip round with every member (adopting the newest slot
   table), then the checks: every peer runs the same R and placement strategy; with a fixed ``--peers``
   list, the same host list in the same order; and no live store already holds this host id elsewhere
   (two stores cannot hold one slot: the newcomer exits, naming the live one).
2. ``start()`` once serving: the watcher polls the source every ``--discovery-interval`` seconds and
   applies each new membership to the table (``Membership.apply``); a gossip round runs at the same
   interval with up to ``GOSSIP_FANOUT`` random members and adopts a newer table
   (``Membership.adopt``). Gossip is push-pull with a constant cost: each Hello carries the asker's table
   version and digest, and the answer carries the table (and the member list) only if it is newer, so a
   store sends ``GOSSIP_FANOUT`` and answers about as many Hellos per interval, each of a size that does not
   grow with the cluster while nothing changes. An asked store that finds the asker's table newer pulls it
   from the asker at once (``Membership.take_newer_at``). A new table reaches every store in O(log N)
   rounds (modelled by ``memstore simulate protocol``). A source that fails or returns garbage keeps the
   last good membership; the error shows in Health (``discovery``) and in the log, once per distinct error.
3. ``close()`` on shutdown.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from memstore.config import StoreConfig
from memstore.core.status import DiscoveryReport, HelloReport
from memstore.errors import ConfigError, StoreError
from memstore.membership import DiscoverySource, DnsDiscovery, Member, Members, PeersFile, StaticPeers, Watcher
from memstore.membership.self_labelled import SelfLabelled
from memstore.server.store import Store
from memstore.v1.security import Credentials

log = logging.getLogger(__name__)

GOSSIP_FANOUT = 3  # peers asked per round: a new table reaches every store in O(log N) rounds
DNS_JOIN_WAIT_SECONDS = 60.0  # how long a store starting with --discovery dns:// waits for DNS to list anyone
ASK_TIMEOUT_SECONDS = 2.0  # a member that does not answer its Hello within this is asked again next poll
TAKEOVER_WAIT_SECONDS = 5.0  # how long a newcomer waits for the listed holder of its host id before taking the slot


def source_for(config: StoreConfig, credentials: Credentials | None = None) -> DiscoverySource:
    """The discovery source ``config`` names: --peers-file, --discovery dns://..., else the fixed --peers list.
    DNS carries no failure-domain labels: with a label of our own, each member is asked for its own (Hello)."""
    if config.peers_file:
        return PeersFile(config.peers_file)
    if config.discovery == "fed":
        raise ConfigError("--discovery fed: the members are fed through Python; pass StoreServer(config, discovery=FedMembers())")
    if config.discovery:
        return SelfLabelled(DnsDiscovery(config.discovery), config.host_id, config.failure_domain, _asker(config, credentials))
    return StaticPeers(config.peers, config.failure_domains)


def _asker(config: StoreConfig, credentials: Credentials | None) -> Callable[[Member], str | None]:
    """``SelfLabelled``'s question: the label the store at ``member.address`` reports in its Hello (None: no answer,
    or the store there is another host)."""
    from memstore.server.peers import Peer

    def ask(member: Member) -> str | None:
        peer = Peer(member.host_id, member.address, credentials)
        try:
            hello = peer.hello(min(config.peer_timeout, ASK_TIMEOUT_SECONDS))
        except StoreError as exc:
            log.debug("failure-domain label of %s at %s: %s", member.host_id, member.address, exc)
            return None
        finally:
            peer.close()
        if hello.host_id != member.host_id:
            log.warning("the store at %s is %s, not %s as discovery names it", member.address, hello.host_id, member.host_id)
            return None
        return hello.failure_domain

    return ask


class ClusterFollower:
    """Keeps ``store.membership`` in step with the discovery source and the other stores."""

    def __init__(self, store: Store, config: StoreConfig, source: DiscoverySource | None = None) -> None:
        self.store = store
        self.config = config
        self.source = source or source_for(config, store.peers.credentials)
        self.watcher = Watcher(self.source, config.discovery_interval, self._members_changed)
        self._stop = threading.Event()
        self._gossip = threading.Thread(target=self._gossip_loop, name="gossip", daemon=True)

    def _members_changed(self, members: Members) -> None:
        self.store.membership.apply({h: (m.address, m.domain) for h, m in members.items()})
        self._report()

    def _report(self) -> None:
        st = self.watcher.status()
        self.store.discovery = DiscoveryReport(st.source, len(st.members), st.last_ok_unix, st.error, st.consecutive_failures)

    # -- before serving ------------------------------------------------------------------------
    def join(self, timeout: float = 2.0) -> None:
        # DNS may not list anyone yet when the first pods of a new cluster start (a headless Service's records
        # follow the pods): wait for it a while. Other sources answer at once, and a wrong file is not retried.
        deadline = time.monotonic() + (DNS_JOIN_WAIT_SECONDS if self.config.discovery.startswith("dns://") else 0.0)
        while not self.watcher.poll_once():
            if time.monotonic() >= deadline:
                raise ConfigError(f"no usable membership from {self.source.description}: {self.watcher.status().error}")
            log.warning("waiting for %s (up to %.0fs): %s", self.source.description, DNS_JOIN_WAIT_SECONDS, self.watcher.status().error)
            time.sleep(min(self.config.discovery_interval, max(0.0, deadline - time.monotonic())))
        self._report()
        members = self.store.membership.members
        if self.store.host_id not in members:
            log.warning(
                "%s does not list this store (%s) yet: it serves, but holds no slot until it is listed", self.source.description,
                self.store.host_id,
            )  # fmt: skip
        self.gossip_round(list(members), timeout, checks=True)
        self._check_own_slot(timeout)

    def _check_own_slot(self, timeout: float) -> None:
        """Refuse to hold a slot a live store with our host id holds at another address."""
        me = self.store.host_id
        view = self.store.membership.view
        slot = view.my_slot
        ours = self.store.advertised_address
        if self.config.peers or slot is None or slot.address == ours:
            return  # with a fixed --peers list the wrong-host-id check above covers it
        from memstore.server.peers import Peer

        other = Peer(me, slot.address, self.store.peers.credentials)
        deadline = time.monotonic() + TAKEOVER_WAIT_SECONDS
        try:
            while True:  # a holder that is only slow or partitioned must not lose its slot at once
                try:
                    hello = other.hello(timeout)
                    break
                except StoreError:
                    if time.monotonic() >= deadline:
                        log.warning("slot %d of %s lists %s, which did not answer for %.0fs: taking the slot over at %s",
                                    slot.index, me, slot.address, TAKEOVER_WAIT_SECONDS, ours)  # fmt: skip
                        return
                    time.sleep(0.5)
        finally:
            other.close()
        if hello.host_id == me:  # we do not serve yet: whoever answers there is another store
            raise ConfigError(
                f"host id {me!r} is already held by a live store at {slot.address} (slot {slot.index}); two stores cannot hold "
                f"one slot: stop that store first, or start this one ({ours}) with another --host-id"
            )

    # -- while serving -------------------------------------------------------------------------
    def start(self) -> None:
        self.watcher.start()
        self._gossip.start()

    def close(self) -> None:
        self._stop.set()
        self.store.membership.wake()
        self.watcher.close()
        if self._gossip.is_alive():
            self._gossip.join(timeout=5)

    def _gossip_loop(self) -> None:
        interval = self.config.discovery_interval
        next_round = time.monotonic() + interval
        while not self._stop.is_set():
            # Between rounds, a member that showed us a newer table in its own round is asked at once (the pull half).
            hosts = self.store.membership.take_newer_at(max(0.0, next_round - time.monotonic()))
            if self._stop.is_set():
                return
            if not hosts:
                if time.monotonic() < next_round:
                    continue
                next_round = time.monotonic() + interval
                others = self.store.membership.view.others()
                hosts = random.sample(others, min(GOSSIP_FANOUT, len(others)))
            try:
                self.gossip_round(hosts, self.config.peer_timeout)
                self._report()
            except Exception:
                log.exception("gossip round failed")

    def gossip_round(self, hosts: list[str], timeout: float, checks: bool = False) -> None:
        """Ask ``hosts`` for their slot tables and adopt the newest; with ``checks`` (at join), ask for the whole
        answer and refuse a differing layout. Without, each asks with our table, so a peer whose table is not
        newer answers without its own (and pulls ours if ours is newer)."""
        for h in hosts:
            if h == self.store.host_id:
                continue
            known = None if checks else self.store.membership.view.table
            try:
                hello = self.store.peers[h].hello(timeout, known, self.store.host_id)
            except StoreError as exc:
                log.debug("gossip: %s: %s", h, exc)
                continue
            if checks:
                self._check_layout(h, hello)
            if hello.host_id == h:
                self.store.membership.adopt(hello.slots, h)

    def _check_layout(self, peer_id: str, hello: HelloReport) -> None:
        host_id, replicas, placement, peer_ids = hello.host_id, hello.replicas, hello.placement, hello.peer_ids
        address = self.store.peers[peer_id].address
        me = self.store.host_id
        for other_id, other_address in zip(hello.peer_ids, hello.peer_addresses, strict=False):
            if other_address == self.store.advertised_address and other_id != me:
                raise ConfigError(f"peer {peer_id} expects host {other_id!r} at {other_address}, not {me!r}: wrong --host-id?")
        if host_id != peer_id:
            if self.config.peers:
                raise ConfigError(f"the store at {address} is host {host_id!r}, but --peers names it {peer_id!r}")
            log.warning("%s names %s at %s, but the store there is %s", self.source.description, peer_id, address, host_id)
            return
        ours = list(self.config.host_ids)
        same_hosts = not self.config.peers or list(peer_ids) == ours
        redundancy, own = hello.cluster_redundancy, str(self.config.redundancy)
        if not same_hosts or redundancy != own or placement != self.config.placement:
            hosts = f"hosts {list(peer_ids)}, " if self.config.peers else ""
            mine = f"hosts {ours}, " if self.config.peers else ""
            raise ConfigError(
                f"peer {peer_id} runs with a different cluster layout ({hosts}{_scheme(redundancy, replicas)}, {placement}); this "
                f"store has {mine}{_scheme(own, self.config.replicas)}, {self.config.placement}. Every store must get the same "
                "--redundancy (or --replicas) and --placement" + (" and the same --peers (same order)" if self.config.peers else "")
            )


def _scheme(redundancy: str, replicas: int) -> str:
    """How a layout message names a scheme: ``R=2`` for replicas (as before), the text for ec."""
    return f"R={replicas}" if redundancy.startswith("replicas:") else redundancy
