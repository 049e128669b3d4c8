"""GPU capture and device restores: CUDA tensors straight into the store's memory, and loads onto a device.

Save. ``ShardLayout.device_tensors()`` finds the CUDA tensors of a planned shard. :class:`DeviceCopier` (one per
client) registers the destination (a segment mapping, or a staging buffer without shared memory) with
``cudaHostRegister`` at its exact size, once, and keeps the registration while the client keeps the
memory (:class:`HostRegistrations`); it enqueues one ``copy_(src, non_blocking=True)`` per CUDA tensor on
a side stream per device (ordered after the trainer's current stream, ``record_stream`` keeping the
source's memory from being reused early) and records an event per device (:class:`DeviceCopies`).
``write_into(skip=...)`` writes everything else (header, CPU tensors) meanwhile (:func:`host_writer`).
:class:`Capture` runs the rest of one save: the host part, waiting for the events,
then the step that hands the bytes to the store (commit or send), inline (``capture="copied"``) or on
the client's capture thread (``capture="enqueued"``).

Restore. :func:`parse_map_location` checks ``load(map_location=...)``; :class:`HostToDevice` copies out
of a shard's memory onto a device: large source storages registered read-only for the duration
(``cudaHostRegisterReadOnly``: a writable pin of a copy-on-write mapping would copy every page), the
copies enqueued ``non_blocking`` on the current stream of the target device, synchronized and
unregistered in :meth:`HostToDevice.finish`. :func:`decode_onto` decodes a shard and moves every tensor.

Nothing here touches CUDA unless the state holds CUDA tensors or the load targets a CUDA device.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memstore.v1.pagefaults import FaultAhead, address_of
from trainer_client import serialization
from trainer_client._shard_encode import ShardLayout
from trainer_client._shard_format import _raw_byte_view
from trainer_client.errors import CapacityExceededError, CaptureError, InvalidArgumentError

log = logging.getLogger(__name__)

CAPTURE_MODES = ("copied", "enqueued")
HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context, so for every device
HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the range
MIN_PIN_BYTES = 2 << 20  # smaller sources are copied from pageable memory: registering them costs more than it saves
_PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------
# cudaHostRegister
# --------------------------------------------------------------------------------------


def _cudart() -> Any:
    """torch's libcudart bindings (a function of its own so tests can put a recording wrapper in between)."""
    return torch.cuda.cudart()


_libcudart: Any = None  # the libcudart this process loaded, for cudaGetLastError; False: none found


def _find_libcudart() -> Any:
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


def _clear_cuda_error() -> None:
    """Reset the calling thread's last CUDA error after a call that failed.

    torch's bindings return the error code but leave it recorded, and torch reads the last error after
    every kernel launch: left there, it would be reported as the failure of some unrelated kernel.
    torch exposes no cudaGetLastError, so it is called in the libcudart the process loaded.
    """
    global _libcudart
    if _libcudart is None:
        _libcudart = _find_libcudart()
    if _libcudart:
        _libcudart.cudaGetLastError()


def _error_text(code: int) -> str:
    try:
        cudart = _cudart()
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (CUDA error {code})"
    except Exception:  # an unknown code, or a test's stand-in
        return f"CUDA error {code}"


def host_register(addr: int, size: int, flags: int) -> int:
    """``cudaHostRegister(addr, size, flags)``; the CUDA error code (0: registered), a failure's error cleared."""
    code = int(_cudart().cudaHostRegister(addr, size, flags))
    if code != 0:
        _clear_cuda_error()
    return code


def host_unregister(addr: int) -> None:
    code = int(_cudart().cudaHostUnregister(addr))
    if code != 0:
        _clear_cuda_error()
        log.warning("cudaHostUnregister(%#x) failed: %s", addr, _error_text(code))


@dataclass
class _Pin:
    owner: Any  # the mapping or buffer, kept alive while its memory is registered
    addr: int
    size: int
    stamp: object
    ok: bool


