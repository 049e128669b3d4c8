"""The store server's typed configuration.

Precedence: CLI flags > environment variables (``MEMSTORE_<FIELD>``) > config file (TOML) > defaults.
Every field is documented once, here; ``memstore serve --help`` shows the same text.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstore.core.redundancy import Redundancy
from memstore.core.sizes import parse_size
from memstore.errors import ConfigError
from memstore.v1.datachannel import MAX_STREAMS
from memstore.v1.integrity import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from memstore.v1.keys import HOST_ID_PATTERN, ip_host_id

if TYPE_CHECKING:
    from memstore.spill.options import SpillOptions

#: a Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of up to 63 characters
NODE_LABEL = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def parse_address(text: str, what: str = "address") -> str:
    host, sep, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} {text!r} is invalid: expected HOST:PORT, e.g. 127.0.0.1:7070")
    return text


def parse_peers(text: str | list[Any] | tuple[Any, ...]) -> tuple[tuple[str, str], ...]:
    """``'h0=127.0.0.1:7070,h1=127.0.0.1:7071'`` -> ((h0, addr), (h1, addr)), order kept."""
    if not isinstance(text, (str, list, tuple)):
        raise ConfigError(f"--peers {text!r} is invalid: expected ID=HOST:PORT,...")
    items = text.split(",") if isinstance(text, str) else list(text)
    peers: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            host_id, address = str(item[0]), str(item[1])
        else:
            host_id, sep, address = str(item).strip().partition("=")
            if not sep:
                raise ConfigError(f"--peers entry {item!r} is invalid: expected ID=HOST:PORT")
        if not HOST_ID_PATTERN.fullmatch(host_id):
            raise ConfigError(f"--peers host id {host_id!r} is invalid: expected 1-64 characters of [A-Za-z0-9._-]")
        peers.append((host_id, parse_address(address, f"--peers address of {host_id}")))
    ids = [p[0] for p in peers]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"--peers lists host ids more than once: {', '.join(dupes)}")
    return tuple(peers)


def parse_domains(text: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(text, Mapping):
        return {str(k): str(v) for k, v in text.items()}
    if not isinstance(text, str):
        raise ConfigError(f"--failure-domains {text!r} is invalid: expected ID=LABEL,...")
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        host_id, sep, label = item.partition("=")
        if not sep or not host_id or not label:
            raise ConfigError(f"--failure-domains entry {item!r} is invalid: expected ID=LABEL")
        out[host_id] = label
    return out


def _number(name: str, kind: type, minimum: float, strict: bool, unit: str) -> Callable[[Any], Any]:
    """A parser for a numeric flag: ``kind`` (int/float), at least ``minimum`` (or above it if ``strict``)."""

    def parse(value: Any) -> Any:
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{name} {value!r} is invalid: expected {unit}") from None
        if not (number > minimum if strict else number >= minimum):
            raise ConfigError(f"{name} {number} is invalid: expected {'>' if strict else '>='} {minimum:g}")
        return number

    return parse


def _positive_int(name: str) -> Callable[[Any], int]:
    return _number(name, int, 1, False, "an integer")


def _non_negative_int(name: str) -> Callable[[Any], int]:
    return _number(name, int, 0, False, "an integer")


def _positive_float(name: str) -> Callable[[Any], float]:
    return _number(name, float, 0, True, "a number of seconds")


def _non_negative_float(name: str) -> Callable[[Any], float]:
    return _number(name, float, 0, False, "a number of seconds")


def _size(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    return parse


def _bool(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} {value!r} is invalid: expected true or false")

    return parse


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ConfigError(f"{name} {value!r} is invalid: expected one of {', '.join(choices)}")
        return str(value)

    return parse


def _streams(value: Any) -> int:
    """--transfer-streams: 'auto' (0) or 1..MAX_STREAMS."""
    if value in ("auto", 0, "0"):
        return 0
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else -1
    except (TypeError, ValueError, OverflowError):  # OverflowError: inf
        number = -1
    if isinstance(value, bool) or not 1 <= number <= MAX_STREAMS:
        raise ConfigError(f"--transfer-streams {value!r} is invalid: expected auto or 1..{MAX_STREAMS}")
    return number


def _redundancy(value: Any) -> Redundancy:
    if isinstance(value, Redundancy):
        return value
    try:
        return Redundancy.parse(value)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None


def _prefault(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"--prefault {value!r} is invalid: expected auto, 0 or a size such as 8GiB ({exc})") from None


def _opt(help: str, parse: Callable[[Any], Any] | None = None, **kw: Any) -> Any:
    return field(metadata={"help": help, "parse": parse}, **kw)


@dataclass(frozen=True)
class StoreConfig:
    host_id: str = _opt(
        "Stable id of this host; a store restarted with the same id and --listen replaces it. With --discovery dns:// it "
        "may be left out: it is then the --listen IP with '.' and ':' as '-' (10.1.2.3 -> 10-1-2-3), the name DNS "
        "discovery gives that IP.",
        default="",
    )
    listen: str = _opt(
        "HOST:PORT the gRPC server binds (port 0 picks a free port).", lambda v: parse_address(v, "--listen"), default="127.0.0.1:7070"
    )
    peers: tuple[tuple[str, str], ...] = _opt(
        "Every host of the cluster including this one, ID=HOST:PORT,...; the order fixes placement.", parse_peers, default=()
    )
    peers_file: str = _opt(
        'Learn the members from this JSON file instead of --peers: {"hosts": {"<id>": "HOST:PORT", ...}, "domains": {...}} '
        "(what `memstore local-cluster --endpoints-file` writes); re-read when it changes.",
        str,
        default="",
    )
    health_listen: str = _opt(
        "HOST:PORT of a plaintext gRPC server with only the standard grpc.health.v1 service (no token, no TLS; it tells "
        "SERVING or NOT_SERVING, nothing else), for Kubernetes gRPC probes: service '' is liveness, service "
        "'memstore.v1.Store' readiness (holds a slot, not draining, repair has confirmed every shard its slot should "
        "hold). '' = off.",
        lambda v: parse_address(v, "--health-listen") if v else "",
        default="",
    )
    data_port: int = _opt(
        "Port of the raw TCP data channel between stores, on the --listen host (0 picks a free port); fix it where a "
        "firewall or NetworkPolicy lists ports.",
        _number("--data-port", int, 0, False, "a port number"),
        default=0,
    )
    discovery: str = _opt(
        "Learn the members from DNS: dns://NAME:PORT[?server=IP:PORT] (e.g. a Kubernetes headless Service); "
        "host ids from the PTR records (first label), else the IP with dashes. 'fed': another runtime feeds them "
        "through Python (StoreServer(config, discovery=FedMembers())).",
        str,
        default="",
    )
    discovery_interval: float = _opt(
        "Seconds between polls of --peers-file/--discovery and between membership gossip rounds.",
        _positive_float("--discovery-interval"),
        default=2.0,
    )
    replicas: int = _opt(
        "Replication factor R: copies of each shard in RAM, counting the owner's (the same as --redundancy replicas:R).",
        _positive_int("--replicas"),
        default=2,
    )
    redundancy: Redundancy = _opt(
        "How each step is protected in RAM: replicas:R (R whole copies, the owner's included; what --replicas R means) or "
        "ec:K+M (erasure coding: each store keeps its own shards whole, groups of K+M stores keep M parity fragments and "
        "survive M lost stores at 1 + M/K of the state; needs at least K+M stores). Default: replicas:<--replicas>.",
        _redundancy,
        default=Redundancy.of_replicas(2),
    )
    capacity: int = _opt("RAM budget for shard bytes (bytes or 512MiB, 8GiB, ...).", _size("--capacity"), default=4 << 30)
    keep: int = _opt("Newest committed steps kept per job in RAM.", _positive_int("--keep"), default=2)
    placement: str = _opt("Placement strategy: mixed (GEMINI) or ring.", _choice("--placement", ("mixed", "ring")), default="mixed")
    failure_domain: str = _opt("This host's failure-domain label (rack, zone, node pool).", str, default="")
    failure_domain_node_labels: str = _opt(
        "Kubernetes: take --failure-domain from these labels of this host's Node, LABEL[,LABEL...] joined with '/' "
        "(e.g. topology.kubernetes.io/zone). Read once at start from the API server with the pod's service account "
        "(needs NODE_NAME from the downward API and RBAC get on nodes).",
        str,
        default="",
    )
    failure_domains: dict[str, str] = _opt(
        "Failure-domain label of every host, ID=LABEL,...; groups then span domains where possible.", parse_domains, default_factory=dict
    )
    chunk_bytes: int = _opt("Chunk size of shard streams and checksums.", _size("--chunk-bytes"), default=DEFAULT_CHUNK_BYTES)
    data_plane: str = _opt(
        "How bulk bytes travel between stores: tcp (a raw data channel, ticketed over gRPC) or grpc (chunked gRPC streams).",
        _choice("--data-plane", ("tcp", "grpc")),
        default="tcp",
    )
    transfer_streams: int = _opt(
        "Parallel data-channel streams per shard moved between stores (a replica's push, a repair's or restore's pull): "
        "'auto' (1 below 64 MiB, 4 from there) or 1..16. A transfer uses the fewer of the two stores' choices; each "
        "stream carries a contiguous run of whole chunks, verified per chunk.",
        _streams,
        default=0,
    )
    shm_dir: str = _opt(
        "Directory on a tmpfs for shared-memory segments ('' disables the local fast path); each store uses <dir>/<host-id>-<port>.",
        str,
        default="/dev/shm/memstore",
    )
    shm_keep_on_exit: bool = _opt(
        "Keep shared-memory segments on a clean exit so a restart with the same --host-id/--listen adopts them.",
        _bool("--shm-keep-on-exit"),
        default=False,
    )
    shm_reclaim_after: float = _opt(
        "Seconds a dead store's segment directory under --shm-dir may stay before this store deletes it (0 = never). "
        "A store adopts at once the verified segments its predecessor left (same host id on another port, or the host "
        "whose slot it took over); other dead stores' directories wait this long for their own successor.",
        _non_negative_float("--shm-reclaim-after"),
        default=600.0,
    )
    prefault: int | None = _opt(
        "Fresh shared memory kept faulted in ahead of need, so a save, a replica or a repair never waits for the kernel "
        "to allocate and zero pages: 'auto' (fault in what each job whose replicas land here lacks of its cycle, keep+1 "
        "shards per rank, and give a job's spares back once it stops saving; capture rings are filled by their "
        "clients), a size (at least that many bytes stay faulted in from start-up, "
        "shards included: size it for what the store cycles through, (keep+3) x each shard saved or copied here), or 0 "
        "(none). Counts against --capacity as pooled bytes.",
        _prefault,
        default=None,
    )
    prefault_unit: int = _opt(
        "Size of each pre-faulted segment (e.g. one rank's shard); default: the largest shard seen lately, before any "
        "--prefault/(keep+3). A larger segment is shrunk to the shard that takes it.",
        _size("--prefault-unit"),
        default=0,
    )
    local_control: bool = _opt(
        "Serve the save path (allocate, commit, release, status) of trainers on this machine over a Unix socket next "
        "to the segment dir, in microseconds instead of gRPC's milliseconds; same checks and tokens as gRPC.",
        _bool("--local-control"),
        default=True,
    )
    repair_interval: float = _opt(
        "Seconds between anti-entropy passes that restore missing replicas.", _positive_float("--repair-interval"), default=2.0
    )
    scrub_rate: int = _opt(
        "Bytes per second the background scrub re-verifies held copies at (0 = off): a copy whose checksum fails is "
        "dropped, and repair pulls one that verifies. Counted in `memstore status`.",
        _size("--scrub-rate"),
        default=32 << 20,
    )
    scrub_interval: float = _opt(
        "Seconds of rest between two scrub passes over every held copy.", _positive_float("--scrub-interval"), default=60.0
    )
    peer_timeout: float = _opt("Deadline in seconds of control RPCs to peers.", _positive_float("--peer-timeout"), default=5.0)
    transfer_min_rate: int = _opt(
        "Slowest acceptable replication rate (bytes/s); a transfer's deadline is 10 s plus its size at this rate.",
        _size("--transfer-min-rate"),
        default=50 << 20,
    )
    job_quota: int = _opt(
        "Bytes one job may hold on this store, its own shards and its replicas together (0 = unlimited); a save or copy "
        "beyond it drops the job's older steps (never its newest restorable one) or is refused with RESOURCE_EXHAUSTED.",
        _size("--job-quota"),
        default=0,
    )
    max_streams_per_peer: int = _opt(
        "Inbound transfers (Put streams, data-channel receives) one peer store, or the clients of one job, may have open "
        "on this store at once (0 = unlimited); more are refused with RESOURCE_EXHAUSTED.",
        _non_negative_int("--max-streams-per-peer"),
        default=16,
    )
    spill: str = _opt(
        "Durable storage URL for spilled steps (file:///path, s3://bucket/prefix, any fsspec URL); '' = no durable tier.", str, default=""
    )
    spill_options: str = _opt(
        "Extra fsspec options for --spill: a JSON object or KEY=VALUE,... (e.g. endpoint_url=http://127.0.0.1:9000).", str, default=""
    )
    spill_every_steps: int = _opt(
        "Spill every step that is a multiple of N (0 = off).", _non_negative_int("--spill-every-steps"), default=0
    )
    spill_every_seconds: float = _opt(
        "Spill the newest committed step when S seconds passed since the last spill (0 = off).",
        _non_negative_float("--spill-every-seconds"),
        default=0.0,
    )
    spill_keep_last: int = _opt("Spilled steps kept, newest first.", _positive_int("--spill-keep-last"), default=2)
    spill_keep_best: int = _opt("Also keep the best M spilled steps by --spill-metric.", _non_negative_int("--spill-keep-best"), default=0)
    spill_metric: str = _opt("Metric (passed with save(..., metrics=...)) ranking steps for --spill-keep-best.", str, default="")
    spill_metric_mode: str = _opt(
        "min: lower is better (loss); max: higher is better (accuracy).", _choice("--spill-metric-mode", ("min", "max")), default="min"
    )
    spill_compression: str = _opt(
        "Codec of spilled chunks: none, zstd, zstd-shuffle2 (bf16/fp16), zstd-shuffle4 (fp32).",
        _choice("--spill-compression", ("none", "zstd", "zstd-shuffle2", "zstd-shuffle4")),
        default="none",
    )
    spill_max_rate: int = _opt("Spill bandwidth limit in bytes/s (0 = unlimited).", _size("--spill-max-rate"), default=0)
    spill_orphan_seconds: float = _opt(
        "Age after which an unpublished shard file (a spill killed midway) is removed.",
        _positive_float("--spill-orphan-seconds"),
        default=300.0,
    )
    flush_grace_seconds: float = _opt(
        "On SIGTERM, time allowed to spill the newest committed step before exiting.",
        _non_negative_float("--flush-grace-seconds"),
        default=30.0,
    )
    drain_grace_seconds: float = _opt(
        "On SIGTERM or `memstore drain`, time allowed to give every shard only this store holds another copy "
        "(a peer, else the durable tier) before exiting.",
        _non_negative_float("--drain-grace-seconds"),
        default=60.0,
    )
    auth_token_file: str = _opt(
        "File holding the cluster token (stores among themselves, trusted trainers, the CLI); '' = no authentication.",
        str,
        default="",
    )
    job_tokens_file: str = _opt('JSON file {"<job id>": "<token>", ...}: a job token reads and writes that one job only.', str, default="")
    admin_token_file: str = _opt("File holding the admin token: every operation, incl. delete, listing every job, drain.", str, default="")
    tls_cert: str = _opt("PEM certificate chain of this store (gRPC and the data channel serve TLS when set).", str, default="")
    tls_key: str = _opt("PEM private key of --tls-cert.", str, default="")
    tls_ca: str = _opt("PEM CA bundle: verifies peers' certificates, and clients must present one it signed (mutual TLS).", str, default="")
    tls_server_name: str = _opt(
        "The name (a DNS SAN) every store's certificate carries: peers' certificates are checked for it instead of the "
        "address dialed (Kubernetes: stores are dialed by pod IPs, which change; one certificate for "
        "memstore-peers.<ns>.svc serves them all). Clients: MEMSTORE_TLS_SERVER_NAME. '' = the address dialed.",
        str,
        default="",
    )
    tls_client_auth: bool = _opt(
        "With TLS, require every client to present a certificate signed by --tls-ca (mutual TLS); --no-tls-client-auth "
        "accepts clients without one (they still verify the store, and need a token when auth is on).",
        _bool("--tls-client-auth"),
        default=True,
    )
    insecure: bool = _opt(
        "Allow listening on a non-loopback address without --auth-token-file (anyone who reaches the port reads every shard).",
        _bool("--insecure"),
        default=False,
    )
    log_level: str = _opt("Logging level.", _choice("--log-level", ("DEBUG", "INFO", "WARNING", "ERROR")), default="INFO")
    log_format: str = _opt(
        "Log lines for people (human) or one JSON object per line (json); both carry host, and job, step and rank "
        "where a line is about a shard.",
        _choice("--log-format", ("human", "json")),
        default="human",
    )
    metrics_port: int = _opt(
        "Port of the Prometheus /metrics endpoint, on the --listen host (0 = off).",
        _number("--metrics-port", int, 0, False, "a port number"),
        default=0,
    )

    # ------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        cli: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> StoreConfig:
        """Merge the sources (CLI > env > file > defaults), parse and validate every value."""
        env = os.environ if env is None else env
        merged: dict[str, Any] = {}
        path = config_file or env.get("MEMSTORE_CONFIG")
        if path:
            merged.update(_read_config_file(Path(path)))
        for f in fields(cls):
            env_value = env.get(f"MEMSTORE_{f.name.upper()}")
            if env_value is not None and env_value != "":
                merged[f.name] = env_value
        merged.update({k: v for k, v in (cli or {}).items() if v is not None})
        unknown = sorted(set(merged) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(unknown)}")
        parsed: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in merged:
                parse = f.metadata["parse"]
                parsed[f.name] = parse(merged[f.name]) if parse else merged[f.name]
        return cls(**_resolve_redundancy(parsed)).validated()

    def validated(self) -> StoreConfig:
        if self.host_id == "" and isinstance(self.discovery, str) and self.discovery.startswith("dns://"):
            return replace(self, host_id=self._host_id_from_listen()).validated()
        if not isinstance(self.host_id, str) or not HOST_ID_PATTERN.fullmatch(self.host_id):
            raise ConfigError(f"--host-id {self.host_id!r} is invalid: expected 1-64 characters of [A-Za-z0-9._-]")
        dynamic = [flag for flag, value in (("--peers-file", self.peers_file), ("--discovery", self.discovery)) if value]
        if dynamic:
            if self.peers or len(dynamic) > 1:
                given = ["--peers"] * bool(self.peers) + dynamic
                raise ConfigError(f"{' and '.join(given)} are exclusive: the members come from one source")
            if self.discovery and not self.discovery.startswith("dns://") and self.discovery != "fed":
                raise ConfigError(f"--discovery {self.discovery!r} is invalid: expected dns://NAME:PORT[?server=IP:PORT] (or fed)")
            return self._validated_common(peers=())
        peers = self.peers or ((self.host_id, self.listen),)
        ids = [p[0] for p in peers]
        if self.host_id not in ids:
            raise ConfigError(f"--peers must list every host including this one; {self.host_id!r} is missing from {', '.join(ids)}")
        own_port = dict(peers)[self.host_id].rpartition(":")[2]
        listen_port = self.listen.rpartition(":")[2]
        if self.peers and listen_port != "0" and own_port not in ("0", listen_port):
            raise ConfigError(
                f"--listen {self.listen} and --peers ({self.host_id}={dict(peers)[self.host_id]}) disagree on this host's port; "
                "is --host-id right?"
            )
        if self.replicas > len(peers):
            raise ConfigError(f"--replicas {self.replicas} is larger than the number of hosts ({len(peers)}) in --peers")
        checked = self._validated_common(peers=peers)
        labels = checked.failure_domains
        unknown = sorted(h for h in labels if h not in ids)
        missing = [h for h in ids if h not in labels]
        if labels and (unknown or missing):
            problem = f"given for hosts not in --peers: {', '.join(unknown)}" if unknown else f"missing for hosts {missing!r}"
            raise ConfigError(f"--failure-domains: failure-domain labels {problem} (label every host, or none)")
        return checked

    def _host_id_from_listen(self) -> str:
        host = self.listen.rpartition(":")[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is None or ip.is_unspecified:
            raise ConfigError(
                f"--host-id is not set and --listen {self.listen} is not one IP address: with --discovery dns:// a store "
                "without --host-id is named after its --listen IP (e.g. --listen $(POD_IP):7070)"
            )
        return ip_host_id(str(ip))

    def _check_ports_and_labels(self) -> None:
        for flag, port in (("--data-port", self.data_port), ("--metrics-port", self.metrics_port)):
            if port > 65535:
                raise ConfigError(f"{flag} {port} is invalid: expected 0..65535")
        if self.failure_domain_node_labels:
            if self.failure_domain:
                raise ConfigError("--failure-domain and --failure-domain-node-labels are exclusive: the label comes from one place")
            bad = [label for label in self.failure_domain_node_labels.split(",") if not NODE_LABEL.fullmatch(label.strip())]
            if bad:
                raise ConfigError(
                    f"--failure-domain-node-labels {self.failure_domain_node_labels!r} is invalid: {bad[0]!r} is not a "
                    "Kubernetes label name (e.g. topology.kubernetes.io/zone)"
                )

    def _check_prefault(self) -> None:
        if self.prefault is not None and self.prefault > self.capacity:
            raise ConfigError(
                f"--prefault {self.prefault} bytes is larger than --capacity {self.capacity} bytes: the reserve is part of the capacity"
            )
        if self.prefault_unit > self.capacity:
            raise ConfigError(f"--prefault-unit {self.prefault_unit} bytes is larger than --capacity {self.capacity} bytes")

    def _check_redundancy(self, hosts: int) -> None:
        """``hosts``: how many --peers lists (0: the members come from discovery, checked as they come)."""
        if self.replicas != self.redundancy.replicas:
            raise ConfigError(
                f"--replicas {self.replicas} and --redundancy {self.redundancy} disagree: give one of them "
                f"(--redundancy {self.redundancy} means --replicas {self.redundancy.replicas})"
            )
        if self.redundancy.erasure_coded and self.placement != "mixed":
            raise ConfigError(
                f"--placement {self.placement} does not apply to --redundancy {self.redundancy}: erasure coding places "
                "disjoint groups (--placement mixed)"
            )
        if hosts and self.redundancy.erasure_coded and self.redundancy.group_size > hosts:
            raise ConfigError(
                f"--redundancy {self.redundancy} needs at least {self.redundancy.group_size} hosts (K+M), but --peers lists {hosts}"
            )

    def _validated_common(self, peers: tuple[tuple[str, str], ...]) -> StoreConfig:
        self._check_redundancy(len(peers))
        host = self.listen.rpartition(":")[0].strip("[]")
        if not self.auth_token_file and not self.insecure and not _loopback(host):
            raise ConfigError(
                f"--listen {self.listen} is reachable from other machines but no --auth-token-file is set: anyone who reaches "
                "the port could read and delete every shard. Set --auth-token-file (and TLS), or pass --insecure to accept that"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_server_name and not self.tls_cert:
            raise ConfigError("--tls-server-name needs TLS (--tls-cert, --tls-key and --tls-ca)")
        if bool(self.tls_ca) != bool(self.tls_cert):
            raise ConfigError("--tls-ca and --tls-cert/--tls-key go together: stores verify each other's certificates with --tls-ca")
        self._check_ports_and_labels()
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"--chunk-bytes {self.chunk_bytes} is invalid: expected 1..{MAX_CHUNK_BYTES}")
        self._check_prefault()
        domains = dict(self.failure_domains)
        if self.failure_domain:
            if domains.get(self.host_id, self.failure_domain) != self.failure_domain:
                raise ConfigError(
                    f"--failure-domain {self.failure_domain!r} contradicts --failure-domains {self.host_id}={domains[self.host_id]}"
                )
            domains.setdefault(self.host_id, self.failure_domain)
        if self.spill_keep_best and not self.spill_metric:
            raise ConfigError("--spill-keep-best needs --spill-metric NAME (the metric passed with save(..., metrics=...))")
        if self.spill:
            from memstore.spill.storage import parse_options

            try:
                parse_options(self.spill_options)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if "://" not in self.spill and not self.spill.startswith("/"):
                raise ConfigError(f"--spill {self.spill!r} is invalid: expected a URL like file:///data/ckpt or s3://bucket/prefix")
        return replace(self, peers=peers, failure_domains=domains)

    def spill_settings(self) -> SpillOptions | None:
        """What the durable tier is told (``memstore.spill.build_spiller``); None without ``--spill``."""
        from memstore.spill.options import SpillOptions

        if not self.spill:
            return None
        return SpillOptions(
            url=self.spill,
            storage_options=self.spill_options,
            every_steps=self.spill_every_steps,
            every_seconds=self.spill_every_seconds,
            keep_last=self.spill_keep_last,
            keep_best=self.spill_keep_best,
            metric=self.spill_metric,
            metric_max=self.spill_metric_mode == "max",
            compression=self.spill_compression,
            max_rate=self.spill_max_rate,
            orphan_seconds=self.spill_orphan_seconds,
        )

    @property
    def host_ids(self) -> tuple[str, ...]:
        return tuple(p[0] for p in self.peers)

    def address_of(self, host_id: str) -> str:
        return dict(self.peers)[host_id]

    @classmethod
    def help_of(cls, name: str) -> str:
        return str({f.name: f.metadata["help"] for f in fields(cls)}[name])


#: Tests only: "1" makes the rule above treat loopback addresses as reachable from other machines, so that a test on
#: 127.0.0.1 runs what a cluster with routable IPs runs (tests/ray_integration sets it for its Ray nodes). Never in production.
FORCE_REMOTE_ENV = "MEMSTORE_TEST_LOOPBACK_IS_REMOTE"


def _loopback(host: str) -> bool:
    if os.environ.get(FORCE_REMOTE_ENV) == "1":
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve_redundancy(parsed: dict[str, Any]) -> dict[str, Any]:
    """``--replicas R`` means ``--redundancy replicas:R``: whichever of the two is given sets the other; both given
    and disagreeing (from any of the sources) is a ``ConfigError`` naming both."""
    if "replicas" not in parsed and "redundancy" not in parsed:
        return parsed
    try:
        scheme = Redundancy.resolve(parsed.get("replicas"), parsed.get("redundancy"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return {**parsed, "replicas": scheme.replicas, "redundancy": scheme}


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, ValueError) as exc:  # a directory, unreadable, a NUL in the name
        if isinstance(exc, (tomllib.TOMLDecodeError, UnicodeDecodeError)):
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests too deeply") from None
    section = data.get("store", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [store] must be a table")
    return {k.replace("-", "_"): v for k, v in section.items()}
