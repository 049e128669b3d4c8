"""Stripes: one state that the D ranks of a data-parallel replica group hold, saved as D pieces and restored whole.

The group's state is planned as one ordinary shard (the *logical shard*, :func:`trainer_client.serialization.plan`);
its bytes ``[0, N)`` are cut into D contiguous ranges, and member ``i`` saves only range ``i``: the slices of the
header and of the blobs that fall in it. What member ``i`` saves under its own rank is itself an ordinary shard
(:func:`stripe_state`): a small dict naming the group and the range, the slices (views of the state's tensors, so a
CUDA tensor's slice is copied straight off the device like any tensor, and each member copies about N/D bytes),
and the rank's own unreplicated part. Nothing in the store changes: a stripe is replicated, spilled, drained and
repaired like any shard, and a step is restorable once every rank's shard (so every stripe) is.

A restore reads the D stripes (:func:`decode_stripe`: their slices left as spans of their memory, no tensor made) and
decodes the logical shard in place (:func:`assemble`): a large tensor that one slice holds whole is made once, as a
view of that slice (of its stripe's memory); the header, small blobs and the few blobs split between stripes are
copied to their offsets in an N-byte buffer whose other pages are never touched. The
bytes decoded are exactly the logical shard's (bit-exact by construction; a unit test compares them with
:func:`serialization.encode`). Cuts move to blob starts where that costs little evenness (:func:`bounds`), so
split blobs are rare.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memstore.v1.pagefaults import address_of
from trainer_client import serialization
from trainer_client.capture.device_restore import move_tree, onto_device
from trainer_client.errors import CorruptShardError, InvalidArgumentError
from trainer_client.serialization import Span
from trainer_client.serialization.dtypes import needs_raw_copy, raw_byte_view
from trainer_client.serialization.header import BlobSpec, read_header
from trainer_client.serialization.memory import parallel_memmove
from trainer_client.serialization.spec import BLOB_TENSOR, SMALL_COPY

__all__ = [
    "MARK", "StripePlan", "assemble", "bounds", "decode_stripe", "is_stripe", "merge", "split_state", "stripe_members", "stripe_state",
    "whole_state",
]  # fmt: skip

MARK = "memstore.stripe"  # the top-level key (and its value, the layout's version) that makes a saved dict a stripe
VERSION = 1
_ALIGN = 4096  # stripe boundaries fall on page multiples of the logical shard (its last stripe ends at N)...
_SNAP = 16  # ...or on a blob's start within 1/16 of a share of them: each stripe stays within 1/8 of even


def bounds(nbytes: int, count: int, starts: Sequence[int] = ()) -> list[int]:
    """Where the ``count`` stripes of an ``nbytes`` logical shard start, plus ``nbytes``: even shares, page-aligned, each
    moved to the nearest blob start (``starts``, ascending) within :data:`_SNAP` of a share, so that a blob split
    between two stripes (which a restore must copy whole) is rare: only one larger than that slack is split."""
    cuts = [min(nbytes, (nbytes * i // count) // _ALIGN * _ALIGN) for i in range(count)]
    slack = nbytes // count // _SNAP
    for i in range(1, count):
        at = bisect.bisect_left(starts, cuts[i])
        near = [s for s in starts[max(0, at - 1) : at + 1] if abs(s - cuts[i]) <= slack]
        if near:
            cuts[i] = min(near, key=lambda s: abs(s - cuts[i]))
    return [*cuts, nbytes]


@dataclass(frozen=True)
class StripePlan:
    """What one member saves for its stripe: ``state`` (an ordinary state to plan and save) and its sizes."""

    state: dict[str, Any]
    logical_nbytes: int  # N: the logical shard's bytes
    stripe_nbytes: int  # the bytes of it this stripe holds


def split_state(state: Any, replicated: Sequence[str] | None) -> tuple[Any, Any, list[Any] | None]:
    """(replicated part, own part, key order): ``replicated`` None means the whole state is replicated (own part None);
    else ``state`` must be a mapping and ``replicated`` names its top-level keys that every member holds alike."""
    if replicated is None:
        return state, None, None
    if isinstance(replicated, str) or not isinstance(replicated, Sequence):
        raise InvalidArgumentError(f"replicated={replicated!r} is invalid: expected a list of the state's top-level keys")
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(f"replicated={list(replicated)!r} needs a state that is a mapping; got {type(state).__name__}")
    missing = [k for k in replicated if k not in state]
    if missing:
        raise InvalidArgumentError(f"replicated={list(replicated)!r} names keys the state lacks: {missing!r} (it has {list(state)!r})")
    chosen = set(replicated)
    shared = {k: v for k, v in state.items() if k in chosen}
    own = {k: v for k, v in state.items() if k not in chosen}
    return shared, own, list(state)


def stripe_state(shared: Any, own: Any, order: list[Any] | None, members: Sequence[int], index: int) -> StripePlan:
    """Member ``index`` of ``members``' stripe of ``shared`` (planned here; the state must not change until it is saved),
    with this rank's ``own`` part and the original key ``order`` of a mixed state."""
    layout = serialization.plan(shared)
    cuts = bounds(layout.nbytes, len(members), layout.blob_starts())
    start, end = cuts[index], cuts[index + 1]
    offsets, pieces = _pieces(layout, start, end)
    state = {
        MARK: VERSION, "group": list(members), "index": index, "logical_nbytes": layout.nbytes, "start": start, "end": end,
        "offsets": offsets, "pieces": pieces, "own": own, "order": order,
    }  # fmt: skip
    return StripePlan(state, layout.nbytes, end - start)