class HostRegistrations:
    """Host memory registered with ``cudaHostRegister`` at its exact size, kept until :meth:`release`.

    One registration per segment mapping or staging buffer the client keeps between saves: registering
    costs about as much as faulting the range in again, so only the first save into a piece of memory
    pays it (the store recycles segments; the client keeps up to four mapped). A range that failed to
    register is remembered, not retried each save; copies into it go through pageable memory. Every
    owner must be released before its memory is unmapped: a registration outliving its mapping would
    pin the old pages, and a new mapping at the same address would not be the memory the GPU writes.
    """

    def __init__(self) -> None:
        self._pins: dict[int, _Pin] = {}  # id(owner) -> its registration
        self.registered = 0  # successful cudaHostRegister calls (tests and the benchmark read it)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, owner: Any, addr: int, size: int, stamp: object = None) -> bool:
        """Register ``owner``'s ``size`` bytes at ``addr`` unless already done; whether they are pinned.

        ``stamp`` identifies the memory's state (a segment file's inode, size and ctime): when it changes,
        the store truncated or regrew the file, which orphans pinned pages, so the range is registered anew.
        """
        pin = self._pins.get(id(owner))
        if pin is not None and (pin.addr, pin.size, pin.stamp) == (addr, size, stamp):
            return pin.ok
        if pin is not None:
            self.release(owner)
        code = host_register(addr, size, HOST_REGISTER_PORTABLE)
        if code != 0:
            log.warning("cudaHostRegister of %d bytes failed (%s): CUDA tensors are copied through pageable memory",
                        size, _error_text(code))
        else:
            self.registered += 1
        self._pins[id(owner)] = _Pin(owner, addr, size, stamp, code == 0)
        return code == 0

    def release(self, owner: Any) -> None:
        """Unregister ``owner``'s memory (no-op if it is not registered); call before unmapping or dropping it."""
        pin = self._pins.pop(id(owner), None)
        if pin is not None and pin.ok:
            host_unregister(pin.addr)

    def release_all(self) -> None:
        for pin in list(self._pins.values()):
            self.release(pin.owner)


def segment_stamp(path: str) -> object:
    """What changes when the store truncates or regrows a segment file (its pinned pages would be orphaned)."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_ctime_ns)


# --------------------------------------------------------------------------------------
# save: device->host copies
# --------------------------------------------------------------------------------------


def host_writer(layout: ShardLayout, skip: list[int], memory: mmap.mmap | memoryview, fault_ahead: bool = False) -> Callable[[], None]:
    """A function writing ``layout`` into ``memory`` but for the blobs in ``skip`` (the CUDA ones: DMA fills them).

    ``fault_ahead``: a thread faults fresh pages in beside the copy (``memstore.v1.pagefaults.FaultAhead``).
    """
    skipped = frozenset(skip)

    def write() -> None:
        view = memoryview(memory)[: layout.nbytes]  # released below: an mmap with a live export cannot close
        ahead = FaultAhead(view) if fault_ahead else None
        try:
            layout.write_into(view, skip=skipped)
        finally:
            if ahead is not None:
                ahead.stop()
            view.release()

    return write


class DeviceCopies:
    """The device->host copies of one save: one event per device marks the end of that device's copies."""

    def __init__(self) -> None:
        self.events: dict[torch.device, torch.cuda.Event] = {}
        self.keep: list[torch.Tensor] = []  # the destination alias and temporaries, alive until the copies are done

    def synchronize(self) -> None:
        """Block until every copy is done (raises CaptureError for a CUDA error)."""
        try:
            for event in self.events.values():
                event.synchronize()
        except RuntimeError as exc:
            raise CaptureError(f"copying CUDA tensors into host memory failed: {exc}") from exc
        finally:
            self.keep.clear()

    def gate(self) -> None:
        """Make each device's current stream wait for the copies, without blocking the host."""
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)


