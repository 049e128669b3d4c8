from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STATE_UNSPECIFIED: _ClassVar[ShardState]
    SHARD_STATE_CAPTURED: _ClassVar[ShardState]
    SHARD_STATE_REPLICATING: _ClassVar[ShardState]
    SHARD_STATE_COMMITTED: _ClassVar[ShardState]
    SHARD_STATE_UNDER_REPLICATED: _ClassVar[ShardState]
    SHARD_STATE_REPLICA: _ClassVar[ShardState]
    SHARD_STATE_PARITY: _ClassVar[ShardState]

class PutOrigin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_ORIGIN_UNSPECIFIED: _ClassVar[PutOrigin]
    PUT_ORIGIN_CLIENT: _ClassVar[PutOrigin]
    PUT_ORIGIN_REPLICA: _ClassVar[PutOrigin]
    PUT_ORIGIN_REPAIR: _ClassVar[PutOrigin]
SHARD_STATE_UNSPECIFIED: ShardState
SHARD_STATE_CAPTURED: ShardState
SHARD_STATE_REPLICATING: ShardState
SHARD_STATE_COMMITTED: ShardState
SHARD_STATE_UNDER_REPLICATED: ShardState
SHARD_STATE_REPLICA: ShardState
SHARD_STATE_PARITY: ShardState
PUT_ORIGIN_UNSPECIFIED: PutOrigin
PUT_ORIGIN_CLIENT: PutOrigin
PUT_ORIGIN_REPLICA: PutOrigin
PUT_ORIGIN_REPAIR: PutOrigin

class ShardKey(_message.Message):
    __slots__ = ("job_id", "step", "rank", "timeline")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    timeline: str
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., timeline: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("key", "world_size", "nbytes", "chunk_size", "chunk_checksums", "checksum_algo", "owner_host", "format_version", "metrics", "created_unix", "spill_codec", "stripe")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    OWNER_HOST_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SPILL_CODEC_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    world_size: int
    nbytes: int
    chunk_size: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[int]
    checksum_algo: str
    owner_host: str
    format_version: int
    metrics: _containers.ScalarMap[str, float]
    created_unix: float
    spill_codec: str
    stripe: Stripe
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., world_size: _Optional[int] = ..., nbytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[int]] = ..., checksum_algo: _Optional[str] = ..., owner_host: _Optional[str] = ..., format_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., created_unix: _Optional[float] = ..., spill_codec: _Optional[str] = ..., stripe: _Optional[_Union[Stripe, _Mapping]] = ...) -> None: ...

class Stripe(_message.Message):
    __slots__ = ("group", "index", "logical_nbytes", "stripe_nbytes", "slices_only")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    STRIPE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SLICES_ONLY_FIELD_NUMBER: _ClassVar[int]
    group: _containers.RepeatedScalarFieldContainer[int]
    index: int
    logical_nbytes: int
    stripe_nbytes: int
    slices_only: bool
    def __init__(self, group: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., logical_nbytes: _Optional[int] = ..., stripe_nbytes: _Optional[int] = ..., slices_only: _Optional[bool] = ...) -> None: ...

class ErasurePlace(_message.Message):
    __slots__ = ("group", "m", "offset", "column")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    group: _containers.RepeatedScalarFieldContainer[str]
    m: int
    offset: int
    column: int
    def __init__(self, group: _Optional[_Iterable[str]] = ..., m: _Optional[int] = ..., offset: _Optional[int] = ..., column: _Optional[int] = ...) -> None: ...

