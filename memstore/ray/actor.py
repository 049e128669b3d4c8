"""The store actor: the same store server as ``memstore serve``, run inside a detached Ray actor on one node.

Authentication is always on. Unless ``ensure_stores`` was given an ``auth_token_file`` (the user's, on every
node), the store presents and accepts the cluster token ``ensure_stores`` keeps in Ray's GCS: the actor reads
it from there, writes it to a 0600 file in a private (0700) directory on tmpfs for the store to read at start,
and removes both once the store has read it.

Its members come from Ray (:class:`RayMembers`): the store records of alive nodes in the GCS. Start-up order:
bind the ports, publish the record, join (learn the slot table from the other stores), serve. A thread
watches Ray's list of draining nodes; when this node is being drained (autoscaler scale-down, a
preemption notice), the store leaves on purpose as on SIGTERM (flush, then give every lone shard another
copy) and removes its record, so the others vacate its slot. It keeps answering reads until the node goes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memstore.config import StoreConfig
from memstore.errors import DiscoveryError, RayStoreError
from memstore.logs import configure as configure_logging
from memstore.membership.members import Members
from memstore.ray import gcs
from memstore.ray.records import StoreRecord, host_id_for, members_of
from memstore.server.app import StoreServer

log = logging.getLogger(__name__)


class RayMembers:
    """Discovery source: the stores that published a record, on nodes Ray reports alive."""

    def __init__(self, registry: gcs.Registry) -> None:
        self.registry = registry
        self.description = f"Ray GCS (memstore cluster {registry.namespace!r})"

    def members(self) -> Members:
        try:
            alive = gcs.alive_nodes()
            records = self.registry.records()
        except Exception as exc:  # GCS unreachable, timed out, or restarting
            raise DiscoveryError(f"{self.description}: cannot ask Ray's GCS: {type(exc).__name__}: {exc}") from None
        return members_of(records.values(), alive, self.description)


def listen_address(ip: str) -> str:
    return f"[{ip}]:0" if ":" in ip else f"{ip}:0"


#: what the caller validates in place of the token file each actor writes for itself (the store reads it only at start)
CLUSTER_TOKEN_FILE = "<the cluster token memstore.ray keeps in Ray's GCS>"


def store_config(settings: dict[str, Any], host_id: str, ip: str, domain: str, token_file: str) -> StoreConfig:
    """The StoreConfig of the store on a node: ``settings`` (flag names as keys) plus what Ray decides.

    ``token_file``: the file of the cluster token, used unless ``settings`` names the user's own
    ``auth_token_file``. The caller (``ensure_stores``) runs this same function for every node, with the node's
    IP, before any actor starts: a setting a store would refuse is refused there, with the store's message.
    Environment variables (MEMSTORE_*) do not apply: every store of a Ray cluster runs with the settings
    given to ``ensure_stores``.
    """
    cli = {**settings, "host_id": host_id, "listen": listen_address(ip), "discovery": "fed", "failure_domain": domain}
    if not settings.get("auth_token_file"):
        cli["auth_token_file"] = token_file
    return StoreConfig.load(cli=cli, env={})


def uses_cluster_token(settings: dict[str, Any]) -> bool:
    """True when the stores authenticate with the cluster token in the GCS (no ``auth_token_file`` of the user's)."""
    return not settings.get("auth_token_file")


@contextmanager
def cluster_token_file(registry: gcs.Registry, settings: dict[str, Any]) -> Iterator[str]:
    """A 0600 file holding the cluster token, in a fresh 0700 directory (on tmpfs where the node has one), removed
    on exit; "" when the user gave an ``auth_token_file``."""
    if not uses_cluster_token(settings):
        yield ""
        return
    token = registry.cluster_token()
    if token is None:
        raise RayStoreError(
            f"no cluster token in Ray's GCS for memstore cluster {registry.namespace!r}: start the stores with memstore.ray.ensure_stores()"
        )
    directory = tempfile.mkdtemp(prefix="memstore-ray-token-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        path = os.path.join(directory, "cluster.token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class StoreActor:
    """One node's store. Created by ``memstore.ray.ensure_stores`` as ``ray.remote(StoreActor)``; never by hand."""

    def __init__(self, namespace: str, settings: dict[str, Any], domain: str = "") -> None:
        self.node_id = gcs.current_node_id()
        ip = gcs.alive_nodes()[self.node_id].ip
        self.registry = gcs.Registry(namespace)
        with cluster_token_file(self.registry, settings) as token_file:  # the store reads the token once, here
            config = store_config(settings, host_id_for(self.node_id), ip, domain, token_file)
            configure_logging(config.log_level, config.log_format, config.host_id)
            self.server = StoreServer(config, discovery=RayMembers(self.registry))
        self.record = StoreRecord(self.node_id, config.host_id, self.server.address, domain)
        self.registry.put(self.record)  # listed first, so that join() finds this store among the members
        try:
            self.server.join()
        except Exception:
            self.registry.delete(self.node_id)
            self.server.stop(grace=0, keep_files=True)
            raise
        self.server.start()
        self._left = threading.Event()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_draining, name="ray-drain-watch", daemon=True)
        self._watch.start()
        log.info("memstore store %s on Ray node %s serving at %s", config.host_id, self.node_id, self.server.address)

    def address(self) -> str:
        return self.server.address

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "host_id": self.record.host_id,
            "address": self.server.address,
            "draining": self.server.store.draining.is_set(),
            "left": self._left.is_set(),
        }

    def _watch_draining(self) -> None:
        interval = self.server.config.discovery_interval
        while not self._stop.wait(interval):
            try:
                draining = self.node_id in gcs.draining_nodes()
            except Exception as exc:
                log.warning("cannot read Ray's draining nodes: %s", exc)
                continue
            if draining:
                log.info("Ray is draining node %s: store %s leaves", self.node_id, self.record.host_id)
                self.leave()
                return

    def leave(self) -> bool:
        """Leave on purpose (what a drain of the node triggers; callable by hand); True once left."""
        if self._left.is_set():
            return True
        self.server.leave()
        self.registry.delete(self.node_id)
        self._left.set()
        return True

    def shutdown(self) -> None:
        """Stop serving and free the memory (``stop_stores``): every shard of this store goes with it."""
        self._stop.set()
        self.registry.delete(self.node_id)
        self.server.stop()
