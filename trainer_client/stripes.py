"""Stripes: one state that the D ranks of a data-parallel replica group hold, saved as D pieces and restored whole.

The group's state is planned as one ordinary shard (the *logical shard*, :func:`trainer_client.serialization.plan`);
its bytes ``[0, N)`` are cut into D contiguous ranges, and member ``i`` saves only range ``i``: the slices of the
header and of the blobs that fall in it. What member ``i`` saves under its own rank is itself an ordinary shard
(:func:`stripe_state`): a small dict naming the group and the range, the slices (views of the state's tensors, so a
CUDA tensor's slice is copied straight off the device like any tensor, and each member copies about N/D bytes),
and the rank's own unreplicated part. Nothing in the store changes: a stripe is replicated, spilled, drained and
repaired like any shard, and a step is restorable once every rank's shard (so every stripe) is.

A restore reads the D stripes as their stores lend them (:class:`StripeCopy`: a shard's bytes and its manifest's
:class:`~memstore.core.model.Stripe`) and decodes the logical shard in place (:func:`assemble_copies`), without
decoding the other members' stripes: the manifests say which range of the logical shard each stripe holds (their
``stripe_nbytes`` in stripe order tile ``[0, N)``), the logical header (the first slices) says where its blobs lie,
and the shard format packs a stripe's slices, its first blobs, one after another from its data offset (read from its
prelude). So each slice's place in its stripe's memory follows; this rank's own stripe, decoded for its own part, must
say the same. A large tensor that one slice holds whole is made once, as a view of that slice (of its stripe's
memory); the header, small blobs and the few blobs split between stripes are copied to their offsets in an N-byte
buffer whose other pages are never touched. Stripes that a store did not name in their manifests (an older store) are
decoded (:func:`decode_stripe`: their slices left as spans of their memory) and assembled from the slices they list
(:func:`assemble`). The bytes decoded are exactly the logical shard's (bit-exact by construction; unit tests compare
them with :func:`serialization.encode`). Cuts move to blob starts where that costs little evenness (:func:`bounds`),
so split blobs are rare.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memstore.core.model import Stripe
from memstore.v1.pagefaults import address_of
from trainer_client import serialization
from trainer_client.capture.device_restore import move_tree, onto_device
from trainer_client.errors import CorruptShardError, InvalidArgumentError
from trainer_client.serialization import Span
from trainer_client.serialization.dtypes import needs_raw_copy, raw_byte_view
from trainer_client.serialization.header import BlobSpec, read_header
from trainer_client.serialization.memory import parallel_memmove
from trainer_client.serialization.spec import BLOB_TENSOR, FORMAT_VERSION, MAGIC, PRELUDE, PRELUDE_SIZE, SMALL_COPY, align

__all__ = [
    "MARK", "StripeCopy", "StripePlan", "assemble", "assemble_copies", "bounds", "decode_stripe", "is_stripe", "merge", "split_state",
    "stripe_members", "stripe_state", "whole_state",
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
    slices_only: bool  # the state holds the slices and no own part (its manifest says so: a restore need not decode it)


@dataclass(frozen=True)
class StripeCopy:
    """A member's stripe as its store lent or sent it, not decoded: its shard's bytes (``buffer``, at least ``nbytes``
    long, writable and unchanging: a private mapping of its segment or a received buffer) and its manifest's
    ``stripe`` (the group, its index there, the logical shard's size and how many of its bytes this stripe holds)."""

    buffer: Any
    nbytes: int
    stripe: Stripe


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
    return StripePlan(state, layout.nbytes, end - start, own is None and order is None)


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
    """Whether a shard as read is a stripe: a :class:`StripeCopy`, or a decoded stripe (see :func:`stripe_state`)."""
    return isinstance(obj, StripeCopy) or (isinstance(obj, dict) and obj.get(MARK) == VERSION and "pieces" in obj)


def stripe_members(stripe: StripeCopy | dict[str, Any]) -> list[int]:
    """The job ranks whose stripes a stripe's assembly needs, in stripe order."""
    members = list(stripe.stripe.group) if isinstance(stripe, StripeCopy) else stripe.get("group")
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
    return _placed(serialization.decode(buf, zero_copy=True, views=views, parsed=parsed), device, zero_copy)


def assemble_copies(copies: Sequence[StripeCopy], device: torch.device | None, zero_copy: bool) -> tuple[Any, list[dict[str, Any]]]:
    """The replicated state of a group from its stripes as read (in stripe order), as :func:`assemble` makes it, and
    what each stripe was read as holding: its range of the logical shard and its slices' offsets there, as a decoded
    stripe lists them (``{"start", "end", "offsets"}``). Nothing
    of a stripe is decoded: where each slice lies follows from the manifests and the logical header (the module's
    docstring); stripes whose manifests do not tile one logical shard, or whose slices would lie outside their shards,
    are refused (CorruptShardError)."""
    first = copies[0].stripe
    members, n = list(first.group), first.logical_nbytes
    ranges: list[tuple[int, int]] = []
    at = 0
    for i, c in enumerate(copies):
        s = c.stripe
        if list(s.group) != members or s.index != i or s.logical_nbytes != n:
            raise CorruptShardError(
                f"stripe {i} of replica group {members} does not fit the others (its manifest names group {list(s.group)}, "
                f"index {s.index}, logical size {s.logical_nbytes})"
            )
        ranges.append((at, at + s.stripe_nbytes))
        at += s.stripe_nbytes
    if at != n:
        raise CorruptShardError(f"the stripes of replica group {members} hold {at} bytes of a logical shard of {n}")
    return _decode_copies(copies, ranges, members, device, zero_copy)


def _decode_copies(
    copies: Sequence[StripeCopy], ranges: list[tuple[int, int]], members: list[int], device: torch.device | None, zero_copy: bool,
) -> tuple[Any, list[dict[str, Any]]]:  # fmt: skip
    """:func:`assemble_copies` once the ranges are known: each stripe's slices are read in order from its data offset,
    the header's first (copied into an N-byte buffer and parsed), then its blobs' (views or copies, as :func:`_decode`)."""
    n = ranges[-1][1]
    buf = mmap.mmap(-1, max(1, n), flags=mmap.MAP_PRIVATE)  # zero pages until written: the padding stays zero
    base = address_of(buf)
    at = [_data_offset(c, i, members) for i, c in enumerate(copies)]  # where each stripe's slices end so far
    held: list[dict[str, Any]] = [{"start": start, "end": end, "offsets": []} for start, end in ranges]
    head_end = _head_end(copies, ranges, at, members)
    head: list[tuple[int, Span]] = []
    for i, (start, end) in enumerate(ranges):
        if start < min(end, head_end):
            head.append((start, Span(copies[i].buffer, at[i], min(end, head_end) - start)))
            held[i]["offsets"].append(start)
            at[i] += head[-1][1].nbytes
            _check_held(copies, at, i, members)
    _copy_into(base, head)
    parsed = read_header(memoryview(buf))
    header, blob_at, specs = parsed
    if header["nbytes"] != n:
        raise CorruptShardError(f"the logical shard of replica group {members} is {header['nbytes']} bytes; its stripes' manifests say {n}")
    views: dict[int, Span] = {}
    copied: list[tuple[int, Span]] = []
    viewable: dict[int, bool] = {}  # by spec: alike blobs share one
    count = len(specs)
    for i, (start, end) in enumerate(ranges):
        first = max(0, bisect.bisect_right(blob_at, start, 0, count) - 1)  # the blob holding start, or the first
        last = bisect.bisect_left(blob_at, end, 0, count)  # the blobs before it start before end
        buffer, offsets = copies[i].buffer, held[i]["offsets"]
        if first < last and blob_at[first] < start:  # the stripe starts inside a blob: its first slice is the rest of it
            lo, hi = start, min(end, blob_at[first] + specs[first].nbytes)
            if lo < hi:
                copied.append((lo, Span(buffer, align(at[i]), hi - lo)))
                offsets.append(lo)
                at[i] = align(at[i]) + hi - lo
            first += 1
        # The others start at their blobs' starts, packed as in the logical shard: each at its offset there + shift.
        shift = align(at[i]) - blob_at[first] if first < last else 0
        for o, spec in zip(blob_at[first:last], specs[first:last], strict=True):
            nbytes = spec.nbytes if o + spec.nbytes <= end else end - o  # the last may hold the start of a blob only
            if nbytes:
                ok = viewable.get(id(spec))
                if ok is None:
                    ok = viewable[id(spec)] = _viewable(spec)
                if ok and nbytes == spec.nbytes:
                    views[o] = Span(buffer, o + shift, nbytes)
                else:
                    copied.append((o, Span(buffer, o + shift, nbytes)))
                offsets.append(o)
                at[i] = o + shift + nbytes
        _check_held(copies, at, i, members, last=True)
    _copy_into(base, copied)
    state = serialization.decode(buf, zero_copy=True, views=views, parsed=parsed)  # its tensors keep buf and the stripes alive
    return _placed(state, device, zero_copy), held


def _data_offset(copy: StripeCopy, index: int, members: list[int]) -> int:
    """Where a stripe's shard holds its first blob (its first slice), from its prelude."""
    if copy.nbytes < PRELUDE_SIZE:
        raise CorruptShardError(f"stripe {index} of replica group {members} is {copy.nbytes} bytes, too short for a shard")
    magic, version, header_len = PRELUDE.unpack_from(copy.buffer, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptShardError(
            f"stripe {index} of replica group {members} is not a shard of format version {FORMAT_VERSION} "
            f"(magic {bytes(magic)!r}, version {version})"
        )
    return align(PRELUDE_SIZE + header_len)


def _check_held(copies: Sequence[StripeCopy], at: list[int], i: int, members: list[int], last: bool = False) -> None:
    """Refuse stripe ``i`` if its slices would end (at ``at[i]``) past its shard: checked before a byte is copied. Once
    ``last`` (all read), a stripe whose manifest says it holds only its slices must end exactly there: a range other
    than the one it was cut at would not, as the slices at either side of a moved cut change length."""
    c = copies[i]
    if at[i] > c.nbytes or (last and c.stripe.slices_only and at[i] != c.nbytes):
        raise CorruptShardError(
            f"stripe {i} of replica group {members} is {c.nbytes} bytes, not what the slices of the range its manifest says "
            f"{'fill' if c.stripe.slices_only else 'need'} ({at[i]}): its manifest does not describe it"
        )


def _head_end(copies: Sequence[StripeCopy], ranges: list[tuple[int, int]], at: list[int], members: list[int]) -> int:
    """The logical shard's data offset (where its header's slices end), from its prelude: the first bytes of the first
    stripe that holds any."""
    i = next((i for i, (start, end) in enumerate(ranges) if start < end), None)
    if i is None or ranges[i][1] < PRELUDE_SIZE or at[i] + PRELUDE_SIZE > copies[i].nbytes:
        raise CorruptShardError(f"the stripes of replica group {members} do not hold a logical shard's prelude")
    magic, _, header_len = PRELUDE.unpack_from(copies[i].buffer, at[i])
    if magic != MAGIC:
        raise CorruptShardError(f"the logical shard of replica group {members} starts with {bytes(magic)!r}, not {MAGIC!r}")
    return min(align(PRELUDE_SIZE + header_len), ranges[-1][1])


def _placed(state: Any, device: torch.device | None, zero_copy: bool) -> Any:
    """A decoded logical shard on ``device``, or (on the CPU) with its own copies unless ``zero_copy``."""
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


def whole_state(
    rank: int, step: int, own: StripeCopy | dict[str, Any], others: dict[int, Any], device: torch.device | None, zero_copy: bool,
) -> Any:  # fmt: skip
    """Rank ``rank``'s whole state at ``step`` from its own stripe and the other members' (by rank), each a
    :class:`StripeCopy` or a decoded stripe: the replicated part assembled bit-exactly, with this rank's own part
    merged in (on ``device`` too). With every stripe a copy, none is decoded (:func:`assemble_copies`) but this rank's
    own where its manifest does not say it holds only its slices: decoded for its own part, it must list the slices
    the assembly read."""
    members = stripe_members(own)
    if rank not in members or set(others) - set(members):
        raise CorruptShardError(f"rank {rank}'s shard of step {step} is a stripe of replica group {members} but not its own")
    index = members.index(rank)
    stripes: list[Any] = [own if r == rank else others.get(r) for r in members]
    for r, stripe in zip(members, stripes, strict=True):
        if not is_stripe(stripe):
            raise CorruptShardError(f"rank {r}'s shard of step {step} is not a stripe of replica group {members}")
    copies = all(isinstance(s, StripeCopy) for s in stripes)
    mine: Any = None  # this rank's stripe decoded: None where every stripe is a copy and its manifest says it holds only slices
    if not (copies and own.stripe.slices_only):  # type: ignore[union-attr]
        mine = decode_stripe(own.buffer) if isinstance(own, StripeCopy) else own
        if not is_stripe(mine) or mine.get("group") != members or mine.get("index") != index:
            raise CorruptShardError(f"rank {rank}'s shard of step {step} is a stripe of replica group {members} but not its own")
    if copies:
        replicated, held = assemble_copies(stripes, device, zero_copy)
        wrong = [] if mine is None else [k for k, v in held[index].items() if mine.get(k) != v]
        if wrong:
            raise CorruptShardError(
                f"rank {rank}'s stripe of step {step} holds other slices than its replica group's manifests say: its "
                + ", ".join(f"{k} {mine.get(k)!r:.100} (not {held[index][k]!r:.100})" for k in wrong)
            )
    else:  # a store that did not name them in their manifests: each decoded, assembled from the slices it lists
        stripes[index] = mine
        replicated = assemble([decode_stripe(s.buffer) if isinstance(s, StripeCopy) else s for s in stripes], device, zero_copy)
    if mine is None:
        return replicated
    theirs = mine.get("own")
    if device is not None and theirs is not None:
        theirs = onto_device(theirs, device)
    return merge(replicated, theirs, mine.get("order"))


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
