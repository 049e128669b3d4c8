"""``memstore reclaim-shm``: delete this machine's shared-memory segment dirs that no running store owns, now.

Optional: a running store adopts its predecessor's and deletes the others after ``--shm-reclaim-after``
(``memstore.server.memory.shm_sweep``); this frees them at once, or on a machine where no store runs any more."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, fields

from memstore.config import StoreConfig
from memstore.errors import ConfigError

HELP = "delete now the shared-memory segment dirs on this machine that no running store owns (stores do it after --shm-reclaim-after)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    store_default = next(str(f.default) for f in fields(StoreConfig) if f.name == "shm_dir")
    p.add_argument(
        "--shm-dir",
        default=os.environ.get("MEMSTORE_SHM_DIR") or store_default,
        help=f"the stores' --shm-dir (default: $MEMSTORE_SHM_DIR, else {store_default})",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="only list them")


def run(args: argparse.Namespace) -> int:
    from memstore.core.sizes import format_size
    from memstore.server.memory.shm_dirs import orphaned_dirs, reclaim_orphans

    if not args.shm_dir:
        raise ConfigError("--shm-dir is empty: name the directory the stores of this machine use (their --shm-dir)")
    if not os.path.isdir(args.shm_dir):
        raise ConfigError(f"--shm-dir {args.shm_dir} is not a directory: name the one the stores of this machine use (their --shm-dir)")
    orphans = orphaned_dirs(args.shm_dir) if args.dry_run else reclaim_orphans(args.shm_dir)
    total = sum(o.bytes for o in orphans)
    if args.json:
        print(
            json.dumps(
                {"shm_dir": args.shm_dir, "dry_run": args.dry_run, "bytes": total, "orphans": [asdict(o) for o in orphans]}, indent=2
            )
        )
        return 0
    if not orphans:
        print(f"no orphaned segment dirs under {args.shm_dir}")
        return 0
    for o in orphans:
        print(f"  {o.path}  host {o.host_id}  {o.files} segments  {format_size(o.bytes)}")
    verb = "would reclaim" if args.dry_run else "reclaimed"
    print(f"{verb} {len(orphans)} orphaned segment dirs, {format_size(total)}")
    return 0
