#!/usr/bin/env python3
"""A cache property's decode and append cost, from one run of kvq_bench_decode_cuda: rotated
against unrotated (`+rot`, the default), or with sink pages against without (`--suffix +sink`).

Usage: report_rotation.py decode.json [--goal 1.05] [--suffix +rot|+sink]

For every shape (format, B, L; the other models' shapes as "<model> <format>") the benchmark
ran both as `<format>` and `<format><suffix>` (bench/decode_cuda.cpp), prints the median times
and their ratio with / without, and marks the ratios above the goal (the 5 % of
docs/decisions.md, "Rotation"). The append-step rows compare `append_step/<format><suffix>` with
`append_step/<format>` the same way (append_us and append_frac).
Exits 1 when a decode ratio is above the goal, so a script can gate on it. A run with
--benchmark_repetitions (best with --benchmark_enable_random_interleaving, so that both sides of a
ratio see the same clock drift) gives each shape the median of its repetitions' medians.
"""
import json
import re
import statistics
import sys


def median(runs, key):
    """The median of `key` over a shape's repetitions (one run: its value)."""
    return statistics.median(b[key] for b in runs)


def main():
    bench = json.load(open(sys.argv[1]))
    goal = float(sys.argv[sys.argv.index("--goal") + 1]) if "--goal" in sys.argv else 1.05
    suffix = sys.argv[sys.argv.index("--suffix") + 1] if "--suffix" in sys.argv else "+rot"
    plain, with_ = ("unrotated", "rotated") if suffix == "+rot" else ("without", "with " + suffix.lstrip("+"))
    decode, append = {}, {}
    for b in bench["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration":
            continue  # (the aggregates of repetitions)
        m = re.match(r"(decode|decode_shape/[^/]+|append_step)/(.+?)(" + re.escape(suffix) + r")?/B(\d+)/L(\d+)/(?!W\d)", b["name"])  # (not a sliding window's row)
        if not m:
            continue
        kind, fmt, rot, B, L = m.group(1), m.group(2), m.group(3) is not None, int(m.group(4)), int(m.group(5))
        if kind.startswith("decode_shape/"):  # another model's shape: "<model> <format>"
            kind, fmt = "decode", kind.split("/")[1] + " " + fmt
        (decode if kind == "decode" else append).setdefault((fmt, B, L), {}).setdefault(rot, []).append(b)
    over = 0
    print(f"| format | B | context | {plain} µs | {with_} µs | {with_} / {plain} | |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (fmt, B, L), pair in decode.items():
        if False not in pair or True not in pair:
            continue
        a, r = median(pair[False], "median_us"), median(pair[True], "median_us")
        ratio = r / a
        over += ratio > goal
        mark = f"above {goal:g}" if ratio > goal else ""
        name = fmt.replace("|", " \\| ")  # (a striped pair: a|b)
        print(f"| {name} | {B} | {L} | {a:.1f} | {r:.1f} | {ratio:.3f} | {mark} |")
    if append:
        print()
        print(f"| format | B | context | append µs | {with_} append µs | ratio | append / attention | {with_} |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for (fmt, B, L), pair in append.items():
            if False not in pair or True not in pair:
                continue
            a, r = pair[False], pair[True]
            au, ru = median(a, "append_us"), median(r, "append_us")
            print(f"| {fmt} | {B} | {L} | {au:.1f} | {ru:.1f} | {ru / au:.3f} | {median(a, 'append_frac'):.3f} | "
                  f"{median(r, 'append_frac'):.3f} |")
    print()
    print(f"{over} decode shape(s) above {goal:g}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
