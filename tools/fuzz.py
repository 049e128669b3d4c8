"""Bounded fuzzing of live stores: random and mutated requests to every RPC, raw bytes to every port.

:func:`run_fuzz` sends ``count`` requests (or as many as fit in ``deadline_s``) to the stores at
``addresses`` and returns a :class:`FuzzReport`:

- typed gRPC calls: each method of the ``Store`` service (``Drain`` excepted: it makes the store leave)
  gets valid requests built from what the stores hold, mutated in one to three fields (huge and negative
  numbers, strings with path separators, NULs and unicode, the other member of a oneof, NaN and inf), or
  messages filled at random; streaming methods get mutated streams (a chunk before the header, a second
  header, chunks of the wrong size);
- raw gRPC calls: the serialized request truncated, bit-flipped, spliced with garbage or replaced by random
  bytes, sent on a generic ``unary_unary('/memstore.v1.Store/<Method>')`` with no (de)serializer;
- the data channel: garbage, short tickets, random tickets, valid tickets followed by corrupt, short,
  long, slow or abandoned payloads, a ticket used twice, reads abandoned midway;
- the gRPC port as plain TCP: random bytes, the HTTP/2 preface followed by garbage frames, partial writes.

Every call has a short deadline and every socket a short timeout; only the given addresses are contacted.
Writes that name a ``protected`` job (Allocate, Put, PrepareReceive, Delete) are pointed at a sacrificial
job instead, or skipped when they are raw bytes, so the data saved before the run stays the reference.
A store that refuses connections is a crash, one that does not answer Health in time a hang; an INTERNAL
answer produced by the servicer's catch-all (``internal error: ...``) is an untyped exception, recorded
with the request that caused it.
"""

from __future__ import annotations

import math
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message

from memstore.v1 import store_pb2 as pb
from memstore.v1.channel import CHANNEL_OPTIONS
from memstore.v1.integrity import checksum

SERVICE = pb.DESCRIPTOR.services_by_name["Store"]
_Field = Any  # a protobuf FieldDescriptor (its upb and pure-Python classes have different static types)
EXCLUDED_METHODS = frozenset({"Drain"})  # makes the store drain and exit: leaving is not a robustness failure
WRITE_METHODS = frozenset({"Allocate", "Put", "Contribute", "PrepareReceive", "Delete"})  # may drop or replace a job's copies
SACRIFICIAL_JOB = "fuzz-sacrificial"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TICKET_BYTES = 16
_MAX_DETAILS = 300

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_EDGE_INTS = (0, 1, -1, 2, 7, 255, 256, 4096, (64 << 20) + 1, 1 << 31, 1 << 32, 1 << 40, 1 << 62, 1 << 63, 1 << 64)
_DOUBLES = (0.0, -0.0, 0.001, 1.0, -1.0, 9.5, 1e9, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324)
_STRINGS = (
    "", ".", "..", "/", "../../etc/passwd", "a/b", "a\\b", "job/../../x", "\x00", "job\x00id", "ü", "日本語", "😀",
    "\u202e", "\ufeff", " ", "\n", "a" * 129, "x" * 10_000, "h0", "h1", "127.0.0.1:1", "none", "zstd", "zstd-shuffle4",
    "xxh3_64", "crc32", "%s%n%x", "'; DROP TABLE x; --", "fuzz", "fuzz.job-1", "-", "_", "0",
)  # fmt: skip