class ParityCover(_message.Message):
    __slots__ = ("row", "place", "needs", "spans")
    ROW_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    row: int
    place: ErasurePlace
    needs: _containers.RepeatedCompositeFieldContainer[ShardKey]
    spans: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, row: _Optional[int] = ..., place: _Optional[_Union[ErasurePlace, _Mapping]] = ..., needs: _Optional[_Iterable[_Union[ShardKey, _Mapping]]] = ..., spans: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("manifest", "state", "verified", "error", "copies", "superseded", "cached", "erasure", "parity")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    ERASURE_FIELD_NUMBER: _ClassVar[int]
    PARITY_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    state: ShardState
    verified: bool
    error: str
    copies: int
    superseded: bool
    cached: bool
    erasure: ErasurePlace
    parity: ParityCover
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., state: _Optional[_Union[ShardState, str]] = ..., verified: _Optional[bool] = ..., error: _Optional[str] = ..., copies: _Optional[int] = ..., superseded: _Optional[bool] = ..., cached: _Optional[bool] = ..., erasure: _Optional[_Union[ErasurePlace, _Mapping]] = ..., parity: _Optional[_Union[ParityCover, _Mapping]] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("known_slots_version", "known_slots_digest", "asker_host_id")
    KNOWN_SLOTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_SLOTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ASKER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    known_slots_version: int
    known_slots_digest: str
    asker_host_id: str
    def __init__(self, known_slots_version: _Optional[int] = ..., known_slots_digest: _Optional[str] = ..., asker_host_id: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("host_id", "version", "replicas", "peer_ids", "peer_addresses", "shm_dir", "boot_id", "capacity_bytes", "max_chunk_bytes", "placement", "data_port", "slots", "draining", "failure_domain", "control_socket", "slots_omitted", "marked_captures", "redundancy")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PEER_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    MARKED_CAPTURES_FIELD_NUMBER: _ClassVar[int]
    REDUNDANCY_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    version: str
    replicas: int
    peer_ids: _containers.RepeatedScalarFieldContainer[str]
    peer_addresses: _containers.RepeatedScalarFieldContainer[str]
    shm_dir: str
    boot_id: str
    capacity_bytes: int
    max_chunk_bytes: int
    placement: str
    data_port: int
    slots: SlotTable
    draining: bool
    failure_domain: str
    control_socket: str
    slots_omitted: bool
    marked_captures: bool
    redundancy: str
    def __init__(self, host_id: _Optional[str] = ..., version: _Optional[str] = ..., replicas: _Optional[int] = ..., peer_ids: _Optional[_Iterable[str]] = ..., peer_addresses: _Optional[_Iterable[str]] = ..., shm_dir: _Optional[str] = ..., boot_id: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., placement: _Optional[str] = ..., data_port: _Optional[int] = ..., slots: _Optional[_Union[SlotTable, _Mapping]] = ..., draining: _Optional[bool] = ..., failure_domain: _Optional[str] = ..., control_socket: _Optional[str] = ..., slots_omitted: _Optional[bool] = ..., marked_captures: _Optional[bool] = ..., redundancy: _Optional[str] = ...) -> None: ...

class SlotTable(_message.Message):
    __slots__ = ("version", "slots")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    def __init__(self, version: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("index", "host_id", "address", "domain", "former", "former_until")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    FORMER_FIELD_NUMBER: _ClassVar[int]
    FORMER_UNTIL_FIELD_NUMBER: _ClassVar[int]
    index: int
    host_id: str
    address: str
    domain: str
    former: _containers.RepeatedScalarFieldContainer[str]
    former_until: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., host_id: _Optional[str] = ..., address: _Optional[str] = ..., domain: _Optional[str] = ..., former: _Optional[_Iterable[str]] = ..., former_until: _Optional[_Iterable[int]] = ...) -> None: ...

class DiscoveryStatus(_message.Message):
    __slots__ = ("source", "members", "last_ok_unix", "error", "consecutive_failures")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LAST_OK_UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    source: str
    members: int
    last_ok_unix: float
    error: str
    consecutive_failures: int
    def __init__(self, source: _Optional[str] = ..., members: _Optional[int] = ..., last_ok_unix: _Optional[float] = ..., error: _Optional[str] = ..., consecutive_failures: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "host_id", "used_bytes", "capacity_bytes", "shards", "replications_in_flight", "repairs_in_flight", "uptime_seconds", "spill_url", "spill", "orphans", "adopted_shards", "draining", "drain_progress", "slots", "discovery", "not_ready", "pooled_bytes", "reserve_bytes", "reserve_filling", "capture", "saves_superseded", "jobs_memory", "ring_overflows", "ring_limit", "scrubbed_bytes", "scrub_corrupt")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REPLICATIONS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPILL_URL_FIELD_NUMBER: _ClassVar[int]
    SPILL_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    POOLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FILLING_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    SAVES_SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    JOBS_MEMORY_FIELD_NUMBER: _ClassVar[int]
    RING_OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    RING_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SCRUBBED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCRUB_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    host_id: str
    used_bytes: int
    capacity_bytes: int
    shards: int
    replications_in_flight: int
    repairs_in_flight: int
    uptime_seconds: float
    spill_url: str
    spill: _containers.RepeatedCompositeFieldContainer[SpillStatus]
    orphans: _containers.RepeatedCompositeFieldContainer[OrphanedSegments]
    adopted_shards: int
    draining: bool
    drain_progress: str
    slots: SlotTable
    discovery: DiscoveryStatus
    not_ready: str
    pooled_bytes: int
    reserve_bytes: int
    reserve_filling: bool
    capture: CaptureStats
    saves_superseded: int
    jobs_memory: _containers.RepeatedCompositeFieldContainer[JobMemory]
    ring_overflows: int
    ring_limit: int
    scrubbed_bytes: int
    scrub_corrupt: int
    def __init__(self, serving: _Optional[bool] = ..., host_id: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., shards: _Optional[int] = ..., replications_in_flight: _Optional[int] = ..., repairs_in_flight: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., spill_url: _Optional[str] = ..., spill: _Optional[_Iterable[_Union[SpillStatus, _Mapping]]] = ..., orphans: _Optional[_Iterable[_Union[OrphanedSegments, _Mapping]]] = ..., adopted_shards: _Optional[int] = ..., draining: _Optional[bool] = ..., drain_progress: _Optional[str] = ..., slots: _Optional[_Union[SlotTable, _Mapping]] = ..., discovery: _Optional[_Union[DiscoveryStatus, _Mapping]] = ..., not_ready: _Optional[str] = ..., pooled_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., reserve_filling: _Optional[bool] = ..., capture: _Optional[_Union[CaptureStats, _Mapping]] = ..., saves_superseded: _Optional[int] = ..., jobs_memory: _Optional[_Iterable[_Union[JobMemory, _Mapping]]] = ..., ring_overflows: _Optional[int] = ..., ring_limit: _Optional[int] = ..., scrubbed_bytes: _Optional[int] = ..., scrub_corrupt: _Optional[int] = ...) -> None: ...

class JobMemory(_message.Message):
    __slots__ = ("job_id", "in_use_bytes", "pooled_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    in_use_bytes: int
    pooled_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., in_use_bytes: _Optional[int] = ..., pooled_bytes: _Optional[int] = ...) -> None: ...

class OrphanedSegments(_message.Message):
    __slots__ = ("path", "host_id", "bytes", "files")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    path: str
    host_id: str
    bytes: int
    files: int
    def __init__(self, path: _Optional[str] = ..., host_id: _Optional[str] = ..., bytes: _Optional[int] = ..., files: _Optional[int] = ...) -> None: ...

class SpillStatus(_message.Message):
    __slots__ = ("job_id", "last_spilled_step", "last_spill_unix", "consecutive_failures", "last_error", "bytes_written")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SPILLED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_SPILL_UNIX_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    last_spilled_step: int
    last_spill_unix: float
    consecutive_failures: int
    last_error: str
    bytes_written: int
    def __init__(self, job_id: _Optional[str] = ..., last_spilled_step: _Optional[int] = ..., last_spill_unix: _Optional[float] = ..., consecutive_failures: _Optional[int] = ..., last_error: _Optional[str] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("key", "world_size", "nbytes", "preferred_segment", "ahead", "grow", "restorable_floor", "restorable_floor_version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    GROW_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    world_size: int
    nbytes: int
    preferred_segment: str
    ahead: bool
    grow: bool
    restorable_floor: int
    restorable_floor_version: FloorVersion
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., world_size: _Optional[int] = ..., nbytes: _Optional[int] = ..., preferred_segment: _Optional[str] = ..., ahead: _Optional[bool] = ..., grow: _Optional[bool] = ..., restorable_floor: _Optional[int] = ..., restorable_floor_version: _Optional[_Union[FloorVersion, _Mapping]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("lease_id", "segment_path", "segment_bytes", "next_segment_path", "ring_paths", "lease_seconds", "ring_limit", "ring_busy", "reserve_at_save")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    RING_PATHS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RING_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RING_BUSY_FIELD_NUMBER: _ClassVar[int]
    RESERVE_AT_SAVE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    segment_path: str
    segment_bytes: int
    next_segment_path: str
    ring_paths: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    ring_limit: int
    ring_busy: bool
    reserve_at_save: bool
    def __init__(self, lease_id: _Optional[str] = ..., segment_path: _Optional[str] = ..., segment_bytes: _Optional[int] = ..., next_segment_path: _Optional[str] = ..., ring_paths: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ..., ring_limit: _Optional[int] = ..., ring_busy: _Optional[bool] = ..., reserve_at_save: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "metrics", "format_version", "spill_codec", "key", "nbytes", "capture", "capture_seconds", "stripe", "restorable_floor", "captured_bytes", "chunk_size", "chunk_checksums", "checksum_algo", "restorable_floor_version")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPILL_CODEC_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    metrics: _containers.ScalarMap[str, float]
    format_version: int
    spill_codec: str
    key: ShardKey
    nbytes: int
    capture: CaptureStats
    capture_seconds: float
    stripe: Stripe
    restorable_floor: int
    captured_bytes: int
    chunk_size: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[int]
    checksum_algo: str
    restorable_floor_version: FloorVersion
    def __init__(self, lease_id: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., format_version: _Optional[int] = ..., spill_codec: _Optional[str] = ..., key: _Optional[_Union[ShardKey, _Mapping]] = ..., nbytes: _Optional[int] = ..., capture: _Optional[_Union[CaptureStats, _Mapping]] = ..., capture_seconds: _Optional[float] = ..., stripe: _Optional[_Union[Stripe, _Mapping]] = ..., restorable_floor: _Optional[int] = ..., captured_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[int]] = ..., checksum_algo: _Optional[str] = ..., restorable_floor_version: _Optional[_Union[FloorVersion, _Mapping]] = ...) -> None: ...

class FloorVersion(_message.Message):
    __slots__ = ("step", "timeline")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    step: int
    timeline: str
    def __init__(self, step: _Optional[int] = ..., timeline: _Optional[str] = ...) -> None: ...

class CaptureStats(_message.Message):
    __slots__ = ("registrations", "fallbacks", "fallback_cause")
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_CAUSE_FIELD_NUMBER: _ClassVar[int]
    registrations: int
    fallbacks: int
    fallback_cause: str
    def __init__(self, registrations: _Optional[int] = ..., fallbacks: _Optional[int] = ..., fallback_cause: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("manifest", "origin", "sender_host", "restorable_floor", "streams", "checksums_follow", "restorable_floor_version")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    origin: PutOrigin
    sender_host: str
    restorable_floor: int
    streams: int
    checksums_follow: bool
    restorable_floor_version: FloorVersion
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., origin: _Optional[_Union[PutOrigin, str]] = ..., sender_host: _Optional[str] = ..., restorable_floor: _Optional[int] = ..., streams: _Optional[int] = ..., checksums_follow: _Optional[bool] = ..., restorable_floor_version: _Optional[_Union[FloorVersion, _Mapping]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("key", "bytes_received")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    bytes_received: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class WaitCommittedRequest(_message.Message):
    __slots__ = ("key", "timeout_seconds", "restorable_floor", "restorable_floor_version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FLOOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    timeout_seconds: float
    restorable_floor: int
    restorable_floor_version: FloorVersion
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., restorable_floor: _Optional[int] = ..., restorable_floor_version: _Optional[_Union[FloorVersion, _Mapping]] = ...) -> None: ...

class WaitCommittedResponse(_message.Message):
    __slots__ = ("info", "done", "next_segment_path")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    info: ShardInfo
    done: bool
    next_segment_path: str
    def __init__(self, info: _Optional[_Union[ShardInfo, _Mapping]] = ..., done: _Optional[bool] = ..., next_segment_path: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("key", "transient", "reader_verifies", "also")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    READER_VERIFIES_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    transient: bool
    reader_verifies: bool
    also: _containers.RepeatedCompositeFieldContainer[ShardKey]
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., transient: _Optional[bool] = ..., reader_verifies: _Optional[bool] = ..., also: _Optional[_Iterable[_Union[ShardKey, _Mapping]]] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("lease_id", "segment_path", "manifest", "verified", "also")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    segment_path: str
    manifest: Manifest
    verified: bool
    also: _containers.RepeatedCompositeFieldContainer[OpenResponse]
    def __init__(self, lease_id: _Optional[str] = ..., segment_path: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., verified: _Optional[bool] = ..., also: _Optional[_Iterable[_Union[OpenResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "also")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ALSO_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    also: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[str] = ..., also: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "chunk_size", "streams")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    chunk_size: int
    streams: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., chunk_size: _Optional[int] = ..., streams: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    chunk: bytes
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "discard_local", "durable_known", "cached")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DISCARD_LOCAL_FIELD_NUMBER: _ClassVar[int]
    DURABLE_KNOWN_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    discard_local: bool
    durable_known: bool
    cached: bool
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., discard_local: _Optional[bool] = ..., durable_known: _Optional[bool] = ..., cached: _Optional[bool] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("manifest", "source_host")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_HOST_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    source_host: str
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., source_host: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("host_id", "shards", "draining")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    draining: bool
    def __init__(self, host_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class ExpectRequest(_message.Message):
    __slots__ = ("job_id", "rank", "nbytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    nbytes: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ExpectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("started",)
    STARTED_FIELD_NUMBER: _ClassVar[int]
    started: bool
    def __init__(self, started: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("job_id", "step", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class LatestStepRequest(_message.Message):
    __slots__ = ("job_id", "step", "ranks", "include_durable")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DURABLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    include_durable: bool
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., include_durable: _Optional[bool] = ...) -> None: ...

class SeenVersion(_message.Message):
    __slots__ = ("step", "timeline", "world_size", "created_unix", "ranks", "durable")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    step: int
    timeline: str
    world_size: int
    created_unix: float
    ranks: _containers.RepeatedScalarFieldContainer[int]
    durable: bool
    def __init__(self, step: _Optional[int] = ..., timeline: _Optional[str] = ..., world_size: _Optional[int] = ..., created_unix: _Optional[float] = ..., ranks: _Optional[_Iterable[int]] = ..., durable: _Optional[bool] = ...) -> None: ...

class LatestStepResponse(_message.Message):
    __slots__ = ("found", "step", "world_size", "unreachable_hosts", "timeline", "note", "versions")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_HOSTS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    step: int
    world_size: int
    unreachable_hosts: _containers.RepeatedScalarFieldContainer[str]
    timeline: str
    note: str
    versions: _containers.RepeatedCompositeFieldContainer[SeenVersion]
    def __init__(self, found: _Optional[bool] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., unreachable_hosts: _Optional[_Iterable[str]] = ..., timeline: _Optional[str] = ..., note: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[SeenVersion, _Mapping]]] = ...) -> None: ...

class DataTicket(_message.Message):
    __slots__ = ("ticket", "data_port", "checksums_follow")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    data_port: int
    checksums_follow: bool
    def __init__(self, ticket: _Optional[bytes] = ..., data_port: _Optional[int] = ..., checksums_follow: _Optional[bool] = ...) -> None: ...

class PrepareSendResponse(_message.Message):
    __slots__ = ("manifest", "ticket", "data_port")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    ticket: bytes
    data_port: int
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., ticket: _Optional[bytes] = ..., data_port: _Optional[int] = ...) -> None: ...

class ContributeHeader(_message.Message):
    __slots__ = ("manifest", "place", "row", "first_position", "blocks", "block_bytes", "checksum", "sender_host")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SENDER_HOST_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    place: ErasurePlace
    row: int
    first_position: int
    blocks: int
    block_bytes: int
    checksum: int
    sender_host: str
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., place: _Optional[_Union[ErasurePlace, _Mapping]] = ..., row: _Optional[int] = ..., first_position: _Optional[int] = ..., blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., sender_host: _Optional[str] = ...) -> None: ...

class ContributeRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ContributeHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ContributeHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ContributeResponse(_message.Message):
    __slots__ = ("already",)
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    already: bool
    def __init__(self, already: _Optional[bool] = ...) -> None: ...

class ReadRangeRequest(_message.Message):
    __slots__ = ("key", "offset", "length", "stride", "count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    key: ShardKey
    offset: int
    length: int
    stride: int
    count: int
    def __init__(self, key: _Optional[_Union[ShardKey, _Mapping]] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., stride: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ReadRangeResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ReadParityRequest(_message.Message):
    __slots__ = ("version", "row", "first_position", "blocks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    version: ShardKey
    row: int
    first_position: int
    blocks: int
    def __init__(self, version: _Optional[_Union[ShardKey, _Mapping]] = ..., row: _Optional[int] = ..., first_position: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class ReadParityResponse(_message.Message):
    __slots__ = ("contents", "data")
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    contents: ParityContents
    data: bytes
    def __init__(self, contents: _Optional[_Union[ParityContents, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ParityContents(_message.Message):
    __slots__ = ("block_bytes", "contributors")
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    block_bytes: int
    contributors: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, block_bytes: _Optional[int] = ..., contributors: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...
