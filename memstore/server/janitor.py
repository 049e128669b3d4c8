"""Background upkeep: retention (keep-K, superseded timelines) and expiry of leases and tickets."""

from __future__ import annotations

import logging
import time

from memstore.core.restorable import latest_restorable, may_supersede, superseded_versions
from memstore.core.retention import retention_victims
from memstore.server.datapath import DataPath
from memstore.server.reading import Reading
from memstore.server.recovery import Recovery

log = logging.getLogger(__name__)


class Janitor(Recovery, Reading, DataPath):
    """Evicts what retention no longer keeps and frees what crashed clients left allocated."""

    def _janitor_loop(self) -> None:
        while not self._stop.is_set():
            self._retention_due.wait(timeout=1.0)
            if self._stop.is_set():
                return
            self._retention_due.clear()
            try:
                self._expire_leases()
                self._expire_tickets()
                self._apply_retention()
            except Exception:
                log.exception("janitor pass failed")
            self._stop.wait(0.05)  # debounce bursts of settles into one pass

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale_alloc = [k for k, lease in self._alloc_leases.items() if lease.expires < now]
            stale_read = [k for k, lease in self._read_leases.items() if lease.expires < now]
        for lease_id in stale_alloc + stale_read:
            log.warning("lease %s expired; releasing it", lease_id)
            self.release(lease_id)

    def _apply_retention(self) -> None:
        with self._lock:
            jobs = {k.job_id for k in self._entries}
        for job in sorted(jobs):
            with self._lock:
                held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job]
            crowded = len({k.version for k, _, _ in held}) > self.config.keep and retention_victims(held, self.config.keep)
            if not crowded and not may_supersede((k, created) for k, _, created in held):
                continue
            # Something would go, or a re-save may have superseded another timeline: learn the cluster's view.
            holdings, _ = self.cluster_holdings(job)
            dead = superseded_versions(holdings, job)
            latest = latest_restorable(holdings, job)
            protected = [latest.step] if latest else []
            if self.durable is not None:
                protected += sorted(self.durable.protected_steps(job))  # due for spilling: keep until spilled
            with self._lock:
                if latest:
                    self._protected[job] = latest.step
                for dead_entry in [e for e in self._entries.values() if e.key.job_id == job and e.key.version in dead and e.state.settled]:
                    log.info("dropping %s: a newer timeline re-saved step %d or earlier", dead_entry.key, dead_entry.key.step)
                    self._drop(dead_entry, reason="superseded: the job went back and saved this step again on a newer timeline")
                held = [(e.key, e.state, e.created_unix) for e in self._entries.values() if e.key.job_id == job]
                for key in retention_victims(held, self.config.keep, protected):
                    entry = self._entries.get(key)
                    if entry is not None:
                        log.debug("retention: evicting %s", key)
                        self._drop(entry, reason="evicted by retention")