@dataclass
class FuzzReport:
    """What a fuzz run sent and what came back."""

    seed: int
    requests: Counter[str] = field(default_factory=Counter)  # kind ("grpc:Put", "raw:Get", "data:short-ticket", ...) -> count
    status_codes: Counter[str] = field(default_factory=Counter)  # "Method CODE" (and "data status N") -> count
    crashes: list[str] = field(default_factory=list)  # a store that stopped accepting connections
    hangs: list[str] = field(default_factory=list)  # a call or health probe that overran its deadline
    internal_errors: list[str] = field(default_factory=list)  # untyped exceptions behind INTERNAL answers (first of each)
    skipped: int = 0  # raw writes that parsed as writes of a protected job
    retargeted: int = 0  # typed writes of a protected job pointed at SACRIFICIAL_JOB instead
    elapsed_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def by_family(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for kind, n in self.requests.items():
            out[kind.split(":", 1)[0]] += n
        return dict(out)

    def summary(self) -> str:
        lines = [f"fuzz seed {self.seed}: {self.total} requests in {self.elapsed_s:.1f}s {self.by_family()}"]
        lines += [f"  {kind:32s} {n}" for kind, n in sorted(self.requests.items())]
        lines.append("  status: " + ", ".join(f"{k}={n}" for k, n in sorted(self.status_codes.items())))
        lines.append(f"  crashes={self.crashes} hangs={self.hangs} skipped={self.skipped} retargeted={self.retargeted}")
        lines += [f"  INTERNAL: {e}" for e in self.internal_errors]
        return "\n".join(lines)


@dataclass(frozen=True)
class Held:
    """A shard a store holds (from List): the keys valid requests are built from."""

    key: pb.ShardKey
    world_size: int
    nbytes: int


def message_class(desc: Descriptor) -> type[Message]:
    cls: type[Message] = message_factory.GetMessageClass(desc)
    return cls


def fuzzed_methods() -> list[MethodDescriptor]:
    return [m for m in SERVICE.methods if m.name not in EXCLUDED_METHODS]


# -- values and messages --------------------------------------------------------------------------------------------


class Values:
    """Interesting values for each protobuf field type, plus the names the stores actually use."""

    def __init__(self, rng: random.Random, names: Sequence[str]) -> None:
        self.rng = rng
        self.strings = [*_STRINGS, *names]

    def integer(self, ftype: int) -> int:
        lo, hi = _INT_RANGES[ftype]
        r = self.rng.random()
        if r < 0.6:
            value = self.rng.choice(_EDGE_INTS) * self.rng.choice((1, 1, -1)) + self.rng.choice((0, 0, -1, 1))
        else:
            value = self.rng.randint(lo, hi) if r < 0.8 else self.rng.randint(-3, 1000)
        return min(hi, max(lo, value))

    def string(self) -> str:
        if self.rng.random() < 0.8:
            return self.rng.choice(self.strings)
        chars = (chr(self.rng.choice((self.rng.randint(32, 126), self.rng.randint(0xA0, 0xD7FF)))) for _ in range(self.rng.randint(0, 40)))
        return "".join(chars)

    def raw(self, limit: int = 200) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, limit))

    def scalar(self, f: _Field) -> Any:
        t = f.type
        if t in _INT_RANGES:
            return self.integer(t)
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return self.rng.choice(_DOUBLES) if self.rng.random() < 0.7 else self.rng.uniform(-1e6, 1e6)
        if t == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FieldDescriptor.TYPE_STRING:
            return self.string()
        return self.raw()


def _repeated(f: _Field) -> bool:
    flag = getattr(f, "is_repeated", None)  # protobuf >= 5; older ones have only ``label``
    return bool(flag) if flag is not None else f.label == FieldDescriptor.LABEL_REPEATED


def _is_map(f: _Field) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def set_field(msg: Message, f: _Field, values: Values, depth: int) -> None:
    """Give ``f`` of ``msg`` a random value (a few elements if repeated, a few entries if a map)."""
    rng = values.rng
    if _is_map(f):
        key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        target = getattr(msg, f.name)
        for _ in range(rng.randint(0, 4)):
            if value_f.type == FieldDescriptor.TYPE_MESSAGE:
                fill(target[values.scalar(key_f)], values, depth + 1)
            else:
                target[values.scalar(key_f)] = values.scalar(value_f)
    elif _repeated(f):
        target = getattr(msg, f.name)
        n = rng.choice((0, 1, 2, 3, 5, 1000)) if rng.random() < 0.95 else 100_000
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            for _ in range(min(n, 5)):
                fill(target.add(), values, depth + 1)
        else:  # many numbers, not many 10 kB strings
            target.extend(values.scalar(f) for _ in range(n if f.type in _INT_RANGES else min(n, 50)))
    elif f.type == FieldDescriptor.TYPE_MESSAGE:
        sub = getattr(msg, f.name)
        sub.SetInParent()
        if depth < 4:
            fill(sub, values, depth + 1)
    else:
        setattr(msg, f.name, values.scalar(f))


