"""The watcher: polls a discovery source on a daemon thread and keeps the last good membership.

A failed poll (DiscoveryError, an unexpected exception, or an answer that is not a valid non-empty
membership) never replaces the membership: it is kept until the source answers well again. Each new
error is logged once, recovery once; ``on_change`` hears every change of the good membership.

A member a good answer leaves out stays in the membership (at its last address) until ``ABSENT_POLLS`` answers
in a row have left it out (``debounce``): a DNS answer that flaps between the whole set and part of it (records
of a headless Service while pods churn) must not empty a live store's slot, which makes every save of its group
fall short of R copies until the next answer. A member that is really gone leaves a few polls later, and one
replaced by a newcomer in the same answer at once (its successor takes its slot over).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from memstore.errors import ConfigError, DiscoveryError
from memstore.membership.members import DiscoverySource, Members, validate_members

log = logging.getLogger(__name__)
ABSENT_POLLS = 3  # good answers in a row that must leave a member out before it leaves the membership


def debounce(kept: Members | None, answer: Members, absent: dict[str, int]) -> tuple[Members, dict[str, int]]:
    """The membership after a good ``answer``, given the one ``kept`` so far: every member of the answer, plus those
    of ``kept`` left out by fewer than ABSENT_POLLS answers in a row (``absent``: member -> answers that left it out
    so far, before this one). Returns it and the new counts.

    An answer that names a newcomer is taken as it is: a member replaced by another (a pod replaced under a new IP, a
    peers file edited) leaves at once, so its successor takes over its slot, and what it left on the machine."""
    if kept is None or set(answer) - set(kept):
        return answer, {}
    counts = {h: absent.get(h, 0) + 1 for h in kept if h not in answer}
    staying = {h: kept[h] for h, n in counts.items() if n < ABSENT_POLLS}
    return {**answer, **staying}, {h: n for h, n in counts.items() if n < ABSENT_POLLS}


@dataclass(frozen=True)
class DiscoveryStatus:
    source: str  # the source's description
    members: Members  # the last good membership ({} before the first good answer)
    last_ok_unix: float  # wall-clock time of the last good answer (0.0: none yet)
    error: str  # why the last poll failed ("" when it was good)
    consecutive_failures: int  # failed polls since the last good one


class Watcher:
    """Polls a source every `interval` seconds on a daemon thread; keeps the last good membership when the source
    fails or returns garbage; logs each new error once (not every poll) and logs recovery; calls on_change(members)
    (outside any lock) whenever the good membership changes, and once with the first good answer.

    ``on_change`` calls never overlap and the last one always carries the newest membership: a change found
    while another thread is inside ``on_change`` is handed to that thread, which calls again after it returns
    (so a ``poll_once`` from another thread may return before its change was delivered). An exception from
    ``on_change`` is logged; the membership counts as delivered. The thread polls at once when it starts,
    unless ``poll_once`` already ran (the startup pattern: ``poll_once()`` then ``start()``).
    """

    def __init__(self, source: DiscoverySource, interval: float, on_change: Callable[[Members], None]) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ConfigError(f"discovery interval {interval!r} is invalid: expected seconds > 0")
        self.source = source
        self.interval = float(interval)
        self._on_change = on_change
        self._poll_lock = threading.Lock()  # one source query and state update at a time (never held in on_change)
        self._lock = threading.Lock()  # guards the fields below (never held in on_change or a source query)
        self._members: Members | None = None
        self._absent: dict[str, int] = {}  # members good answers left out lately -> how many in a row (debounce)
        self._last_ok = 0.0
        self._error = ""
        self._failures = 0
        self._polls = 0
        self._logged_error = ""
        self._pending: Members | None = None  # a change not yet handed to on_change
        self._delivered: Members | None = None
        self._delivering = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        """Ask the source now; True if it gave a good membership."""
        with self._poll_lock:
            try:
                answer = validate_members(self.source.members(), self.source.description)
            except DiscoveryError as exc:
                self._failed(str(exc), None)
                return False
            except Exception as exc:  # a broken source must not stop the watcher
                self._failed(f"{self.source.description}: unexpected {type(exc).__name__}: {exc}", exc)
                return False
            self._succeeded(answer)
        self._deliver()
        return True

    def status(self) -> DiscoveryStatus:
        with self._lock:
            return DiscoveryStatus(self.source.description, dict(self._members or {}), self._last_ok, self._error, self._failures)

    def start(self) -> None:
        """Start polling on a daemon thread (once; later calls do nothing)."""
        if self._stop.is_set():
            raise RuntimeError(f"the watcher of {self.source.description} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memstore-discovery", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop polling and join the thread (it ends once a poll in progress returns)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _run(self) -> None:
        delay = 0.0 if self._polls == 0 else self.interval
        while not self._stop.wait(delay):
            self.poll_once()
            delay = self.interval

    def _failed(self, error: str, exc: Exception | None) -> None:
        with self._lock:
            self._polls += 1
            self._failures += 1
            self._error = error
            new = error != self._logged_error
            self._logged_error = error
            kept = len(self._members or {})
        if new:
            log.warning("membership discovery failed (keeping the last good membership, %d members): %s", kept, error, exc_info=exc)

    def _succeeded(self, answer: Members) -> None:
        with self._lock:
            self._polls += 1
            failures, self._failures = self._failures, 0
            self._error = self._logged_error = ""
            self._last_ok = time.time()
            answer, self._absent = debounce(self._members, answer, self._absent)
            old, self._members = self._members, answer
            if answer != old:
                self._pending = answer
        if failures:
            log.info("membership discovery recovered after %d failed polls: %s", failures, self.source.description)
        if answer != old:
            log.info("membership from %s: %s%s", self.source.description, ", ".join(sorted(answer)), _diff(old, answer))

    def _deliver(self) -> None:
        """Hand pending changes to on_change, on one thread at a time, outside every lock."""
        with self._lock:
            if self._delivering:
                return  # the delivering thread will see self._pending
            self._delivering = True
        while True:
            with self._lock:
                pending, self._pending = self._pending, None
                if pending is None or pending == self._delivered:
                    self._delivering = False
                    return
                self._delivered = pending
            try:
                self._on_change(dict(pending))
            except Exception:
                log.exception("membership on_change failed for %s", self.source.description)


def _diff(old: Members | None, new: Members) -> str:
    if old is None:
        return ""
    added = sorted(set(new) - set(old))
    removed = sorted(set(old) - set(new))
    moved = sorted(h for h in set(new) & set(old) if new[h] != old[h])
    parts = [f"+{h}" for h in added] + [f"-{h}" for h in removed] + [f"~{h}" for h in moved]
    return f" ({' '.join(parts)})" if parts else ""
