"""The same-host control channel: the store's save-path calls over a Unix-domain socket, in microseconds.

A trainer on the store's machine allocates, commits and releases shared-memory segments many times per
job; over gRPC each call costs ~0.5-1 ms of Python-side framing and thread hand-offs, more than the copy
of a small state. A client that shares memory with its store (same boot id, the segment dir visible) also
reaches the store's Unix socket (``HelloResponse.control_socket``) and sends these calls there instead.
The calls are the gRPC methods themselves, served by the same servicer: same validation, same errors,
same authentication (the bearer token travels with every request).

Frames (little-endian):

- request: ``u32 length | u8 method | u16 token length | token (UTF-8) | request message (protobuf)``,
  ``length`` counting everything after itself;
- response: ``u32 length | u8 status | payload``: status 0 is OK and the payload the response message;
  otherwise the status is a ``grpc.StatusCode`` value's number and the payload a JSON object
  ``{"message": str, "metadata": [[key, value], ...]}`` (the gRPC call's details and trailing metadata).

Standard library only (plus the generated messages), so both packages can import it.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from memstore.v1 import store_pb2 as pb

#: method number -> (gRPC method name, request type, response type)
METHODS: dict[int, tuple[str, Any, Any]] = {
    1: ("Allocate", pb.AllocateRequest, pb.AllocateResponse),
    2: ("Commit", pb.CommitRequest, pb.CommitResponse),
    3: ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
    4: ("WaitCommitted", pb.WaitCommittedRequest, pb.WaitCommittedResponse),
    5: ("Open", pb.OpenRequest, pb.OpenResponse),
}
NUMBERS = {name: number for number, (name, _, _) in METHODS.items()}
OK = 0
MAX_FRAME = 16 << 20  # control messages are small; anything larger is a broken or hostile peer
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BH")
_STATUS = struct.Struct("<B")


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol, or closed mid-frame."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise FrameError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes is larger than {MAX_FRAME}")
    return recv_exact(sock, length)


def send_request(sock: socket.socket, method: int, token: str, message: bytes) -> None:
    tok = token.encode()
    body = _HEAD.pack(method, len(tok)) + tok + message
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_request(sock: socket.socket) -> tuple[int, str, bytes]:
    """(method, token, message bytes); FrameError on a malformed frame."""
    frame = _recv_frame(sock)
    if len(frame) < _HEAD.size:
        raise FrameError("request frame too short")
    method, token_len = _HEAD.unpack_from(frame)
    end = _HEAD.size + token_len
    if end > len(frame):
        raise FrameError("request token runs past the frame")
    try:
        token = frame[_HEAD.size : end].decode()
    except UnicodeDecodeError:
        raise FrameError("request token is not UTF-8") from None
    return method, token, frame[end:]


def send_response(sock: socket.socket, status: int, payload: bytes) -> None:
    sock.sendall(_LEN.pack(_STATUS.size + len(payload)) + _STATUS.pack(status) + payload)


def recv_response(sock: socket.socket) -> tuple[int, bytes]:
    frame = _recv_frame(sock)
    if not frame:
        raise FrameError("empty response frame")
    return frame[0], frame[1:]


def error_payload(message: str, metadata: Any = ()) -> bytes:
    return json.dumps({"message": message, "metadata": [[str(k), str(v)] for k, v in metadata or ()]}).encode()


def parse_error(payload: bytes) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(message, trailing metadata) of an error payload; a payload that is not ours becomes its text."""
    try:
        data = json.loads(payload)
        return str(data["message"]), tuple((str(k), str(v)) for k, v in data.get("metadata", ()))
    except (ValueError, KeyError, TypeError):
        return payload.decode(errors="replace"), ()
