"""Which pages a segment directory's files get: huge (2 MiB) or 4 KiB, from the tmpfs it is on.

Every process that maps a segment builds page tables for it: about 0.1 s per GiB on 4 KiB pages on the
development VM, paid by a trainer's first save into each segment of its ring and by the first touch of restored
tensors, beside the transfers on the same cores. Huge pages make that ~1 ms. A tmpfs gives a file huge pages by
its ``huge=`` mount option (``never`` by default, which is what ``/dev/shm`` usually has); the
``shmem_enabled`` switch overrides every mount with ``deny`` or ``force``. The store logs what it found at start-up
(``memstore serve``) and the bench records it with its figures.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTS = "/proc/self/mounts"
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE = ("always", "within_size")  # huge= policies under which every process maps a segment with huge pages


@dataclass(frozen=True)
class ShmPages:
    """The tmpfs policy that decides the page size of segments under one directory."""

    mount: str  # the mount point holding the directory ("" when none was found)
    fstype: str
    policy: str  # the effective huge= policy: never, always, within_size, advise (or "" when not a tmpfs)

    @property
    def huge(self) -> bool:
        return self.policy in HUGE

    def describe(self) -> str:
        if self.fstype != "tmpfs":
            return f"{self.mount or '?'} is {self.fstype or 'not a mounted filesystem'}, not a tmpfs"
        if self.huge:
            return f"tmpfs {self.mount} (huge={self.policy}): segments use huge pages"
        return (
            f"tmpfs {self.mount} (huge={self.policy}): segments use 4 KiB pages; every process maps them at about 0.1 s "
            "per GiB (a trainer's first save into each segment, the first touch of restored tensors). A tmpfs mounted "
            "with huge=within_size removes that: see 'Huge pages' in docs/operations.md"
        )


def _unescape(field: str) -> str:
    """A /proc/mounts field with its octal escapes (\\040 for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _read(path: str) -> str:
    """The text of a /proc or /sys file; "" where it cannot be read (another OS, no THP in the kernel)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def shm_pages(directory: str, mounts: str | None = None, shmem_enabled: str | None = None) -> ShmPages:
    """The page policy for files under ``directory`` (which may not exist yet: its nearest existing parent counts).
    ``mounts`` (the text of /proc/self/mounts) and ``shmem_enabled`` (the sysfs switch, e.g. ``always [never] deny``)
    are read from the system when None."""
    mounts = _read(MOUNTS) if mounts is None else mounts
    shmem_enabled = _read(SHMEM_ENABLED) if shmem_enabled is None else shmem_enabled
    path = os.path.realpath(directory)
    best: tuple[str, str, str] = ("", "", "")
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        point, fstype, options = _unescape(parts[1]), parts[2], parts[3]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):  # the deepest mount holding the path (a later one shadows an earlier)
            best = (point, fstype, options)
    point, fstype, options = best
    if fstype != "tmpfs":
        return ShmPages(point, fstype, "")
    policy = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")), "never")
    chosen = next((w[1:-1] for w in shmem_enabled.split() if w.startswith("[") and w.endswith("]")), "")
    if chosen == "deny":
        policy = "never"
    elif chosen == "force":
        policy = "always"
    return ShmPages(point, fstype, policy)
