"""How each figure is measured: the ``method`` section of the bench's JSON."""

from __future__ import annotations

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
        "none: save 1 is the first save of a fresh job on freshly started stores (after their RSS stopped growing and, where "
        "they say so, their --prefault reserve is filled: a job's first save comes well after its hosts' stores started; "
        "stores_idle_wait_seconds); saves 2..keep+2 each get a new segment (the store pools a segment only once retention "
        "evicts the oldest of keep steps) unless the store keeps a pre-faulted reserve; the saves after them are the steady "
        "state. Every save is reported (phase first / early / steady)"
    ),
    "stall": "save() call -> return, every save; the steady-state summary is over the saves after keep+2",
    "saves_from_the_first": (
        "issue 16: per save, the stall and save() call -> SaveHandle.wait() returned (R copies), each right after a paired "
        "memcpy of the same bytes; save 1's stall / its memcpy <= 3x, every later save's <= 1.5x (the worst counts), and for "
        "every save state bytes / (call -> committed) >= 0.7x raw TCP (a save that did not commit counts 0). The headline's "
        "own saves run with the store's defaults (or --prefault); without --prefault the same series runs again on fresh "
        "stores and a fresh job with MEMSTORE_PREFAULT = (keep+2)x the shard rounded up to MiB (from_first_save.series[1])"
    ),
    "small_states": (
        "1 MiB and 16 MiB states of the same layout, one rank, the headline's hosts and R, fresh stores and job each: save 1, "
        "then --small-saves (30) saves, each paired with a memcpy and followed by retention settling; stall p50/p95 and "
        "call -> committed p50 over the saves after save 1; the target is the 1 MiB stall p50 (other processes' CPU share in "
        "conditions)"
    ),
    "per_tensor": (
        "10,000 float32 tensors of 1024 elements vs one float32 tensor of the same bytes, one fresh cluster (headline shape), "
        "a job each: save 1, saves 2..keep+2 and up to 10 steady saves, then 5 load()s of each in this process (zero-copy, "
        "alternating); per tensor = (p50 many - p50 one) / 10,000, for the steady saves' stall and for load"
    ),
    "no_shared_memory": (
        "CheckpointClient(use_shared_memory=False) on fresh stores (headline shape), the headline's state: save 1 and 3 more "
        "(stall includes streaming the shard to the store over gRPC), then --restores loads each by a new client in this "
        "process (connect + load(): a streamed Get into fresh memory); throughput = state bytes / time, over raw TCP"
    ),
    "memcpy_floor": (
        "paired: torch copy_ of the state's tensors into one pre-faulted uint8 buffer, right before every save "
        "(same background load); standalone: median of 5 before the cluster starts; memmove single-thread, a /dev/shm "
        "mapping and fresh memory for reference"
    ),
    "committed": "save() call until SaveHandle.wait() returned (all R copies verified); the next save starts after retention settled",
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
        "pre-faulted staging memory; its first call reported apart); the targets use the default. no_dist, async_stager and "
        "DefaultStager are used where this torch has them; a staging torch's DCP raises on (e.g. a reused DefaultStager on "
        "torch 2.11: KeyError <class 'type'>) is reported unavailable, with the reason, and its ratios and target are n/a"
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
        "after a host replacement: h0 SIGKILLed, a new restore process waiting, h0's replacement started (empty RAM; its "
        "startup repair pass pulls the newest keep steps and the client's Fetch joins the pull of the newest); timed from "
        "the trainer's load call (CheckpointClient() + load() as soon as the replacement's port accepts) to load() returned: "
        "each run is the first restore after its replacement; also recorded: from the replacement's process start "
        "(start_to_loaded_seconds) and from its 'serving on' log line (restore_seconds, issue 3's timing); the store's log "
        "says whether the repair pass, the Fetch, or both pulled"
    ),
    "restore_durable": (
        "stores of their own (headline shape) with --spill file://DIR --spill-every-steps 1: one save, wait until the owner "
        "reports the step spilled (Health.spill), then before each restore Delete the step on every store and wait until "
        "LatestStep lists it again (from durable storage); a new process load()s it, timed from its load call as "
        "restore_local (the owner pulls it from the spill into its pool); vs torch.load"
    ),
    "store_memory": (
        "after the scenario's saves: /proc/<pid>/status VmRSS (RssAnon, RssFile, RssShmem) and /proc/<pid>/smaps_rollup Pss of "
        "each store process; shard bytes held = sum of nbytes over its List RPC; pool = Health.pooled_bytes where the store "
        "reports it (free segments kept faulted in: job pools and the --prefault reserve), else used_bytes - held; the "
        "target uses RSS / (held + pool) of the worst store holding shards"
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
    return METHOD | {"warmup": f"saves 2..{warmup + 1} (keep+2={keep}+2) reported apart; {METHOD['warmup']}"}
