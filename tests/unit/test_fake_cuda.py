"""tests.harness.fake_cuda against real mappings of this process: the cudaHostRegister rules it enforces, the sticky
last error, and trainer_client.capture.cuda's seam (install / installed, register / unregister clearing the error)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from memstore.v1.pagefaults import address_of
from tests.harness.fake_cuda import FakeCudaRuntime
from trainer_client.capture import cuda

pytestmark = pytest.mark.unit

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(addr: int, length: int, flags: int, fd: int = -1) -> int:
    out = _libc.mmap(addr or None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if out in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(out)


@pytest.fixture
def anon() -> Iterator[tuple[int, int]]:
    """Three anonymous pages, as raw memory: (address, length)."""
    addr = _mmap(0, 3 * PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    yield addr, 3 * PAGE
    _libc.munmap(addr, 3 * PAGE)


def _file(tmp_path: Path, pages: int, name: str = "seg") -> int:
    fd = os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, pages * PAGE)
    return fd


def test_size_zero_is_invalid(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, _ = anon
    assert fake_cuda.host_register(addr, 0, 0) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.failures == [(addr, 0, cuda.ERROR_INVALID_VALUE)]
    assert fake_cuda.live == {}


def test_anonymous_mapping_registers(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, length = anon
    assert fake_cuda.host_register(addr, length, cuda.HOST_REGISTER_PORTABLE) == 0
    assert fake_cuda.live == {addr: (length, cuda.HOST_REGISTER_PORTABLE)}
    assert fake_cuda.registrations == 1
    assert fake_cuda.calls == [("register", addr, length, cuda.HOST_REGISTER_PORTABLE)]
    assert fake_cuda.last_error == 0


def test_unmapped_address_is_invalid(fake_cuda: FakeCudaRuntime) -> None:
    assert fake_cuda.host_register(PAGE, PAGE, 0) == cuda.ERROR_INVALID_VALUE  # below mmap_min_addr: never mapped


def test_range_running_into_a_hole_is_invalid(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, length = anon
    _libc.munmap(addr + PAGE, PAGE)  # [mapped][hole][mapped]
    assert fake_cuda.host_register(addr, length, 0) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.host_register(addr, PAGE + 1, 0) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.host_register(addr, PAGE, 0) == 0
    assert fake_cuda.host_register(addr + 2 * PAGE, PAGE, 0) == 0


def test_range_past_the_end_of_its_file_is_invalid(fake_cuda: FakeCudaRuntime, tmp_path: Path) -> None:
    fd = _file(tmp_path, 3)
    with mmap.mmap(fd, 3 * PAGE) as m:
        addr = address_of(m)
        os.ftruncate(fd, 2 * PAGE)  # the mapping now reaches a page past the file
        assert fake_cuda.host_register(addr, 3 * PAGE, 0) == cuda.ERROR_INVALID_VALUE
        assert fake_cuda.host_register(addr + 2 * PAGE, 1, 0) == cuda.ERROR_INVALID_VALUE
        assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
        assert fake_cuda.host_unregister(addr) == 0
        os.ftruncate(fd, 2 * PAGE + 1)  # the last page is partly in the file: it can be faulted in
        assert fake_cuda.host_register(addr, 3 * PAGE, 0) == 0
        assert fake_cuda.host_unregister(addr) == 0
    os.close(fd)


def test_file_mapping_at_an_offset(fake_cuda: FakeCudaRuntime, tmp_path: Path) -> None:
    fd = _file(tmp_path, 4)
    with mmap.mmap(fd, 2 * PAGE, offset=2 * PAGE) as m:
        addr = address_of(m)
        assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
        assert fake_cuda.host_unregister(addr) == 0
        os.ftruncate(fd, 3 * PAGE)  # the mapping's second page (file page 3) is gone
        assert fake_cuda.host_register(addr, 2 * PAGE, 0) == cuda.ERROR_INVALID_VALUE
        assert fake_cuda.host_register(addr, PAGE, 0) == 0
    os.close(fd)


def test_range_across_adjacent_mappings_checks_each(fake_cuda: FakeCudaRuntime, tmp_path: Path, anon: tuple[int, int]) -> None:
    addr, length = anon
    fd = _file(tmp_path, 2)
    # [anonymous page][two file pages], one range over both
    assert _mmap(addr + PAGE, 2 * PAGE, mmap.MAP_SHARED | _MAP_FIXED, fd) == addr + PAGE
    assert fake_cuda.host_register(addr, length, 0) == 0
    assert fake_cuda.host_unregister(addr) == 0
    os.ftruncate(fd, PAGE)  # the last page of the range is past the file
    assert fake_cuda.host_register(addr, length, 0) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
    os.close(fd)


def test_deleted_file_is_still_checked(fake_cuda: FakeCudaRuntime, tmp_path: Path) -> None:
    fd = _file(tmp_path, 2)
    with mmap.mmap(fd, 2 * PAGE) as m:
        addr = address_of(m)
        os.unlink(tmp_path / "seg")  # /proc/self/maps now shows "... (deleted)"
        assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
        assert fake_cuda.host_unregister(addr) == 0
        os.ftruncate(fd, PAGE)
        try:
            os.stat(f"/proc/self/map_files/{addr:x}-{addr + 2 * PAGE:x}")
        except OSError:
            expected = 0  # the file's size cannot be known here: accepted
        else:
            expected = cuda.ERROR_INVALID_VALUE
        assert fake_cuda.host_register(addr, 2 * PAGE, 0) == expected
    os.close(fd)


def test_overlapping_a_live_registration(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, _ = anon
    assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
    assert fake_cuda.host_register(addr, 2 * PAGE, 0) == cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert fake_cuda.host_register(addr + PAGE, 2 * PAGE, 0) == cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert fake_cuda.host_register(addr + PAGE, 1, 0) == cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert fake_cuda.host_register(addr + 2 * PAGE, PAGE, 0) == 0  # adjacent, not overlapping
    assert fake_cuda.registrations == 2
    assert [code for _, _, code in fake_cuda.failures] == [cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED] * 3


def test_unregister_needs_the_start_of_a_live_registration(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, _ = anon
    assert fake_cuda.host_unregister(addr) == cuda.ERROR_HOST_MEMORY_NOT_REGISTERED
    assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0
    assert fake_cuda.host_unregister(addr + PAGE) == cuda.ERROR_HOST_MEMORY_NOT_REGISTERED
    assert fake_cuda.host_unregister(addr) == 0
    assert fake_cuda.live == {}
    assert fake_cuda.host_unregister(addr) == cuda.ERROR_HOST_MEMORY_NOT_REGISTERED
    assert fake_cuda.calls[-1] == ("unregister", addr)
    assert fake_cuda.host_register(addr, 2 * PAGE, 0) == 0  # registrable again


def test_last_error_is_sticky_until_read(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, _ = anon
    assert fake_cuda.host_register(addr, 0, 0) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.host_register(addr, PAGE, 0) == 0  # a success leaves it
    assert fake_cuda.host_unregister(addr) == 0
    assert fake_cuda.last_error == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.get_last_error() == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.last_error == 0
    assert fake_cuda.get_last_error() == 0


def test_seam_register_and_unregister_clear_the_error(
    fake_cuda: FakeCudaRuntime, anon: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    addr, _ = anon
    assert cuda.register(addr, PAGE, 0) == 0
    assert cuda.register(addr, PAGE, 0) == cuda.ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert fake_cuda.last_error == 0
    assert cuda.unregister(addr) == 0
    with caplog.at_level(logging.WARNING, logger="trainer_client.capture.cuda"):
        assert cuda.unregister(addr) == cuda.ERROR_HOST_MEMORY_NOT_REGISTERED
    assert fake_cuda.last_error == 0
    assert "pointer does not correspond to a registered memory region (CUDA error 713)" in caplog.text


def test_fail_next(fake_cuda: FakeCudaRuntime, anon: tuple[int, int]) -> None:
    addr, _ = anon
    fake_cuda.fail_next = [cuda.ERROR_INVALID_VALUE, 0]
    assert fake_cuda.host_register(addr, PAGE, cuda.HOST_REGISTER_READ_ONLY) == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.last_error == cuda.ERROR_INVALID_VALUE
    assert fake_cuda.host_register(addr, 0, 0) == cuda.ERROR_INVALID_VALUE  # 0: checked as usual
    assert fake_cuda.host_register(addr, PAGE, 0) == 0
    assert fake_cuda.fail_next == []
    assert fake_cuda.registrations == 1
    assert len(fake_cuda.calls) == 3


def test_error_text() -> None:
    fake_cuda = FakeCudaRuntime()
    assert fake_cuda.error_text(1) == "invalid argument (CUDA error 1)"
    assert fake_cuda.error_text(712) == "part or all of the requested memory range is already mapped (CUDA error 712)"
    assert fake_cuda.error_text(713) == "pointer does not correspond to a registered memory region (CUDA error 713)"
    assert fake_cuda.error_text(999) == "CUDA error 999"
    with cuda.installed(fake_cuda):
        assert cuda.error_text(1) == "invalid argument (CUDA error 1)"


def test_installed_restores_the_previous_runtime() -> None:
    before = cuda.runtime()
    outer, inner = FakeCudaRuntime(), FakeCudaRuntime(pins_host_states=False)
    with cuda.installed(outer):
        assert cuda.runtime() is outer
        with cuda.installed(inner):
            assert cuda.runtime() is inner
        assert cuda.runtime() is outer
    assert cuda.runtime() is before
    with pytest.raises(RuntimeError), cuda.installed(outer):
        raise RuntimeError
    assert cuda.runtime() is before


def test_install_returns_the_previous() -> None:
    fake_cuda = FakeCudaRuntime()
    previous = cuda.install(fake_cuda)
    try:
        assert cuda.runtime() is fake_cuda
    finally:
        assert cuda.install(previous) is fake_cuda
    assert cuda.runtime() is not fake_cuda


def test_torch_runtime_without_cuda() -> None:
    rt = cuda.TorchCudaRuntime()  # touches nothing
    assert rt.pins_host_states is False
    assert isinstance(cuda.runtime(), (cuda.TorchCudaRuntime, FakeCudaRuntime))


# -- the delayed copy engine ------------------------------------------------------------------------------------------


def _dst(m: mmap.mmap, n: int) -> tuple[memoryview, torch.Tensor]:
    view = memoryview(m)
    return view, torch.frombuffer(view, dtype=torch.uint8, count=n)


def test_an_async_copy_lands_only_at_its_events_synchronize(fake_cuda: FakeCudaRuntime) -> None:
    with mmap.mmap(-1, PAGE) as m:
        view, dst = _dst(m, 16)
        assert fake_cuda.host_register(address_of(m), PAGE, 0) == 0
        stream = fake_cuda.new_stream(torch.device("cpu"))
        fake_cuda.copy_to_host(stream, torch.arange(16, dtype=torch.uint8), dst, non_blocking=True)
        event = fake_cuda.record_event(stream)
        fake_cuda.copy_to_host(stream, torch.full((16,), 9, dtype=torch.uint8), dst, non_blocking=True)  # after the event
        assert bytes(m[:16]) == bytes(16) and fake_cuda.pending_copies == 2
        fake_cuda.synchronize(event)
        assert bytes(m[:16]) == bytes(range(16)) and fake_cuda.pending_copies == 1
        assert fake_cuda.host_unregister(address_of(m)) == cuda.ERROR_INVALID_VALUE  # a copy is still pending into it
        fake_cuda.synchronize(stream)
        assert bytes(m[:16]) == bytes([9] * 16) and fake_cuda.written == 2
        assert fake_cuda.host_unregister(address_of(m)) == 0
        del dst
        view.release()
    assert len(fake_cuda.copy_errors) == 1 and "pending" in fake_cuda.copy_errors[0]


def test_a_copy_whose_destination_was_unregistered_or_unmapped_raises(fake_cuda: FakeCudaRuntime) -> None:
    m = mmap.mmap(-1, PAGE)
    addr = address_of(m)
    assert fake_cuda.host_register(addr, PAGE, 0) == 0
    stream = fake_cuda.new_stream(torch.device("cpu"))
    view, dst = _dst(m, 8)
    fake_cuda.copy_to_host(stream, torch.ones(8, dtype=torch.uint8), dst, non_blocking=True)
    fake_cuda.live.clear()  # the registration undone behind the engine's back
    with pytest.raises(RuntimeError, match="registration was undone"):
        fake_cuda.synchronize(stream)
    assert fake_cuda.host_register(addr, PAGE, 0) == 0
    fake_cuda.copy_to_host(stream, torch.ones(8, dtype=torch.uint8), dst, non_blocking=True)
    del dst
    view.release()
    m.close()  # unmapped under the queued copy
    with pytest.raises(RuntimeError, match="no longer mapped"):
        fake_cuda.synchronize(stream)
    assert len(fake_cuda.copy_errors) == 2


def test_an_async_copy_into_unregistered_memory_is_refused_and_a_sync_one_lands_at_once(fake_cuda: FakeCudaRuntime) -> None:
    with mmap.mmap(-1, PAGE) as m:
        view, dst = _dst(m, 4)
        stream = fake_cuda.current_stream(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="no live registration"):
            fake_cuda.copy_to_host(stream, torch.ones(4, dtype=torch.uint8), dst, non_blocking=True)
        fake_cuda.copy_to_host(stream, torch.full((4,), 7, dtype=torch.uint8), dst, non_blocking=False)
        assert bytes(m[:4]) == bytes([7] * 4) and fake_cuda.sync_copies == 1 and fake_cuda.async_copies == 0
        del dst
        view.release()


def test_device_marks_are_per_tensor_object(fake_cuda: FakeCudaRuntime) -> None:
    t = fake_cuda.device(torch.ones(3))
    assert fake_cuda.device_tensor(t) and not fake_cuda.device_tensor(t.view(3)) and not fake_cuda.device_tensor(torch.ones(3))
    assert fake_cuda.host_device_tensors and not cuda.TorchCudaRuntime.host_device_tensors
