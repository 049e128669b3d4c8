"""P-stream throughput: one shard pushed to a store on P = 1, 2 and 4 parallel data-channel streams.

The pushing side is this process running the owner store's own push (``Peer.push_data``, what replication runs),
from a segment file on the tmpfs as an owner's shard is (its pages sent by reference, ``sendfile``); the receiving
side is a real store process that verifies every chunk and registers the copy. Each push is timed from the call to
the store's acknowledgement; the copy is deleted between pushes, so every push lands in memory the store has pooled
(pre-faulted), as a steady-state replica does. A first, untimed push warms that memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from memstore.bench.rig import CAPACITY_SLACK, running, store_rpc
from memstore.bench.state import p50
from memstore.core.model import Manifest, PutOrigin, ShardKey, TransferHeader
from memstore.server.peers import PeerDirectory
from memstore.testing import LocalCluster
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import DEFAULT_CHUNK_BYTES, compute_checksums

JOB = "bench-streams"
STREAMS = (1, 2, 4)
SHM_DIR = "/dev/shm"  # where the pushed shard's file lives, as a store's segments do (else the temp dir)


@contextlib.contextmanager
def _segment(nbytes: int, directory: str) -> Iterator[tuple[int, mmap.mmap, TransferHeader]]:
    """A shard of ``nbytes`` random bytes in a file under ``directory`` (a tmpfs), as an owner holds one: its
    descriptor, its mapping and the header a push of it sends."""
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="bench-streams-") as fh:
        for off in range(0, nbytes, len(block)):
            fh.write(block[: min(len(block), nbytes - off)])
        fh.flush()
        with mmap.mmap(fh.fileno(), nbytes) as mm:
            sums = compute_checksums(memoryview(mm), nbytes, DEFAULT_CHUNK_BYTES, workers=2)
            manifest = Manifest(ShardKey(JOB, 1, 0), 1, nbytes, DEFAULT_CHUNK_BYTES, tuple(sums), "h0")
            yield fh.fileno(), mm, TransferHeader(manifest, PutOrigin.REPLICA, "h0")


def measure_streams(nbytes: int, reps: int, env: dict[str, str], shm_root: str = SHM_DIR) -> dict[str, Any]:
    """Seconds of each push of an ``nbytes`` shard, per stream count, and their p50; the pushed file and the receiver's
    segments on the tmpfs ``shm_root``."""
    page = os.sysconf("SC_PAGE_SIZE")
    capacity = 3 * (-(-nbytes // page) * page) + CAPACITY_SLACK
    extra = ["--repair-interval", "3600", "--transfer-streams", "16"]  # the receiver grants what the pusher asks
    # Pushes into memory the receiver pooled (warmed below): the run's --prefault, sized for its own stores, is not theirs.
    env = {k: v for k, v in env.items() if k != "MEMSTORE_PREFAULT"}
    cluster = LocalCluster(hosts=2, replicas=2, capacity=str(capacity), keep=1, extra_args=extra, env=env or None, shm_root=shm_root)
    out: dict[str, Any] = {"bytes": nbytes}
    cluster.start()
    with running(cluster), _segment(nbytes, shm_root if os.path.isdir(shm_root) else tempfile.gettempdir()) as (fd, mm, header):
        peers = PeerDirectory("h0", [(h, cluster.address(h)) for h in ("h0", "h1")])
        target = peers["h1"]
        timeout = 60.0 + nbytes / (10 << 20)

        view = memoryview(mm)

        def push(streams: int) -> float:
            t = time.perf_counter()
            target.push_data(header, view, timeout, 5.0, streams, source_fd=fd)
            seconds = time.perf_counter() - t
            store_rpc(cluster.address("h1"), "Delete", pb.DeleteRequest(job_id=JOB, step=-1, rank=-1))
            return seconds

        try:
            push(max(STREAMS))  # warm the receiver's memory
            for streams in STREAMS:
                seconds = [push(streams) for _ in range(reps)]
                out[f"p{streams}"] = {"seconds": seconds, "p50": p50(seconds)}
        finally:
            view.release()
            peers.close()
    return out
