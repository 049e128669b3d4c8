"""Per-sender admission of inbound transfers: at most ``--max-streams-per-peer`` open at once from one sender.

A sender is a peer store or the clients of one job (``memstore.core.limits.transfer_sender``). The ``Saver``
admits each shard arriving as a stream (a gRPC Put, a data-channel receive) before it reserves memory for it, and
ends it exactly once, when the shard is registered, fails or never got memory; the store's ``foreground_busy`` asks
whether any is open. ``Store`` builds the one ``Admission`` and hands it to the saver.

Lock: its own, a leaf (nothing else is taken under it). That is enough: a sender's count is checked and raised in
one step under it, and nothing else has to agree with the counts at the same instant. Whether a client's shard is
held already (``Catalog.refuse_resave``) is asked of the catalog first, and was never more than a look at one
instant: a copy registered after it is handled by the catalog when the transfer registers.
"""

from __future__ import annotations

import threading

from memstore.core.limits import admits
from memstore.errors import TooManyStreams


class Admission:
    """The inbound transfers open per sender, each admitted within ``max_streams`` (0: unlimited)."""

    def __init__(self, host_id: str, max_streams: int) -> None:
        self.host_id = host_id
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # sender -> inbound transfers open

    def admit(self, sender: str) -> None:
        """Count one more open transfer of ``sender``; TooManyStreams (nothing counted) beyond the limit.
        ``end`` must follow, once."""
        with self._lock:
            active = self._open.get(sender, 0)
            if not admits(active, self.max_streams):
                kind, _, who = sender.partition(":")
                whom = f"the clients of job {who!r}" if kind == "job" else f"peer {who!r}"
                raise TooManyStreams(
                    f"{whom} already have {active} transfers open to store {self.host_id}, the most allowed "
                    f"(--max-streams-per-peer {self.max_streams}); retry once one has finished, or raise --max-streams-per-peer",
                    sender=sender,
                    active=active,
                    max_streams=self.max_streams,
                )
            self._open[sender] = active + 1

    def end(self, sender: str) -> None:
        """One of ``sender``'s transfers ended (registered, failed, or never got memory)."""
        with self._lock:
            left = self._open.get(sender, 0) - 1
            if left > 0:
                self._open[sender] = left
            else:
                self._open.pop(sender, None)

    def open_streams(self) -> dict[str, int]:
        """Sender -> inbound transfers open (a copy)."""
        with self._lock:
            return dict(self._open)

    def busy(self) -> bool:
        """Some transfer is open (bytes are arriving): background work yields (``Store.foreground_busy``)."""
        with self._lock:
            return bool(self._open)
