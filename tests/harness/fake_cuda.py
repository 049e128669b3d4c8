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

Usage: ``with cuda.installed(FakeCudaRuntime()) as fake: ...``.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

from trainer_client.capture.cuda import ERROR_HOST_MEMORY_ALREADY_REGISTERED, ERROR_HOST_MEMORY_NOT_REGISTERED, ERROR_INVALID_VALUE

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


class FakeCudaRuntime:
    """Implements ``trainer_client.capture.cuda.CudaRuntime`` without CUDA, enforcing the rules above.

    Records: :attr:`calls` (``("register", addr, size, flags)`` / ``("unregister", addr)``), :attr:`registrations`
    (successful registers), :attr:`failures` (``(addr, size, code)``; size 0 for an unregister), :attr:`live`
    (addr -> (size, flags)) and :attr:`last_error`. ``fail_next``: codes the next register calls return instead
    of checking (0: check as usual); they are recorded as failures like any other.
    """

    def __init__(self, pins_host_states: bool = True, fail_next: list[int] | None = None) -> None:
        self.pins_host_states = pins_host_states
        self.fail_next: list[int] = list(fail_next or [])
        self.calls: list[tuple[Any, ...]] = []
        self.registrations = 0
        self.failures: list[tuple[int, int, int]] = []
        self.live: dict[int, tuple[int, int]] = {}
        self.last_error = 0
        self._lock = threading.Lock()

    def host_register(self, addr: int, size: int, flags: int) -> int:
        with self._lock:
            self.calls.append(("register", addr, size, flags))
            code = self.fail_next.pop(0) if self.fail_next else 0
            if code == 0:
                code = self._check_register(addr, size)
            if code != 0:
                return self._fail(addr, size, code)
            self.live[addr] = (size, flags)
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
            if self.live.pop(addr, None) is None:
                return self._fail(addr, 0, ERROR_HOST_MEMORY_NOT_REGISTERED)
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
