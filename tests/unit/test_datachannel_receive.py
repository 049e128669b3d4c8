"""A data-channel receive hashes each piece as it lands (a running checksum): the same verdicts as hashing the chunk
afterwards, however the socket cuts the bytes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from memstore.core.model import Manifest, ShardKey
from memstore.errors import StreamChecksumError
from memstore.v1.datachannel import receive_verified
from memstore.v1.integrity import checksum, compute_checksums, running_checksum

pytestmark = pytest.mark.unit
CHUNK = 64 << 10


def test_a_running_checksum_equals_the_checksum_of_the_pieces_joined() -> None:
    data = bytes(range(256)) * 1000 + b"tail"
    for cut in (1, 7, 4096, len(data)):
        running = running_checksum()
        for off in range(0, len(data), cut):
            running.update(memoryview(data)[off : off + cut])
        assert running.intdigest() == checksum(data)


def receive(data: bytes, sent: bytes, write: int) -> bytearray:
    """``sent`` written in pieces of ``write`` bytes into one end of a socket pair; ``receive_verified`` on the other
    against the manifest of ``data``."""
    manifest = Manifest(ShardKey("job", 1, 0), 1, len(data), CHUNK, tuple(compute_checksums(memoryview(data), len(data), CHUNK)), "h0")
    a, b = socket.socketpair()
    dest = bytearray(len(data))

    def send() -> None:
        with a, contextlib.suppress(OSError):  # the receiver closes its end at the first bad chunk
            for off in range(0, len(sent), write):
                a.sendall(sent[off : off + write])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        with b:
            receive_verified(b, manifest, memoryview(dest), deadline=time.monotonic() + 30)
    finally:
        sender.join(10)
    return dest


@pytest.mark.parametrize("write", [997, CHUNK, 3 * CHUNK + 5])
def test_pieces_of_any_size_are_verified_chunk_by_chunk(write: int) -> None:
    data = bytes((i * 31) % 251 for i in range(5 * CHUNK + 123))
    assert receive(data, data, write) == data
    corrupt = bytearray(data)
    corrupt[2 * CHUNK + 500] ^= 0xFF  # in chunk 2, away from any piece boundary
    with pytest.raises(StreamChecksumError, match="chunk 2 of job/step=1/rank=0 failed its checksum on the data channel"):
        receive(data, bytes(corrupt), write)