class DeviceCopier:
    """A client's side streams (one per CUDA device) and its registrations of save destinations."""

    def __init__(self) -> None:
        self.pins = HostRegistrations()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def pin_mapping(self, mm: mmap.mmap, path: str) -> bool:
        """Register a segment mapping (all of it) unless it is already; whether it is pinned."""
        return self.pins.pin(mm, address_of(mm), len(mm), segment_stamp(path))

    def pin_buffer(self, buf: torch.Tensor) -> bool:
        """Register a staging buffer's whole storage, if large enough and page-aligned (a huge-page mapping)."""
        storage = buf.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if size < MIN_PIN_BYTES or addr % _PAGE:
            return False  # a small malloc'ed buffer: its pages may hold other allocations, some registered elsewhere
        return self.pins.pin(buf, addr, size)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def start(self, layout: ShardLayout, blobs: list[int], target: torch.Tensor) -> DeviceCopies:
        """Enqueue the copies of the CUDA blobs ``blobs`` into their slots of ``target`` (uint8, the shard's bytes).

        Each device's copies run on its side stream after everything the trainer's current stream has
        enqueued so far (so they see the state as it is now), non_blocking: asynchronous DMA when
        ``target`` is registered. The caller must keep ``target``'s memory until :meth:`DeviceCopies.synchronize`.
        """
        copies = DeviceCopies()
        copies.keep.append(target)
        by_device: dict[torch.device, list[int]] = collections.defaultdict(list)
        for index in blobs:
            src, _, _ = layout.slot(index)  # raises if it changed since plan()
            by_device[src.device].append(index)
        used: list[torch.cuda.Stream] = []
        try:
            with torch.no_grad():
                for device, indices in by_device.items():
                    side = self._stream(device)
                    used.append(side)
                    with torch.cuda.device(device):
                        side.wait_stream(torch.cuda.current_stream(device))
                        with torch.cuda.stream(side):
                            for index in indices:
                                self._copy(copies, layout, index, target, side)
                        event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps instead of spinning on a core
                        event.record(side)
                    copies.events[device] = event
        except BaseException:
            for side in used:  # nothing may still write into the destination once the caller gives it back
                side.synchronize()
            raise
        return copies

    @staticmethod
    def _copy(copies: DeviceCopies, layout: ShardLayout, index: int, target: torch.Tensor, side: torch.cuda.Stream) -> None:
        src, offset, nbytes = layout.slot(index)
        if nbytes == 0:
            return
        src.record_stream(side)  # the allocator may not hand its memory out again before the side stream read it
        if src.is_conj() or src.is_neg():
            src = src.resolve_conj().resolve_neg()
        raw = _raw_byte_view(src)  # uint8, shape + (itemsize,): every dtype copies as bytes
        if not raw.is_contiguous():
            raw = raw.contiguous()  # on the side stream, on the GPU
        target[offset : offset + nbytes].view(raw.shape).copy_(raw, non_blocking=True)
        copies.keep.append(raw)


# --------------------------------------------------------------------------------------
# one save's capture
# --------------------------------------------------------------------------------------


