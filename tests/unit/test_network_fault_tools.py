"""The network faults' tools: the TCP fault proxy (tools/faultproxy.py), where its bit flips land and its
modes on a live link, the recovery matrix's links, and the clock-jump library (tools/clockshift.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import clockshift
from tools.faultproxy import FaultProxy, flip_bits
from tools.recovery_matrix.links import Links, set_links

pytestmark = pytest.mark.unit


def test_bit_flips_land_on_every_nth_byte_of_the_link_across_pieces() -> None:
    data = bytes(10)
    out, n = flip_bits(data, 0, 4)
    assert n == 2 and [i for i, b in enumerate(out) if b] == [3, 7]  # the 4th and 8th byte, never the first
    out, n = flip_bits(data, 3, 4)  # the link already carried 3 bytes: its 4th byte is this piece's first
    assert n == 3 and [i for i, b in enumerate(out) if b] == [0, 4, 8]
    assert all(bin(b).count("1") == 1 for b in out if b)  # one bit per flipped byte
    assert flip_bits(b"abc", 0, 100) == (b"abc", 0)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A server that sends back what it receives, one connection at a time."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    server.close()


def roundtrip(address: str, payload: bytes) -> bytes:
    """What comes back through ``address``; b"" when the link is cut (closed or reset)."""
    host, _, port = address.rpartition(":")
    got = b""
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        try:
            conn.sendall(payload)
            while len(got) < len(payload) and (piece := conn.recv(65536)):
                got += piece
        except ConnectionError:
            pass
    return got


def test_a_link_passes_corrupts_in_the_direction_asked_and_cuts(echo) -> None:  # type: ignore[no-untyped-def]
    payload = bytes(1000)
    with FaultProxy(echo, listen=("127.77.253.1", 0)) as proxy:
        assert proxy.address.startswith("127.77.253.1:")  # a loopback alias of its own
        assert roundtrip(proxy.address, payload) == payload
        proxy.set("corrupt", every=100, direction="down")  # only what comes back flips
        back = roundtrip(proxy.address, payload)
        assert sum(1 for b in back if b) == 10 == proxy.corrupted
        proxy.set("corrupt", every=100, direction="both")  # flipped on the way there, flipped back on the way back
        assert sum(1 for b in roundtrip(proxy.address, payload) if b) == 0 and proxy.corrupted == 30
        proxy.set("cut")
        assert roundtrip(proxy.address, payload) == b""  # accepted, then closed: refused
        with pytest.raises(ValueError, match="positive"):
            proxy.set("slow")  # a rate is needed


def test_a_proxy_forwards_in_a_process_with_descriptors_past_1024(echo) -> None:  # type: ignore[no-untyped-def]
    """A test process may hold many descriptors (a 32-rank gloo group holds ~1,000): select() refuses those from 1024
    up, which once made a proxy stop accepting without a word, and the rolling-replacement test time out."""
    spare = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(spare) for _ in range(max(0, 1100 - spare))]
    try:
        with FaultProxy(echo) as proxy:
            assert roundtrip(proxy.address, b"x" * 1000) == b"x" * 1000
    finally:
        for fd in [spare, *held]:
            os.close(fd)


def test_links_give_every_store_pair_an_alias_and_reuse_a_link_to_the_same_target(echo) -> None:  # type: ignore[no-untyped-def]
    links = Links()
    try:
        address = f"{echo[0]}:{echo[1]}"
        assert links.dial("h0", "h1", address, 0) == f"127.77.1.2:{echo[1]}"
        first = links.stores[("h0", "h1")]
        assert links.dial("h0", "h1", address, 0) == first.address and links.stores[("h0", "h1")] is first
        links.dial("h1", "h0", address, 0)
        assert len(links.of_host("h0")) == 2 and links.of_host("h2") == []
        assert roundtrip(first.address, b"hello") == b"hello"
        set_links(links.of_host("h0"), "cut")
        assert roundtrip(first.address, b"hello") == b""
    finally:
        links.close()


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler to build the clock-jump library")
def test_the_clock_jump_library_shifts_the_wall_clock_of_a_process(tmp_path: Path) -> None:
    lib = clockshift.build(tmp_path)
    offset = tmp_path / "offset"
    clockshift.set_offset(offset, -7200)
    env = {**os.environ, **clockshift.preload_env(lib, offset)}
    shown = int(subprocess.run(["date", "+%s"], env=env, capture_output=True, text=True, check=True, timeout=30).stdout)
    assert abs(shown - (time.time() - 7200)) < 60  # two hours behind
    assert clockshift.build(tmp_path) == lib  # built once per source