def _pieces(layout: serialization.ShardLayout, start: int, end: int) -> tuple[list[int], list[Any]]:
    """The slices of ``layout``'s header and blobs inside ``[start, end)``, with their offsets in the logical shard."""
    offsets: list[int] = []
    pieces: list[Any] = []
    if start < layout.data_offset and start < end:
        offsets.append(start)
        pieces.append(layout.head()[start : min(end, layout.data_offset)])
    with torch.no_grad():
        for i in layout.blobs_between(start, end):
            src, offset, n = layout.slot(i)
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                offsets.append(lo)
                pieces.append(_byte_slice(src, lo - offset, hi - offset))
    return offsets, pieces


def _byte_slice(src: Any, lo: int, hi: int) -> Any:
    """Bytes ``[lo, hi)`` of a blob as the encoder writes it (C order, raw element bits): a view where it can be."""
    if isinstance(src, torch.Tensor):
        t = src.detach()
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            try:
                return t.reshape(-1).view(torch.uint8)[lo:hi]  # the common case: three views
            except RuntimeError:
                pass  # a dtype without a byte view
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        raw = raw_byte_view(t)
        if not raw.is_contiguous():
            raw = raw.contiguous()  # a strided tensor: one copy on its device
        return raw.reshape(-1)[lo:hi]
    if isinstance(src, np.ndarray):
        return np.ascontiguousarray(src).reshape(-1).view(np.uint8)[lo:hi]
    return bytes(memoryview(src)[lo:hi])


def decode_stripe(buf: Any) -> Any:
    """A stripe's shard (``buf``: writable, unchanging) decoded zero-copy with its slices left as
    :class:`~trainer_client.serialization.Span` s of ``buf``, so that :func:`assemble` makes each tensor of the state
    once. Where the rank's own part holds a large byte tensor too (a span that is not a slice), it is decoded as usual."""
    made: list[Span] = []
    state = serialization.decode(buf, zero_copy=True, spans=made)
    if made:
        pieces = state.get("pieces") if is_stripe(state) else None  # type: ignore[attr-defined]
        if not isinstance(pieces, list) or not set(map(id, pieces)).issuperset(map(id, made)):
            return serialization.decode(buf, zero_copy=True)
    return state


def is_stripe(obj: Any) -> bool:
    """Whether a decoded shard is a stripe (see :func:`stripe_state`)."""
    return isinstance(obj, dict) and obj.get(MARK) == VERSION and "pieces" in obj