class Capture:
    """The rest of one save once its device copies are enqueued: host part, wait, then commit or send.

    Args:
        copies: the save's device copies (None: a CPU state).
        write_host: writes the header and every non-CUDA blob.
        finish: hands the written bytes to the store (commit, send); runs only after every copy is done; may
            return a future of a step it left running (``handed_off``).
        abort: gives the destination back (release the lease, the staging buffer) when a step before
            ``finish`` failed; runs only once no copy writes into it any more.

    :meth:`run` does it inline (``capture="copied"``); :meth:`start` on an executor (``"enqueued"``).
    ``skipped_reason`` is set when ``skip_capacity`` turned a full store into a skipped save.
    """

    def __init__(
        self,
        copies: DeviceCopies | None,
        write_host: Callable[[], None],
        finish: Callable[[], Future[None] | None],
        abort: Callable[[], None],
    ) -> None:
        self.copies = copies
        self._write_host = write_host
        self._finish = finish
        self._abort = abort
        self.skip_capacity = False
        self.on_success: Callable[[], None] | None = None
        self.skipped_reason = ""
        self.host_written: threading.Event | None = None  # start(): set once the CPU tensors are copied (or that failed)
        self.host_error: BaseException | None = None
        self.future: Future[None] | None = None
        self.handed_off: Future[None] | None = None  # what ``finish`` left running (remote_save="background": the send)

    def run(self) -> None:
        try:
            try:
                self._write_host()
            except BaseException as exc:
                self.host_error = exc
            finally:
                if self.host_written is not None:
                    self.host_written.set()
            if self.copies is not None:
                self.copies.synchronize()  # also after a failed host write: nothing may still write into the buffer
            if self.host_error is not None:
                raise self.host_error
        except BaseException:
            self._abort()
            raise
        try:
            self.handed_off = self._finish()
        except CapacityExceededError as exc:
            if not self.skip_capacity:
                raise
            log.warning("skipping checkpoint: %s", exc)
            self.skipped_reason = str(exc)
            return
        if self.on_success is not None:
            self.on_success()

    def start(self, executor: Executor) -> None:
        self.host_written = threading.Event()
        self.future = executor.submit(self._run_logged)

    def _run_logged(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            log.warning("background capture of a save failed (its handle's wait_captured()/wait() raises it): %s", exc)
            raise

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def failed(self) -> bool:
        return self.future is not None and self.future.done() and self.future.exception() is not None

    def result(self, timeout: float | None = None) -> None:
        """Wait for the whole capture (copies and commit/send); raises its error, or TimeoutError."""
        if self.future is None:
            return
        try:
            self.future.result(timeout)
        except FutureTimeoutError:
            raise TimeoutError(f"capture still running after {timeout}s") from None

    def settle(self) -> None:
        """Wait for the capture without raising (its handle reports the outcome)."""
        if self.future is not None:
            self.future.exception()

    def wait_captured(self, timeout: float | None, block: bool) -> None:
        """Return once the trainer may modify the state; see ``SaveHandle.wait_captured``."""
        if block:
            self.result(timeout)
            return
        if self.host_written is not None and not self.host_written.wait(timeout):
            raise TimeoutError(f"the state's CPU tensors were still being copied after {timeout}s")
        if self.host_error is not None:
            self.result()  # raises the save's error once its cleanup is done
        if self.future is not None and self.future.done():
            self.future.result()  # raises a failure
            return
        if self.copies is not None:
            self.copies.gate()


class Captures:
    """One client's capture machinery, made on first use: its device copier, its capture thread, its save in flight."""

    def __init__(self) -> None:
        self._copier: DeviceCopier | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.in_flight: Capture | None = None  # the latest capture="enqueued" save's

    def device_copies(self, layout: ShardLayout, memory: mmap.mmap | torch.Tensor, path: str = "") -> tuple[list[int], DeviceCopies | None]:
        """The CUDA blobs of ``layout`` and their copies, enqueued into ``memory`` (the segment mapping of ``path``,
        or a staging buffer), registered first; ``([], None)`` for a state without CUDA tensors."""
        blobs = layout.device_tensors()
        if not blobs:
            return blobs, None
        if self._copier is None:
            self._copier = DeviceCopier()
        if isinstance(memory, mmap.mmap):
            self._copier.pin_mapping(memory, path)
            target = torch.frombuffer(memory, dtype=torch.uint8, count=layout.nbytes)
        else:
            self._copier.pin_buffer(memory)
            target = memory[: layout.nbytes]
        return blobs, self._copier.start(layout, blobs, target)

    def unpin(self, *owners: Any) -> None:
        """Unregister mappings or buffers the client is about to unmap or drop (no-op for those not registered)."""
        if self._copier is not None:
            for owner in owners:
                self._copier.pins.release(owner)

    def start(self, job: Capture) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memstore-capture")
        job.start(self._thread)
        self.in_flight = job

    def settle(self) -> None:
        """Wait for the capture in flight, if any (one per client); its handle reports how it went."""
        if self.in_flight is not None:
            self.in_flight.settle()

    def gate_hook(self) -> Callable[[Any, Any, Any], None]:
        """An optimizer step pre-hook: ``wait_captured()`` of the save in flight (a failure is raised once)."""

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            job = self.in_flight
            if job is None:
                return
            if job.done():
                self.in_flight = None  # nothing to gate any more; a failure below is raised this once
            job.wait_captured(None, block=False)

        return hook

    def close(self) -> None:
        """Finish the capture in flight, stop the thread, unregister everything."""
        self.settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._copier is not None:
            self._copier.pins.release_all()


# --------------------------------------------------------------------------------------
# restore onto a device
# --------------------------------------------------------------------------------------


def parse_map_location(value: object) -> torch.device | None:
    """``load(map_location=...)``: None for CPU (the default path), else the device every tensor goes to."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError) as exc:
            raise InvalidArgumentError(f"map_location {value!r} is not a device: {exc}") from None
    elif isinstance(value, torch.device):
        device = value
    else:
        raise InvalidArgumentError(
            f"map_location {value!r} ({type(value).__qualname__}) is invalid: expected None, 'cpu', a device string such as "
            "'cuda:0', or a torch.device"
        )
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"map_location {value!r}: CUDA is not available in this process")
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise InvalidArgumentError(f"map_location {value!r}: this process sees {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    try:
        torch.empty(0, device=device)
    except Exception as exc:  # each backend fails its own way (AssertionError, NotImplementedError, ...)
        raise InvalidArgumentError(f"map_location {value!r}: device {device} is not usable here: {exc}") from None
    return device


class HostToDevice:
    """Host->device copies out of one shard's memory, finished (and unpinned) by :meth:`finish`.

    A large source's storage (the shard's copy-on-write mapping, or the received buffer) is registered
    read-only the first time a copy reads it, so the copies are asynchronous DMA; they are enqueued
    ``non_blocking`` on the current stream of the target's device. Sources that are small, not
    page-aligned or fail to register are copied from pageable memory, which is correct too.
    """

    _warned = False

    def __init__(self) -> None:
        self._pinned: dict[int, torch.UntypedStorage | None] = {}  # storage address -> storage if registered
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _pin(self, source: torch.Tensor) -> None:
        storage = source.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if addr in self._pinned or size < MIN_PIN_BYTES or addr % _PAGE:
            return
        code = host_register(addr, size, HOST_REGISTER_PORTABLE | HOST_REGISTER_READ_ONLY)
        self._pinned[addr] = storage if code == 0 else None
        if code != 0 and not HostToDevice._warned:
            HostToDevice._warned = True
            log.warning("read-only cudaHostRegister failed (%s): restores copy from pageable memory", _error_text(code))

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``; asynchronous when ``target`` is on a CUDA device and ``source`` in host memory."""
        if not (target.is_cuda and source.is_cpu):
            target.copy_(source)
            return
        self._pin(source)
        self._streams.setdefault(target.device, torch.cuda.current_stream(target.device))
        target.copy_(source, non_blocking=True)

    def to(self, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``source`` on ``device`` (asynchronous onto a CUDA device until :meth:`finish`)."""
        if device.type != "cuda":
            return source.to(device)
        self._pin(source)
        self._streams.setdefault(device, torch.cuda.current_stream(device))
        return source.to(device, non_blocking=True)

    def finish(self) -> None:
        """Wait for every copy, then unregister the sources."""
        try:
            for stream in self._streams.values():
                stream.synchronize()
        finally:
            for addr, storage in self._pinned.items():
                if storage is not None:
                    host_unregister(addr)
            self._pinned.clear()
            self._streams.clear()


class _TreeMover:
    """Walks a decoded state (dicts, OrderedDicts, lists, tuples: what decode builds) and replaces its leaves."""

    def __init__(self, move: Callable[[torch.Tensor], torch.Tensor], copy_arrays: bool) -> None:
        self.move = move
        self.copy_arrays = copy_arrays
        self.memo: dict[int, Any] = {}  # id(leaf) -> its replacement: a leaf met twice stays one object

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        out = self.move(t.detach())
        if type(t) is torch.nn.Parameter:
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return out.requires_grad_(True) if t.requires_grad else out

    def leaf(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            make: Callable[[Any], Any] = self.tensor
        elif kind is np.ndarray and self.copy_arrays:
            make = np.copy
        else:
            return obj
        key = id(obj)
        if key not in self.memo:
            self.memo[key] = make(obj)
        return self.memo[key]

    def visit(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is dict or kind is collections.OrderedDict:
            if hasattr(obj, "_metadata"):
                obj._metadata = self.visit(obj._metadata)
            for key in list(obj):
                obj[key] = self.visit(obj[key])
            return obj
        if kind is list:
            obj[:] = [self.visit(item) for item in obj]
            return obj
        if kind is tuple:
            return tuple(self.visit(item) for item in obj)
        return self.leaf(obj)


def move_tree(tree: Any, move: Callable[[torch.Tensor], torch.Tensor], copy_arrays: bool) -> Any:
    """Replace every tensor of a decoded state by ``move(tensor)`` (dicts and lists in place, tuples rebuilt).

    A tensor met twice stays one object; ``nn.Parameter`` and ``requires_grad`` are kept. ``copy_arrays``:
    numpy arrays become copies (they may be views of the shard's memory).
    """
    return _TreeMover(move, copy_arrays).visit(tree)


def decode_onto(buffer: Any, device: torch.device, zero_copy: bool) -> Any:
    """Decode a shard and put every tensor on ``device``, copied straight from ``buffer`` (no CPU copy first).

    ``buffer`` must be writable and unchanging (the copy-on-write mapping, the received buffer). Copies
    have finished when this returns; the caller may close the mapping then (``zero_copy=False``: numpy
    arrays are copies too, so nothing refers to it any more).
    """
    state = serialization.decode(buffer, zero_copy=True)
    copies = HostToDevice()
    try:
        return move_tree(state, lambda t: copies.to(t, device), copy_arrays=not zero_copy)
    finally:
        copies.finish()
        del state
