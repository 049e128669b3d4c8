"""The baselines memstore is compared with, measured in the same run on the same bytes: a memcpy (torch ``copy_`` into
pre-faulted memory), raw TCP between two Python processes on loopback, and ``torch.save`` + fsync / ``torch.load``
(DCP ``async_save``: :mod:`memstore.bench.baselines_dcp`). ``torch.load`` runs in a new process, as the restores do.

The TCP sender is this module run as a child: ``python -m memstore.bench.baselines PORT NBYTES`` (``PairedTcp``: one
transfer each time it is asked; the baseline is a few of them, each save's paired TCP one).
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from memstore.bench.state import copy_all, module_env, nbytes_of, p50, prefaulted

if TYPE_CHECKING:
    import torch

CHUNK = 4 << 20  # what the sender hands to sendall at a time (memstore's chunk size)
BASELINE_TIMEOUT = 300.0
MEMCPY_REPS = 5
TCP_REPS = 3


def baseline_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> dict[str, Any]:
    """torch ``copy_`` of every state tensor into a pre-faulted buffer, ``reps`` times."""
    import torch

    dst = prefaulted(nbytes_of(tensors))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy_all(dst, tensors)
        times.append(time.perf_counter() - t0)
    del dst
    gc.collect()
    return {"bytes": nbytes_of(tensors), "torch_threads": torch.get_num_threads(), "seconds": times, "p50": p50(times)}


def baseline_hash(nbytes: int, reps: int = MEMCPY_REPS) -> dict[str, Any]:
    """The store's verification of ``nbytes`` held in RAM: every chunk's checksum (xxh3, the shards' chunk size) on as
    many threads as a store verifies a shard a trainer opens with, ``reps`` times. A restore from local RAM verifies
    every byte before the trainer gets it, so this is its baseline."""
    from memstore.server.engine.local_reads import VERIFY_WORKERS
    from memstore.v1.integrity import DEFAULT_CHUNK_BYTES, compute_checksums

    buf = prefaulted(nbytes)
    buf.view(-1)[:: 4096 // buf.element_size()] = 1  # bytes of its own (xxh3's speed does not depend on them)
    view = memoryview(buf.numpy().data).cast("B")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        compute_checksums(view, nbytes, DEFAULT_CHUNK_BYTES, workers=VERIFY_WORKERS)
        times.append(time.perf_counter() - t0)
    view.release()
    del buf
    gc.collect()
    return {"bytes": nbytes, "workers": VERIFY_WORKERS, "chunk_bytes": DEFAULT_CHUNK_BYTES, "seconds": times, "p50": p50(times)}


def baseline_tcp(nbytes: int, reps: int = TCP_REPS) -> dict[str, Any]:
    """Raw TCP of ``nbytes``, ``reps`` transfers on one connection (``PairedTcp``: a child Python process sends 4 MiB
    memoryview slices with blocking ``sendall``, this one receives with ``recv_into`` a pre-faulted buffer); each is
    timed from its first byte to its last; the figure is bytes per second, p50."""
    with PairedTcp(nbytes) as tcp:
        rates = [nbytes / tcp.seconds() for _ in range(reps)]
    return {"bytes": nbytes, "reps": reps, "bytes_per_second": rates, "p50": p50(rates)}


def _receive(conn: socket.socket, view: memoryview, nbytes: int) -> float:
    """One transfer of ``nbytes`` into ``view``: bytes per second from its first recv (which it then misses) to its last.
    A transfer whose first recv took every byte (a small one, with large socket buffers) is timed from the asking."""
    asked = time.perf_counter()
    got = missed = 0
    start = 0.0
    while got < nbytes:
        n = conn.recv_into(view[got:], nbytes - got)
        if n == 0:
            raise RuntimeError(f"TCP sender closed after {got} of {nbytes} bytes")
        if got == 0:
            start, missed = time.perf_counter(), n
        got += n
    if missed == nbytes:
        return nbytes / max(time.perf_counter() - asked, 1e-9)
    return (nbytes - missed) / (time.perf_counter() - start)


class PairedTcp:
    """Raw loopback TCP of ``nbytes``, one transfer whenever asked: a save's ratio is taken against the TCP of the same
    bytes measured right before it (as its stall is against the memcpy right before it), so a machine whose speed
    drifts over the run (other tenants, frequency) moves both alike. A child process sends (``serve_tcp``), this one
    receives into a pre-faulted buffer; each transfer is timed from its first byte to its last (``_receive``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf = prefaulted(nbytes)
        self._view = self._buf.numpy().data
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(BASELINE_TIMEOUT)
            port = listener.getsockname()[1]
            sender = [sys.executable, "-m", __name__, str(port), str(nbytes)]
            self._child = subprocess.Popen(sender, stderr=subprocess.PIPE, env=module_env())
            try:
                self._conn, _ = listener.accept()
            except BaseException:
                self._reap()
                raise
        self._conn.settimeout(BASELINE_TIMEOUT)

    @property
    def sender_pid(self) -> int:
        return self._child.pid

    def seconds(self) -> float:
        """One transfer of ``nbytes``: seconds at the rate from its first byte to its last."""
        self._conn.sendall(b"g")
        return self.nbytes / _receive(self._conn, self._view, self.nbytes)

    def close(self) -> None:
        """Tell the sender to stop and reap it; RuntimeError with its stderr if it failed."""
        try:
            self._conn.sendall(b"q")
            self._conn.close()
        except OSError:
            pass
        err = self._reap()
        self._view.release()
        if self._child.returncode != 0:
            raise RuntimeError(f"TCP sender failed with {self._child.returncode}: {err[-2000:]}")

    def _reap(self) -> str:
        try:
            _, err = self._child.communicate(timeout=BASELINE_TIMEOUT)
            return err.decode(errors="replace")
        finally:
            if self._child.poll() is None:
                self._child.kill()
                self._child.wait(timeout=10)

    def __enter__(self) -> PairedTcp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_tcp(port: int, nbytes: int) -> None:
    """The sending side of :class:`PairedTcp`: ``nbytes`` each time the receiver sends ``g``, until it sends ``q``."""
    buf = bytearray(nbytes)
    mv = memoryview(buf)
    pattern = bytes(range(256)) * (CHUNK // 256)
    for off in range(0, nbytes, CHUNK):
        mv[off : off + CHUNK] = pattern[: min(CHUNK, nbytes - off)]
    with socket.create_connection(("127.0.0.1", port), timeout=BASELINE_TIMEOUT) as s:
        s.settimeout(None)  # blocking sends: one call per piece (with a timeout, sendall polls before every partial send)
        while s.recv(1) == b"g":
            for off in range(0, nbytes, CHUNK):
                s.sendall(mv[off : off + CHUNK])


def _evict_page_cache(path: str) -> bool:
    """Drop the file's clean pages from the page cache (POSIX_FADV_DONTNEED; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def baseline_disk(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """``torch.save`` + flush + fsync to a file on local disk; then ``torch.load(weights_only=True)`` of it, ``reps``
    times with the file's page cache evicted (cold) and as many warm, each in a new process (a restarted trainer, like
    the restores it is compared with: into a fresh process's memory), timed around the call and verified."""
    import torch

    from memstore.bench.rig import restore_in_new_process
    from memstore.bench.state import fingerprint

    expected = fingerprint(state)
    cold: list[float] = []
    warm: list[float] = []
    with tempfile.TemporaryDirectory(prefix="memstore-bench-", dir=disk_dir) as d:
        path = os.path.join(d, "state.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        save_fsync = time.perf_counter() - t0
        file_bytes = os.path.getsize(path)
        evicted = _evict_page_cache(path)  # whether this system can (the cold loads evict right before they load)
        runs = []
        for _ in range(reps):
            runs.append(restore_in_new_process({"path": path}, BASELINE_TIMEOUT, before=lambda: _evict_page_cache(path)))
            cold.append(runs[-1]["seconds"])
            runs.append(restore_in_new_process({"path": path}, BASELINE_TIMEOUT))
            warm.append(runs[-1]["seconds"])
        verified = all(r["fingerprint"] == expected for r in runs)
    return {
        "dir": d,
        "file_bytes": file_bytes,
        "save_fsync_seconds": save_fsync,
        "load_warm_seconds": warm,
        "load_warm_p50": p50(warm),
        "load_cold_seconds": cold,
        "load_cold_p50": p50(cold),
        "cold_page_cache_evicted": evicted,
        "load_verified": verified,
    }


if __name__ == "__main__":
    serve_tcp(int(sys.argv[1]), int(sys.argv[2]))
