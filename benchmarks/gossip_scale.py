"""Membership gossip on many real store processes: Hello calls per store per second, and convergence time.

    python benchmarks/gossip_scale.py [--hosts 16,32] [--window 10] [--json PATH]

For each host count, starts that many stores on 127.0.0.1, each following a peers file of its own
(``tools.scale.run_gossip``): the Hellos served right after joining (each store's join round asks
every member), the idle Hello rate per store over ``--window`` seconds once joining settled, and the seconds
(and gossip rounds of --discovery-interval 0.5 s) from one store applying a membership change that only its own
peers file shows until every store holds the new slot table, with the model's rounds
(``memstore simulate protocol``) beside it; and the bytes of one Hello answer, in full and to a gossip ask.
"""

from __future__ import annotations

import argparse
import json

from tools import scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="16,32", help="comma-separated host counts")
    p.add_argument("--window", type=float, default=10.0, help="seconds of the idle Hello count")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    results = [scale.run_gossip(int(n), args.window) for n in args.hosts.split(",")]
    print(f"{'hosts':>5} {'Hello at start':>14} {'Hello/s':>8} {'per store/s':>11} {'converge s':>10} {'rounds':>6} {'model':>5} "
          f"{'bytes full':>10} {'gossip':>6}")  # fmt: skip
    for r in results:
        idle, conv = r["idle"], r["convergence"]
        print(f"{r['hosts']:>5} {r['hello_at_start']:>14} {idle['hello_per_s']:>8.1f} {idle['hello_per_store_per_s']:>11.2f} "
              f"{conv['seconds']:>10.2f} {conv['rounds']:>6.1f} {r['modelled_rounds']:>5} "
              f"{r['hello_bytes']['full']:>10} {r['hello_bytes']['gossip']:>6}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
