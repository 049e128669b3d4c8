"""The background task that spills committed steps to durable storage, and reads them back.

Each store spills the shards whose spill duty is its own (``memstore.core.spill_policy.spill_duty``):
those its trainer ranks captured while it holds its slot, and, once their owner is gone, those of the
slot it succeeded to or of the first held slot of the owner's group. A step is spilled once every rank's
manifest is published. Which steps:

- every ``--spill-every-steps N``: steps with ``step % N == 0`` (every store picks the same ones);
- every ``--spill-every-seconds S``: the first store whose timer fires writes an intent marker
  (``SPILL``) for its newest committed step; every store that spills shards of that step spills it too;
- on SIGTERM: the newest committed step, within the grace time (``flush``).

A shard is verified chunk by chunk against its capture checksums while it is written; its manifest
is written last. Failures (storage down, permission denied, disk full, a partial write) are
retried with exponential backoff and reported in status; nothing in RAM depends on a spill.

What the tier holds (``holdings``, the pseudo-host ``durable`` in the store's cluster views) is read from a listing and
the published manifests. A manifest that is corrupt or gone since the listing is left out (logged); when the storage
does not answer (``SpillUnreachable``: connection refused, a timeout, throttling), the view stops at the first such
failure and raises: what the tier holds is then unknown, never handed on as a whole view with parts missing. For
``OUTAGE_SECONDS`` after such a failure ``holdings`` raises at once, without asking the storage (and waiting out its
client's retries) again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from memstore.core.model import Holding, Manifest, ShardKey
from memstore.core.spill_policy import RetentionPolicy, due_by_steps, due_by_time, steps_to_delete
from memstore.errors import LayoutError, SpillCorrupt, SpillStorageError, SpillUnreachable
from memstore.faults import fault
from memstore.spill import codec as codecs
from memstore.spill import layout
from memstore.spill.layout import SpilledManifest
from memstore.spill.port import DURABLE_HOST, JobSpillStatus
from memstore.spill.reader import read_manifest, read_shard_into
from memstore.spill.storage import Durable
from memstore.v1.integrity import checksum, chunk_spans

if TYPE_CHECKING:
    from memstore.spill.port import ShardSource, SpillListener, SpillObserver

log = logging.getLogger(__name__)
T = TypeVar("T")

ORPHAN_SECONDS = 300.0  # a shard file with no manifest this old, below the newest spilled step, is debris
LISTING_CACHE_SECONDS = 1.0
OUTAGE_SECONDS = 1.0  # after the storage did not answer, ``holdings`` says so at once for this long


@dataclass
class StepListing:
    """What durable storage holds of one job: step -> rank -> manifest path, plus debris."""

    manifests: dict[int, dict[int, str]] = field(default_factory=dict)
    shards: dict[int, dict[int, tuple[str, float]]] = field(default_factory=dict)  # step -> rank -> (path, mtime)
    intents: set[int] = field(default_factory=set)
    debris: list[tuple[int, str, float]] = field(default_factory=list)  # (step, path, mtime) of temporary files


class Spiller:
    def __init__(
        self,
        source: ShardSource,
        durable: Durable,
        *,
        every_steps: int,
        every_seconds: float,
        retention: RetentionPolicy,
        codec: str,
        max_rate: int,
        interval: float = 0.5,
        orphan_seconds: float = ORPHAN_SECONDS,
        listeners: Sequence[SpillListener] = (),
        observer: SpillObserver | None = None,
    ) -> None:
        self.source = source
        self.listeners = tuple(listeners)
        self.observer = observer  # told of each shard written (the store's metrics)
        self.durable = durable
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.retention = retention
        self.codec = codecs.check(codec)
        self.max_rate = max_rate
        self.interval = interval
        self.orphan_seconds = orphan_seconds
        self.status: dict[str, JobSpillStatus] = {}
        self._lock = threading.Lock()  # one spill at a time: bounded memory and bandwidth
        self._stop = threading.Event()
        self.stopping = self._stop  # set when the spiller closes: listeners end with it
        self._thread = threading.Thread(target=self._loop, name="spill", daemon=True)
        self._listing_cache: dict[str, tuple[float, StepListing]] = {}
        self._manifest_cache: dict[str, tuple[float, SpilledManifest]] = {}
        self._intents: dict[str, set[int]] = {}  # job -> the SPILL intents of its last listing (kept while none succeeds)
        self._outage: tuple[float, SpillUnreachable] | None = None  # (when, what) the storage last did not answer
        self.started = time.time()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        # Spilling is background work: let the kernel prefer the threads serving saves and replication.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception:
                log.exception("spill pass failed")

    # -- listing --------------------------------------------------------------------------------
    def listing(self, job_id: str, max_age: float = LISTING_CACHE_SECONDS) -> StepListing:
        cached = self._listing_cache.get(job_id)
        if cached is not None and time.monotonic() - cached[0] < max_age:
            return cached[1]
        out = StepListing()
        prefix = layout.job_dir(self.durable.root, job_id)
        for path, info in self._answered(lambda: self.durable.list_files(prefix)).items():
            parts = path.rstrip("/").split("/")
            if len(parts) < 2:
                continue
            m_step = layout.STEP_DIR.match(parts[-2])
            if not m_step:
                continue
            step = int(m_step.group(1))
            if parts[-1] == "SPILL":
                out.intents.add(step)
                continue
            m_rank = layout.RANK_FILE.fullmatch(parts[-1])
            if not m_rank:
                continue
            rank = int(m_rank.group(1))
            mtime = _as_timestamp(info.get("mtime") or info.get("LastModified") or info.get("created") or 0)
            if m_rank.group(3):  # a temporary file: an unfinished local write
                out.debris.append((step, path, mtime))
            elif m_rank.group(2) == "json":
                out.manifests.setdefault(step, {})[rank] = path
            else:
                out.shards.setdefault(step, {})[rank] = (path, mtime)
        self._listing_cache[job_id] = (time.monotonic(), out)
        self._intents[job_id] = set(out.intents)
        self._outage = None
        st = self.status.get(job_id)
        if st is not None:  # what the metrics show of the durable tier: counted here, never listed for them
            st.listed_steps = len(out.manifests)
            st.listed_shards = sum(len(ranks) for ranks in out.manifests.values())
        return out

    def read_manifest(self, job_id: str, step: int, rank: int, max_age: float = LISTING_CACHE_SECONDS) -> SpilledManifest:
        """A published manifest, cached as long as a listing (re-spills of a step replace it)."""
        path = layout.manifest_path(self.durable.root, job_id, step, rank)
        cached = self._manifest_cache.get(path)
        if cached is not None and time.monotonic() - cached[0] <= max_age:
            return cached[1]
        m = self._answered(lambda: read_manifest(self.durable, job_id, step, rank))
        self._manifest_cache[path] = (time.monotonic(), m)
        return m

    def _answered(self, call: Callable[[], T]) -> T:
        """``call()`` (a storage call); when the storage does not answer, noted for ``holdings`` before it raises."""
        try:
            return call()
        except SpillUnreachable as exc:
            self._outage = (time.monotonic(), exc)
            raise

    def _published(self, job_id: str, listing: StepListing) -> dict[int, list[SpilledManifest]]:
        """step -> the readable published manifests of its ranks (a step none of whose manifests reads is left out).

        A manifest that is corrupt or gone since the listing (or denied) is left out, logged. SpillUnreachable at the first
        the storage does not answer: the others would fail alike, each after the storage client's retries, and a view
        without them is no view of what the tier holds."""
        out: dict[int, list[SpilledManifest]] = {}
        for step, ranks in listing.manifests.items():
            readable = []
            for rank in sorted(ranks):
                try:
                    readable.append(self.read_manifest(job_id, step, rank))
                except SpillUnreachable:
                    raise
                except (SpillStorageError, LayoutError) as exc:
                    log.warning("ignoring durable shard %d/%d of %s: %s", step, rank, job_id, exc)
            if readable:
                out[step] = readable
        return out

    def holdings(self, job_id: str) -> list[Holding]:
        """Durable copies of ``job_id`` as holdings of the pseudo-host ``durable``: published ranks only.

        SpillUnreachable when the storage does not answer (or did not within ``OUTAGE_SECONDS``): what the tier holds
        is unknown then (``memstore.spill.port.DurableTier.holdings`` says what callers make of that)."""
        outage = self._outage
        if outage is not None and time.monotonic() - outage[0] < OUTAGE_SECONDS:
            raise SpillUnreachable(f"{outage[1]} ({time.monotonic() - outage[0]:.1f} s ago; not asked again yet)")
        return [
            Holding(DURABLE_HOST, ShardKey(job_id, m.step, m.rank, m.timeline), m.world_size, True, m.created_unix)
            for ms in self._published(job_id, self.listing(job_id)).values()
            for m in ms
        ]

    def complete_steps(self, listing: StepListing, job_id: str) -> dict[int, dict[str, float]]:
        """step -> metrics of every fully published step (all ranks, one timeline; metrics from its lowest rank)."""
        complete: dict[int, dict[str, float]] = {}
        for step, ms in self._published(job_id, listing).items():
            first = ms[0]
            ranks = {m.rank for m in ms}  # each rank < its world_size (checked when decoded): all of them iff as many
            if len(ranks) == first.world_size and {(m.timeline, m.world_size) for m in ms} == {(first.timeline, first.world_size)}:
                complete[step] = dict(first.metrics)
        return complete

    # -- the pass ---------------------------------------------------------------------------------
    def run_once(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for job_id, steps in self._duty().items():
            st = self.status.setdefault(job_id, JobSpillStatus())
            if time.monotonic() < st.retry_at:
                continue
            try:
                listing = self.listing(job_id)
                due = {s for s in steps if due_by_steps(s, self.every_steps)} | (listing.intents & set(steps))
                newest = max(steps)
                if due_by_time(st.last_spill_time if st.last_spill_time is not None else self.started, now, self.every_seconds):
                    self.durable.write_small(layout.intent_path(self.durable.root, job_id, newest), b"")
                    due.add(newest)
                for step in sorted(due, reverse=True):  # newest first
                    if _unspilled(st, steps[step]):
                        self.spill_step(job_id, step)
                self.collect_garbage(job_id)
                st.consecutive_failures = 0
            except (SpillStorageError, LayoutError) as exc:
                self._failed(st, job_id, exc)

    def protected_steps(self, job_id: str) -> set[int]:
        """Steps this store must spill, due but not spilled yet (a gone owner's it took over too): retention must
        not evict them from RAM first."""
        st = self.status.get(job_id, JobSpillStatus())
        intents = self._intents.get(job_id, set())  # the last listing's: while the tier does not answer, they stand
        steps = self._duty().get(job_id, {})
        return {s for s, ms in steps.items() if (due_by_steps(s, self.every_steps) or s in intents) and _unspilled(st, ms)}

    def _failed(self, st: JobSpillStatus, job_id: str, exc: Exception) -> None:
        st.consecutive_failures += 1
        st.last_error = str(exc)
        backoff = min(60.0, 0.5 * 2 ** min(st.consecutive_failures, 7))
        st.retry_at = time.monotonic() + backoff
        log.warning("spill of job %s failed (%d in a row, retry in %.1fs): %s", job_id, st.consecutive_failures, backoff, exc)

    def _duty(self) -> dict[str, dict[int, list[Manifest]]]:
        """job -> step -> the shards of the newest settled version of that step this store must spill."""
        shards = self.source.spill_shards()
        newest: dict[tuple[str, int], Manifest] = {}
        for m in shards:
            k = (m.key.job_id, m.key.step)
            if k not in newest or m.created_unix > newest[k].created_unix:
                newest[k] = m
        out: dict[str, dict[int, list[Manifest]]] = {}
        for m in sorted(shards, key=lambda m: (m.key.job_id, m.key.step, m.key.rank)):
            if m.key.timeline == newest[(m.key.job_id, m.key.step)].key.timeline:
                out.setdefault(m.key.job_id, {}).setdefault(m.key.step, []).append(m)
        return out

    def _published_timeline(self, job_id: str, step: int, rank: int) -> tuple[str, float] | None:
        """(timeline, capture time) of the published manifest of (job, step, rank), or None."""
        if not self.durable.exists(layout.manifest_path(self.durable.root, job_id, step, rank)):
            return None
        try:
            m = read_manifest(self.durable, job_id, step, rank)
        except LayoutError:
            return None  # unreadable: overwrite it
        return m.timeline, m.created_unix

    def spill_step(self, job_id: str, step: int) -> int:
        """Publish every shard of ``step`` this store must spill (its newest version). Returns bytes written."""
        entries = self._duty().get(job_id, {}).get(step, [])
        st = self.status.setdefault(job_id, JobSpillStatus())
        written = 0
        with self._lock:
            for entry in sorted(entries, key=lambda e: e.key.rank):
                published = self._published_timeline(job_id, step, entry.key.rank)
                if published is None or (published[0] != entry.key.timeline and published[1] < entry.created_unix):
                    if published is not None:
                        # A newer timeline re-saved the step: unpublish the old version first, never mix the two.
                        self.durable.delete([layout.manifest_path(self.durable.root, job_id, step, entry.key.rank)])
                        self._manifest_cache.pop(layout.manifest_path(self.durable.root, job_id, step, entry.key.rank), None)
                    written += self._spill_entry(entry)
                # else published before (by the owner, its previous incarnation or the store that spilled it before
                # this one took it over; or a newer version is there already)
                self._after_publish(entry)
                st.spilled.add((step, entry.key.timeline, entry.key.rank))
        st.last_spilled_step = max(st.last_spilled_step, step)
        st.last_spill_time = time.time()
        st.bytes_written += written
        st.last_error = ""
        self._listing_cache.pop(job_id, None)
        self.source.spilled()  # steps kept in RAM only for this spill may go now
        if written:
            log.info("spilled %s step %d: %d shards, %d bytes to %s", job_id, step, len(entries), written, self.durable.url)
        return written

    def _after_publish(self, entry: Manifest) -> None:
        """Tell the listeners (e.g. the plain-DCP export) a rank is published; theirs is not the spill's failure."""
        for listener in self.listeners:
            try:
                listener.published(self, entry)
            except Exception:
                log.exception("spill listener %s failed on %s", type(listener).__name__, entry.key)

    def _yield_to_foreground(self, limit: float = 2.0) -> None:
        """Wait (bounded) while a trainer is copying a save in or a shard is replicating.

        On a busy host the spiller's reads and writes compete with the save's memcpy and with
        replication for memory bandwidth and cores; both of those are on the training critical path
        and the spill is not. ``limit`` keeps the spill progressing under a continuous load.
        """
        deadline = time.monotonic() + limit
        while self.source.foreground_busy() and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.005)

    def _spill_entry(self, entry: Manifest) -> int:
        started = time.monotonic()
        with self.source.pinned_bytes(entry.key) as view:
            if view is None:
                return 0
            written = self._spill_bytes(entry, view)
        if self.observer is not None:
            self.observer.shard_spilled(entry.key.job_id, time.monotonic() - started, written)
        return written

    def _spill_bytes(self, m: Manifest, view: memoryview) -> int:
        """Write one shard's bytes (verified chunk by chunk against its capture checksums), then its manifest."""
        codec = m.spill_codec or self.codec  # the job's choice, else the store's --spill-compression
        stored: list[int] = []

        def pieces() -> Iterator[memoryview | bytes]:
            started = time.monotonic()
            sent = 0
            for index, (off, length) in enumerate(chunk_spans(m.nbytes, m.chunk_size)):
                self._yield_to_foreground()
                raw = view[off : off + length]
                if checksum(raw) != m.checksums[index]:
                    raise SpillCorrupt(f"{m.key}: chunk {index} in RAM failed its checksum; not spilling a corrupt copy")
                encoded = codecs.encode(codec, raw)
                stored.append(len(encoded))
                yield encoded
                fault("spill.after_chunk")
                sent += len(encoded)
                if self.max_rate:
                    ahead = sent / self.max_rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)

        key = m.key
        shard = layout.shard_path(self.durable.root, key.job_id, key.step, key.rank)
        written = self.durable.write_stream(shard, pieces())
        if self.durable.size(shard) != written:
            raise SpillStorageError(f"{shard}: stored size differs from what was written; not publishing")
        fault("spill.before_manifest")
        manifest = SpilledManifest(
            job_id=key.job_id,
            step=key.step,
            rank=key.rank,
            world_size=m.world_size,
            nbytes=m.nbytes,
            chunk_size=m.chunk_size,
            checksums=list(m.checksums),
            owner_host=m.owner_host,
            codec=codec,
            stored_chunks=stored,
            metrics=dict(m.metrics),
            format_version=m.format_version,
            created_unix=m.created_unix,
            spilled_unix=time.time(),
            timeline=key.timeline,
            stripe=m.stripe,
        )
        self.durable.write_small(layout.manifest_path(self.durable.root, key.job_id, key.step, key.rank), manifest.encode())
        return written

    # -- retention and debris ------------------------------------------------------------------------
    def collect_garbage(self, job_id: str) -> list[int]:
        """Delete steps retention no longer keeps (this store's ranks, plus debris anyone may remove)."""
        listing = self.listing(job_id, max_age=0)
        complete = self.complete_steps(listing, job_id)
        if not complete:
            return []
        incomplete = (set(listing.manifests) | set(listing.shards) | listing.intents) - set(complete)
        doomed = steps_to_delete(complete, incomplete, self.retention)
        spills_for: dict[str, bool] = {}  # owner host -> whether this store spills for it (asked once per owner)
        paths: list[str] = []
        for step in doomed:
            # Unpublish first (manifests), then the bytes; only the ranks this store spills for (whoever spills their
            # owner's shards now: a gone owner's successor collects them too), or debris of incomplete steps.
            ranks = set(listing.manifests.get(step, {})) | set(listing.shards.get(step, {}))
            mine = {r for r in ranks if self._collects(job_id, step, r, spills_for)} if step in complete else ranks
            paths += [listing.manifests[step][r] for r in mine if r in listing.manifests.get(step, {})]
            paths += [listing.shards[step][r][0] for r in mine if r in listing.shards.get(step, {})]
            paths += self._interop_paths(job_id, step, mine)
            if step in listing.intents and step not in complete:
                paths.append(layout.intent_path(self.durable.root, job_id, step))
        newest = max(complete)
        now = time.time()
        for step, files in listing.shards.items():
            for rank, (path, mtime) in files.items():
                unpublished = rank not in listing.manifests.get(step, {})
                if unpublished and step < newest and step not in doomed and mtime and now - mtime > self.orphan_seconds:
                    paths.append(path)  # a half-written spill nobody will finish
        paths += [path for step, path, mtime in listing.debris if step in doomed or (mtime and now - mtime > self.orphan_seconds)]
        if paths:
            self.durable.delete(sorted(set(paths), key=lambda p: (not p.endswith(".json"), p)))
            self.durable.remove_empty_dirs([layout.step_dir(self.durable.root, job_id, s) for s in doomed])
            self._listing_cache.pop(job_id, None)
            log.info("spill retention for %s removed %d files (steps %s)", job_id, len(paths), sorted(doomed))
        self._sweep_empty_step_dirs(job_id, listing, newest)
        return sorted(doomed)

    def _sweep_empty_step_dirs(self, job_id: str, listing: StepListing, newest: int) -> None:
        """Remove empty directories of steps older than the newest spilled one, whoever deleted their files last.

        Each store deletes only its own ranks' files and tries the directory once; when another store's files
        (or a rider's late write, which re-creates the directory) were still there, nobody would try again.
        """
        held = set(listing.manifests) | set(listing.shards) | listing.intents | {step for step, _, _ in listing.debris}
        leftovers = []
        for path in self.durable.local_subdirs(layout.job_dir(self.durable.root, job_id)):
            m = layout.STEP_DIR.search(path.rstrip("/"))
            if m and int(m.group(1)) < newest and int(m.group(1)) not in held:
                leftovers.append(path)
        self.durable.remove_empty_dirs(leftovers)  # rmdir: a directory that still holds anything stays

    def _interop_paths(self, job_id: str, step: int, ranks: set[int]) -> list[str]:
        """The listeners' files of ``ranks`` in a doomed step; what a listener fails to name is left (logged)."""
        paths: list[str] = []
        for listener in self.listeners:
            try:
                paths += listener.doomed_paths(self.durable, job_id, step, ranks)
            except Exception:
                log.exception("spill listener %s: files of %s step %d not collected", type(listener).__name__, job_id, step)
        return paths

    def _collects(self, job_id: str, step: int, rank: int, spills_for: dict[str, bool]) -> bool:
        """Whether this store deletes a published rank of a doomed step: it spills for that rank's owner now."""
        try:
            owner = self.read_manifest(job_id, step, rank).owner_host
        except SpillUnreachable:
            raise  # no answer: this pass deletes nothing
        except (SpillStorageError, LayoutError):
            return False  # unreadable: whoever spills for it cannot tell either; the next pass tries again
        if owner not in spills_for:
            spills_for[owner] = self.source.spills_for(owner)
        return spills_for[owner]

    # -- reading back ---------------------------------------------------------------------------------
    def read_into(self, key: ShardKey, allocate: object) -> SpilledManifest:
        """Read a spilled shard, decode and verify every chunk into the view ``allocate(manifest)`` returns."""
        m = read_manifest(self.durable, key.job_id, key.step, key.rank)
        if m.timeline != key.timeline:
            raise LayoutError(f"the durable copy of {key} is of timeline {m.timeline!r} (a different save of that step)")
        dest: memoryview = allocate(m)  # type: ignore[operator]
        read_shard_into(self.durable, m, dest)
        return m

    # -- SIGTERM ----------------------------------------------------------------------------------------
    def flush(self, grace: float) -> list[str]:
        """Spill the newest committed step of every job within ``grace`` seconds. Returns what failed."""
        deadline = time.monotonic() + grace
        failures: list[str] = []
        for job_id, steps in self._duty().items():
            if time.monotonic() >= deadline:
                failures.append(f"{job_id}: grace time over before its turn")
                continue
            newest = max(steps)
            try:
                self.durable.write_small(layout.intent_path(self.durable.root, job_id, newest), b"")
                self.spill_step(job_id, newest)
            except (SpillStorageError, LayoutError) as exc:
                failures.append(f"{job_id} step {newest}: {exc}")
        return failures


def _unspilled(st: JobSpillStatus, shards: list[Manifest]) -> bool:
    """Whether any of ``shards`` (of one step) is not yet published by this store (nor found published)."""
    return any((m.key.step, m.key.timeline, m.key.rank) not in st.spilled for m in shards)


def _as_timestamp(value: object) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    ts = getattr(value, "timestamp", None)
    return float(ts()) if callable(ts) else 0.0
