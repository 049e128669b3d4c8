"""Restores onto a device: a decoded shard's tensors copied out of host memory onto a GPU, nothing registered per load.

:func:`parse_map_location` checks ``load(map_location=...)``. :class:`HostToDevice` copies each tensor: straight
out of memory the client registered already (a segment of its capture ring, for a restore in the process that
saved), else through the process's :class:`BounceRing` (registered buffers the CPU fills while the previous
chunk's DMA runs), small or strided ones from pageable memory; the copies are enqueued ``non_blocking`` on the
current stream of the target device and waited for in :meth:`HostToDevice.finish`. :func:`decode_onto` decodes a
shard and moves every tensor (:func:`move_tree`).

Nothing here touches CUDA unless the load targets a CUDA device.
"""

from __future__ import annotations

import collections
import logging
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memstore.v1.pagefaults import address_of
from trainer_client import serialization
from trainer_client.capture import cuda
from trainer_client.capture.device_save import MIN_PIN_BYTES, raw_bytes
from trainer_client.errors import InvalidArgumentError

log = logging.getLogger(__name__)

BOUNCE_BUFFERS = 4  # registered buffers of a restore's bounce ring (per process) ...
BOUNCE_CHUNK_BYTES = 16 << 20  # ... of this many bytes each: 64 MiB pinned in all


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


def _record(target: torch.Tensor) -> torch.cuda.Event | None:
    """An event after the work enqueued so far on ``target``'s device (None on the CPU: copies there are done)."""
    if not target.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(target.device))
    return event


