"""Where the store and the durable tier meet: two small interfaces, nothing else.

The server's composition root (``memstore.server.app``) builds both: the ``Store`` (which implements
:class:`ShardSource`) and, when ``--spill`` is set, a ``Spiller`` reading from it (which implements
:class:`DurableTier`), then hands the tier to the store. Neither side touches the other's fields.

Who calls what, in which order:

- The spill loop, every pass: ``source.spill_shards()`` to see which settled shards this store must spill
  (its own, and those of a gone owner it took over: ``memstore.core.spill_policy.spill_duty``) and choose
  the due steps; for each shard it writes, ``with source.pinned_bytes(key) as view:``
  (``None`` if the shard was evicted meanwhile; the bytes cannot be freed or reused while the block
  runs); between chunks ``source.foreground_busy()`` to yield to saves and replication; after a step is
  published ``source.spilled()`` so retention may evict steps it kept only for the spill;
  ``source.spills_for(owner_host)`` when collecting garbage (a published rank is deleted by whoever
  spills its owner's shards now).
- Listeners (``SpillListener``): the spill loop calls ``published(spiller, shard)`` after publishing each
  rank and ``doomed_paths(...)`` when retention deletes a step.
- The observer (``SpillObserver``, the store's metrics): ``shard_spilled(job, seconds, nbytes)`` after each
  shard it writes.
- The store: ``tier.start()`` once serving, ``tier.close()`` on shutdown (after ``tier.flush(grace)``
  on SIGTERM); ``tier.holdings(job)`` as the pseudo-host ``durable`` in every cluster view
  (``latest_step``, retention, restore candidates), the host ``durable`` among those that did not answer when it
  raises; ``tier.protected_steps(job)`` before evicting;
  ``tier.read_into(key, allocate)`` to restore a shard from durable storage into memory it allocates;
  ``tier.status`` for the health report.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from memstore.core.model import Holding, Manifest, ShardKey

if TYPE_CHECKING:
    import threading

    from memstore.spill.layout import SpilledManifest
    from memstore.spill.storage import Durable


DURABLE_HOST = "durable"  # the pseudo-host the tier's copies are held by in a cluster view; in its unreachable hosts: no answer


@dataclass
class JobSpillStatus:
    """The durable tier's progress for one job, as the store reports it in Health."""

    last_spilled_step: int = -1
    last_spill_time: float | None = None
    consecutive_failures: int = 0
    last_error: str = ""
    retry_at: float = 0.0
    spilled: set[tuple[int, str, int]] = field(default_factory=set)  # (step, timeline, rank) this store published (or found published)
    bytes_written: int = 0
    # What durable storage held of the job (every store's ranks) when this store last listed it: no listing of its own.
    listed_steps: int = 0  # steps with at least one published rank
    listed_shards: int = 0  # published ranks (manifests), over all steps


class ShardSource(Protocol):
    """What the durable tier reads from the store."""

    host_id: str

    def spill_shards(self) -> list[Manifest]:
        """Manifests of the settled, verified copies held here whose spill duty is this store's: the shards its
        trainer ranks captured while it holds its slot, and a gone owner's it took over (``spill_duty``)."""
        ...

    def spills_for(self, owner_host: str) -> bool:
        """Whether this store spills (and collects from durable storage) the shards ``owner_host`` captured."""
        ...

    def pinned_bytes(self, key: ShardKey) -> AbstractContextManager[memoryview | None]:
        """The shard's bytes, held in memory for the duration of the block; None if it is gone."""
        ...

    def foreground_busy(self) -> bool:
        """A trainer is copying a save in, or a shard is being checksummed or replicated."""
        ...

    def spilled(self) -> None:
        """A step was published: steps kept in RAM only until spilled may go now."""
        ...


class DurableTier(Protocol):
    """What the store reads from the durable tier."""

    status: dict[str, JobSpillStatus]

    def start(self) -> None: ...

    def close(self) -> None: ...

    def flush(self, grace: float) -> list[str]:
        """Spill the newest committed step of every job within ``grace`` seconds; what failed."""
        ...

    def holdings(self, job_id: str) -> list[Holding]:
        """Published durable copies of ``job_id``, as holdings of the pseudo-host ``durable``.

        Raises ``SpillStorageError`` (``SpillUnreachable`` when the storage does not answer) rather than return part of
        what the tier holds: what it holds is unknown then. Callers count the tier among the hosts that did not answer
        and decide as if it might hold anything: retention keeps in RAM what is not known durable (``Janitor``), a
        restore's answer says the view is incomplete (``LatestStep``'s unreachable hosts)."""
        ...

    def protected_steps(self, job_id: str) -> set[int]:
        """Steps due for spilling but not spilled yet: not to be evicted from RAM."""
        ...

    def read_into(self, key: ShardKey, allocate: Callable[[SpilledManifest], memoryview]) -> SpilledManifest:
        """Read, decode and verify a spilled shard into the memory ``allocate(manifest)`` returns."""
        ...


class SpillObserver(Protocol):
    """Told of each shard the spill tier writes (the store's metrics, ``memstore.server.events``)."""

    def shard_spilled(self, job_id: str, seconds: float, nbytes: int) -> None:
        """One shard of ``job_id`` written (``nbytes`` stored) and its manifest published, in ``seconds``."""
        ...


class SpillerView(Protocol):
    """What a listener may use of the spiller it rides on: its storage, the shards' bytes, its lifetime, its rate."""

    durable: Durable
    source: ShardSource
    stopping: threading.Event
    max_rate: int


class SpillListener(Protocol):
    """Rides on the spill tier (e.g. ``memstore.interop.dcp_export.DcpExport``, plugged in by ``memstore serve``).

    The spiller calls ``published(spiller, shard)`` after each rank of a step is published (or found
    published), from its own thread: a listener returns at once and never raises into the spill. When
    retention deletes a step, it asks ``doomed_paths(...)`` for the listener's own files in that step
    (of ``ranks``, the ones this store collects) and deletes them with the step's.
    """

    def published(self, spiller: SpillerView, shard: Manifest) -> None: ...

    def doomed_paths(self, durable: Durable, job_id: str, step: int, ranks: set[int]) -> list[str]: ...
