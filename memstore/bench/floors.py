"""The floors memstore is compared with, measured in the same run on the same bytes: a memcpy (torch ``copy_`` into
pre-faulted memory), raw TCP between two Python processes on loopback, and ``torch.save`` + fsync / ``torch.load``
(DCP ``async_save``: :mod:`memstore.bench.floors_dcp`). ``torch.load`` runs in a new process, as the restores do.

The TCP sender is this module run as a child: ``python -m memstore.bench.floors PORT NBYTES REPS``, or, for
``PairedTcp`` (one transfer on demand, paired with each save), ``python -m memstore.bench.floors --paired PORT NBYTES``.
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
FLOOR_TIMEOUT = 300.0
MEMCPY_REPS = 5
TCP_REPS = 3


def floor_memcpy(tensors: list[torch.Tensor], reps: int = MEMCPY_REPS) -> dict[str, Any]:
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


def floor_tcp(nbytes: int, reps: int = TCP_REPS) -> dict[str, Any]:
    """A child Python process sends ``nbytes`` ``reps`` times (sendall of 4 MiB memoryview slices); this process
    receives with recv_into a pre-faulted buffer. Each repetition is timed from its first byte (rep 0) or the previous
    repetition's last byte to its last byte; the figure is bytes per second, p50."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(FLOOR_TIMEOUT)
        port = listener.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(port), str(nbytes), str(reps)], stderr=subprocess.PIPE, env=module_env()
        )
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(FLOOR_TIMEOUT)
                rates = _receive(conn, view, nbytes, reps)
                conn.sendall(b"k")
            _, err = child.communicate(timeout=FLOOR_TIMEOUT)
        finally:
            view.release()
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
    if child.returncode != 0:
        raise RuntimeError(f"TCP sender failed with {child.returncode}: {err.decode(errors='replace')[-2000:]}")
    return {"bytes": nbytes, "reps": reps, "bytes_per_second": rates, "p50": p50(rates)}


def _receive(conn: socket.socket, view: memoryview, nbytes: int, reps: int) -> list[float]:
    rates: list[float] = []
    t_prev = 0.0
    for rep in range(reps):
        got = missed = 0
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise RuntimeError(f"TCP sender closed after {got} of {nbytes} bytes (rep {rep})")
            if rep == 0 and got == 0:
                t_prev, missed = time.perf_counter(), n  # rep 0 is timed from its first recv, which it then misses
            got += n
        now = time.perf_counter()
        rates.append((nbytes - missed) / (now - t_prev))
        t_prev = now
    return rates


class PairedTcp:
    """Raw loopback TCP of ``nbytes``, one transfer whenever asked: a save's ratio is taken against the TCP of the same
    bytes measured right before it (as its stall is against the memcpy right before it), so a machine whose speed
    drifts over the run (other tenants, frequency) moves both alike. A child process sends (``serve_tcp``), this one
    receives into a pre-faulted buffer; each transfer is timed from its first byte to its last, like
    ``floor_tcp``'s first repetition."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf = bytearray(nbytes)
        self._view = memoryview(self._buf)
        for off in range(0, nbytes, 1 << 12):
            self._buf[off] = 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(FLOOR_TIMEOUT)
            port = listener.getsockname()[1]
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, "--paired", str(port), str(nbytes)], stderr=subprocess.PIPE, env=module_env()
            )
            try:
                self._conn, _ = listener.accept()
            except BaseException:
                self._reap()
                raise
        self._conn.settimeout(FLOOR_TIMEOUT)

    def seconds(self) -> float:
        """One transfer of ``nbytes``: seconds at the rate from its first byte to its last."""
        self._conn.sendall(b"g")
        (rate,) = _receive(self._conn, self._view, self.nbytes, 1)
        return self.nbytes / rate

    def close(self) -> None:
        try:
            self._conn.sendall(b"q")
            self._conn.close()
        except OSError:
            pass
        self._reap()
        self._view.release()

    def _reap(self) -> None:
        try:
            self._child.communicate(timeout=FLOOR_TIMEOUT)
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
    with socket.create_connection(("127.0.0.1", port), timeout=FLOOR_TIMEOUT) as s:
        s.settimeout(None)
        while s.recv(1) == b"g":
            for off in range(0, nbytes, CHUNK):
                s.sendall(mv[off : off + CHUNK])


def send_tcp(port: int, nbytes: int, reps: int) -> None:
    """The sending side of :func:`floor_tcp`; waits for the receiver's one-byte acknowledgement."""
    buf = bytearray(nbytes)
    mv = memoryview(buf)
    pattern = bytes(range(256)) * (CHUNK // 256)
    for off in range(0, nbytes, CHUNK):
        mv[off : off + CHUNK] = pattern[: min(CHUNK, nbytes - off)]
    with socket.create_connection(("127.0.0.1", port), timeout=FLOOR_TIMEOUT) as s:
        s.settimeout(None)  # blocking sends: one call per piece (with a timeout, sendall polls before every partial send)
        for _ in range(reps):
            for off in range(0, nbytes, CHUNK):
                s.sendall(mv[off : off + CHUNK])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


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


def floor_disk(state: Any, disk_dir: str | None, reps: int) -> dict[str, Any]:
    """``torch.save`` + flush + fsync to a file on local disk; then ``torch.load(weights_only=True)`` of it, ``reps``
    times with the file's page cache evicted (cold) and as many warm, each in a new process (a restarted trainer, like
    the restores it is compared with: into a fresh process's memory), timed around the call and verified."""
    import torch

    from memstore.bench.state import fingerprint
    from memstore.bench.stores import restore_in_new_process

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
            runs.append(restore_in_new_process({"path": path}, FLOOR_TIMEOUT, before=lambda: _evict_page_cache(path)))
            cold.append(runs[-1]["seconds"])
            runs.append(restore_in_new_process({"path": path}, FLOOR_TIMEOUT))
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
    if sys.argv[1] == "--paired":
        serve_tcp(int(sys.argv[2]), int(sys.argv[3]))
    else:
        send_tcp(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
