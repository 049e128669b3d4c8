"""What the store engine reports as it works: the event points of its metrics.

The engine (``memstore.server.store`` and its parts), the servicer and the spill tier call these small hooks
at the few places where something is counted or timed: a save taken in, a shard replicated, a fetch, a repair
pull, a spilled shard, an RPC and its failure. Everything else the metrics show is read from the engine's
state when Prometheus scrapes (``memstore.server.metrics.StoreCollector``).

:class:`StoreEvents` ignores every event: a store without ``--metrics-port`` runs with it. The Prometheus side
(``memstore.server.metrics.StoreMetrics``) overrides each hook; it is the only module that imports
``prometheus_client``, so nothing here or in the engine depends on it.
"""

from __future__ import annotations

SAVE_PATHS = ("shm", "stream")  # a client's save: Allocate/Commit over shared memory, or a Put / data-channel stream
FETCH_SOURCES = ("local", "peer", "durable")  # where a fetched copy came from
PULL_SOURCES = ("peer", "durable")  # where a pulled copy (fetch or repair) came from
SETTLED = ("committed", "under_replicated")  # how an owned shard's replication ended


def pull_source(host: str) -> str:
    """The metric label of a pull's source: the pseudo-host ``durable``, or any peer."""
    return "durable" if host == "durable" else "peer"


class StoreEvents:
    """The hooks; this base records nothing (metrics off). Every hook returns at once and never raises."""

    def saved(self, path: str, seconds: float) -> None:
        """A client's save was taken in: ``path`` in SAVE_PATHS; from Allocate to Commit (shm), or from the
        transfer's header to its last verified chunk (stream)."""

    def captured(self, registrations: int, fallbacks: int) -> None:
        """A client's Commit reported its capture: ``registrations`` cudaHostRegister calls made and ``fallbacks``
        copies through pageable memory, since its previous commit."""

    def pushed(self, nbytes: int) -> None:
        """One group peer acknowledged a verified copy of an owned shard of ``nbytes``."""

    def replicated(self, seconds: float) -> None:
        """The last of the R-1 group peers acknowledged an owned shard, ``seconds`` after the store took it in."""

    def settled(self, state: str) -> None:
        """An owned shard's replication ended: ``state`` in SETTLED."""

    def fetched(self, source: str, seconds: float) -> None:
        """A Fetch (restore) made a verified copy available here: ``source`` in FETCH_SOURCES."""

    def repaired(self, source: str, seconds: float) -> None:
        """The repair loop pulled one missing shard back: ``source`` in PULL_SOURCES."""

    def pulled(self, source: str, nbytes: int) -> None:
        """A copy of ``nbytes`` arrived from ``source`` (PULL_SOURCES), for a fetch or a repair."""

    def shard_spilled(self, job_id: str, seconds: float, nbytes: int) -> None:
        """The spill tier wrote one shard (``nbytes`` stored) and its manifest (``memstore.spill.port.SpillObserver``)."""

    def rpc(self, method: str) -> None:
        """The gRPC method ``method`` was called."""

    def rpc_failed(self, method: str, code: str) -> None:
        """The call of ``method`` ended with the gRPC status ``code`` (its name, e.g. INVALID_ARGUMENT)."""
