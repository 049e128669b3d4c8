"""How the bench runs its helper processes (:mod:`memstore.bench.workers`): JSON lines with bounded reads."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from memstore.bench.jsonable import to_json
from memstore.bench.scenario_results import RestoreReport, RestoreRun
from memstore.bench.units import child_env
from memstore.bench.workers import MODULE, RestoreCommand


class Child:
    """A helper process (``python -m memstore.bench.workers ROLE``) speaking JSON lines on stdin/stdout."""

    def __init__(self, role: str, what: str) -> None:
        self.what = what
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close(), lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=child_env(),
        )
        self._buf = b""

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.what}: no answer within {timeout:.0f}s; stderr: {self.stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}: {self.stderr_tail()}")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-n:]
        return ""

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._err.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self.proc.poll() is None:
            self.proc.kill()
        self.close()


def restore_in_new_process(
    address: str,
    job: str,
    zero_copy: bool,
    timeout: float,
    before: Callable[[], object] | None = None,
    during: Callable[[], object] | None = None,
) -> RestoreRun:
    """Start a restore process and wait until it has imported torch; then run ``before`` (e.g. kill a store), tell it
    to restore, run ``during`` (e.g. start the replacement store) and collect its report."""
    with Child("restore", "restore process") as child:
        ready = child.read(timeout=120.0)
        if before is not None:
            before()
        child.send(to_json(RestoreCommand(address=address, job=job, zero_copy=zero_copy, wait_seconds=timeout)))
        t0 = time.perf_counter()
        if during is not None:
            during()
        data = child.read(timeout=timeout)
        wall = time.perf_counter() - t0
    return RestoreRun(
        report=RestoreReport.from_json(data),
        fingerprint=str(data.get("fingerprint") or ""),
        bench_wall_seconds=wall,
        import_seconds=float(ready["import_seconds"]),
        pid=int(ready["pid"]),
    )
