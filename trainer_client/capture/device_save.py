"""GPU capture: CUDA tensors straight into the store's memory (the save side; restores are :mod:`.device_restore`).

A save's device tensors are found when it is planned (:func:`trainer_client.capture.cuda.device_part`: the CUDA ones;
those the CUDA seam's test stand-in marked). :class:`DeviceCopier` (one per client)
enqueues their copies into the destination (a segment of the client's capture ring, registered once by
``trainer_client.capture.ring``, or a staging buffer without shared memory, registered once here by
:class:`HostRegistrations`) on a side stream per device, ordered after the trainer's stream as it was when
``save()`` was called (:func:`mark_streams`), ``record_stream`` keeping each source's memory from being reused
early; neighbouring small tensors go as one copy (:func:`copy_runs`, :func:`gather_run`); an event per device
marks the end (:class:`DeviceCopies`). ``write_into(skip=...)`` writes everything else (header, CPU tensors)
meanwhile (:func:`host_writer`). :class:`Capture` runs one save: the copies, the host part, the wait, then the
step that hands the bytes to the store (commit or send), inline (``capture="copied"``) or on the client's capture
thread (``capture="enqueued"``). A save path makes one call here per save, :meth:`Captures.capture`, with the
:class:`Destination` it took for the save: where the bytes go and, as plain callables, how they leave (the ring's
commit, the transfer's send) or go back. Nothing here calls back into the path.

Every stream, event and copy goes through the CUDA seam (``trainer_client.capture.cuda``), so the CPU suite runs this
path against a fake with a delayed copy engine. A copy is asynchronous only into a destination inside a live
registration (``CudaRuntime.host_registered``), synchronous otherwise; with ``MEMSTORE_STRICT_PINNING=1`` the
copies of a save whose destination is not registered are refused (CaptureError) before any is queued. The caller keeps
the destination mapped and registered until :meth:`DeviceCopies.synchronize` (the capture ring's ``Hold``).

Nothing here touches CUDA unless the state holds CUDA tensors.
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import torch

from memstore.v1.pagefaults import FaultAhead
from trainer_client import knobs
from trainer_client.capture import cuda
from trainer_client.capture.ring import CaptureStats
from trainer_client.errors import CapacityExceededError, CaptureError
from trainer_client.serialization import ALIGNMENT, ChunkSums, ShardLayout
from trainer_client.serialization.dtypes import raw_byte_view

log = logging.getLogger(__name__)

CAPTURE_MODES = ("copied", "enqueued")
SMALL_COPY_BYTES = 1 << 20  # device tensors under this are batched with their neighbours into one copy
MIN_PIN_BYTES = 2 << 20  # smaller sources are copied from pageable memory: registering them costs more than it saves
_PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------
# registered staging buffers (without shared memory)
# --------------------------------------------------------------------------------------


@dataclass
class _Pin:
    owner: Any  # the buffer, kept alive while its memory is registered
    addr: int
    ok: bool


class HostRegistrations:
    """Staging buffers registered with ``cudaHostRegister`` at their exact size, kept until :meth:`release`.

    Without shared memory the client keeps its staging buffers between saves, so only the first save into
    one pays the registration. Segments of the shared-memory path are the capture ring's
    (``trainer_client.capture.ring``). A buffer that failed to register is remembered, not retried each save.
    """

    def __init__(self) -> None:
        self._pins: dict[int, _Pin] = {}  # id(owner) -> its registration
        self.registered = 0  # successful cudaHostRegister calls
        self.failed = ""  # the last failure's cause

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, owner: Any, addr: int, size: int) -> bool:
        """Register ``owner``'s ``size`` bytes at ``addr`` unless already done; whether they are pinned."""
        pin = self._pins.get(id(owner))
        if pin is not None:
            return pin.ok
        code = cuda.register(addr, size, cuda.HOST_REGISTER_PORTABLE)
        if code != 0:
            self.failed = cuda.error_text(code)
            log.warning("cudaHostRegister of %d bytes failed (%s): CUDA tensors are copied through pageable memory", size, self.failed)
        else:
            self.registered += 1
        self._pins[id(owner)] = _Pin(owner, addr, code == 0)
        return code == 0

    def release(self, owner: Any) -> None:
        """Unregister ``owner``'s memory (no-op if it is not registered); call before dropping it."""
        pin = self._pins.pop(id(owner), None)
        if pin is not None and pin.ok:
            cuda.unregister(pin.addr)

    def release_all(self) -> None:
        for pin in list(self._pins.values()):
            self.release(pin.owner)


# --------------------------------------------------------------------------------------
# save: device->host copies
# --------------------------------------------------------------------------------------


