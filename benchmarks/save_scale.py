"""The save path on many real store processes: retention's calls per store per saved step, with and without the floor.

    python benchmarks/save_scale.py [--hosts 8,16,32] [--measured 3] [--variants floor,listing,dcp] [--json PATH]

For each host count, starts that many stores on 127.0.0.1 (R=2, --keep 2, 64 MiB each) twice and runs the scenario
of ``tools.save_scale``: one rank per host saves --keep steps, then --measured more, each beyond
--keep; ranks are processes of one gloo job (as ``torchrun`` starts them). Once with the clients built as the quick
start shows (no ``group=``: they agree over the job's default group, the ranks' restorable floor) and once with
``group=False`` (each store lists every store before it evicts); with ``--variants ...,dcp``, once more through
``dcp.save`` (a fresh ``MemStoreWriter`` per save: the floor rides DCP's plans). Calls are counted on the stores (their
Prometheus counters).
"""

from __future__ import annotations

import argparse
import json
import math

from tools import save_scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", default="8,16,32", help="comma-separated host counts")
    p.add_argument("--measured", type=int, default=3, help="saves beyond --keep that are counted")
    p.add_argument("--variants", default="floor,listing", help=f"comma-separated, of {','.join(save_scale.VARIANTS)}")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args()
    counts = [int(h) for h in args.hosts.split(",")]
    variants = tuple(args.variants.split(","))
    results = [save_scale.run(hosts=n, measured=args.measured, variants=variants) for n in counts]
    print(f"{'hosts':>5} {'clients':<22} {'List+LatestStep per store per save (max)':>42} {'in all, per save':>17} {'listing passes':>15}")
    for r in results:
        for name in variants:
            x = r[name]
            what = {"floor": "default (the floor)", "listing": "group=False (listing)", "dcp": "dcp.save (plan floor)"}[name]
            print(f"{x['hosts']:>5} {what:<22} {x['retention_calls_per_store_per_save_max']:>42.2f} "
                  f"{x['retention_calls_per_save_total']:>17.1f} {x['listings_per_store_per_save_max']:>15.2f}")  # fmt: skip
    a, b = (results[0].get("listing"), results[-1].get("listing"))
    if a is not None and b is not None and a is not b and a["retention_calls_per_save_total"]:
        k = math.log(b["hosts"] / a["hosts"])
        growth = math.log(b["retention_calls_per_save_total"] / a["retention_calls_per_save_total"]) / k
        print(f"with group=False, calls per saved step grow as hosts^{growth:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
