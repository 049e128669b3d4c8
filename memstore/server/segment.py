"""One shared-memory segment: a mapped region of a file on the tmpfs (or anonymous memory) holding one shard.

``memstore.server.segments.SegmentPool`` makes, recycles and accounts them.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os

from memstore.server.shm_dirs import sidecar_path

log = logging.getLogger(__name__)

NO_RING = -1  # Segment.ring of a segment in no rank's capture ring


class Segment:
    """One mapped region. ``path`` is None for anonymous memory (no shm dir configured)."""

    __slots__ = ("_closed", "described", "exported", "mm", "owner", "path", "ring", "size")

    def __init__(self, path: str | None, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.owner = ""  # job whose bytes the segment last held; pooled segments are reused by that job only
        # The rank of ``owner`` whose capture ring it belongs to (NO_RING: none): it goes back to that rank's saves
        # only, because its client keeps it mapped and registered for DMA (never resized while in a ring).
        self.ring = NO_RING
        # A reader mapped it (copy-on-write): its bytes must never change, so it is unlinked, not recycled.
        self.exported = False
        self.described = False  # a sidecar exists next to it (SegmentPool.describe)
        self.size = size
        self.mm = mm
        self._closed = False

    def view(self, nbytes: int | None = None) -> memoryview:
        """The first ``nbytes`` (default ``size``; the map may be longer after a shrink, see ``SegmentPool``)."""
        return memoryview(self.mm)[: self.size if nbytes is None else nbytes]

    def unmap(self) -> None:
        """Unmap, keeping the file (and sidecar) on the tmpfs."""
        if self._closed:
            return
        self._closed = True
        try:
            self.mm.close()
        except BufferError:
            # A memoryview still references the map (an in-flight reader); the pages go when it does.
            log.debug("segment %s still exported; unmapped when its last view is released", self.path)

    def destroy(self) -> None:
        """Unmap and unlink the file and its sidecar."""
        self.unmap()
        if self.path:
            for path in (self.path, sidecar_path(self.path)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.described = False