def fill(msg: Message, values: Values, depth: int = 0) -> Message:
    """Set a random subset of ``msg``'s fields (one member per oneof) to random values."""
    rng = values.rng
    f: _Field
    for f in msg.DESCRIPTOR.fields:
        if rng.random() < 0.6:
            set_field(msg, f, values, depth)
    return msg


def mutate(msg: Message, values: Values) -> Message:
    """A copy of ``msg`` with one to three fields, anywhere in it, changed: a new value, cleared, or another oneof member."""
    out = type(msg)()
    out.CopyFrom(msg)
    for _ in range(values.rng.randint(1, 3)):
        node = out
        while True:  # walk down to a random (sub)message
            fs: list[_Field] = list(node.DESCRIPTOR.fields)
            subs = [f for f in fs if f.type == FieldDescriptor.TYPE_MESSAGE and not _repeated(f) and node.HasField(f.name)]
            if not subs or values.rng.random() < 0.4:
                break
            node = getattr(node, values.rng.choice(subs).name)
        if not node.DESCRIPTOR.fields:
            continue
        f: _Field = values.rng.choice(node.DESCRIPTOR.fields)
        if values.rng.random() < 0.2:
            node.ClearField(f.name)
        else:
            if _repeated(f):
                node.ClearField(f.name)
            set_field(node, f, values, depth=2)
    return out


def mutate_bytes(data: bytes, values: Values) -> bytes:
    """Truncate, flip, splice, overwrite or extend serialized bytes; or a hand-made hostile encoding."""
    rng = values.rng
    how = rng.randrange(8)
    if how == 0 or not data:
        return values.raw(300)
    pos = rng.randrange(len(data))
    if how == 1:
        return data[:pos]
    if how == 2:
        return data[:pos] + bytes([data[pos] ^ (1 << rng.randrange(8))]) + data[pos + 1 :]
    if how == 3:
        return data[:pos] + values.raw(20) + data[pos:]
    if how == 4:
        return data + values.raw(50)
    if how == 5:  # a length-delimited field whose length runs far past the end
        return data + bytes([(rng.randint(1, 15) << 3) | 2]) + b"\xff\xff\xff\xff\x0f" + values.raw(10)
    if how == 6:  # a varint that never ends, or an unknown wire type
        return data + rng.choice((b"\x08" + b"\xff" * 11, b"\x0f", b"\x0b\x0c", b"\x1f\xff"))
    return bytes(b ^ 0xFF if rng.random() < 0.05 else b for b in data)


def job_ids(msg: Message) -> set[str]:
    """Every ``job_id`` anywhere in ``msg``."""
    found: set[str] = set()
    for f, value in msg.ListFields():
        if f.name == "job_id" and isinstance(value, str):
            found.add(value)
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(f):
            for sub in value if _repeated(f) else [value]:
                found |= job_ids(sub)
    return found


def retarget(msg: Message, protected: frozenset[str]) -> bool:
    """Point every ``job_id`` of ``msg`` that names a protected job at SACRIFICIAL_JOB; True if any did."""
    changed = False
    for f, value in msg.ListFields():
        if f.name == "job_id" and value in protected:
            setattr(msg, f.name, SACRIFICIAL_JOB)
            changed = True
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(f):
            for sub in value if _repeated(f) else [value]:
                changed = retarget(sub, protected) or changed
    return changed


def describe(msg: Message | bytes) -> str:
    if isinstance(msg, bytes):
        return f"raw {msg[:48].hex()}{'...' if len(msg) > 48 else ''} ({len(msg)} bytes)"
    text = " ".join(str(msg).split())
    return f"{type(msg).__name__} {{{text[:240]}{'...' if len(text) > 240 else ''}}}"


