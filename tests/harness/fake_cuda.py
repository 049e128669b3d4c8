"""A stand-in for the CUDA runtime (``trainer_client.capture.cuda.CudaRuntime``) that enforces what ``cudaHostRegister``
does on real hardware (measured on an H200), checked against this process's real mappings:

- a size of 0 is refused (1, ``cudaErrorInvalidValue``);
- every byte of ``[addr, addr + size)`` must be mapped (1), and where a part lies in a file mapping, that part
  must not reach past the last page of the file as it is now (1: those pages cannot be faulted in);
  the range may span several adjacent mappings, each part is checked;
- a range overlapping a live registration is refused (712, ``cudaErrorHostMemoryAlreadyRegistered``);
- ``host_unregister`` of an address that does not start a live registration is refused
  (713, ``cudaErrorHostMemoryNotRegistered``);
- every failure stays recorded in :attr:`FakeCudaRuntime.last_error` until :meth:`FakeCudaRuntime.get_last_error`.
  Real CUDA keeps the last error per thread; the fake keeps one for the process, which is stricter for a
  test asserting that it was cleared.

It also stands in for the device copy engine, with the lifetimes a GPU has (a **delayed copy engine**):

- CPU tensors marked with :meth:`FakeCudaRuntime.device` count as device tensors (:meth:`~FakeCudaRuntime.device_tensor`):
  the client copies them through the device-copy path (side streams, events, ``copy_to_host``) as it would CUDA ones;
- an asynchronous copy (``non_blocking``) records its destination range and a snapshot of its source's bytes, and
  must land inside a live registration; its bytes are written into the destination only when its stream, or an event
  recorded after it, is synchronized. Then the range must still be mapped (``/proc/self/maps``) and still inside the
  very registration it was queued into: else the synchronize raises ``RuntimeError``;
- a synchronous copy (into memory not registered) is written at once, into a mapped range only;
- ``host_unregister`` of a registration with copies pending into it fails (1, ``cudaErrorInvalidValue``; the
  registration stays);
- every breach of these rules is also recorded in :attr:`FakeCudaRuntime.copy_errors`, for a test to assert on even
  where the client swallowed the error. Streams order nothing else: the host's tensor work runs at once.

Usage: ``with cuda.installed(FakeCudaRuntime()) as fake: ...``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import stat
import threading
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_client.capture.cuda import (
    ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    ERROR_HOST_MEMORY_NOT_REGISTERED,
    ERROR_INVALID_VALUE,
    inside,
)

_PAGE = mmap.PAGESIZE
_DELETED = " (deleted)"

_ERROR_TEXTS = {
    0: "no error",
    ERROR_INVALID_VALUE: "invalid argument",
    ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
}


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps``."""

    start: int
    end: int
    offset: int  # file offset of ``start``
    inode: int  # 0: anonymous (or a pseudo mapping such as [heap])
    path: str  # may end with " (deleted)"

    @property
    def file_backed(self) -> bool:
        return self.inode != 0 and self.path.startswith("/")


def read_mappings() -> list[Mapping]:
    """This process's mappings, by address."""
    mappings = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.rstrip("\n").split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) > 5 else ""
            mappings.append(Mapping(start, end, int(parts[2], 16), int(parts[4]), path))
    mappings.sort(key=lambda m: m.start)
    return mappings


def file_size(m: Mapping) -> int | None:
    """The current size of the regular file behind a file mapping; None where it cannot be known (or is no regular file)."""
    candidates = [f"/proc/self/map_files/{m.start:x}-{m.end:x}"]  # the mapped file itself, even deleted or renamed over
    if not m.path.endswith(_DELETED):
        candidates.append(m.path)
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        return st.st_size if stat.S_ISREG(st.st_mode) else None
    return None


