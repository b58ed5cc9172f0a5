#!/usr/bin/env python3
"""Tables of docs/quality.md (policies at matched bytes) from the kvq-eval JSON of policies_smollm2.sh.

usage: policies_table.py out/policies_smollm2.json

Bits are the formats' own bits per K/V element of the pages (scales and zeros included):
`nominal` for the final format map, `pages` for the pages actually written (the two differ only
for a policy that changed its decisions during the run, EchoKV). Random rows: mean and standard
deviation over the seeds. EchoKV tier agreement: the fraction of layers whose final K format is
the same for all three seeds, and the mean over seed pairs of the fraction of layers that agree.
"""
import itertools
import json
import statistics
import sys


def short(name):
    return name.split(",artifact=")[0] if ",artifact=" in name else name


def main(path):
    rep = json.load(open(path))
    cfgs = {c["name"]: c for c in rep["configs"]}
    t = rep["text"]
    print(f"positions {t['positions'][0]}..{t['positions'][1]} ({t['teacher_forced']} teacher-forced tokens after "
          f"a prefill of {t['prefill']}) of {t['path']}; wall {rep['wall_seconds']:.0f} s, {rep['threads']} threads\n")

    def q(c):
        return c["quality"]

    def row(label, c, note=""):
        b = c["bits"]
        return (f"| {label} | {b['nominal_bits']:.2f} | {b['page_bits']:.2f} | {q(c)['mean_kl']:.2e} | "
                f"{q(c)['p99_kl']:.2e} | {q(c)['top1_agreement']:.4f} | {q(c)['perplexity']:.3f} | "
                f"{q(c)['perplexity_delta']:+.3f} | {note} |")

    head = ("| configuration | nominal bits | page bits | mean KL | p99 KL | top-1 | PPL | ΔPPL | note |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    ref = next(c for c in rep["configs"] if c["reference"])
    print("Reference: " + ref["name"] + f", PPL {q(ref)['perplexity']:.3f}\n")
    autok_phi = {4: "0.1913", 5: "0.3792", 6: "0.5486"}
    uniform = {4: ["k=kivi4/g32,v=kivi2/g32", "sym4/g32"], 5: ["kivi4/g32"], 6: ["k=kivi8/g32,v=kivi2/g32"]}
    for b in (4, 5, 6):
        print(f"### Target {b} bits\n")
        print(head)
        kb = [n for n in cfgs if n.startswith(f"kl_budget:bits={b},")][0]
        print(row(f"`kl_budget:bits={b}`", cfgs[kb]))
        ak = [n for n in cfgs if n.startswith(f"autok:phi={autok_phi[b]},")][0]
        print(row(f"`{short(ak)}`", cfgs[ak]))
        for u in uniform[b]:
            c = cfgs[u]
            off = abs(c["bits"]["nominal_bits"] - b)
            print(row(f"`{u}` (uniform)", c, "" if off <= 0.1 else f"not matched: {off:+.2f} bits off"))
        rs = [cfgs[n] for n in cfgs if n.startswith("random:") and f"like=kl_budget:bits={b}," in n]
        for c in rs:
            print(row(f"`{short(c['name'])}`", c))
        kl = [q(c)["mean_kl"] for c in rs]
        ag = [q(c)["top1_agreement"] for c in rs]
        pp = [q(c)["perplexity_delta"] for c in rs]
        print(f"| random, mean ± sd of {len(rs)} seeds | {rs[0]['bits']['nominal_bits']:.2f} | "
              f"{rs[0]['bits']['page_bits']:.2f} | {statistics.mean(kl):.2e} ± {statistics.stdev(kl):.1e} | | "
              f"{statistics.mean(ag):.4f} ± {statistics.stdev(ag):.4f} | | {statistics.mean(pp):+.3f} ± "
              f"{statistics.stdev(pp):.3f} | |")
        kbq = q(cfgs[kb])
        verdict = []
        verdict.append(f"kl_budget KL / random mean KL = {kbq['mean_kl'] / statistics.mean(kl):.2f}")
        verdict.append(f"kl_budget KL below every random seed: {'yes' if kbq['mean_kl'] < min(kl) else 'NO'}")
        akq = q(cfgs[ak])
        verdict.append(f"autok KL below every random seed: {'yes' if akq['mean_kl'] < min(kl) else 'NO'}")
        matched = [u for u in uniform[b] if abs(cfgs[u]["bits"]["nominal_bits"] - b) <= 0.1]
        best_u = min(matched, key=lambda u: q(cfgs[u])["mean_kl"])
        verdict.append(f"kl_budget KL below the matched uniform ({best_u}): "
                       f"{'yes' if kbq['mean_kl'] < q(cfgs[best_u])['mean_kl'] else 'NO'}")
        print("\n" + "; ".join(verdict) + ".\n")

    print("### EchoKV (live; tiers kivi2|kivi4|kivi8 /g32, per layer)\n")
    print("| rate | hysteresis | seed | page bits | final nominal bits | mean KL | p99 KL | top-1 | ΔPPL | "
          "map changes (sampled) |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    groups = {}
    for n, c in cfgs.items():
        if not n.startswith("echokv:"):
            continue
        p = dict(kv.split("=") for kv in n.split(":", 1)[1].split(","))
        key = (p["rate"], "k=1,h=0 (none)" if p.get("hysteresis") == "1" else "k=3,h=0.1")
        groups.setdefault(key, []).append((int(p["seed"]), c))
    summary = []
    for key in sorted(groups):
        runs = sorted(groups[key], key=lambda x: x[0])
        for seed, c in runs:
            hist = c["format_map_history"]
            print(f"| {key[0]} | {key[1]} | {seed} | {c['bits']['page_bits']:.2f} | {c['bits']['nominal_bits']:.2f} | "
                  f"{q(c)['mean_kl']:.2e} | {q(c)['p99_kl']:.2e} | {q(c)['top1_agreement']:.4f} | "
                  f"{q(c)['perplexity_delta']:+.3f} | {len(hist) - 1} |")
        tiers = [[row[0] for row in c["format_map"]["k"]] for _, c in runs]
        layers = len(tiers[0])
        all_agree = sum(1 for l in range(layers) if len({t[l] for t in tiers}) == 1) / layers
        pair = statistics.mean(sum(1 for l in range(layers) if a[l] == b[l]) / layers
                               for a, b in itertools.combinations(tiers, 2))
        pb = [c["bits"]["page_bits"] for _, c in runs]
        nb = [c["bits"]["nominal_bits"] for _, c in runs]
        kl = [q(c)["mean_kl"] for _, c in runs]
        ag = [q(c)["top1_agreement"] for _, c in runs]
        summary.append(f"| {key[0]} | {key[1]} | {statistics.mean(pb):.2f} | {max(pb) - min(pb):.2f} | "
                       f"{statistics.mean(nb):.2f} | {max(nb) - min(nb):.2f} | {all_agree:.2f} | {pair:.2f} | "
                       f"{statistics.mean(kl):.2e} | {statistics.mean(ag):.4f} |")
    print("\n| rate | hysteresis | page bits, mean of 3 seeds | spread (max−min) | final nominal bits, mean | "
          "spread | layers with the same final tier in all 3 seeds | mean pairwise tier agreement | mean KL | "
          "top-1 |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(summary))


if __name__ == "__main__":
    main(sys.argv[1])
