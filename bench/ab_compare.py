#!/usr/bin/env python3
"""A/B of two builds of a Google Benchmark binary run in the same GPU session, rounds interleaved
(base, new, base, new, ...): per benchmark, each build's median of its rounds, the ratio new/base,
and the run-to-run noise, the largest relative spread between rounds of one build.

usage: ab_compare.py [--counters a,b] base_1.json [base_2.json ...] -- new_1.json [...] > ab.md

--counters adds a row per benchmark and named counter that it reports (e.g. the append benchmark's
per-iteration medians append_us, append_busy_us), compared the same way.

A change is within noise when |new/base - 1| <= the larger of the two builds' spreads.
"""
import json
import math
import statistics
import sys

if "--" not in sys.argv:
    sys.exit(__doc__)
args = sys.argv[1:]
counters = []
if args[0] == "--counters":
    counters, args = args[1].split(","), args[2:]
cut = args.index("--")
runs = {"base": args[:cut], "new": args[cut + 1:]}
times = {}  # (build, name) -> [real_time per round]
names = []
for build, files in runs.items():
    for path in files:
        for b in json.load(open(path))["benchmarks"]:
            if b.get("run_type", "iteration") != "iteration":
                continue
            for c in [None] + counters:
                if c is not None and c not in b:
                    continue
                name = b["name"] if c is None else f'{b["name"]} [{c}]'
                if name not in names:
                    names.append(name)
                times.setdefault((build, name), []).append(b["real_time"] if c is None else b[c])


def spread(xs):
    return (max(xs) - min(xs)) / min(xs) if len(xs) > 1 else float("nan")


print(f"rounds: base {len(runs['base'])}, new {len(runs['new'])} (interleaved); times in µs, median of rounds")
print()
print("| benchmark | base | new | new / base | noise (base, new) | |")
print("| --- | --- | --- | --- | --- | --- |")
logs, outside = [], 0
for n in names:
    a, b = times.get(("base", n)), times.get(("new", n))
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    r = mb / ma
    noise = max(spread(a), spread(b))
    flag = "" if abs(r - 1) <= noise else ("slower" if r > 1 else "faster")
    outside += flag == "slower"
    logs.append(math.log(r))
    label = (n.split("/iterations:")[0] + (" [" + n.split(" [")[1] if " [" in n else "")).replace("|", "\\|")
    print(f"| {label} | {ma:.1f} | {mb:.1f} | {r:.3f} | {spread(a):.1%}, {spread(b):.1%} | {flag} |")
print()
if logs:
    print(f"geometric mean new / base over {len(logs)} benchmarks: {math.exp(statistics.mean(logs)):.4f}; "
          f"slower beyond noise: {outside}")