def stripe_members(stripe: dict[str, Any]) -> list[int]:
    """The job ranks whose stripes :func:`assemble` needs, in stripe order."""
    members = stripe.get("group")
    if not isinstance(members, list) or not members or not all(isinstance(r, int) and r >= 0 for r in members):
        raise CorruptShardError(f"stripe names a bad replica group: {members!r}")
    return members


def assemble(stripes: Sequence[dict[str, Any]], device: torch.device | None, zero_copy: bool) -> Any:
    """The replicated state of a group from its decoded stripes (in stripe order), on ``device`` (None: the CPU, its
    large tensors views of the stripes with ``zero_copy``); :func:`merge` adds a mixed state's own part."""
    first = stripes[0]
    n = first.get("logical_nbytes")
    if not isinstance(n, int) or n < 0:
        raise CorruptShardError(f"stripe of ranks {first.get('group')!r} has a bad logical size {n!r}")
    members = stripe_members(first)
    expected: Any = 0
    for i, s in enumerate(stripes):
        if s.get("group") != members or s.get("index") != i or s.get("logical_nbytes") != n or s.get("start") != expected:
            raise CorruptShardError(
                f"stripe {i} of replica group {members} does not fit the others (group {s.get('group')!r}, index {s.get('index')!r}, "
                f"logical size {s.get('logical_nbytes')!r}, start {s.get('start')!r}; expected start {expected})"
            )
        expected = s.get("end")
        if not isinstance(expected, int) or expected < s["start"] or expected > n:
            raise CorruptShardError(f"stripe {i} of replica group {members} ends at {expected!r}, outside its logical size {n}")
    if expected != n:
        raise CorruptShardError(f"the stripes of replica group {members} cover {expected} of {n} bytes")
    return _decode(stripes, n, device, zero_copy)


def _decode(stripes: Sequence[dict[str, Any]], n: int, device: torch.device | None, zero_copy: bool) -> Any:
    """Decode the logical shard without copying it whole: a large tensor that one slice holds is made over that slice
    (its stripe's memory); the rest (the header, small and split blobs) is copied into an N-byte buffer whose other
    pages are never touched."""
    pieces = _pieces_of(stripes)
    buf = mmap.mmap(-1, max(1, n), flags=mmap.MAP_PRIVATE)  # zero pages until written: the padding stays zero
    base = address_of(buf)
    _copy_into(base, [(o, span) for o, span, whole in pieces if not whole])  # the header's slices, and every other kind
    parsed = read_header(memoryview(buf))
    spec_at = dict(zip(parsed[1], parsed[2], strict=False))  # blob offset -> its spec (one per distinct record)
    viewable: dict[int, bool] = {}  # by spec: a table's blobs of one record share it
    views: dict[int, Span] = {}
    copied: list[tuple[int, Span]] = []
    for o, span, whole in pieces:
        if whole:
            spec = spec_at.get(o)
            ok = None if spec is None else viewable.get(id(spec))
            if spec is not None and ok is None:
                ok = viewable[id(spec)] = _viewable(spec)
            if ok and span.nbytes == spec.nbytes:  # type: ignore[union-attr]
                views[o] = span
            else:
                copied.append((o, span))
    _copy_into(base, copied)
    state = serialization.decode(buf, zero_copy=True, views=views, parsed=parsed)  # its tensors keep buf and the stripes alive
    if device is not None:
        return onto_device(state, device)
    if not zero_copy:
        return move_tree(state, torch.Tensor.clone, copy_arrays=True)
    return state


def _viewable(spec: BlobSpec) -> bool:
    """Whether a blob of ``spec`` decodes as a view of its bytes (a large tensor of a dtype ``copy_`` handles)."""
    return spec.kind == BLOB_TENSOR and spec.nbytes > SMALL_COPY and not needs_raw_copy(spec.dtype)