class BounceRing:
    """Registered host buffers that stage host->device copies out of memory that is not registered.

    A restore reads a shard out of a mapping this process has not registered (a fresh process after a crash,
    a shard pulled from a peer, a copy-on-write mapping). Registering it would cost more than the copy itself
    (0.7-1.1 s/GiB measured for a copy-on-write mapping), and a pageable copy is synchronous and slow. So each
    chunk goes through one of ``buffers`` buffers of ``chunk`` bytes, registered once per process: a CPU copy
    into the buffer (torch's, on its threads), then an asynchronous copy to the device; a buffer is refilled
    once the event of its previous device copy has passed, so the CPU copies of one chunk overlap the DMA of
    the last. Targets on the CPU (tests) take the same path with synchronous copies.
    """

    def __init__(self, buffers: int = BOUNCE_BUFFERS, chunk: int = BOUNCE_CHUNK_BYTES) -> None:
        self.chunk = chunk
        self._maps: list[mmap.mmap] = []
        self._tensors: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None] * buffers
        self._next = 0
        self.lock = threading.Lock()  # one restore at a time uses the ring (held by HostToDevice until finish())
        self.registered = 0

    def _buffer(self, i: int) -> torch.Tensor:
        while len(self._tensors) <= i:
            mm = mmap.mmap(-1, self.chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
            code = cuda.register(address_of(mm), self.chunk, cuda.HOST_REGISTER_PORTABLE)
            if code == 0:
                self.registered += 1
            else:
                log.warning("cudaHostRegister of a %d-byte bounce buffer failed (%s): restores copy from pageable memory",
                            self.chunk, cuda.error_text(code))  # fmt: skip
            self._maps.append(mm)
            self._tensors.append(torch.frombuffer(mm, dtype=torch.uint8))
        return self._tensors[i]

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (uint8, 1-D, host) into ``target`` (uint8, 1-D, same length) chunk by chunk; the device
        copies are enqueued on the current stream of ``target``'s device (:meth:`drain` waits for them)."""
        for offset in range(0, source.numel(), self.chunk):
            n = min(self.chunk, source.numel() - offset)
            i = self._next
            self._next = (i + 1) % len(self._events)
            event = self._events[i]
            if event is not None:
                event.synchronize()  # the buffer's previous device copy has read it
            staged = self._buffer(i)[:n]
            staged.copy_(source[offset : offset + n])
            target[offset : offset + n].copy_(staged, non_blocking=True)
            self._events[i] = _record(target)

    @property
    def prepared(self) -> bool:
        """Whether every buffer is made (and registered, where registration worked)."""
        return len(self._tensors) == len(self._events)

    def prepare(self) -> None:
        """Make and register every buffer now (on a thread, off a restore's path: ``prepare_bounce_ring``); a restore
        running meanwhile has them made already, as it goes."""
        with self.lock:
            self._buffer(len(self._events) - 1)

    def drain(self) -> None:
        """Wait until every device copy out of the buffers is done."""
        for i, event in enumerate(self._events):
            if event is not None:
                event.synchronize()
                self._events[i] = None

    def close(self) -> None:
        self.drain()
        self._tensors.clear()
        for mm in self._maps:
            cuda.unregister(address_of(mm))
            mm.close()
        self._maps.clear()


_bounce: BounceRing | None = None
_bounce_lock = threading.Lock()


def bounce_ring() -> BounceRing:
    """The process's bounce ring (made on first use: its buffers are registered once per process)."""
    global _bounce
    with _bounce_lock:
        if _bounce is None:
            _bounce = BounceRing()
        return _bounce


def prepare_bounce_ring(only_if_cuda_in_use: bool = False) -> None:
    """Register the process's bounce buffers on a thread now, so that the first restore onto a device does not (the
    client starts it when it connects in a process that uses CUDA already, and at a ``load(map_location=cuda)``).
    ``only_if_cuda_in_use``: nothing unless this process has initialized CUDA."""
    if only_if_cuda_in_use and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    if not bounce_ring().prepared:  # a later load: nothing to make
        threading.Thread(target=_prepare_quietly, name="memstore-bounce", daemon=True).start()


def _prepare_quietly() -> None:
    try:
        bounce_ring().prepare()
    except Exception as exc:  # the restore makes them itself then, and says why it could not
        log.debug("bounce buffers not prepared: %s", exc)


class HostToDevice:
    """Host->device copies out of one shard's memory, finished by :meth:`finish`.

    A source in memory the client registered (``registered(addr, nbytes)``: a segment of its capture ring, which
    a same-process restore reads in place) is copied straight to the device, asynchronously. Other large
    contiguous sources go through the process's :class:`BounceRing`; small or strided ones are copied from
    pageable memory. No mapping is registered per restore. Copies are enqueued on the current stream of the
    target's device.
    """

    def __init__(
        self, registered: Callable[[int, int], bool] | None = None, staged: Callable[[torch.Tensor], bool] | None = None,
        gate: Callable[[int, int], None] | None = None,
    ) -> None:  # fmt: skip
        """``gate(addr, nbytes)``: called before the bytes of a host source are copied (a ``ChunkCheck``'s: it waits for
        their chunks to verify, and raises if one failed)."""
        self._registered = registered or (lambda addr, nbytes: False)
        self._staged = staged or (lambda target: target.is_cuda)  # which targets the bounce ring serves (tests: CPU ones too)
        self._gate = gate
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._bounce: BounceRing | None = None
        self.direct = 0  # copies straight out of registered memory
        self.bounced = 0  # copies through the bounce ring

    def copy_into(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``; asynchronous when ``target`` is on a CUDA device and ``source`` in host memory."""
        if self._gate is not None and source.is_cpu:
            self._gate(source.data_ptr(), source.numel() * source.element_size())
        if not (self._staged(target) and source.is_cpu) or target.dtype != source.dtype:
            target.copy_(source)
            return
        if target.is_cuda:
            self._streams.setdefault(target.device, torch.cuda.current_stream(target.device))
        nbytes = source.numel() * source.element_size()
        if self._registered(source.data_ptr(), nbytes):
            target.copy_(source, non_blocking=True)
            self.direct += 1
            return
        if nbytes < MIN_PIN_BYTES or not (source.is_contiguous() and target.is_contiguous()):
            target.copy_(source)  # small or strided: pageable (torch stages it)
            return
        if self._bounce is None:
            self._bounce = bounce_ring()
            self._bounce.lock.acquire()  # released by finish()
        self._bounce.copy(raw_bytes(target).reshape(-1), raw_bytes(source).reshape(-1))
        self.bounced += 1

    def to(self, source: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``source`` on ``device`` (asynchronous onto a CUDA device until :meth:`finish`)."""
        if device.type != "cuda" and not self._staged(source):
            return source.to(device)
        target = torch.empty_like(source, device=device)
        self.copy_into(target, source)
        return target

    def finish(self) -> None:
        """Wait for every copy."""
        try:
            if self._bounce is not None:
                self._bounce.drain()
            for stream in self._streams.values():
                stream.synchronize()
        finally:
            if self._bounce is not None:
                self._bounce.lock.release()
                self._bounce = None
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


def decode_onto(buffer: Any, device: torch.device, zero_copy: bool, copies: HostToDevice | None = None) -> Any:
    """Decode a shard and put every tensor on ``device``, copied straight from ``buffer`` (no CPU copy first).

    ``buffer`` must be writable and unchanging (the copy-on-write mapping, the received buffer, a registered
    segment of the client's capture ring under a read lease). Copies have finished when this returns; the
    caller may close the mapping then (``zero_copy=False``: numpy arrays are copies too, so nothing refers to
    it any more). ``copies``: how to copy (default: through the bounce ring).
    """
    return onto_device(serialization.decode(buffer, zero_copy=True), device, zero_copy, copies)


def onto_device(state: Any, device: torch.device, zero_copy: bool = False, copies: HostToDevice | None = None) -> Any:
    """A decoded host state with every tensor copied onto ``device`` (see :func:`decode_onto`); numpy arrays are copied
    unless ``zero_copy``."""
    copies = copies or HostToDevice()
    try:
        return move_tree(state, lambda t: copies.to(t, device), copy_arrays=not zero_copy)
    finally:
        copies.finish()
        del state


def decode_registered(mm: mmap.mmap, nbytes: int, device: torch.device, gate: Callable[[int, int], None] | None = None) -> Any:
    """Decode a shard held in a registered mapping of the client's capture ring onto ``device``: the copies read it in
    place (no copy-on-write mapping, no registration, no bounce). Numpy arrays are copied out of it: the segment goes
    back to the ring. ``gate``: as ``HostToDevice``'s."""
    start = address_of(mm)

    def registered(addr: int, n: int) -> bool:
        return start <= addr and addr + n <= start + nbytes

    view = memoryview(mm)[:nbytes]
    try:
        return decode_onto(view, device, zero_copy=False, copies=HostToDevice(registered=registered, gate=gate))
    finally:
        view.release()


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def populate_for_reading(mm: mmap.mmap) -> None:
    """Map every page of a private mapping readable in one call, without breaking copy-on-write.

    MAP_POPULATE on a private writable mapping would copy every page (it populates for writing);
    MADV_POPULATE_READ maps the shared pages as they are. On older kernels the verification pass
    faults them in instead.
    """
    try:
        mm.madvise(_MADV_POPULATE_READ)
    except (OSError, ValueError):
        pass