def range_mapped(addr: int, size: int, mappings: list[Mapping] | None = None) -> bool:
    """Whether every byte of ``[addr, addr + size)`` is mapped, and no part of it in a file mapping lies past the
    last page of its file."""
    end = addr + size
    pos = addr
    for m in mappings if mappings is not None else read_mappings():
        if m.end <= pos:
            continue
        if m.start > pos:
            return False  # a hole
        piece_end = min(end, m.end)
        if m.file_backed:
            fsize = file_size(m)
            if fsize is not None and m.offset + (piece_end - m.start) > -(-fsize // _PAGE) * _PAGE:
                return False
        pos = piece_end
        if pos >= end:
            return True
    return False


@dataclass(eq=False)
class FakeStream:
    """A stream of the fake: the asynchronous copies queued on it and not yet written."""

    device: torch.device
    pending: list[PendingCopy] = field(default_factory=list)
    queued: int = 0  # copies ever queued on it
    done: int = 0  # of which written (in order)


@dataclass(frozen=True)
class FakeEvent:
    """Recorded on ``stream`` after its first ``upto`` copies: synchronizing it writes those."""

    stream: FakeStream
    upto: int


@dataclass(frozen=True)
class PendingCopy:
    """An asynchronous copy queued and not written yet: ``data`` goes to ``[addr, addr + len(data))``, which lay inside
    the registration ``registration`` (its serial number) when it was queued."""

    addr: int
    data: bytes
    registration: int


class FakeCudaRuntime:
    """Implements ``trainer_client.capture.cuda.CudaRuntime`` without CUDA, enforcing the rules above.

    Records: :attr:`calls` (``("register", addr, size, flags)`` / ``("unregister", addr)``), :attr:`registrations`
    (successful registers), :attr:`failures` (``(addr, size, code)``; size 0 for an unregister), :attr:`live`
    (addr -> (size, flags)) and :attr:`last_error`. ``fail_next``: codes the next register calls return instead
    of checking (0: check as usual); they are recorded as failures like any other.

    The copy engine's: :attr:`async_copies` and :attr:`sync_copies` (queued / written at once), :attr:`written`
    (asynchronous copies written at a synchronize), :attr:`copy_errors` (each breach, described) and
    :attr:`pending_copies`.
    """

    host_device_tensors = True

    def __init__(self, pins_host_states: bool = True, fail_next: list[int] | None = None) -> None:
        self.pins_host_states = pins_host_states
        self.fail_next: list[int] = list(fail_next or [])
        self.calls: list[tuple[Any, ...]] = []
        self.registrations = 0
        self.failures: list[tuple[int, int, int]] = []
        self.live: dict[int, tuple[int, int]] = {}
        self.last_error = 0
        self.async_copies = 0
        self.sync_copies = 0
        self.written = 0
        self.copy_errors: list[str] = []
        self._serials: dict[int, int] = {}  # addr of a live registration -> its serial number
        self._next_serial = itertools.count(1)
        self._devices: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensors marked as device tensors
        self._current: dict[torch.device, FakeStream] = {}
        self._streams: list[FakeStream] = []
        self._lock = threading.RLock()

    def host_register(self, addr: int, size: int, flags: int) -> int:
        with self._lock:
            self.calls.append(("register", addr, size, flags))
            code = self.fail_next.pop(0) if self.fail_next else 0
            if code == 0:
                code = self._check_register(addr, size)
            if code != 0:
                return self._fail(addr, size, code)
            self.live[addr] = (size, flags)
            self._serials[addr] = next(self._next_serial)
            self.registrations += 1
            return 0

    def _check_register(self, addr: int, size: int) -> int:
        if size <= 0 or not range_mapped(addr, size):
            return ERROR_INVALID_VALUE
        if any(addr < start + live_size and start < addr + size for start, (live_size, _) in self.live.items()):
            return ERROR_HOST_MEMORY_ALREADY_REGISTERED
        return 0

    def host_unregister(self, addr: int) -> int:
        with self._lock:
            self.calls.append(("unregister", addr))
            if addr not in self.live:
                return self._fail(addr, 0, ERROR_HOST_MEMORY_NOT_REGISTERED)
            serial = self._serials[addr]
            pending = sum(copy.registration == serial for stream in self._streams for copy in stream.pending)
            if pending:
                self.copy_errors.append(f"cudaHostUnregister({addr:#x}) with {pending} copies still pending into it")
                return self._fail(addr, 0, ERROR_INVALID_VALUE)
            del self.live[addr], self._serials[addr]
            return 0

    def _fail(self, addr: int, size: int, code: int) -> int:
        self.failures.append((addr, size, code))
        self.last_error = code
        return code

    def get_last_error(self) -> int:
        with self._lock:
            code, self.last_error = self.last_error, 0
            return code

    def error_text(self, code: int) -> str:
        text = _ERROR_TEXTS.get(code)
        return f"{text} (CUDA error {code})" if text else f"CUDA error {code}"

    # -- the delayed copy engine --------------------------------------------------------------------------------
    def device(self, t: torch.Tensor) -> torch.Tensor:
        """Mark the CPU tensor ``t`` as a device tensor (for as long as it lives); returns it."""
        self._devices[id(t)] = weakref.ref(t)
        return t

    def device_tensor(self, t: torch.Tensor) -> bool:
        ref = self._devices.get(id(t))
        return ref is not None and ref() is t

    def host_registered(self, addr: int, size: int) -> bool:
        with self._lock:
            return self._registration(addr, size) is not None

    def _registration(self, addr: int, size: int) -> int | None:
        """The serial number of the live registration holding ``[addr, addr + size)``; None: none does."""
        for start, (length, _) in self.live.items():
            if inside({start: length}, addr, size):
                return self._serials[start]
        return None

    def current_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            stream = self._current.get(device)
            if stream is None:
                stream = self._current[device] = self.new_stream(device)
            return stream

    def new_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            stream = FakeStream(device)
            self._streams.append(stream)
            return stream

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record_event(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            return FakeEvent(stream, stream.queued)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Nothing to order: the host's tensor work runs at once."""

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        """Nothing to keep: a copy's source bytes are snapshotted when it is queued."""

    def copy_to_host(self, stream: FakeStream, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        addr, size = dst.data_ptr(), dst.numel() * dst.element_size()
        if not dst.is_cpu or not dst.is_contiguous() or src.numel() * src.element_size() != size:
            raise RuntimeError(f"fake CUDA: copy_to_host of {src.numel() * src.element_size()} bytes into a {size}-byte destination")
        data = src.contiguous().view(torch.uint8).numpy().tobytes()
        with self._lock:
            if not non_blocking:
                self.synchronize(stream)  # a synchronous copy runs after what the stream holds
                self._write(addr, data, None)
                self.sync_copies += 1
                return
            registration = self._registration(addr, size)
            if registration is None:
                self._breach(f"an asynchronous copy of {size} bytes into {addr:#x}, which no live registration holds")
            stream.pending.append(PendingCopy(addr, data, registration))
            stream.queued += 1
            self.async_copies += 1

    def synchronize(self, waitable: FakeStream | FakeEvent) -> None:
        """Write the copies queued on a stream (all of them), or before an event; raises RuntimeError for a copy whose
        destination is no longer mapped or no longer in the registration it was queued into."""
        with self._lock:
            stream, upto = (waitable.stream, waitable.upto) if isinstance(waitable, FakeEvent) else (waitable, waitable.queued)
            count = upto - stream.done
            if count <= 0:
                return
            batch, stream.pending = stream.pending[:count], stream.pending[count:]
            stream.done += len(batch)
            mappings = read_mappings()
            for copy in batch:
                self._write(copy.addr, copy.data, copy.registration, mappings)
                self.written += 1

    def _write(self, addr: int, data: bytes, registration: int | None, mappings: list[Mapping] | None = None) -> None:
        size = len(data)
        if registration is not None and self._registration(addr, size) != registration:
            self._breach(f"a copy of {size} bytes into {addr:#x}: its registration was undone before the copy ran")
        if not range_mapped(addr, size, mappings):
            self._breach(f"a copy of {size} bytes into {addr:#x}: the range is no longer mapped")
        ctypes.memmove(addr, data, size)

    def _breach(self, what: str) -> None:
        self.copy_errors.append(what)
        raise RuntimeError(f"fake CUDA: {what}")

    @property
    def pending_copies(self) -> int:
        with self._lock:
            return sum(len(stream.pending) for stream in self._streams)