def host_writer(
    layout: ShardLayout,
    skip: list[int],
    memory: mmap.mmap | memoryview,
    fault_ahead: bool = False,
    mark: Callable[[int], None] | None = None,
    sums: ChunkSums | None = None,
) -> Callable[[], None]:
    """A function writing ``layout`` into ``memory`` but for the blobs in ``skip`` (the CUDA ones: DMA fills them).

    ``fault_ahead``: a thread faults fresh pages in beside the copy (``memstore.v1.pagefaults.FaultAhead``).
    ``mark``: told how many of the shard's bytes are final as the copy goes (``ShardLayout.write_into``). ``sums``: the
    chunks are hashed as they are copied (``ShardLayout.write_into``).
    """
    skipped = frozenset(skip)

    def write() -> None:
        view = memoryview(memory)[: layout.nbytes]  # released below: an mmap with a live export cannot close
        ahead = FaultAhead(view) if fault_ahead else None
        try:
            layout.write_into(view, skip=skipped, mark=mark, sums=sums)
        finally:
            if ahead is not None:
                ahead.stop()
            view.release()

    return write


class DeviceCopies:
    """The device->host copies of one save: one event per device marks the end of that device's copies."""

    def __init__(self, runtime: cuda.CudaRuntime | None = None) -> None:
        self.runtime = runtime or cuda.runtime()
        self.events: dict[torch.device, Any] = {}
        self.keep: list[torch.Tensor] = []  # the destination alias and temporaries, alive until the copies are done

    def synchronize(self) -> None:
        """Block until every copy is done (raises CaptureError for a CUDA error)."""
        try:
            for event in self.events.values():
                self.runtime.synchronize(event)
        except RuntimeError as exc:
            raise CaptureError(f"copying CUDA tensors into host memory failed: {exc}") from exc
        finally:
            self.keep.clear()

    def gate(self) -> None:
        """Make each device's current stream wait for the copies, without blocking the host."""
        rt = self.runtime
        for device, event in self.events.items():
            rt.wait_event(rt.current_stream(device), event)


@dataclass(frozen=True)
class CopyRun:
    """Blobs whose slots follow each other in the shard, copied as one: ``(index, offset, nbytes)`` each; the run
    covers ``[start, end)`` of the shard (their slots and the zero padding between them)."""

    blobs: tuple[tuple[int, int, int], ...]

    @property
    def start(self) -> int:
        return self.blobs[0][1]

    @property
    def end(self) -> int:
        return self.blobs[-1][1] + self.blobs[-1][2]


