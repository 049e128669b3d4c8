"""A TCP fault proxy between two endpoints on loopback: pass, cut, stall, slow or corrupt a link.

    proxy = FaultProxy(("127.0.0.1", 7071)).start()      # listen on 127.0.0.1:<port>, forward to 7071
    proxy.set("cut")                                      # partition: close and refuse connections
    proxy.set("stall")                                    # connections stay open, bytes stop flowing
    proxy.set("slow", rate=1 << 20)                       # 1 MiB/s each direction
    proxy.set("corrupt", every=100_000)                   # flip one bit every 100 kB, client -> server
    proxy.set("pass")
    proxy.close()

Loops are bounded by the sockets' lives and a stop flag; every thread is a daemon and joined on close.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FaultProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "pass"
        self.rate = 0
        self.every = 0
        self.corrupted = 0  # bits flipped so far
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> FaultProxy:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def set(self, mode: str, rate: int = 0, every: int = 0) -> None:
        if mode not in ("pass", "cut", "stall", "slow", "corrupt"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        self.mode, self.rate, self.every = mode, rate, every
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

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for src, dst, upstream in ((client, server, True), (server, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, upstream), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        seen = 0
        try:
            src.settimeout(0.2)
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                while self.mode == "stall" and not self._stop.is_set():
                    time.sleep(0.05)  # poll until the test changes the mode
                if self.mode == "cut":
                    break
                if self.mode == "corrupt" and upstream and self.every:
                    buf = bytearray(data)
                    for pos in range(-seen % self.every, len(buf), self.every):
                        buf[pos] ^= 0x10
                        self.corrupted += 1
                    data = bytes(buf)
                seen += len(data)
                dst.sendall(data)
                if self.mode == "slow" and self.rate:
                    time.sleep(len(data) / self.rate)  # rate limit (a backoff per piece)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