# -- the fuzzer -----------------------------------------------------------------------------------------------------


@dataclass
class _Target:
    address: str
    host: str
    channel: grpc.Channel
    data_port: int = 0


class Fuzzer:
    """The state of one run: channels, what the stores hold, the random source and the report."""

    def __init__(self, addresses: Sequence[str], seed: int, protected: Sequence[str], call_timeout: float,
                 metadata: Sequence[tuple[str, str]]) -> None:  # fmt: skip
        self.rng = random.Random(seed)
        self.report = FuzzReport(seed)
        self.protected = frozenset(protected)
        self.call_timeout = call_timeout
        self.metadata = tuple(metadata)
        self.targets = [_Target(a, a.rpartition(":")[0].strip("[]"), grpc.insecure_channel(a, options=CHANNEL_OPTIONS)) for a in addresses]
        self.held: list[Held] = []
        self.leases: list[str] = []
        self.serial = 0
        self.methods = {m.name: m for m in fuzzed_methods()}
        self.values = Values(self.rng, sorted(self.protected))

    def close(self) -> None:
        for t in self.targets:
            t.channel.close()

    # -- calls --------------------------------------------------------------------------------------------------
    def _callable(self, target: _Target, method: MethodDescriptor, raw: bool) -> Any:
        path = f"/{SERVICE.full_name}/{method.name}"
        request_cls, response_cls = message_class(method.input_type), message_class(method.output_type)
        ser: Callable[[Any], bytes] | None = None if raw else request_cls.SerializeToString
        de: Callable[[bytes], Any] | None = None if raw else response_cls.FromString
        if method.client_streaming:
            return target.channel.stream_unary(path, request_serializer=ser, response_deserializer=de)
        if method.server_streaming:
            return target.channel.unary_stream(path, request_serializer=ser, response_deserializer=de)
        return target.channel.unary_unary(path, request_serializer=ser, response_deserializer=de)

    def call(self, target: _Target, method: MethodDescriptor, request: Any, kind: str) -> Any:
        """One call with a short deadline; records its status. Returns the response (None on error)."""
        self.report.requests[f"{kind}:{method.name}"] += 1
        raw = kind == "raw"
        fn = self._callable(target, method, raw)
        t0 = time.monotonic()
        try:
            if method.server_streaming:
                response = self._drain_stream(fn(request, timeout=self.call_timeout, metadata=self.metadata))
            else:
                arg = iter(request) if method.client_streaming else request
                response = fn(arg, timeout=self.call_timeout, metadata=self.metadata)
            self.report.status_codes[f"{method.name} OK"] += 1
            return response
        except grpc.RpcError as err:
            self._record_error(method.name, err, request)
            return None
        finally:
            took = time.monotonic() - t0
            if took > self.call_timeout + 5.0:
                self.report.hangs.append(f"{method.name} on {target.address} took {took:.1f}s (deadline {self.call_timeout}s)")

    def _drain_stream(self, responses: Any) -> list[Any]:
        """Read a few messages of a server stream, sometimes all of them, sometimes cancel early."""
        keep = self.rng.choice((1, 2, 1000))
        out = []
        for item in responses:
            out.append(item)
            if len(out) >= keep:
                responses.cancel()
                break
        return out

    def _record_error(self, method: str, err: grpc.RpcError, request: Any) -> None:
        code = err.code()
        details = err.details() or ""
        name = code.name if code is not None else "NONE"
        if code == grpc.StatusCode.INTERNAL and "deserializ" in details:  # gRPC's own answer to bytes that do not parse
            name = "INTERNAL(unparsable)"
        self.report.status_codes[f"{method} {name}"] += 1
        if code == grpc.StatusCode.INTERNAL and details.startswith("internal error:"):
            first = request[0] if isinstance(request, list) and request else request
            entry = f"{method}: {details[:_MAX_DETAILS]} <- {describe(first) if isinstance(first, (Message, bytes)) else first!r}"
            seen = any(e.startswith(f"{method}: {details[:80]}") for e in self.report.internal_errors)
            if len(self.report.internal_errors) < 50 and not seen:
                self.report.internal_errors.append(entry)

    # -- setup --------------------------------------------------------------------------------------------------
    def discover(self) -> None:
        """Learn each store's data port and the shards it holds (valid requests are built from them)."""
        for t in self.targets:
            hello = self._plain_call(t, "Hello", pb.HelloRequest())
            t.data_port = int(hello.data_port) if hello is not None else 0
            listing = self._plain_call(t, "List", pb.ListRequest())
            for s in listing.shards if listing is not None else ():
                self.held.append(Held(s.manifest.key, s.manifest.world_size, s.manifest.nbytes))

    def _plain_call(self, t: _Target, name: str, request: Message) -> Any:
        try:
            return self._callable(t, self.methods[name], raw=False)(request, timeout=max(self.call_timeout, 5.0), metadata=self.metadata)
        except grpc.RpcError:
            return None

    # -- valid requests ------------------------------------------------------------------------------------------
    def fuzz_key(self) -> pb.ShardKey:
        self.serial += 1
        return pb.ShardKey(job_id=f"fuzz-{self.rng.randrange(4)}", step=self.serial, rank=0, timeline=self.rng.choice(("", "t1")))

    def held_key(self) -> pb.ShardKey:
        if self.held and self.rng.random() < 0.85:
            return self.rng.choice(self.held).key
        return self.fuzz_key()

    def shard(self, nbytes: int | None = None) -> tuple[pb.PutHeader, list[bytes]]:
        """A valid header (fuzz job, right checksums) and the chunks of random bytes it describes."""
        n = self.rng.randint(1, 6000) if nbytes is None else nbytes
        chunk = self.rng.choice((64, 1000, 4096, 1 << 20))
        data = self.rng.randbytes(n)
        chunks = [data[i : i + chunk] for i in range(0, n, chunk)]
        manifest = pb.Manifest(key=self.fuzz_key(), world_size=1, nbytes=n, chunk_size=chunk, chunk_checksums=[checksum(c) for c in chunks],
                               checksum_algo="xxh3_64", owner_host="fuzz", created_unix=time.time())  # fmt: skip
        origin = self.rng.choice((pb.PUT_ORIGIN_CLIENT, pb.PUT_ORIGIN_REPLICA, pb.PUT_ORIGIN_REPAIR))
        return pb.PutHeader(manifest=manifest, origin=origin, sender_host="fuzz"), chunks

    def template(self, name: str) -> Any:
        """A valid request of method ``name`` (a list of messages for a client stream)."""
        key = self.held_key()
        builders: dict[str, Callable[[], Any]] = {
            "Allocate": lambda: pb.AllocateRequest(key=self.fuzz_key(), world_size=1, nbytes=self.rng.randint(1, 8192)),
            "Commit": lambda: pb.CommitRequest(lease_id=self.rng.choice(self.leases) if self.leases else "0" * 32, format_version=1),
            "Put": lambda: self._put_stream(),
            "Contribute": lambda: self._contribute_stream(),
            "WaitCommitted": lambda: pb.WaitCommittedRequest(key=key, timeout_seconds=self.rng.choice((0.0, 0.05))),
            "Open": lambda: pb.OpenRequest(key=key),
            "Release": lambda: pb.ReleaseRequest(lease_id=self.rng.choice(self.leases) if self.leases else "x"),
            "Get": lambda: pb.GetRequest(key=key),
            "Fetch": lambda: pb.FetchRequest(key=key),
            "List": lambda: pb.ListRequest(job_id=key.job_id),
            "Delete": lambda: pb.DeleteRequest(job_id=self.fuzz_key().job_id, step=self.rng.choice((-1, self.serial)), rank=-1),
            "LatestStep": lambda: pb.LatestStepRequest(job_id=key.job_id),
            "PrepareReceive": lambda: self.shard()[0],
            "PrepareSend": lambda: pb.GetRequest(key=key),
        }
        build = builders.get(name)
        return build() if build is not None else message_class(self.methods[name].input_type)()

    def _put_stream(self) -> list[pb.PutRequest]:
        header, chunks = self.shard()
        return [pb.PutRequest(header=header), *(pb.PutRequest(chunk=c) for c in chunks)]

    def _contribute_stream(self) -> list[pb.ContributeRequest]:
        """A parity contribution as an ec store sends one: a header (filled with fuzz values), then its bytes."""
        header: Any = fill(pb.ContributeHeader(), self.values)
        return [pb.ContributeRequest(header=header), *(pb.ContributeRequest(data=c) for c in self.shard()[1])]

    # -- one typed gRPC request ----------------------------------------------------------------------------------
    def grpc_request(self) -> None:
        method = self.rng.choice(list(self.methods.values()))
        request = self.template(method.name)
        r = self.rng.random()
        if method.client_streaming:
            request = self._mutate_stream(request)
        elif r < 0.15:
            request = fill(message_class(method.input_type)(), self.values)
        elif r < 0.8:
            request = mutate(request, self.values)
        messages = request if isinstance(request, list) else [request]
        if method.name in WRITE_METHODS and any(retarget(m, self.protected) for m in messages):
            self.report.retargeted += 1
        target = self.rng.choice(self.targets)
        response = self.call(target, method, request, "grpc")
        self._follow_up(target, method.name, response)

    def _mutate_stream(self, stream: list[Message]) -> list[Message]:
        """A client stream (a header, then chunks: Put's ``chunk``, Contribute's ``data``) mutated one of six ways."""
        rng = self.rng
        kind = type(stream[0])
        field = "chunk" if kind is pb.PutRequest else "data"
        how = rng.randrange(6)
        if how == 0:  # a mutated header
            return [mutate(stream[0], self.values), *stream[1:]]
        if how == 1:  # a chunk first (the other member of the oneof)
            return stream[1:] + stream[:1]
        if how == 2:  # a second header in the middle
            return [*stream[:2], stream[0], *stream[2:]]
        if how == 3 and len(stream) > 1:  # a chunk corrupted, cut or padded
            i = rng.randrange(1, len(stream))
            chunk = getattr(stream[i], field)
            bad = rng.choice((chunk[:-1], chunk + b"x", bytes(len(chunk)), b""))
            return [*stream[:i], kind(**{field: bad}), *stream[i + 1 :]]
        if how == 4:  # cut short, or nothing at all
            return stream[: rng.randrange(len(stream))]
        return [fill(kind(), self.values) for _ in range(rng.randint(1, 4))]

    def _follow_up(self, target: _Target, name: str, response: Any) -> None:
        """Keep leases from Allocate/Open for later Commit/Release requests; release opened shards."""
        lease = getattr(response, "lease_id", "") if response is not None else ""
        if not lease:
            return
        self.leases = [*self.leases[-20:], lease]
        if name == "Open" and self.rng.random() < 0.8:
            self._plain_call(target, "Release", pb.ReleaseRequest(lease_id=lease))

    # -- one raw gRPC request ------------------------------------------------------------------------------------
    def raw_request(self) -> None:
        method = self.rng.choice(list(self.methods.values()))
        request_cls = message_class(method.input_type)
        template = self.template(method.name)
        messages = template if isinstance(template, list) else [template]
        raws = [mutate_bytes(m.SerializeToString(), self.values) for m in messages[: self.rng.randint(1, 4)]]
        if method.name in WRITE_METHODS and any(self._protected_write(request_cls, b) for b in raws):
            self.report.skipped += 1
            return
        request: Any = raws if method.client_streaming else raws[0]
        self.call(self.rng.choice(self.targets), method, request, "raw")

    def _protected_write(self, request_cls: type[Message], data: bytes) -> bool:
        try:
            parsed = request_cls.FromString(data)
        except DecodeError:
            return False
        return bool(job_ids(parsed) & self.protected)

    # -- the data channel ----------------------------------------------------------------------------------------
    def _connect(self, target: _Target, port: int) -> socket.socket | None:
        try:
            return socket.create_connection((target.host, port), timeout=1.0)
        except OSError as exc:
            self.report.crashes.append(f"{target.host}:{port} refused a connection: {exc}")
            return None

    def _exchange(self, sock: socket.socket, pieces: Sequence[bytes], pause: float = 0.0, read: int = 64, wait: float = 0.0) -> bytes:
        """Send ``pieces`` (pausing between them), mostly half-close, then read up to ``read`` bytes until EOF or
        timeout (``wait``, else a short random one)."""
        got = b""
        try:
            for piece in pieces:
                sock.sendall(piece)
                if pause:
                    time.sleep(pause)
            if self.rng.random() < 0.8:
                sock.shutdown(socket.SHUT_WR)  # the peer sees EOF now instead of waiting for more
            sock.settimeout(wait or self.rng.choice((0.01, 0.05, 0.2)))
            while read > 0:
                data = sock.recv(min(read, 65536))
                if not data:
                    break
                got += data
                read -= len(data)
        except OSError:
            pass
        return got

    def data_request(self) -> None:
        target = self.rng.choice(self.targets)
        if not target.data_port:
            return
        scenarios: list[tuple[str, Callable[[_Target], None]]] = [
            ("garbage", lambda t: self._data_plain(t, [self.values.raw(200)])),
            ("short-ticket", lambda t: self._data_plain(t, [self.rng.randbytes(self.rng.randint(0, TICKET_BYTES - 1))])),
            ("random-ticket", lambda t: self._data_plain(t, [self.rng.randbytes(TICKET_BYTES), self.values.raw(4096)])),
            ("push", self._data_push),
            ("pull", self._data_pull),
        ]
        name, run = self.rng.choice(scenarios)
        self.report.requests[f"data:{name}"] += 1
        run(target)

    def _data_plain(self, target: _Target, pieces: list[bytes]) -> None:
        sock = self._connect(target, target.data_port)
        if sock is not None:
            with sock:
                self._exchange(sock, pieces)

    def _data_push(self, target: _Target) -> None:
        """A valid ticket for a push, then the payload exact, corrupt, short, long, slow or abandoned; sometimes reused."""
        header, chunks = self.shard()
        ticket = self._plain_call(target, "PrepareReceive", header)
        if ticket is None:
            return
        payload = b"".join(chunks)
        variant = self.rng.choice(("exact", "corrupt", "short", "long", "slow", "abandon", "reuse"))
        if variant == "corrupt":
            i = self.rng.randrange(len(payload))
            payload = payload[:i] + bytes([payload[i] ^ 0x5A]) + payload[i + 1 :]
        elif variant == "short":
            payload = payload[: self.rng.randrange(len(payload))]
        elif variant == "long":
            payload += self.values.raw(500)
        sock = self._connect(target, int(ticket.data_port) or target.data_port)
        if sock is None:
            return
        with sock:
            if variant == "abandon":
                sock.sendall(ticket.ticket + payload[: len(payload) // 2])
                return
            if variant == "short":
                sock.sendall(ticket.ticket + payload)
                sock.shutdown(socket.SHUT_WR)
            thirds = [payload[: len(payload) // 3], payload[len(payload) // 3 :]] if variant == "slow" else [payload]
            pieces = [ticket.ticket, *thirds] if variant != "short" else []
            status = self._exchange(sock, pieces, pause=0.02 if variant == "slow" else 0.0, read=1, wait=2.0)
        self.report.status_codes[f"data status {status[:1].hex() or 'none'}"] += 1
        if variant == "reuse":
            self._data_plain(target, [ticket.ticket, payload])

    def _data_pull(self, target: _Target) -> None:
        """A valid ticket for a read of a held shard; the reader abandons it midway or reads it all."""
        if not self.held:
            return
        response = self._plain_call(target, "PrepareSend", pb.GetRequest(key=self.rng.choice(self.held).key))
        if response is None:
            return
        sock = self._connect(target, int(response.data_port) or target.data_port)
        if sock is not None:
            with sock:
                want = int(response.manifest.nbytes)
                self._exchange(sock, [response.ticket], read=self.rng.choice((0, 1, want // 2, want)))

    # -- the gRPC port as plain TCP -------------------------------------------------------------------------------
    def tcp_request(self) -> None:
        target = self.rng.choice(self.targets)
        port = int(target.address.rpartition(":")[2])
        variants: dict[str, list[bytes]] = {
            "garbage": [self.values.raw(500)],
            "preface-garbage": [HTTP2_PREFACE, self.values.raw(300)],
            "bad-frame": [HTTP2_PREFACE, self._h2_frame()],
            "partial-preface": [HTTP2_PREFACE[: self.rng.randrange(len(HTTP2_PREFACE))]],
            "http1": [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"],
        }
        name = self.rng.choice(sorted(variants))
        self.report.requests[f"tcp:{name}"] += 1
        sock = self._connect(target, port)
        if sock is not None:
            with sock:
                self._exchange(sock, variants[name], pause=0.01 if self.rng.random() < 0.1 else 0.0, read=256)

    def _h2_frame(self) -> bytes:
        """An HTTP/2 frame header of random type and flags, claiming a random length, with a shorter random payload."""
        length = self.rng.choice((0, 5, 16_384, (1 << 24) - 1))
        frame_type = self.rng.choice((0, 1, 3, 4, 6, 8, 9, 0x20))
        stream = self.rng.choice((0, 1, 3, (1 << 31) - 1))
        return length.to_bytes(3, "big") + bytes([frame_type, self.rng.randrange(256)]) + stream.to_bytes(4, "big") + self.values.raw(64)

    # -- liveness ------------------------------------------------------------------------------------------------
    def probe(self, timeout: float = 5.0) -> None:
        """Every store answers Health within ``timeout``; else a crash (refused) or a hang (no answer) is recorded."""
        for t in self.targets:
            try:
                self._callable(t, self.methods["Health"], raw=False)(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)
            except grpc.RpcError as err:
                what = "hang" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "crash"
                entry = f"{t.address}: Health failed after {self.report.total} requests: {err.code()} {err.details()}"
                (self.report.hangs if what == "hang" else self.report.crashes).append(entry)


_FAMILIES: tuple[tuple[str, float], ...] = (("grpc", 0.45), ("raw", 0.30), ("data", 0.13), ("tcp", 0.12))


def run_fuzz(
    addresses: Sequence[str],
    seed: int,
    count: int,
    deadline_s: float,
    *,
    protected_jobs: Sequence[str] = (),
    call_timeout: float = 2.0,
    probe_every: int = 500,
    metadata: Sequence[tuple[str, str]] = (),
) -> FuzzReport:
    """Send ``count`` random and mutated requests to the stores at ``addresses`` (fewer if ``deadline_s`` runs out).

    ``protected_jobs``: jobs whose copies must survive: writes naming them are retargeted or skipped.
    ``metadata``: sent with every gRPC call (e.g. an auth token, so the fuzz reaches past authorization).
    """
    fuzzer = Fuzzer(addresses, seed, protected_jobs, call_timeout, metadata)
    actions: dict[str, Callable[[], None]] = {
        "grpc": fuzzer.grpc_request, "raw": fuzzer.raw_request, "data": fuzzer.data_request, "tcp": fuzzer.tcp_request,
    }  # fmt: skip
    names, weights = zip(*_FAMILIES, strict=True)
    start = time.monotonic()
    try:
        fuzzer.discover()
        next_probe = probe_every
        while fuzzer.report.total < count and time.monotonic() - start < deadline_s:
            actions[fuzzer.rng.choices(names, weights)[0]]()
            if fuzzer.report.total >= next_probe:
                next_probe += probe_every
                fuzzer.probe()
        fuzzer.probe()
    finally:
        fuzzer.close()
        fuzzer.report.elapsed_s = time.monotonic() - start
    return fuzzer.report
