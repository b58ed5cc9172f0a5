#!/usr/bin/env python3
"""EchoKV budget-mode (target_bits) table of docs/quality.md from a kvq-eval JSON.

usage: echokv_budget_table.py <kvq-eval.json>

For every `echokv:...target_bits=B` configuration: the target, the canary rate, the starting tier
(`init=`, a column only when some configuration sets it), the page bits
actually written (every page since the start, prefill included), the nominal bits of the final
format map, the nominal bits of the format maps sampled every `--map-every` steps averaged over
the second half of the decode steps (where the controller has had time to act), the largest
distance of those samples from the target in that half, mean / p99 KL, top-1 agreement and
ΔPPL against the FP16 cache, and the number of sampled map changes.

Nominal bits of a format, per element: kivi<b>/g<G> and ra<b>/g<G> b + 32/G (an FP16 scale and
zero per group of G), sym<b>/g<G> b + 16/G (scale only), fp16/bf16 16 (fp8 is not an EchoKV tier
and is rejected). The final-map value is checked against the JSON's own `nominal_bits`.
"""
import json
import re
import sys


def fmt_bits(name):
    m = re.fullmatch(r"(kivi|ra|sym)(\d)(?:/g(\d+))?", name)
    if m:
        fam, b, g = m.group(1), int(m.group(2)), int(m.group(3) or 64)
        return b + (16 if fam == "sym" else 32) / g
    if name in ("fp16", "bf16"):
        return 16.0
    raise SystemExit(f"unknown format {name!r} (extend fmt_bits)")


def map_bits(snap):
    vals = [fmt_bits(f) for role in ("k", "v") for row in snap[role] for f in row]
    return sum(vals) / len(vals)


def param(name, key, default=""):
    m = re.search(rf"[:,]{key}=([^,]+)", name)
    return m.group(1) if m else default


def main(path):
    rep = json.load(open(path))
    t = rep["text"]
    steps = t["teacher_forced"]
    print(f"positions {t['positions'][0]}..{t['positions'][1]} ({steps} teacher-forced tokens after a prefill of "
          f"{t['prefill']}) of {t['path']}; wall {rep['wall_seconds']:.0f} s, {rep['threads']} threads\n")
    ref = next(c for c in rep["configs"] if c["reference"])
    print(f"Reference: {ref['name']}, PPL {ref['quality']['perplexity']:.3f}\n")
    budget = [c for c in rep["configs"] if c["name"].startswith("echokv:") and "target_bits=" in c["name"]]
    # the start-tier column only when some configuration sets init= (kvq-eval's echokv:...,init=I)
    with_init = any(param(c["name"], "init") for c in budget)
    print("| target bits | rate | " + ("start tier (init) | " if with_init else "") +
          "page bits | final nominal bits | nominal bits, 2nd half (mean) | "
          "max \\|error\\|, 2nd half | mean KL | p99 KL | top-1 | ΔPPL | map changes (sampled) |")
    print("| ---: | ---: | " + ("---: | " if with_init else "") + ("---: | " * 9).rstrip())
    for c in budget:
        target = float(param(c["name"], "target_bits"))
        rate = param(c["name"], "rate", "0.015625 (default)")
        hist = c["format_map_history"]
        final = map_bits(c["format_map"])
        assert abs(final - c["bits"]["nominal_bits"]) < 1e-6, (c["name"], final, c["bits"]["nominal_bits"])
        # the history keeps a sample only when the map changed: expand to every sampled step
        half = steps // 2
        changes = [(h["step"], map_bits(h)) for h in hist]
        at_half = [b for s, b in changes if s <= half][-1]
        segs = [(half, at_half)] + [(s, b) for s, b in changes if s > half] + [(steps, None)]
        mean2 = sum((segs[i + 1][0] - segs[i][0]) * segs[i][1] for i in range(len(segs) - 1)) / (steps - half)
        err2 = max(abs(b - target) for _, b in segs[:-1])
        q = c["quality"]
        init = f"{param(c['name'], 'init', 'high (default)')} | " if with_init else ""
        print(f"| {target:g} | {rate} | {init}{c['bits']['page_bits']:.2f} | {final:.2f} | {mean2:.2f} | {err2:.2f} | "
              f"{q['mean_kl']:.2e} | {q['p99_kl']:.2e} | {q['top1_agreement']:.4f} | {q['perplexity_delta']:+.3f} | "
              f"{len(hist) - 1} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
