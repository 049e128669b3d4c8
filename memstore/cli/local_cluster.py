"""``memstore local-cluster``: N stores on 127.0.0.1 until SIGINT/SIGTERM (a development cluster)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from typing import Any

from memstore.cli.common import add_credential_arguments, configure_logging, resolve_redundancy

HELP = "run N stores on 127.0.0.1 until SIGINT/SIGTERM"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--replicas", type=int, default=None, help="copies of each shard, the owner's included (default 2)")
    p.add_argument("--redundancy", default=None, help="replicas:R or ec:K+M (memstore serve --redundancy); instead of --replicas")
    p.add_argument("--base-port", type=int, default=0, help="first port (0 = free ports)")
    p.add_argument("--capacity", default="2GiB")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--endpoints-file", default=None, help='write {"hosts": {"<host_id>": "127.0.0.1:<port>"}} here')
    p.add_argument("--metrics", action="store_true", help="every store serves Prometheus /metrics on a free port (printed)")
    # The stores and the cluster's own health checks read these through the environment (MEMSTORE_AUTH_TOKEN_FILE, MEMSTORE_TLS_*):
    # with --tls-ca the stores serve --tls-cert/--tls-key and require client certificates signed by the CA.
    add_credential_arguments(p)


def run(args: argparse.Namespace) -> int:
    from memstore.testing import LocalCluster

    configure_logging("INFO")
    redundancy = resolve_redundancy(args.replicas, args.redundancy)
    cluster = LocalCluster(
        hosts=args.hosts, capacity=args.capacity, base_port=args.base_port, keep=args.keep, metrics=args.metrics, redundancy=redundancy
    )
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        if args.endpoints_file:
            cluster.write_endpoints(args.endpoints_file)
        metrics = {h: cluster.metrics_url(h) for h in cluster.stores} if args.metrics else {}
        print(json.dumps({"hosts": cluster.endpoints, **({"metrics": metrics} if metrics else {})}), flush=True)
        while not stop:
            for h, sp in cluster.stores.items():
                if not sp.alive and not stop:
                    logging.warning("store %s exited (code %s); see %s", h, sp.proc.returncode if sp.proc else None, sp.log_path)
                    sp.proc = None
            time.sleep(0.2)
    finally:
        cluster.stop()
    return 0
