"""memstore bench sizes its stores to hold an explicit --prefault (a store refuses a reserve beyond its capacity)."""

from __future__ import annotations

from typing import Any

import pytest

from memstore.bench import rig

pytestmark = pytest.mark.unit
MiB = 1 << 20


class Recorded:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def start(self) -> None:
        return None


def capacity(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> int:
    monkeypatch.setattr(rig, "LocalCluster", Recorded)
    cluster: Any = rig.start_cluster(2, 2, 2, 128 * MiB, None, env)
    return int(cluster.kwargs["capacity"])


def test_the_stores_hold_an_explicit_prefault_beside_their_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    shards = capacity(monkeypatch, {})
    assert shards == 5 * 128 * MiB + rig.CAPACITY_SLACK  # keep + 3 shards
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "auto"}) == shards
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "256MiB"}) == shards  # fits already
    assert capacity(monkeypatch, {"MEMSTORE_PREFAULT": "1GiB"}) == 1024 * MiB + rig.CAPACITY_SLACK


def test_a_bad_prefault_is_refused_before_any_store_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from memstore.bench import add_arguments

    p = argparse.ArgumentParser(prog="memstore bench")
    add_arguments(p)
    assert p.parse_args(["--prefault", "4100MiB"]).prefault == "4100MiB"
    assert p.parse_args(["--prefault", "auto"]).prefault == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--prefault", "lots"])
    assert "argument --prefault: size 'lots' is invalid" in capsys.readouterr().err


def test_the_stores_keep_their_segments_on_the_tmpfs_asked_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """--shm-dir: the stores' segment directories go there (a tmpfs mounted with huge pages, say); a path that is not a
    writable directory is refused before any store starts."""
    import argparse

    from memstore.bench import add_arguments
    from memstore.testing import LocalCluster

    p = argparse.ArgumentParser(prog="memstore bench")
    add_arguments(p)
    assert p.parse_args([]).shm_dir == "/dev/shm"
    assert p.parse_args(["--shm-dir", str(tmp_path)]).shm_dir == str(tmp_path)
    with pytest.raises(SystemExit):
        p.parse_args(["--shm-dir", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert "argument --shm-dir:" in err and "is not a directory" in err
    monkeypatch.setattr(rig, "LocalCluster", Recorded)
    cluster: Any = rig.start_cluster(2, 2, 2, 128 * MiB, None, {}, str(tmp_path))
    assert cluster.kwargs["shm_root"] == str(tmp_path)
    real = LocalCluster(hosts=2, shm_root=str(tmp_path))  # not started: its stores' arguments only
    try:
        args = real.stores["h0"].args
        assert args[args.index("--shm-dir") + 1] == real.shm_dir and real.shm_dir.startswith(str(tmp_path) + "/")
    finally:
        real.stop()


def test_a_paired_tcp_transfer_moves_the_bytes_each_time_it_is_asked() -> None:
    from memstore.bench.baselines import PairedTcp

    with PairedTcp(3 * MiB + 5) as tcp:
        times = [tcp.seconds() for _ in range(3)]
        child = tcp._child
    assert all(t > 0 for t in times)
    assert child.returncode == 0  # the sender was told to stop and reaped
