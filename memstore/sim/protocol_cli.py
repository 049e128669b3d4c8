"""``memstore simulate protocol``: the restore protocol's message counts and restart timeline at scale.

The flags of the ``protocol`` mode of ``memstore simulate`` (:mod:`memstore.sim.cli` adds the mode; the model is
:mod:`memstore.sim.protocol`). Flags take human units (``--rpc-ms``, ``--collective-hop-us``); the model's
:class:`~memstore.sim.protocol.ProtocolConfig` holds seconds. Every flag's ``dest`` starts with ``protocol_`` so
none collides with a flag of the ETTR sweep in the same namespace.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from memstore.sim.flags import fraction, host_list, nonnegative_float, nonnegative_int, positive_float, positive_int
from memstore.sim.protocol import ProtocolConfig, ProtocolPoint, run_protocol
from memstore.sim.save_path_model import SaveConfig, SaveCost, save_cost

HELP = "the restore protocol's messages and restart time at scale, legacy vs process group"
DESCRIPTION = (
    "Closed-form model of one job's restart: how many RPCs, durable listings and collectives latest_step()/load() cost "
    "and how long the slowest rank takes, for the legacy protocol (every rank's store lists every store) and the "
    "process-group one (each rank asks its store about itself, ranks agree with collectives). Model outputs, not "
    "measurements. See docs/simulator.md, 'Restore protocol at scale'."
)
DEFAULT_HOSTS = "32,1000,10000"
D = ProtocolConfig(hosts=32)  # the defaults (the host count is a placeholder)
#: dest -> (ProtocolConfig field, factor from the flag's unit to the field's)
SCALED = {
    "protocol_rpc_ms": ("rpc_s", 1e-3),
    "protocol_list_service_ms": ("list_service_s", 1e-3),
    "protocol_list_entry_us": ("list_entry_s", 1e-6),
    "protocol_collective_hop_us": ("collective_hop_s", 1e-6),
    "protocol_durable_list_seconds": ("durable_list_s", 1.0),
    "protocol_durable_list_ms_per_1000": ("durable_list_per_1000_s", 1e-3),
    "protocol_durable_cache_seconds": ("durable_cache_s", 1.0),
    "protocol_start_seconds": ("start_s", 1.0),
}
#: ProtocolConfig fields set from a flag of the same name
SAME = (
    "ranks_per_host",
    "replicas",
    "keep",
    "failed_hosts",
    "fanout_threads",
    "entry_bytes",
    "durable_steps",
    "durable_page_objects",
    "durable_list_rate",
    "shard_gb",
    "local_gbps",
    "stream_gbps",
    "link_gbps",
    "fallback_probability",
)


def _flag(g: argparse._ArgumentGroup, name: str, **kw: Any) -> None:
    if kw.get("action") != "store_true":
        kw.setdefault("metavar", name.upper().replace("-", "_"))
    g.add_argument(f"--{name}", dest="protocol_" + name.replace("-", "_"), **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``memstore simulate protocol`` flag, in groups."""
    g = p.add_argument_group("job")
    _flag(g, "hosts", type=host_list, default=DEFAULT_HOSTS, metavar="N[,N...]", help="host counts (N), one table row each")
    _flag(g, "ranks-per-host", type=positive_int, default=D.ranks_per_host, help="trainer ranks per host (G)")
    _flag(g, "replicas", type=positive_int, default=D.replicas, help="copies of each shard, the owner's included (R)")
    _flag(g, "keep", type=positive_int, default=D.keep, help="versions each store keeps per job (K)")
    _flag(g, "failed-hosts", type=nonnegative_int, default=D.failed_hosts, help="replaced hosts (empty RAM) at the restart (F)")
    _flag(g, "shard-gb", type=positive_float, default=D.shard_gb, help="one rank's shard, 10^9 bytes (S)")
    g = p.add_argument_group("stores and RPCs")
    _flag(g, "fanout-threads", type=positive_int, default=D.fanout_threads, help="a store's peer-listing pool, shared by its calls (P)")
    _flag(g, "rpc-ms", type=nonnegative_float, default=D.rpc_s * 1e3, help="round trip of one control RPC, service time excluded")
    _flag(g, "list-service-ms", type=nonnegative_float, default=D.list_service_s * 1e3, help="a store's CPU time per ListShards")
    _flag(g, "list-entry-us", type=nonnegative_float, default=D.list_entry_s * 1e6, help="added CPU time per shard entry listed")
    _flag(g, "entry-bytes", type=positive_int, default=D.entry_bytes, help="bytes per shard entry in a ListShards response")
    _flag(g, "collective-hop-us", type=nonnegative_float, default=D.collective_hop_s * 1e6, help="latency of one hop of a collective")
    _flag(g, "start-seconds", type=nonnegative_float, default=D.start_s, help="process start + connect, before the first call")
    g = p.add_argument_group("durable tier")
    _flag(g, "no-durable", action="store_true", help="no durable tier configured (nothing to list)")
    _flag(g, "durable-steps", type=positive_int, default=D.durable_steps, help="spilled steps kept (2 objects per rank each, + 1)")
    _flag(g, "durable-list-seconds", type=nonnegative_float, default=D.durable_list_s, help="fixed time of one listing")
    _flag(g, "durable-list-ms-per-1000", type=nonnegative_float, default=D.durable_list_per_1000_s * 1e3, help="its time per 1,000 objects")
    _flag(g, "durable-page-objects", type=positive_int, default=D.durable_page_objects, help="objects per LIST request (S3: 1,000)")
    _flag(g, "durable-list-rate", type=positive_float, default=D.durable_list_rate, help="LIST requests/s the job's prefix sustains")
    _flag(g, "durable-cache-seconds", type=nonnegative_float, default=D.durable_cache_s, help="a store reuses its listing this long")
    g = p.add_argument_group("restore")
    _flag(g, "local-gbps", type=positive_float, default=D.local_gbps, help="reading a shard from local RAM")
    _flag(g, "stream-gbps", type=positive_float, default=D.stream_gbps, help="one peer-to-peer pull stream")
    _flag(g, "link-gbps", type=positive_float, default=D.link_gbps, help="a host's NIC")
    _flag(g, "fallback-probability", type=fraction, default=D.fallback_probability, help="adds a row: the group protocol's expected cost")
    g = p.add_argument_group("output")
    _flag(g, "json", metavar="PATH", default=None, help="write all results as JSON")
    _flag(g, "markdown", metavar="PATH", default=None, help="write the tables as Markdown")
    _flag(g, "no-table", action="store_true", help="don't print the tables")


