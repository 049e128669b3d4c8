"""gRPC channel and server options every memstore endpoint uses, one comment per option."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from memstore.v1.integrity import MAX_CHUNK_BYTES

if TYPE_CHECKING:
    from memstore.v1.security import Credentials

# A message is one chunk plus a little framing; anything larger is refused by gRPC itself
# (RESOURCE_EXHAUSTED) before our code sees it.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead peer on an idle connection within ~20 s instead of the kernel's hours.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect quickly after a peer restarts (a replacement store comes back on the same address).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", 100),
    # Large flow-control windows: bulk chunks are MiB-sized.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    # Each channel gets its own TCP connection, so bulk pushes don't share one with control calls.
    ("grpc.use_local_subchannel_pool", 1),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Accept client keepalive pings at the rate the channels above send them.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Refuse reuse of a port another live store holds (a replacement must wait for the old one to die).
    ("grpc.so_reuseport", 0),
)


def insecure_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def store_stub(address: str, credentials: Credentials | None = None) -> tuple[grpc.Channel, Any]:
    """(channel, StoreStub) to the store at ``address``: the one way every caller builds a stub. Close the channel.

    ``credentials``: the token and TLS files to present (``memstore.v1.security``); by default from the
    environment (MEMSTORE_AUTH_TOKEN, MEMSTORE_TLS_CA, ...).
    """
    from memstore.v1 import store_pb2_grpc as pb_grpc
    from memstore.v1.security import Credentials

    creds = credentials if credentials is not None else Credentials.from_env()
    secure = creds.tls
    if secure:
        channel = grpc.secure_channel(address, creds.channel_credentials(), options=[*CHANNEL_OPTIONS, *creds.channel_options()])
    else:
        channel = insecure_channel(address)
    channel = creds.wrap(channel)
    return channel, pb_grpc.StoreStub(channel)


def boot_id() -> str:
    """This machine's kernel boot id: a client and a store that report the same one share memory ("" if unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


# Trailing-metadata keys of a RESOURCE_EXHAUSTED answer: the byte counts behind a refused write.
CAPACITY_METADATA = ("memstore-needed-bytes", "memstore-used-bytes", "memstore-capacity-bytes")


def capacity_numbers(err: grpc.RpcError) -> dict[str, int]:
    """``{"needed": .., "used": .., "capacity": ..}`` from a RESOURCE_EXHAUSTED error (0 where absent)."""
    raw: Any = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    found = {str(item[0]): str(item[1]) for item in (raw or ())}
    out: dict[str, int] = {}
    for key in CAPACITY_METADATA:
        name = key.removeprefix("memstore-").removesuffix("-bytes")
        try:
            out[name] = int(found.get(key, 0))
        except ValueError:
            out[name] = 0
    return out
