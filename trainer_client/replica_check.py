"""``verify_replicas``: do the members of a replica group really hold the same state? One all-reduce says.

Internal to ``CheckpointClient`` (users pass ``verify_replicas=True``); not public API.

Each member computes :func:`state_fingerprint` of its state, a 63-bit hash of:

* the state's skeleton as the shard format describes it (:mod:`trainer_client.serialization.walk`): every
  container, key and non-tensor leaf (ints, floats bit for bit, strings, ``None``, dtypes, ...), with sets in a
  canonical order. Dicts count in insertion order: replicas build their states with the same code, so a dict whose
  keys came in another order is a different state here, as it is in the shard;
* every blob's record as the header writes it (kind, dtype, shape, ``requires_grad``, Parameter), less the device:
  a state on ``cuda:3`` and its copy on ``cuda:0`` or on the CPU fingerprint alike;
* the raw bits of a sample of each tensor's and array's elements in logical (row-major) order: all of them for a
  tensor of at most ``samples_per_tensor`` elements, else ``samples_per_tensor`` of them, the first, the last and
  one drawn in each of the evenly spaced gaps between (where in the gap: a fixed function of the blob's index and
  size, the same in every process); conj and neg views count by their values. ``bytes`` leaves count whole.

Cost: the walk of :func:`~trainer_client.serialization.encoder.plan` (no tensor data copied) plus, per device, one
upload of every sampled position, one ``take`` per tensor and ONE small copy back to the CPU (which waits for the
work queued on the current CUDA stream, as a capture does): it grows with the number of tensors, hardly with their
size (on 2 CPU cores: 10 to 20 ms for a 576-tensor transformer + AdamW state of 3.6 GB, 0.25 ms for 4 tensors of
256 MiB). What it cannot see: a difference only in elements it did not sample (a replica that differs in one
random element of a tensor of ``n`` passes with probability ``1 - samples/n``). It catches what goes wrong as a
whole: a member that restored another checkpoint, skipped or repeated a step, used another seed, dtype or config.
The same tensor object met twice (tied weights) is one blob, as in the shard, so tying is part of the structure.

:func:`verify_replicas` shares the fingerprints with one ``all_reduce`` (SUM) of an int64 tensor with one slot per
member. Every member takes part even when its own fingerprint or arguments failed (it writes -1), so all of them
raise together instead of some waiting in a collective the others left.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch
import xxhash

from trainer_client.agreement import collective_device
from trainer_client.errors import InvalidArgumentError, ReplicaMismatchError, SerializationError
from trainer_client.serialization.memory import GcPaused
from trainer_client.serialization.spec import BLOB_NDARRAY, BLOB_TENSOR
from trainer_client.serialization.walk import Kind, Planner, encode_tree

__all__ = ["state_fingerprint", "verify_replicas"]

_DOMAIN: Final = b"memstore replica fingerprint v1\0"
_FAILED: Final = -1  # a member's slot when it could not fingerprint its state or passed arguments that do not fit
_MASK63: Final = (1 << 63) - 1
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)


# -- the sample -------------------------------------------------------------------------------------------------


_ARANGE: Final = np.arange(1 << 16, dtype=np.int64)  # read-only slices serve as the positions of small blobs
_ARANGE.flags.writeable = False
_SAME_SIZE_INT: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """splitmix64's finalizer on a uint64 array (wraps silently, as array arithmetic does)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_positions(indices: Sequence[int], sizes: Sequence[int], k: int) -> list[np.ndarray[Any, Any]]:
    """The sampled element positions (row-major) of each blob, by its index in the state and its element count
    ``n``: all of them if ``n <= k``; else ``k`` strictly increasing ones from 0 to ``n - 1``: ``k`` evenly spaced
    points, each inner one moved forward by a hash of (index, n, which point) modulo the smallest gap, so that it
    never reaches the next. Computed for all blobs at once."""
    n = np.asarray(sizes, dtype=np.int64)
    out = [_ARANGE[:size] if size <= k else _ARANGE[:0] for size in sizes]  # the big ones: replaced below
    big = np.flatnonzero(n > k)
    if len(big):
        nb = n[big]
        base = (np.arange(k, dtype=np.int64) * (nb[:, None] - 1)) // (k - 1)
        gap = (nb - 1) // (k - 1)
        seed = _mix(np.asarray(indices, dtype=np.uint64)[big] * _GOLDEN + nb.astype(np.uint64))
        inner = _mix(seed[:, None] + np.arange(1, k - 1, dtype=np.uint64) * _GOLDEN)
        base[:, 1:-1] += (inner % gap.astype(np.uint64)[:, None]).astype(np.int64)
        for row, j in zip(base, big.tolist(), strict=True):
            out[j] = row
    return out