def configs_from_args(args: argparse.Namespace) -> tuple[list[ProtocolConfig], dict[str, Any]]:
    """One :class:`ProtocolConfig` per host count, plus the parameters for the JSON; :class:`argparse.ArgumentError` on bad input."""
    fields: dict[str, Any] = {name: getattr(args, "protocol_" + name) for name in SAME}
    fields.update({field: getattr(args, dest) * factor for dest, (field, factor) in SCALED.items()})
    fields["durable"] = not args.protocol_no_durable
    configs = []
    for n in args.protocol_hosts:
        try:
            configs.append(ProtocolConfig(hosts=n, **fields))
        except ValueError as exc:  # validate_protocol's messages name the flags
            raise argparse.ArgumentError(None, str(exc)) from None
    common = asdict(configs[0])
    common.pop("hosts")
    return configs, {"hosts": list(args.protocol_hosts), **common, "units": "seconds (_s), 10^9 bit/s (_gbps), 10^9 bytes (_gb)"}


def title_of(cfg: ProtocolConfig) -> str:
    durable = (
        f"durable tier listed ({cfg.durable_steps} steps kept, {cfg.durable_page_objects:,} objects/LIST, "
        f"{cfg.durable_list_rate:,.0f} LIST/s per prefix, cache {cfg.durable_cache_s:g} s)"
        if cfg.durable
        else "no durable tier"
    )
    return (
        f"memstore simulate protocol: {cfg.ranks_per_host} ranks/host, R={cfg.replicas}, K={cfg.keep}, pool {cfg.fanout_threads}, "
        f"{cfg.failed_hosts} replaced host(s); RPC {cfg.rpc_s * 1e3:g} ms, ListShards {cfg.list_service_s * 1e3:g} ms + "
        f"{cfg.list_entry_s * 1e6:g} us/entry; {durable}; collective hop {cfg.collective_hop_s * 1e6:g} us; shard "
        f"{cfg.shard_gb:g} GB, local {cfg.local_gbps:g} / stream {cfg.stream_gbps:g} / NIC {cfg.link_gbps:g} Gbps. "
        "Model outputs, not measurements"
    )


MEASURED_HOSTS = (8, 16, 32)  # the save-path table also models the host counts measured on real stores


def save_costs(configs: list[ProtocolConfig]) -> list[SaveCost]:
    """The save path and gossip at the measured host counts and at every host count asked for."""
    cfg = configs[0]
    hosts = sorted({*MEASURED_HOSTS, *(c.hosts for c in configs)})
    return [save_cost(SaveConfig(n, ranks_per_host=cfg.ranks_per_host, replicas=min(cfg.replicas, n))) for n in hosts]


def run(args: argparse.Namespace) -> int:
    """Run ``memstore simulate protocol``; the exit code. :class:`argparse.ArgumentError` if the flags don't fit together."""
    configs, parameters = configs_from_args(args)
    started = time.perf_counter()
    points: list[ProtocolPoint] = [run_protocol(cfg) for cfg in configs]
    saves = save_costs(configs)
    elapsed = time.perf_counter() - started
    title = title_of(configs[0])
    if not args.protocol_no_table:
        from rich.console import Console

        from memstore.sim.report import render_protocol, render_save_path

        console = Console()
        if not console.is_terminal:  # piped / captured: don't squeeze the tables into 80 columns
            console = Console(width=240)
        render_protocol(points, console, title)
        render_save_path(saves, console)
        console.print(f"[dim]{len(points)} host counts modelled in {elapsed * 1e3:.1f} ms (closed form)[/]")
    if args.protocol_json:
        from memstore.sim.report import protocol_to_json, write_json

        doc = {**protocol_to_json(points, parameters), "save_path": [c.to_dict() for c in saves]}
        print(f"wrote {write_json(args.protocol_json, doc)}")
    if args.protocol_markdown:
        from memstore.sim.report import protocol_markdown, save_path_markdown, write_text

        text = protocol_markdown(points, title) + "\n" + save_path_markdown(saves)
        print(f"wrote {write_text(args.protocol_markdown, text)}")
    return 0
