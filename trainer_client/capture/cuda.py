"""The CUDA runtime calls the client makes (host-memory registration, the device copies of a save), behind one small seam.

Everything that pins host memory goes through :func:`register` / :func:`unregister`, which call the
installed :class:`CudaRuntime`: :class:`TorchCudaRuntime` by default (torch's ``torch.cuda.cudart()``
bindings, plus ``cudaGetLastError`` from the libcudart the process loaded), or a stand-in installed with
:func:`install` / :func:`installed`. The tests' stand-in (``tests.harness.fake_cuda.FakeCudaRuntime``)
enforces the rules of ``cudaHostRegister`` measured on an H200, so the CPU test suite catches the
mistakes real CUDA would refuse:

- a size of 0: ``cudaErrorInvalidValue`` (1);
- any part of the range not mapped in the process, or a part of a file mapping past the (page-rounded)
  end of its file (the pages cannot be faulted in): 1;
- a range overlapping a live registration: ``cudaErrorHostMemoryAlreadyRegistered`` (712);
- ``cudaHostUnregister`` of an address that does not start a live registration:
  ``cudaErrorHostMemoryNotRegistered`` (713);
- every failure also stays recorded as the thread's last CUDA error until ``cudaGetLastError`` reads it.
  torch checks the last error after each kernel launch, so one left behind would be reported as the
  failure of some unrelated kernel: :func:`register` and :func:`unregister` clear it.

The device copies of a save (``trainer_client.capture.device_save``) go through the same runtime: which tensors are
device tensors (:meth:`CudaRuntime.device_tensor`; :func:`device_part`, what a planned shard's save copies from a device
and whether its memory must be registered), side streams, events, and the device-to-host copy itself
(:meth:`CudaRuntime.copy_to_host`), and whether a destination lies inside a live registration
(:meth:`CudaRuntime.host_registered`: the copier copies asynchronously only into registered memory). The tests'
stand-in counts CPU tensors it marked as device tensors and delays every asynchronous copy until its event or stream
is synchronized, refusing one whose destination was unmapped or unregistered meanwhile: the CPU suite runs the
device-copy path with the lifetimes a GPU has.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from trainer_client.serialization import ShardLayout

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context, so for every device
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the range
ERROR_INVALID_VALUE = 1  # cudaErrorInvalidValue
ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
ERROR_HOST_MEMORY_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class CudaRuntime(Protocol):
    """The CUDA runtime calls behind the seam; codes are raw ``cudaError_t`` values (0: success)."""

    pins_host_states: bool
    """Register capture memory even for CPU-only states (only the tests' fake: it lets the CPU suite run the pinning logic)."""

    def host_register(self, addr: int, size: int, flags: int) -> int:
        """``cudaHostRegister(addr, size, flags)``; a failure also stays recorded as the last error."""
        ...

    def host_unregister(self, addr: int) -> int:
        """``cudaHostUnregister(addr)``; a failure also stays recorded as the last error."""
        ...

    def get_last_error(self) -> int:
        """``cudaGetLastError()``: the last error recorded, which is reset to 0."""
        ...

    def error_text(self, code: int) -> str:
        """A readable description of ``code`` for messages."""
        ...

    # -- the device copy engine (trainer_client.capture.device_save) --------------------------------------------
    host_device_tensors: bool
    """Whether :meth:`device_tensor` may count CPU tensors as device tensors (only the tests' fake); if not, only CUDA
    tensors are device tensors, and a shard's layout finds them without asking about every tensor."""

    def device_tensor(self, t: torch.Tensor) -> bool:
        """Whether the copier copies ``t`` from a device (the real runtime: ``t.is_cuda``)."""
        ...

    def host_registered(self, addr: int, size: int) -> bool:
        """Whether ``[addr, addr + size)`` lies inside one live registration made through this runtime."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The stream the trainer enqueues on for ``device``."""
        ...

    def new_stream(self, device: torch.device) -> Any:
        """A new side stream on ``device``."""
        ...

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """A block whose device work (packing small tensors, resolving views) is enqueued on ``stream``."""
        ...

    def record_event(self, stream: Any) -> Any:
        """A new event recorded on ``stream`` (a host thread synchronizing it sleeps instead of spinning)."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event``, without blocking the host."""
        ...

    def synchronize(self, waitable: Any) -> None:
        """Block the host until an event has passed or a stream has drained; a CUDA error raises RuntimeError."""
        ...

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        """Keep ``t``'s device memory from being handed out again before ``stream`` has read it (``record_stream``)."""
        ...

    def copy_to_host(self, stream: Any, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        """Enqueue on ``stream`` the copy of ``src`` (a contiguous uint8 device tensor) into ``dst`` (a uint8 host tensor
        of the same size: the range ``[dst.data_ptr(), + dst.numel())``). ``non_blocking``: asynchronous, only for a
        destination inside a live registration (:meth:`host_registered`); else the host waits for the copy."""
        ...


def inside(live: Mapping[int, int], addr: int, size: int) -> bool:
    """Whether ``[addr, addr + size)`` lies inside one of the ranges ``live`` (start -> size)."""
    return any(start <= addr and addr + size <= start + length for start, length in live.items())


class TorchCudaRuntime:
    """The real runtime: torch's libcudart bindings, and ``cudaGetLastError`` from the libcudart the process loaded
    (torch exposes none). Constructing one touches nothing; the library is looked for at the first
    :meth:`get_last_error`."""

    pins_host_states = False
    host_device_tensors = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._libcudart: Any = None  # the loaded libcudart; False: none found
        self._live: dict[int, int] = {}  # addr -> size of the registrations made through this runtime

    @staticmethod
    def _cudart() -> Any:
        import torch

        return torch.cuda.cudart()

    def host_register(self, addr: int, size: int, flags: int) -> int:
        code = int(self._cudart().cudaHostRegister(addr, size, flags))
        if code == 0:
            with self._lock:
                self._live[addr] = size
        return code

    def host_unregister(self, addr: int) -> int:
        code = int(self._cudart().cudaHostUnregister(addr))
        if code == 0:
            with self._lock:
                self._live.pop(addr, None)
        return code

    def get_last_error(self) -> int:
        with self._lock:
            if self._libcudart is None:
                self._libcudart = _find_libcudart()
        if not self._libcudart:
            return 0
        return int(self._libcudart.cudaGetLastError())

    def error_text(self, code: int) -> str:
        try:
            cudart = self._cudart()
            return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (CUDA error {code})"
        except Exception:  # an unknown code, or no CUDA
            return f"CUDA error {code}"

    def device_tensor(self, t: torch.Tensor) -> bool:
        return bool(t.is_cuda)

    def host_registered(self, addr: int, size: int) -> bool:
        with self._lock:
            return inside(self._live, addr, size)

    def current_stream(self, device: torch.device) -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        import torch

        return torch.cuda.Stream(device=device)

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream)  # switches to the stream's device too

    def record_event(self, stream: Any) -> Any:
        import torch

        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, waitable: Any) -> None:
        waitable.synchronize()

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def copy_to_host(self, stream: Any, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        import torch

        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=non_blocking)


