"""A TCP fault proxy between two endpoints on loopback: pass, cut, stall, slow or corrupt a link.

    proxy = FaultProxy(("127.0.0.1", 7071)).start()      # listen on 127.0.0.1:<port>, forward to 7071
    proxy.set("cut")                                      # partition, refused: close and refuse connections
    proxy.set("stall")                                    # partition, silent: connections stay open, bytes stop flowing
    proxy.set("slow", rate=1 << 20)                       # 1 MiB/s each direction
    proxy.set("corrupt", every=100_000)                   # flip one bit every 100 kB, client -> server
    proxy.set("corrupt", every=100_000, direction="both") # ... and server -> client
    proxy.set("pass")
    proxy.close()

``listen=(ip, port)`` picks where it listens: another loopback address (127.x.y.z) lets it stand in for a server
whose port number is handed out by the server itself (e.g. a store's data channel port, sent in a ticket): listen on
``(alias, that port)`` and dial the alias. Used by the fault tests and the recovery matrix's network faults.

Loops are bounded by the sockets' lives and a stop flag; every thread is a daemon and joined on close.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

MODES = ("pass", "cut", "stall", "slow", "corrupt")
DIRECTIONS = ("up", "down", "both")  # which bytes "corrupt" flips: client -> server, server -> client, or both


def flip_bits(data: bytes, seen: int, every: int) -> tuple[bytes, int]:
    """``data``, the bytes of a link after its first ``seen``, with one bit flipped in the ``every``-th byte, the
    2 * ``every``-th, ... of the link; and how many bits that flipped."""
    buf = bytearray(data)
    positions = range((every - 1 - seen) % every, len(buf), every)
    for pos in positions:
        buf[pos] ^= 0x10
    return bytes(buf), len(positions)


class FaultProxy:
    def __init__(self, target: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.target = target
        self.mode = "pass"
        self.rate = 0
        self.every = 0
        self.direction = "up"
        self.corrupted = 0  # bits flipped so far
        self._flipped_bytes = {True: 0, False: 0}  # bytes "corrupt" has passed so far, upstream and down, all connections
        self.connections = 0  # connections accepted so far
        self._listener = socket.create_server(listen)
        self.address = f"{listen[0]}:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> FaultProxy:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def set(self, mode: str, rate: int = 0, every: int = 0, direction: str = "up") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}")
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown proxy direction {direction!r}: expected one of {DIRECTIONS}")
        if (mode == "slow" and rate <= 0) or (mode == "corrupt" and every <= 0):
            raise ValueError(f"proxy mode {mode!r} needs a positive {'rate' if mode == 'slow' else 'every'}")
        self.rate, self.every, self.direction = rate, every, direction
        self.mode = mode  # last: a pump that sees the mode sees its parameters
        if mode == "cut":
            self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._drop_all()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                if not _readable(self._listener):
                    continue  # look at the stop flag again: closing a listener does not wake an accept()
                client, _ = self._listener.accept()
            except (OSError, ValueError):  # closed
                return
            if self.mode == "cut":
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            self.connections += 1
            with self._lock:
                self._conns += [client, server]
            for src, dst, upstream in ((client, server, True), (server, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True)
                t.start()
                self._threads.append(t)
            self._threads = [t for t in self._threads if t.is_alive()]

    def _flips(self, upstream: bool) -> bool:
        return self.mode == "corrupt" and self.direction in (("up", "both") if upstream else ("down", "both"))

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        """Copy ``src`` to ``dst`` until either closes. Blocking sockets: a send waits for a slow reader as long as
        it takes (close() shuts the sockets down, which wakes it); a receive waits in 0.2 s slices to see the stop flag."""
        try:
            while not self._stop.is_set():
                if not _readable(src):
                    continue
                # slow: pieces of a tenth of a second's worth, so the rate holds within a transfer
                data = src.recv(max(1024, min(65536, self.rate // 10)) if self.mode == "slow" else 65536)
                if not data:
                    break
                while self.mode == "stall" and not self._stop.is_set():
                    time.sleep(0.05)  # poll until the test changes the mode
                if self.mode == "cut":
                    break
                if self._flips(upstream):
                    with self._lock:  # one count per direction across connections: every-th byte of the link
                        seen = self._flipped_bytes[upstream]
                        self._flipped_bytes[upstream] += len(data)
                    data, flipped = flip_bits(data, seen, self.every)
                    self.corrupted += flipped
                dst.sendall(data)
                if self.mode == "slow":
                    time.sleep(len(data) / self.rate)  # rate limit (a backoff per piece)
        except (OSError, ValueError):  # reset, or closed under it
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def _readable(sock: socket.socket, timeout: float = 0.2) -> bool:
    """Whether ``sock`` has something to read within ``timeout``. poll(), not select(): select() refuses descriptors
    from 1024 up, and a test process that opened many (a 32-rank gloo group) would silently lose its proxies."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
