"""Frames of the same-host control channel (memstore.v1.local_control), over a socket pair."""

from __future__ import annotations

import socket
import struct

import pytest

from memstore.v1.local_control import (
    MAX_FRAME,
    FrameError,
    error_payload,
    parse_error,
    recv_request,
    recv_response,
    send_request,
    send_response,
)

pytestmark = pytest.mark.unit


def test_request_and_response_round_trip() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_request(a, 2, "tøken", b"\x01\x02")
        assert recv_request(b) == (2, "tøken", b"\x01\x02")
        send_response(b, 0, b"abc")
        assert recv_response(a) == (0, b"abc")


def test_error_payload_keeps_message_and_trailing_metadata() -> None:
    payload = error_payload("no room", [("memstore-needed-bytes", "10")])
    assert parse_error(payload) == ("no room", (("memstore-needed-bytes", "10"),))
    assert parse_error(b"plain text")[0] == "plain text"


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (struct.pack("<I", MAX_FRAME + 1), "larger than"),
        (struct.pack("<I", 2) + b"\x01\x00", "too short"),
        (struct.pack("<I", 4) + b"\x01\x09\x00x", "runs past"),
        (struct.pack("<I", 5) + b"\x01\x02\x00\xff\xfe", "not UTF-8"),
        (struct.pack("<I", 10) + b"\x01", "closed after"),
    ],
)
def test_malformed_requests_raise_frame_error(raw: bytes, problem: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=problem):
            recv_request(b)
