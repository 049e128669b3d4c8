"""Names from the network never reach a path: every entry point of the engine refuses a bad job id, timeline,
host id or key with a typed error, and so do the durable layout's path functions and the reader of spilled
manifests, whatever part of a path would come from a job id, a step, a rank or a manifest read back."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from memstore.config import StoreConfig
from memstore.core.model import Manifest, PutOrigin, ShardKey, TransferHeader
from memstore.errors import InvalidArgument, LayoutError
from memstore.server.store import Store
from memstore.spill import layout
from memstore.spill.layout import SpilledManifest
from memstore.spill.reader import read_manifest
from memstore.spill.spiller import Spiller
from memstore.spill.storage import Durable

pytestmark = pytest.mark.unit
MiB = 1 << 20

BAD_JOB_IDS = ["..", ".", "../etc", "a/b", "/abs", "a\\b", "a\0b", "", "x" * 129, "é", "a b"]
BAD_TIMELINES = ["..", ".", "../t", "a/b", "/t", "t\0", "x" * 129]
BAD_HOST_IDS = ["..", "../h", "h/1", "/h", "h\0", "x" * 65]


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    cli = {"host_id": "solo", "replicas": "1", "capacity": "16MiB", "shm_dir": str(tmp_path / "shm"), "chunk_bytes": "1MiB"}
    s = Store(StoreConfig.load(cli, env={}))
    s.start()
    yield s
    s.close()


def header(key: ShardKey, owner: str = "peer1", sender: str = "peer1", origin: PutOrigin = PutOrigin.REPLICA) -> TransferHeader:
    return TransferHeader(Manifest(key, 1, 1, 1, (0,), owner), origin, sender)


def entry_points(store: Store, key: ShardKey) -> dict[str, Callable[[], Any]]:
    """Every engine call a request naming ``key`` reaches (the servicer calls exactly these)."""
    return {
        "allocate": lambda: store.allocate(key, 1, 10),
        "receive": lambda: store.receive(header(key), [b"x"]),
        "prepare_receive": lambda: store.prepare_receive(header(key)),
        "wait_committed": lambda: store.wait_committed(key, 0),
        "open": lambda: store.open(key),
        "read": lambda: list(store.read(key)),
        "fetch": lambda: store.fetch(key, False),
        "prepare_send": lambda: store.prepare_send(key),
        "list": lambda: store.list_shards(key.job_id),
        "delete": lambda: store.delete(key.job_id, -1, -1),
        "latest_step": lambda: store.latest_step(key.job_id),
    }


@pytest.mark.parametrize("job_id", BAD_JOB_IDS)
def test_every_entry_point_refuses_a_bad_job_id(store: Store, job_id: str) -> None:
    for name, call in entry_points(store, ShardKey(job_id, 1, 0)).items():
        if name == "list" and job_id == "":
            continue  # "" lists every job
        with pytest.raises(InvalidArgument, match="job_id"):
            call()
    assert store.pool.in_use_bytes == 0 and store.admission.open_streams() == {}


@pytest.mark.parametrize("timeline", BAD_TIMELINES)
def test_every_entry_point_refuses_a_bad_timeline(store: Store, timeline: str) -> None:
    for name, call in entry_points(store, ShardKey("job", 1, 0, timeline)).items():
        if name in ("list", "delete", "latest_step"):
            continue  # these name a job only
        with pytest.raises(InvalidArgument, match="timeline"):
            call()


def test_keys_out_of_range_are_refused(store: Store) -> None:
    for key in (ShardKey("job", -1, 0), ShardKey("job", 1, -1), ShardKey("job", True, 0), ShardKey("job", 1, 10**7)):  # type: ignore[arg-type]
        for name, call in entry_points(store, key).items():
            if name in ("list", "delete", "latest_step"):
                continue
            with pytest.raises(InvalidArgument):
                call()
    for step, rank in ((-2, 0), (0, -2), (True, 0)):
        with pytest.raises(InvalidArgument):
            store.delete("job", step, rank)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.latest_step("job", -1)


@pytest.mark.parametrize("host_id", BAD_HOST_IDS)
def test_transfers_refuse_bad_owner_and_sender_host_ids(store: Store, host_id: str) -> None:
    key = ShardKey("job", 1, 0)
    for h in (header(key, owner=host_id), header(key, sender=host_id), header(key, owner=host_id, origin=PutOrigin.CLIENT)):
        with pytest.raises(InvalidArgument, match=r"owner_host|sender_host"):
            store.prepare_receive(h)
        with pytest.raises(InvalidArgument, match=r"owner_host|sender_host"):
            store.receive(h, [b"x"])
    with pytest.raises(InvalidArgument, match="owner_host"):
        store.prepare_receive(header(key, owner=""))  # a copy between stores names its owner
    store.prepare_receive(header(key, owner="", sender="client-rank-0", origin=PutOrigin.CLIENT))  # a client's save: the store owns it
    assert store.pool.in_use_bytes > 0


# -- the durable layout ----------------------------------------------------------------------------------
PATHS: list[Callable[[str, Any, Any], str]] = [
    lambda job, step, rank: layout.job_dir("/root", job),
    lambda job, step, rank: layout.step_dir("/root", job, step),
    lambda job, step, rank: layout.shard_path("/root", job, step, rank),
    lambda job, step, rank: layout.manifest_path("/root", job, step, rank),
    lambda job, step, rank: layout.intent_path("/root", job, step),
]


@pytest.mark.parametrize("job_id", BAD_JOB_IDS)
def test_layout_refuses_job_ids_that_would_leave_their_directory(job_id: str) -> None:
    for path in PATHS:
        with pytest.raises(LayoutError) as err:
            path(job_id, 1, 0)
        assert "job_id" in str(err.value) and repr(job_id)[:20] in str(err.value)


@pytest.mark.parametrize("value", [-1, True, "1", "../1", 1.5, None, "1/../../x"])
def test_layout_refuses_steps_and_ranks_that_are_not_ints(value: Any) -> None:
    for path in PATHS[1:]:
        with pytest.raises(LayoutError, match="step"):
            path("job", value, 0)
    for path in PATHS[2:4]:
        with pytest.raises(LayoutError, match="rank"):
            path("job", 1, value)


def test_layout_paths_stay_below_the_root() -> None:
    for path in PATHS:
        p = path("job.1-x_y", 10**13, 10**6)
        assert p.startswith("/root/job.1-x_y") and ".." not in p.split("/") and "\0" not in p


def write_manifest(root: Path, job: str, step: int, rank: int, fields: dict[str, Any] | None = None) -> None:
    """A manifest of (job, step, rank) at its place, with ``fields`` replaced."""
    m = SpilledManifest(job, step, rank, 1, 4, 4, [1], "h0", stored_chunks=[4], codec="zstd")
    raw = {**json.loads(m.encode()), **(fields or {})}
    path = Path(layout.manifest_path(str(root), job, step, rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "fields",
    [
        {"job_id": "../evil"},
        {"job_id": "/etc"},
        {"job_id": "job/../../x"},
        {"step": -1},
        {"step": "1/../2"},
        {"rank": -1},
        {"rank": "0/../../x"},
        {"timeline": "../t"},
        {"step": 2},  # another step's manifest in this one's place
        {"job_id": "other"},
        {"owner_host": "../h"},
        {"world_size": 10**7, "rank": 0},
        {"stored_chunks": [1 << 50]},  # a reader would read (allocate) this much for one chunk
    ],
)
def test_a_tampered_spilled_manifest_is_refused(tmp_path, fields: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    durable = Durable(f"file://{tmp_path}")
    write_manifest(tmp_path, "job", 1, 0, fields)
    with pytest.raises(LayoutError):
        read_manifest(durable, "job", 1, 0)
    allocated: list[SpilledManifest] = []
    spiller = Spiller(object(), durable, every_steps=1, every_seconds=0, retention=None, codec="none", max_rate=0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        spiller.read_into(ShardKey("job", 1, 0), lambda m: allocated.append(m) or memoryview(bytearray(m.nbytes)))
    assert allocated == []  # refused before anything was allocated for it


def test_a_sound_spilled_manifest_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    write_manifest(tmp_path, "job", 1, 0)
    assert read_manifest(Durable(f"file://{tmp_path}"), "job", 1, 0).owner_host == "h0"