def copy_runs(slots: list[tuple[int, int, int]], small: int = SMALL_COPY_BYTES) -> list[CopyRun]:
    """Group blobs ``(index, offset, nbytes)`` of one device into runs: neighbouring small blobs (under ``small``
    bytes, slots adjacent up to the alignment padding) form one run, copied in one transfer; others are alone."""
    runs: list[list[tuple[int, int, int]]] = []
    for blob in sorted(slots, key=lambda b: b[1]):
        _, offset, nbytes = blob
        if runs and nbytes < small:
            last = runs[-1][-1]
            if last[2] < small and offset == _aligned(last[1] + last[2]):
                runs[-1].append(blob)
                continue
        runs.append([blob])
    return [CopyRun(tuple(run)) for run in runs]


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def gather_run(run: CopyRun, sources: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``run`` (its slots and zero padding) as one uint8 tensor on the sources' device, filled by one
    batched copy (``torch._foreach_copy_``: a launch or two for any number of tensors, not one per tensor).
    ``sources``: each blob's bytes as a contiguous uint8 tensor, in the run's order."""
    packed = torch.zeros(run.end - run.start, dtype=torch.uint8, device=sources[0].device)
    views = [packed[offset - run.start : offset - run.start + nbytes] for _, offset, nbytes in run.blobs]
    torch._foreach_copy_(views, [src.reshape(-1) for src in sources])
    return packed


def raw_bytes(src: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a contiguous uint8 tensor on its device (a view when it is contiguous)."""
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    raw = raw_byte_view(src)  # uint8, shape + (itemsize,): every dtype copies as bytes
    return raw if raw.is_contiguous() else raw.contiguous()


def mark_streams(layout: ShardLayout, blobs: list[int]) -> dict[torch.device, Any]:
    """An event on the current stream of every device holding one of ``blobs``: the copies start after it, so they
    see the state as the trainer had it when it called ``save()`` (and not what it enqueues later)."""
    rt = cuda.runtime()
    marks: dict[torch.device, Any] = {}
    for index in blobs:
        device = layout.slot(index)[0].device
        if device not in marks:
            marks[device] = rt.record_event(rt.current_stream(device))
    return marks


class DeviceCopier:
    """A client's side streams (one per CUDA device) and its registered staging buffers (no shared memory)."""

    def __init__(self) -> None:
        self.pins = HostRegistrations()
        self._streams: dict[torch.device, Any] = {}  # made by the CUDA runtime installed at the first copy

    def pin_buffer(self, buf: torch.Tensor) -> bool:
        """Register a staging buffer's whole storage, if large enough and page-aligned (a huge-page mapping)."""
        storage = buf.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if size < MIN_PIN_BYTES or addr % _PAGE:
            return False  # a small malloc'ed buffer: its pages may hold other allocations, some registered elsewhere
        return self.pins.pin(buf, addr, size)

    def _stream(self, rt: cuda.CudaRuntime, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = rt.new_stream(device)
        return stream

    def start(
        self, layout: ShardLayout, blobs: list[int], target: torch.Tensor, after: dict[torch.device, Any] | None = None
    ) -> DeviceCopies:
        """Enqueue the copies of the device blobs ``blobs`` into their slots of ``target`` (uint8, the shard's bytes).

        Each device's copies run on its side stream after ``after[device]`` (an event :func:`mark_streams` recorded
        when the save was called), else after everything the trainer's current stream has enqueued so far.
        Asynchronous only when ``target`` lies inside a live registration, synchronous otherwise; with
        ``MEMSTORE_STRICT_PINNING=1`` an unregistered ``target`` raises CaptureError before anything is queued.
        Neighbouring small tensors go as one copy (:func:`copy_runs`). The caller must keep ``target``'s memory
        mapped and registered until :meth:`DeviceCopies.synchronize`.
        """
        rt = cuda.runtime()
        registered = rt.host_registered(target.data_ptr(), target.numel())
        if not registered and knobs.strict_pinning():
            raise CaptureError(
                f"the save's device copies would go into {target.numel()} bytes at {target.data_ptr():#x}, which no live "
                f"registration holds (pageable memory); refused because {knobs.STRICT_PINNING_ENV} is set"
            )
        copies = DeviceCopies(rt)
        copies.keep.append(target)
        by_device: dict[torch.device, list[tuple[int, int, int]]] = collections.defaultdict(list)
        for index in blobs:
            src, offset, nbytes = layout.slot(index)  # raises if it changed since plan()
            if nbytes:
                by_device[src.device].append((index, offset, nbytes))
        used: list[Any] = []
        try:
            with torch.no_grad():
                for device, slots in by_device.items():
                    side = self._stream(rt, device)
                    used.append(side)
                    mark = after.get(device) if after is not None else None
                    rt.wait_event(side, mark if mark is not None else rt.record_event(rt.current_stream(device)))
                    with rt.stream_context(side):
                        for run in copy_runs(slots):
                            self._copy(rt, copies, layout, run, target[run.start : run.end], side, registered)
                    copies.events[device] = rt.record_event(side)
        except BaseException:
            for side in used:  # nothing may still write into the destination once the caller gives it back
                rt.synchronize(side)
            raise
        return copies

    @staticmethod
    def _copy(
        rt: cuda.CudaRuntime, copies: DeviceCopies, layout: ShardLayout, run: CopyRun, dst: torch.Tensor, side: Any, registered: bool
    ) -> None:
        sources = []
        for index, _, _ in run.blobs:
            src = layout.slot(index)[0]
            rt.keep_for(src, side)  # the allocator may not hand its memory out again before the side stream read it
            sources.append(raw_bytes(src))
        data = sources[0].reshape(-1) if len(sources) == 1 else gather_run(run, sources)
        rt.copy_to_host(side, data, dst, non_blocking=registered)
        copies.keep.extend(sources)
        copies.keep.append(data)


# --------------------------------------------------------------------------------------
# one save's capture
# --------------------------------------------------------------------------------------


class Capture:
    """One save once its destination is chosen: device copies, host part, wait, then commit or send.

    Args:
        start_copies: enqueues the device copies (None: a CPU state); run by :meth:`run`, so on the capture
            thread with ``capture="enqueued"`` (the copies start after the events recorded at ``save()``).
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
        start_copies: Callable[[], DeviceCopies] | None,
        write_host: Callable[[], None],
        finish: Callable[[], Future[None] | None],
        abort: Callable[[], None],
    ) -> None:
        self._start_copies = start_copies
        self.copies: DeviceCopies | None = None
        self._write_host = write_host
        self._finish = finish
        self._abort = abort
        self.skip_capacity = False
        self.on_success: Callable[[], None] | None = None
        self.skipped_reason = ""
        self.host_written: threading.Event | None = None  # start(): set once the copies are enqueued and the CPU tensors copied
        self.host_error: BaseException | None = None
        self.future: Future[None] | None = None
        self.handed_off: Future[None] | None = None  # what ``finish`` left running (remote_save="background": the send)

    def run(self) -> None:
        try:
            try:
                if self._start_copies is not None:
                    self.copies = self._start_copies()
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


@dataclass(frozen=True)
class Destination:
    """Where one save's bytes go and how they leave: what a save path took for the save (``trainer_client.transport``).

    Attributes:
        target: what the device copies fill (uint8): the same bytes as ``memory`` (a ring segment's mapping, a staging
            buffer).
        memory: what the host part writes (:func:`host_writer`).
        finish: hands the written bytes to the store (the ring's commit, the transfer's send), once every byte is
            written; may return a future of a step it left running (a background send).
        abort: gives the memory back when a step before ``finish`` failed.
        mark: told how many bytes are final as the host copy goes (a commit that lets the store push them early).
        sums: the chunks are hashed into it as they are copied.
        fault_ahead: fresh pages are faulted in by a thread beside the copy (a new staging buffer).
        register: the capture registers ``target``'s memory for DMA when the save needs it (a staging buffer; a ring
            segment was registered by its ring when it was taken).
    """

    target: torch.Tensor
    memory: mmap.mmap | memoryview
    finish: Callable[[], Future[None] | None]
    abort: Callable[[], None]
    mark: Callable[[int], None] | None = None
    sums: ChunkSums | None = None
    fault_ahead: bool = False
    register: bool = False


class Captures:
    """One client's capture machinery, made on first use: its device copier, its capture thread, its save in flight."""

    def __init__(self) -> None:
        self._copier: DeviceCopier | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.in_flight: Capture | None = None  # the latest capture="enqueued" save's

    def device_copies(
        self, layout: ShardLayout, blobs: list[int], target: torch.Tensor, deferred: bool = False
    ) -> Callable[[], DeviceCopies] | None:
        """What enqueues the copies of ``layout``'s device tensors ``blobs`` into ``target`` (uint8: the segment mapping,
        or a staging buffer, registered by the caller); None for a state without device tensors.

        ``deferred``: the copies are enqueued later, on the capture thread: the current streams are marked now.
        """
        if not blobs:
            return None
        copier = self.copier
        after = mark_streams(layout, blobs) if deferred else None
        return lambda: copier.start(layout, blobs, target, after)

    @property
    def has_copier(self) -> bool:
        return self._copier is not None

    def stats(self, ring: CaptureStats) -> CaptureStats:
        """``ring``'s registrations and fallbacks plus the copier's (buffers it registered outside the ring)."""
        if self._copier is None:
            return ring
        pins = self._copier.pins
        return CaptureStats(ring.registrations + pins.registered, ring.fallbacks, ring.last_fallback or pins.failed)

    @property
    def copier(self) -> DeviceCopier:
        if self._copier is None:
            self._copier = DeviceCopier()
        return self._copier

    def unpin(self, *owners: Any) -> None:
        """Unregister buffers the client is about to drop (no-op for those not registered)."""
        if self._copier is not None:
            for owner in owners:
                self._copier.pins.release(owner)

    def capture(
        self, layout: ShardLayout, device: cuda.DevicePart, into: Destination, enqueued: bool,
        on_success: Callable[[], None] | None, skip_capacity: bool,
    ) -> Capture:  # fmt: skip
        """One save of ``layout`` into ``into``: the one call a save path makes per save. ``device``: the save's device
        tensors and whether its memory must be registered (``cuda.device_part``). The device copies are prepared (with
        ``enqueued``, the trainer's streams marked now) and the capture is run now (``capture="copied"``) or started on
        the capture thread (``enqueued``; ``skip_capacity``: a full store then skips the save instead of failing it);
        ``on_success`` is called once the store took the bytes. A failure before the capture starts aborts ``into``."""
        try:
            if device.pin and into.register:
                self.copier.pin_buffer(into.target)
            start_copies = self.device_copies(layout, device.blobs, into.target, deferred=enqueued)
        except BaseException:
            into.abort()
            raise
        write = host_writer(layout, device.blobs, into.memory, fault_ahead=into.fault_ahead, mark=into.mark, sums=into.sums)
        job = Capture(start_copies, write, into.finish, into.abort)
        job.on_success = on_success
        if not enqueued:
            job.run()
            return job
        job.skip_capacity = skip_capacity
        self.start(job)
        return job

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
        """Finish the capture in flight, stop the thread, unregister the staging buffers."""
        self.settle()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._copier is not None:
            self._copier.pins.release_all()