def _pieces_of(stripes: Sequence[dict[str, Any]]) -> list[tuple[int, Span, bool]]:
    """Every stripe's slices: (offset in the logical shard, where its bytes lie, whether it is a tensor's), each checked
    to lie in its stripe's range."""
    out: list[tuple[int, Span, bool]] = []
    for i, s in enumerate(stripes):
        offsets, pieces = s.get("offsets"), s.get("pieces")
        if not isinstance(offsets, list) or not isinstance(pieces, list) or len(offsets) != len(pieces):
            raise CorruptShardError(f"stripe {i} of replica group {s.get('group')!r} has mismatched offsets and pieces")
        for offset, piece in zip(offsets, pieces, strict=True):
            span = piece if type(piece) is Span else _span_of(piece, i)
            if not isinstance(offset, int) or offset < s["start"] or offset + span.nbytes > s["end"]:
                raise CorruptShardError(f"stripe {i} of replica group {s.get('group')!r} holds a slice outside its range")
            out.append((offset, span, type(piece) is Span or isinstance(piece, torch.Tensor)))
    return out


def _copy_into(base: int, pieces: list[tuple[int, Span]]) -> None:
    """Copy each (offset, bytes) to ``base + offset`` (large ones in parallel)."""
    addresses: dict[int, int] = {}  # by buffer: a stripe's slices share one
    moves = []
    for offset, span in pieces:
        if span.nbytes:
            at = addresses.get(id(span.buffer))
            if at is None:
                at = addresses[id(span.buffer)] = address_of(span.buffer)
            moves.append((base + offset, at + span.offset, span.nbytes))
    parallel_memmove(moves)


def _span_of(piece: Any, index: int) -> Span:
    """A slice that a stripe decoded as an object (bytes, a tensor, an array) as a span of a writable CPU buffer."""
    if isinstance(piece, (bytes, bytearray)):
        return Span(bytearray(piece), 0, len(piece))
    if isinstance(piece, np.ndarray) and piece.dtype == np.uint8 and piece.ndim == 1:
        return Span(np.ascontiguousarray(piece), 0, piece.nbytes)
    if isinstance(piece, torch.Tensor) and piece.dtype == torch.uint8 and piece.dim() == 1:
        array = piece.detach().cpu().contiguous().numpy()  # on a device only where a store without stripes in its manifests served it
        return Span(array, 0, array.nbytes)
    raise CorruptShardError(f"stripe {index} holds a slice that is not bytes: {type(piece).__name__}")


def whole_state(rank: int, step: int, own: dict[str, Any], others: dict[int, Any], device: torch.device | None, zero_copy: bool) -> Any:
    """Rank ``rank``'s whole state at ``step`` from its own stripe and the other members' (by rank): the replicated part
    assembled bit-exactly (:func:`assemble`), with this rank's own part merged in (on ``device`` too)."""
    members = stripe_members(own)
    if rank not in members or own.get("index") != members.index(rank) or set(others) - set(members):
        raise CorruptShardError(f"rank {rank}'s shard of step {step} is a stripe of replica group {members} but not its own")
    stripes = [own if r == rank else others.get(r) for r in members]
    for r, stripe in zip(members, stripes, strict=True):
        if not is_stripe(stripe):
            raise CorruptShardError(f"rank {r}'s shard of step {step} is not a stripe of replica group {members}")
    replicated = assemble(stripes, device, zero_copy)  # type: ignore[arg-type]
    mine = own.get("own")
    if device is not None and mine is not None:
        mine = onto_device(mine, device)
    return merge(replicated, mine, own.get("order"))


def merge(replicated: Any, own: Any, order: list[Any] | None) -> Any:
    """The whole state of a member: the replicated part, with a mixed state's own part merged back in its key order."""
    if order is None:
        return replicated
    if not isinstance(replicated, dict) or not isinstance(own, dict) or not isinstance(order, list):
        raise CorruptShardError("a mixed stripe's parts are not mappings")
    parts = {**own, **replicated}
    if set(parts) != set(order):
        raise CorruptShardError(f"a mixed stripe's parts hold keys {sorted(map(str, parts))}, not {sorted(map(str, order))}")
    return {k: parts[k] for k in order}
