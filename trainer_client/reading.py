"""Reading one rank's shard of one version through the host's store: the store makes it local (pulling it from a
peer or the durable tier if need be) and verifies it; the client maps it copy-on-write (shared memory) or receives
it over the store's data channel, and decodes it. A copy that fails verification is discarded and fetched once
more. ``CheckpointClient.load`` decides *which* version; this module reads it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from memstore.core.model import Manifest
from memstore.v1 import store_pb2 as pb
from memstore.v1.integrity import first_mismatch
from memstore.v1.manifests import manifest_from_pb
from memstore.v1.pagefaults import address_of
from memstore.v1.streams import manifest_problem
from trainer_client import serialization
from trainer_client.agreement import Agreements
from trainer_client.capture.device_restore import HostToDevice, decode_onto, decode_registered, populate_for_reading
from trainer_client.capture.ring import CaptureRing
from trainer_client.chunk_check import ChunkCheck
from trainer_client.errors import CorruptShardError, NotFoundError
from trainer_client.stripes import StripeCopy, decode_stripe
from trainer_client.transport.link import StoreLink
from trainer_client.transport.remote import VERIFY_THREADS, byte_view

log = logging.getLogger(__name__)


class ShardReader:
    """Reads shards for one client (its collaborators: its store link, capture ring and agreements).

    Args:
        link: the client's connection to its store (``call``, ``control``, the data channel, ``shared_memory``).
        ring: the client's capture ring with shared memory (a restore onto a device DMAs straight out of a segment of
            it); None without.
        rank: the client's rank (for the log).
        agreement: the client's agreements: versions known durable are fetched without listing.
    """

    def __init__(self, link: StoreLink, ring: CaptureRing | None, rank: int, agreement: Agreements) -> None:
        self._link = link
        self._ring = ring
        self.shared_memory = link.shared_memory
        self.host_id = link.hello.host_id
        self.rank = rank
        self.agreement = agreement

    def read_stripe(self, key: pb.ShardKey) -> Any:
        """Another member's stripe: opened straight from the local store when it holds one (assembled ahead), else fetched."""
        if self.shared_memory:
            with contextlib.suppress(NotFoundError, CorruptShardError):  # a copy that fails verification: fetched anew below
                return self.read_shared(key, True, None, stripe=True)
        return self.fetch_and_read(key, True, None)

    def fetch_and_read(
        self, key: pb.ShardKey, zero_copy: bool, device: torch.device | None, on_stripe: Callable[[list[int]], None] | None = None,
        on_source: Callable[[str], None] | None = None, stripes: dict[int, Any] | None = None,
    ) -> Any:  # fmt: skip
        """One rank's shard of one version, made local by its store (pulled from a peer if need be) and decoded; a copy
        that fails verification is discarded and fetched once more. A stripe is read into host memory. ``on_source``: told
        where it came from (the client's ``last_load_source``); None for another member's stripe, which a store pulls as
        a cached copy. A stripe comes back undecoded, as a :class:`~trainer_client.stripes.StripeCopy` (decoded, its slices
        spans of its memory, where its manifest does not name its group: an older store).

        A stripe through shared memory, with ``stripes`` given: its group's other stripes that the store holds (it
        assembles them ahead) are opened in the same call (:meth:`read_stripes`) and put in ``stripes`` by rank;
        ``on_stripe`` is not called. Otherwise ``on_stripe`` is told the group before this stripe is read, so the
        caller can fetch the others meanwhile."""
        step = key.step
        for attempt in range(2):
            durable_known = (key.step, key.timeline) in self.agreement.durable  # agreed from the durable tier's one listing
            request = pb.FetchRequest(key=key, discard_local=attempt > 0, durable_known=durable_known, cached=on_source is None)
            fetched = self._link.call(
                lambda t, request=request: self._link.stub.Fetch(request, timeout=t + 600),  # type: ignore[misc]
                f"load step {step}",
                retries=3,
            )
            if on_source is not None:
                on_source(fetched.source_host or self.host_id)
            group = list(fetched.manifest.stripe.group) if fetched.manifest.HasField("stripe") else None
            stripe = group is not None
            batched = stripe and self.shared_memory and stripes is not None  # the others opened with it
            if group is not None:  # read as it is: its slices are spans until assembled
                zero_copy, device = True, None
                if on_stripe is not None and not batched:
                    on_stripe(group)
            try:
                if batched:
                    assert group is not None and stripes is not None
                    own, found = self.read_stripes(key, [_with_rank(key, r) for r in group if r != key.rank])
                    stripes.update(found)
                    return own
                if self.shared_memory:
                    return self.read_shared(key, zero_copy, device, stripe=stripe)
                return self.read_remote(key, zero_copy, device, stripe=stripe)
            except CorruptShardError as exc:
                log.warning("rank %d: copy of step %d failed verification (%s); asking the store for another", self.rank, step, exc)
                if attempt == 1:
                    raise
        raise AssertionError("unreachable")

    def read_stripes(self, key: pb.ShardKey, others: list[pb.ShardKey]) -> tuple[Any, dict[int, Any]]:
        """This rank's stripe and, opened in the same call (``OpenRequest.also``) and released in one, those of
        ``others`` this store holds; each a :class:`~trainer_client.stripes.StripeCopy` of its segment, mapped
        privately. The others by rank: one the store does not hold, or whose copy fails its check here, is left out
        (the caller fetches it)."""
        opened = self._link.control("Open", pb.OpenRequest(key=key, also=others), f"open step {key.step}", retries=3)
        found: dict[int, Any] = {}
        try:
            own = self._decode_on_host(opened, key, zero_copy=True, stripe=True)
            for other, answer in zip(others, opened.also, strict=False):  # an older store answers none of them
                if answer.lease_id:
                    try:
                        found[other.rank] = self._decode_on_host(answer, other, zero_copy=True, stripe=True)
                    except CorruptShardError as exc:
                        log.warning("rank %d: the stripe of rank %d failed verification (%s); fetching it", self.rank, other.rank, exc)
            return own, found
        finally:
            leases = [a.lease_id for a in opened.also if a.lease_id]
            self._link.control("Release", pb.ReleaseRequest(lease_id=opened.lease_id, also=leases), f"release step {key.step}")

    def read_shared(self, key: pb.ShardKey, zero_copy: bool, device: torch.device | None = None, stripe: bool = False) -> Any:
        # Onto a device the bytes are copied out before Release, so the segment stays recyclable (in its ring), and they
        # are verified here beside the copies (chunk_check), not by the store before them.
        request = pb.OpenRequest(key=key, transient=device is not None, reader_verifies=device is not None)
        opened = self._link.control("Open", request, f"open step {key.step}", retries=3)
        try:
            if device is None:
                return self._decode_on_host(opened, key, zero_copy, stripe)
            m = _manifest(opened, key)
            assert self._ring is not None  # shared memory: the client has its ring
            with self._ring.registered_view(opened.segment_path, m.nbytes) as ring_mm:
                if ring_mm is not None:  # a segment of this rank's ring (a same-process restore): DMA straight out of it
                    return self._onto_device(ring_mm, m, key, device, opened.verified, registered=True)
            mm = _map_private(opened.segment_path, m.nbytes)
            try:  # nothing may keep the mapping: the lease was transient
                return self._onto_device(mm, m, key, device, opened.verified, registered=False)
            finally:
                with contextlib.suppress(BufferError):  # numpy arrays still viewing it (zero_copy) keep it mapped
                    mm.close()
        finally:
            self._link.control("Release", pb.ReleaseRequest(lease_id=opened.lease_id), f"release step {key.step}")

    @staticmethod
    def _decode_on_host(opened: pb.OpenResponse, key: pb.ShardKey, zero_copy: bool, stripe: bool = False) -> Any:
        """The shard an ``Open`` lent, decoded in host memory from a private mapping of its segment (its lease held);
        a ``stripe`` left undecoded (:func:`_stripe_copy`)."""
        m = _manifest(opened, key)
        mm = _map_private(opened.segment_path, m.nbytes)
        if not opened.verified:  # an older store: verify here (the store verifies for this Open otherwise)
            populate_for_reading(mm)
            view = memoryview(mm)[: m.nbytes]
            try:
                bad = first_mismatch(view, m.nbytes, m.chunk_size, m.checksums, workers=VERIFY_THREADS)
            finally:
                view.release()
            if bad is not None:
                mm.close()
                raise CorruptShardError(f"chunk {bad} of step {key.step} rank {key.rank} failed its checksum")
        if stripe:
            return _stripe_copy(mm, m)
        if zero_copy:
            return serialization.decode(mm, zero_copy=True)  # tensors keep the mapping alive
        try:
            return serialization.decode(mm)
        finally:
            mm.close()

    @staticmethod
    def _onto_device(mm: mmap.mmap, m: Manifest, key: pb.ShardKey, device: torch.device, verified: bool, registered: bool) -> Any:
        """The shard in ``mm`` decoded onto ``device``; unless the store ``verified`` it, every chunk hashed beside the
        copies (``ChunkCheck``): nothing is returned before every byte verified."""
        check = None
        if not verified:
            view = memoryview(mm)[: m.nbytes]
            check = ChunkCheck(view, address_of(mm), m.chunk_size, m.checksums, f"step {key.step} rank {key.rank}")
        try:
            gate = check.gate if check is not None else None
            if registered:
                state = decode_registered(mm, m.nbytes, device, gate=gate)
            else:
                state = decode_onto(mm, device, zero_copy=False, copies=HostToDevice(gate=gate))
            if check is not None:
                check.finish()
            return state
        finally:
            if check is not None:
                check.close()

    def read_remote(self, key: pb.ShardKey, zero_copy: bool, device: torch.device | None = None, stripe: bool = False) -> Any:
        """Without shared memory: the shard over the store's data channel (gRPC streams if it has none), every
        chunk verified as it lands; with ``zero_copy`` large tensors are views of the received buffer (a ``stripe``
        left undecoded: :func:`_stripe_copy`)."""
        m, buf = self._link.data.get(key, f"read step {key.step}")
        if stripe:
            return _stripe_copy(byte_view(buf, m.nbytes), m)
        if device is not None:
            return decode_onto(byte_view(buf, m.nbytes), device, zero_copy)
        return serialization.decode(byte_view(buf, m.nbytes), zero_copy=zero_copy)


def _manifest(opened: pb.OpenResponse, key: pb.ShardKey) -> Manifest:
    m = manifest_from_pb(opened.manifest)
    problem = manifest_problem(m)
    if problem:
        raise CorruptShardError(f"store sent a bad manifest for step {key.step} rank {key.rank}: {problem}")
    return m


def _stripe_copy(buf: Any, m: Manifest) -> Any:
    """A stripe's verified bytes as a :class:`StripeCopy` of the stripe its manifest names; decoded, its slices spans of
    ``buf`` (:func:`~trainer_client.stripes.decode_stripe`), where the manifest names none (an older store)."""
    if m.stripe is None:
        return decode_stripe(buf)
    return StripeCopy(buf, m.nbytes, m.stripe)


def _map_private(path: str, nbytes: int) -> mmap.mmap:
    """A private (copy-on-write) mapping of a segment: the trainer may modify restored tensors freely and the store's
    copy never changes; the store never reuses a segment it let a reader map."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, max(1, nbytes), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _with_rank(key: pb.ShardKey, rank: int) -> pb.ShardKey:
    other = pb.ShardKey()
    other.CopyFrom(key)
    other.rank = rank
    return other
