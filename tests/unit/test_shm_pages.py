"""Which pages a segment directory's files get, from /proc/self/mounts and the shmem_enabled switch."""

from __future__ import annotations

import pytest

from memstore.server.memory.shm_pages import shm_pages

pytestmark = pytest.mark.unit

MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
/dev/vda1 / ext4 rw,relatime 0 0
shm /dev/shm tmpfs rw,nosuid,nodev 0 0
tmpfs /mnt/huge tmpfs rw,relatime,size=16777216k,huge=within_size 0 0
tmpfs /mnt/huge/inner tmpfs rw,relatime,huge=advise 0 0
tmpfs /mnt/with\\040space tmpfs rw,huge=always 0 0
"""
SWITCH = "always within_size advise [never] deny force"


def test_the_deepest_tmpfs_holding_the_directory_decides() -> None:
    plain = shm_pages("/dev/shm/memstore/h0-7070", MOUNTS, SWITCH)
    assert (plain.mount, plain.policy, plain.huge) == ("/dev/shm", "never", False)  # no huge= option: never
    assert "4 KiB pages" in plain.describe() and "huge=within_size" in plain.describe()  # says how to fix it
    huge = shm_pages("/mnt/huge/memstore", MOUNTS, SWITCH)
    assert (huge.mount, huge.policy, huge.huge) == ("/mnt/huge", "within_size", True)
    assert huge.describe().endswith("segments use huge pages")
    inner = shm_pages("/mnt/huge/inner/x", MOUNTS, SWITCH)
    assert (inner.mount, inner.policy, inner.huge) == ("/mnt/huge/inner", "advise", False)
    assert shm_pages("/mnt/with space/x", MOUNTS, SWITCH).huge  # octal escapes in mount points decoded
    assert not shm_pages("/mnt/hugepages", MOUNTS, SWITCH).huge  # a sibling with a common prefix is not inside


def test_the_shmem_switch_overrides_every_mount_with_deny_or_force() -> None:
    assert shm_pages("/mnt/huge/x", MOUNTS, "always within_size advise never [deny] force").policy == "never"
    assert shm_pages("/dev/shm/x", MOUNTS, "always within_size advise never deny [force]").huge
    assert shm_pages("/dev/shm/x", MOUNTS, "").policy == "never"  # no switch (no THP in the kernel): the mount's


def test_a_directory_off_tmpfs_says_so() -> None:
    found = shm_pages("/var/lib/memstore", MOUNTS, SWITCH)
    assert (found.fstype, found.huge) == ("ext4", False) and found.describe() == "/ is ext4, not a tmpfs"
    assert shm_pages("/x", "", SWITCH).describe() == "? is not a mounted filesystem, not a tmpfs"


def test_this_machine_answers_without_error() -> None:
    assert shm_pages("/dev/shm").describe()
