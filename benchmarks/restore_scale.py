"""The restore protocol on many real store processes: calls per rank and time of latest_step() and of a full restore.

    python benchmarks/restore_scale.py [--hosts 8,16,32] [--ranks-per-host 1] [--json PATH]

For each host count, starts that many stores on 127.0.0.1 (R=2, 64 MiB each) and runs the scenario of
``tools.scale``: every rank saves two steps, then calls latest_step() at once without and with a
process group, then restores at once after one host was replaced, without and with a group. Calls are
counted on the stores (their Prometheus counters); gossip and health checks are reported apart.
"""

from __future__ import annotations

import argparse
import json
import math

from tools import scale

PHASES = ("save", "latest_step", "latest_step_group", "restore", "restore_group")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="8,16,32", help="comma-separated host counts")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    counts = [int(h) for h in args.hosts.split(",")]
    results = [scale.run(hosts=n, ranks_per_host=args.ranks_per_host) for n in counts]
    print(f"{'hosts':>5} {'phase':<18} {'calls/rank':>10} {'seconds':>8}  calls by method")
    for r in results:
        for name in PHASES:
            ph = r[name]
            print(f"{r['hosts']:>5} {name:<18} {ph['calls_per_rank']:>10.2f} {ph['seconds']:>8.3f}  {ph['calls']}")
    for name in PHASES:
        a, b = results[0], results[-1]
        if a is not b and a[name]["calls_per_rank"] and a[name]["seconds"]:
            k = math.log(b["hosts"] / a["hosts"])
            calls = math.log(b[name]["calls_per_rank"] / a[name]["calls_per_rank"]) / k
            secs = math.log(b[name]["seconds"] / a[name]["seconds"]) / k
            print(f"{name:<18} grows as hosts^{calls:.2f} in calls per rank, hosts^{secs:.2f} in time ({a['hosts']} -> {b['hosts']} hosts)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
