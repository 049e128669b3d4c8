"""How each figure is measured: the ``method`` section of the bench's JSON."""

from __future__ import annotations

from memstore.bench.scenario_results import DURABLE_NOTE

METHOD: dict[str, str] = {
    "scenarios": (
        "state size x hosts x R; the baselines are measured once per state size, on the same bytes, before its scenarios; every "
        "scenario starts its own local cluster (1 rank on h0, world size 1) and stops it at the end"
    ),
    "ram_need": (
        "(keep+1) x size x R in the stores (one benchmarked rank: keep steps plus one pooled segment on each of its R holders; a "
        "job with a rank on every host needs x hosts as much, ram_need.one_rank_per_host_bytes) + 3 x size in the bench; "
        "scenarios above --max-ram are skipped; the measured peak PSS is conditions.memory_peak_pss_bytes"
    ),
    "warmup": (
        "each of the first keep+1 saves gets a new segment (the store pools a segment only once retention evicts the oldest "
        "of keep steps), so save keep+2 is the first into a recycled, pre-faulted segment; those cold saves are reported apart"
    ),
    "stall": "wall time of CheckpointClient.save() over the measured saves",
    "memcpy_floor": (
        "paired: torch copy_ of the state's tensors into one pre-faulted uint8 buffer, right before each measured save "
        "(same background load); standalone: median of 5 before the cluster starts; memmove single-thread, a /dev/shm "
        "mapping and fresh memory for reference"
    ),
    "committed": "save() start until SaveHandle.wait() returned (all R copies verified); the next save starts after retention settled",
    "replication_throughput": "shard bytes / (time to committed - save() wall time); includes the owner's xxh3 pass over the shard",
    "tcp_floor": "child python sendall of 4 MiB memoryview slices, this process recv_into a pre-faulted buffer; median of 3",
    "grpc_floors": (
        "diagnosis of the gRPC data plane (--data-plane grpc, and the fallback), not a target: gRPC-Python client stream from "
        "a child process, 4 MiB messages, memstore's channel and server options; raw bytes messages and PutRequest protobuf "
        "messages; receiver copies into a pre-faulted buffer"
    ),
    "disk_floor": "torch.save to a file, flush + fsync; torch.load(weights_only=True) after POSIX_FADV_DONTNEED (cold) and again (warm)",
    "dcp_floor": (
        "torch.distributed.checkpoint.async_save(state, storage_writer=FileSystemWriter(dir, sync_files=True), no_dist=True) "
        "in this process, no process group; blocking = until it returns, total = until its future completes (files fsynced); "
        "default staging (a new stager per call: fresh staging memory) and a reused caller-owned DefaultStager (cached, "
        "pre-faulted staging memory; its first call reported apart); the targets use the default"
    ),
    "restore_local": (
        "after a trainer-process crash: a NEW process (torch and trainer_client imported before the clock starts) connects to "
        "the owner's store and load()s the latest step, zero-copy (the default); timed from the store port accepting to "
        "load() returned (connect + LatestStep + Fetch + Open + map + xxh3 verify of every chunk + decode); verified by a "
        "fingerprint (xxh3-128 over structure and bytes) against the saved state; zero_copy=False once for reference"
    ),
    "peer_pull": "Delete of the newest step on h0 (h0 stays up), then h0's Fetch RPC timed alone: the store's pull from peer RAM",
    "restore_peer_deleted": "as restore_local, after the newest step was deleted on h0: h0's Fetch pulls it from the group peer",
    "restore_peer": (
        "after a host loss: h0 SIGKILLed, a new restore process waiting, h0's replacement started (empty RAM; its startup "
        "repair pass pulls the newest keep steps and the client's Fetch joins the pull of the newest); timed from the "
        "replacement's 'serving on' log line (its port accepts earlier, while it wipes the dead store's segments) to load() "
        "returned in the new process; "
        "the store's log says whether the repair pass, the Fetch, or both pulled"
    ),
    "restore_durable": DURABLE_NOTE,
    "store_memory": (
        "after the measured saves: /proc/<pid>/status VmRSS (RssAnon, RssFile, RssShmem) and /proc/<pid>/smaps_rollup Pss of "
        "each store process; shard bytes held = sum of nbytes over its List RPC; used_bytes (Health) = held segments + pooled "
        "free segments; the target uses RSS / shard bytes held of the worst store holding shards"
    ),
    "leak_check": (
        "a separate cluster (the headline's hosts and R) and a saving process: --leak-saves consecutive save() + wait() of a "
        "--leak-size state, each followed by retention settling; VmRSS of each store and of the saving process after save 10 "
        "vs after the last save"
    ),
    "conditions": (
        "per scenario and run: PSI CPU pressure (share of time some task waited for a CPU, this bench's included), load "
        "average, and the CPU seconds other processes took (machine busy time from /proc/stat minus this bench and its children)"
    ),
    "memory": "peak of the summed PSS of this process and its children (stores, helpers), sampled every 0.5 s and per step",
}


def method(warmup: int, keep: int) -> dict[str, str]:
    return METHOD | {"warmup": f"{warmup} saves (keep+1={keep}+1): {METHOD['warmup']}"}