def _find_libcudart() -> Any:
    """The libcudart this process loaded (``ctypes.CDLL``), or False, logged once, where none is found."""
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "libcudart" in line})
    except OSError:
        paths = []
    for path in paths:
        if os.path.basename(path).startswith("libcudart.so"):
            try:
                lib = ctypes.CDLL(path)  # the library already loaded: dlopen hands back the same instance
            except OSError:
                continue
            lib.cudaGetLastError.restype = ctypes.c_int
            return lib
    log.warning("libcudart not found among this process's libraries: a failed cudaHostRegister stays recorded as the last CUDA error")
    return False


_runtime: CudaRuntime | None = None  # installed with install(); None: the default, created at first use
_default: TorchCudaRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> CudaRuntime:
    """The installed runtime; by default a :class:`TorchCudaRuntime`, created at the first call."""
    global _default
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _default is None:
            _default = TorchCudaRuntime()
        return _default


def install(rt: CudaRuntime | None) -> CudaRuntime | None:
    """Make ``rt`` the runtime (None: back to the default); returns the one installed before (None: the default)."""
    global _runtime
    with _runtime_lock:
        previous, _runtime = _runtime, rt
    return previous


@contextlib.contextmanager
def installed(rt: CudaRuntime) -> Iterator[CudaRuntime]:
    """Install ``rt`` for the duration of the block, then put back the runtime installed before."""
    previous = install(rt)
    try:
        yield rt
    finally:
        install(previous)


def register(addr: int, size: int, flags: int) -> int:
    """``cudaHostRegister(addr, size, flags)``; the CUDA error code (0: registered), a failure's error cleared."""
    rt = runtime()
    code = rt.host_register(addr, size, flags)
    if code != 0:
        rt.get_last_error()
    return code


def unregister(addr: int) -> int:
    """``cudaHostUnregister(addr)``; the CUDA error code, a failure's error cleared and logged."""
    rt = runtime()
    code = rt.host_unregister(addr)
    if code != 0:
        rt.get_last_error()
        log.warning("cudaHostUnregister(%#x) failed: %s", addr, rt.error_text(code))
    return code


def error_text(code: int) -> str:
    """The installed runtime's description of a CUDA error code."""
    return runtime().error_text(code)


@dataclass(frozen=True)
class DevicePart:
    """What of a planned shard the device copies fill: its device tensors (``blobs``, the host writer skips them), and
    whether the memory the save lands in must be registered for DMA (``pin``: it holds device tensors, or the installed
    runtime registers host states too, as the CPU suite's fake does)."""

    blobs: list[int]
    pin: bool


def device_part(layout: ShardLayout) -> DevicePart:
    """``layout``'s :class:`DevicePart` under the installed runtime: its CUDA tensors (found when it was planned), or
    every tensor the runtime's :meth:`~CudaRuntime.device_tensor` counts (the tests' stand-in). Part of planning a save:
    its path takes memory registered or not by it, and its capture copies those blobs."""
    rt = runtime()
    blobs = layout.device_tensors(rt.device_tensor) if rt.host_device_tensors else list(layout.cuda_blobs)
    return DevicePart(blobs, bool(blobs) or rt.pins_host_states)