def _take(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` at row-major ``positions``, as a small contiguous tensor of their bits; any strides."""
    if t.is_conj() or t.is_neg():  # a view whose values are not its storage's bits: take the values
        return torch.take(t, positions).resolve_conj().resolve_neg()
    same = _SAME_SIZE_INT.get(t.element_size())  # an integer view: take has kernels for those (not for fp8, ...)
    return torch.take(t if same is None else t.view(same), positions)


def _tensor_samples(tensors: list[tuple[int, torch.Tensor]], k: int) -> dict[int, memoryview]:
    """The sampled bytes of each (blob index, tensor). Per device: the positions go over in one piece, each tensor
    gives one ``take`` on the device, and ONE small tensor comes back to the CPU."""
    out = {index: memoryview(b"") for index, t in tensors if t.numel() == 0}
    live = [(index, t) for index, t in tensors if index not in out]
    positions = sample_positions([index for index, _ in live], [t.numel() for _, t in live], k)
    by_device: dict[torch.device, list[int]] = {}
    for j, (_, t) in enumerate(live):
        by_device.setdefault(t.device, []).append(j)
    for device, js in by_device.items():
        sent = torch.from_numpy(np.concatenate([positions[j] for j in js])).to(device)
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for j, where in zip(js, sent.split([len(positions[j]) for j in js]), strict=True):
            index, t = live[j]
            picked = _take(t, where)
            by_dtype.setdefault(picked.dtype, []).append((index, picked))
        pieces = [torch.cat([picked for _, picked in items]).view(torch.uint8) for items in by_dtype.values()]
        host = torch.cat(pieces).cpu().numpy().data  # the one copy to the CPU
        start = 0
        for items in by_dtype.values():
            for index, picked in items:
                size = picked.numel() * picked.element_size()
                out[index] = host[start : start + size]
                start += size
    return out


def _array_sample(index: int, a: np.ndarray[Any, Any], k: int) -> bytes:
    if a.ndim == 0 or a.size <= k:
        return a.tobytes()  # row-major, whatever its strides
    return a[np.unravel_index(sample_positions([index], [a.size], k)[0], a.shape)].tobytes()


# -- the fingerprint -------------------------------------------------------------------------------------------


def _canonical_sets(node: Any) -> Any:
    """The encoded tree with every set's members in sorted order (a set of str iterates in a per-process order)."""
    if type(node) is not list:
        return node
    if node and node[0] in ("s", "F"):
        return [node[0], *sorted(node[1:], key=encode_tree)]
    return [_canonical_sets(child) for child in node]


def _described(kind: Kind, cache: dict[int, bytes]) -> bytes:
    """The blob's header record without its device, as bytes (once per :class:`Kind`: alike tensors share one)."""
    found = cache.get(id(kind))
    if found is None:
        record = json.loads(kind.record)
        record.pop("device", None)
        found = cache[id(kind)] = encode_tree(record).encode() + b"\0"
    return found


def state_fingerprint(state: Any, samples_per_tensor: int = 32) -> int:
    """A 63-bit fingerprint of a deterministic sample of ``state`` (what is hashed: the module's docstring).

    Equal states give equal fingerprints in every process and on every device (CPU or CUDA); states that differ in
    structure, key names, dtypes, shapes, non-tensor leaves or in any sampled element differ (with overwhelming
    probability). ``state`` is anything ``save()`` accepts; :class:`SerializationError` for what it refuses.
    """
    if type(samples_per_tensor) is not int or not 2 <= samples_per_tensor <= len(_ARANGE):
        raise InvalidArgumentError(
            f"samples_per_tensor must be an int from 2 (the first and last element) to {len(_ARANGE)}, got {samples_per_tensor!r}"
        )
    with GcPaused(), torch.no_grad():
        planner = Planner()
        try:
            root = planner.enc(state, None, 0)
        except RecursionError:
            raise SerializationError("state nests too deeply for Python's recursion limit", "state") from None
        planner.finish_tensors()
        tree = encode_tree(root)
        if '["s",' in tree or '["F",' in tree:  # cannot occur inside a JSON string, whose quotes are escaped
            tree = encode_tree(_canonical_sets(root))
        h = xxhash.xxh3_64(_DOMAIN)
        h.update(b"%d\0" % samples_per_tensor)
        h.update(tree.encode())
        srcs, kinds = planner.srcs, planner.kinds
        tensors = [(i, src) for i, (src, kind) in enumerate(zip(srcs, kinds, strict=True)) if kind.kind == BLOB_TENSOR]
        samples = _tensor_samples(tensors, samples_per_tensor)
        cache: dict[int, bytes] = {}
        for i, (src, kind) in enumerate(zip(srcs, kinds, strict=True)):
            h.update(_described(kind, cache))
            if kind.kind == BLOB_TENSOR:
                h.update(samples[i])
            elif kind.kind == BLOB_NDARRAY:
                h.update(_array_sample(i, src, samples_per_tensor))
            else:
                h.update(src)  # bytes / bytearray: whole
        return h.intdigest() & _MASK63


# -- the check -------------------------------------------------------------------------------------------------


def _position(group: Any, members: Sequence[int], rank: int) -> tuple[int, int, InvalidArgumentError | None]:
    """The group's size, this process's rank in it, and why ``members``/``rank`` do not fit it (None when they do).
    Raises at once for an object that is no initialized process group: there is nothing to take part in."""
    try:
        size, me = int(group.size()), int(group.rank())
    except (AttributeError, TypeError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"replica group {group!r:.80} is not an initialized torch.distributed process group that this process is a member of: {exc}"
        ) from None
    if not 0 <= me < size:
        raise InvalidArgumentError(f"this process is not a member of the replica group (its rank there is {me} of {size})")
    listed = list(members)
    if len(listed) != size or len(set(listed)) != size or not all(type(m) is int for m in listed):
        return (
            size,
            me,
            InvalidArgumentError(
                f"members {listed!r:.200} must be the {size} distinct job ranks of the replica group's {size} processes, "
                "in group-rank order"
            ),
        )
    if listed[me] != rank:
        return (
            size,
            me,
            InvalidArgumentError(
                f"this process is rank {me} of the replica group, so members[{me}] must be its job rank {rank}, "
                f"but members is {listed!r:.200}"
            ),
        )
    return size, me, None


def _odd_ones(values: list[int]) -> tuple[list[int], bool]:
    """The slots whose value differs from the majority's, and whether the majority was a tie (then: from slot 0's)."""
    counts = collections.Counter(values).most_common()
    tie = len(counts) > 1 and counts[0][1] == counts[1][1]
    reference = values[0] if tie else counts[0][0]
    return [i for i, v in enumerate(values) if v != reference], tie


def verify_replicas(state: Any, group: Any, members: Sequence[int], rank: int, samples_per_tensor: int = 32) -> None:
    """Check that every member of the replica group holds the same ``state``; a collective over ``group``.

    ``group``: the torch.distributed process group whose ranks are exactly the replica group's members;
    ``members``: their job ranks in group-rank order; ``rank``: this process's job rank. Every member must call it
    with the same ``samples_per_tensor``. Each member fingerprints its state (:func:`state_fingerprint`) and ONE
    ``all_reduce`` (SUM of an int64 tensor of one slot per member, each member writing its own; gloo and NCCL)
    shares them.

    Raises :class:`ReplicaMismatchError` on every member if the fingerprints are not all equal, naming the job ranks
    that differ from the majority (on a tie, those that differ from ``members[0]``; the error says it was a tie), or
    the members that could not fingerprint their state. A member whose own fingerprint or arguments failed raises
    that error instead (:class:`SerializationError`, :class:`InvalidArgumentError`), after taking part.
    :class:`InvalidArgumentError` at once if ``group`` is no initialized process group this process is in.
    """
    import torch.distributed as dist

    size, me, problem = _position(group, members, rank)
    error: Exception | None = problem
    mine = _FAILED
    if error is None:
        try:
            mine = state_fingerprint(state, samples_per_tensor)
        except Exception as exc:  # raised below, after the collective the other members are waiting in
            error = exc
    slots = torch.zeros(size, dtype=torch.int64)
    slots[me] = mine
    slots = slots.to(collective_device(group))
    dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=group)
    if error is not None:
        raise error
    values = [int(v) for v in slots.cpu().tolist()]
    listed = list(members)
    failed = [listed[i] for i, v in enumerate(values) if v == _FAILED]
    if failed:
        raise ReplicaMismatchError(
            f"replica group {listed}: job rank(s) {failed} could not fingerprint their state or passed arguments "
            "that do not fit the group (their own error says which); the replicas were not verified",
            ranks=tuple(failed),
            members=tuple(listed),
        )
    odd, tie = _odd_ones(values)
    if odd:
        ranks = tuple(listed[i] for i in odd)
        agree = size - len(odd)
        whose = f"that of job rank {listed[0]} (no majority: a tie)" if tie else f"the majority's ({agree} of {size} agree)"
        raise ReplicaMismatchError(
            f"replica group {listed}: job rank(s) {list(ranks)} hold a state that differs from {whose}; the members of "
            "a replica group must save identical states (check their seeds, the data they loaded and the steps they "
            "took, or save without replica_group)",
            ranks=ranks,
            members=tuple(listed),
            tie=tie,
        )
