#!/usr/bin/env python3
"""The table, the targets and the plot of bench/hf_generate.py's runs (issue: kvq from Python).

    python3 bench/report_hf_generate.py out/hf/a.jsonl [out/hf/b.jsonl ...] [--plot out/hf/generate]
        [--md out/hf/generate.md]

Targets (each judged only where both sides ran in these files, on one device), like against like:
  - kvq-graph:kivi4/g32 (the decode forward replayed from a CUDA graph) at least 1.0x the
    compiled StaticCache's (torch.compile reduce-overhead: CUDA graphs too) decode tokens/s at
    equal batch and context;
  - at least 2.5x it at equal memory (each at its largest batch at the largest context in the
    same KV bytes, the `--max-batch-kv-gib` runs);
  - kvq-graph:kivi4/g32 at least 3x the faster QuantizedCache (quanto, hqq; eager, since
    transformers cannot compile it) at about equal bytes per token (the table shows both); the
    eager kvq:kivi4/g32 against it is printed too, not judged.
Exits 1 when a judged target is missed.
"""
import argparse
import json
import sys

ORDER = ["dynamic", "static", "quanto", "hqq", "kvq:fp16", "kvq:kivi4/g32", "kvq:kivi2/g32+rot+sink",
         "kvq-graph:fp16", "kvq-graph:kivi4/g32", "kvq-graph:kivi2/g32+rot+sink"]
COLORS = {"dynamic": "#BBBBBB", "static": "#7F7F7F", "quanto": "#F58518", "hqq": "#EECA3B",
          "kvq:fp16": "#C6DBEF", "kvq:kivi4/g32": "#9ECAE1", "kvq:kivi2/g32+rot+sink": "#A1D99B",
          "kvq-graph:fp16": "#6BAED6", "kvq-graph:kivi4/g32": "#2171B5", "kvq-graph:kivi2/g32+rot+sink": "#238B45"}
KVQ4 = "kvq:kivi4/g32"  # eager forward: against the eager QuantizedCache
KVQ4G = "kvq-graph:kivi4/g32"  # CUDA-graph replay: against the compiled (CUDA-graphed) StaticCache


def load(paths):
    """Rows of every file; a later file's row of the same cache and shape (batch, context, max
    batch or not) replaces an earlier one, and a measured row always replaces a failed one."""
    rows = {}
    for p in paths:
        for line in open(p):
            if not line.strip():
                continue
            r = json.loads(line)
            key = (r.get("cache"), r.get("batch"), r.get("context"), "max_batch_in_gib" in r)
            if "error" in r and "tokens_per_s" in rows.get(key, {}):
                continue
            rows[key] = r
    return list(rows.values())


def order(name):
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def table(rows):
    ok = [r for r in rows if "tokens_per_s" in r]
    devices = sorted({r.get("device", "?") for r in rows})
    out = [f"Device: {', '.join(devices)}.", ""]
    skipped = [f"{r['cache']} ({r['skipped']})" for r in rows if "skipped" in r]
    failed = [f"{r['cache']} B={r['batch']} L={r['context']}: {r['error'].splitlines()[0][:160]}"
              for r in rows if "error" in r]
    out += ["| cache | B | context | new tokens | tokens/s | vs static | ms/step | prefill s | peak GiB | KV bytes/token |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    static = {(r["batch"], r["context"]): r for r in ok if r["cache"] == "static" and "max_batch_in_gib" not in r}
    static_max = {r["context"]: r for r in ok if r["cache"] == "static" and "max_batch_in_gib" in r}
    for r in sorted(ok, key=lambda r: ("max_batch_in_gib" in r, r["context"], r["batch"], order(r["cache"]))):
        mb = "max_batch_in_gib" in r
        ref = static_max.get(r["context"]) if mb else static.get((r["batch"], r["context"]))
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        tag = f" (max batch in {r['max_batch_in_gib']:g} GiB)" if mb else ""
        out.append(f"| {r['cache']}{tag} | {r['batch']} | {r['context']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | "
                   f"{ratio} | "
                   f"{r['ms_per_step']:.2f} | {r['prefill_s']:.1f} | {r['peak_gib']:.1f} | {r['kv_bytes_per_token']:.0f} |")
    out.append("")
    out += [f"- not run: {s}" for s in skipped] + [f"- failed: {f}" for f in failed]
    return out, ok


def targets(ok):
    lines, missed = [], False

    def judge(label, got, goal, detail):
        nonlocal missed
        missed |= got < goal
        lines.append(f"- {label}: {got:.2f}x (target >= {goal:g}x) {'met' if got >= goal else 'MISSED'}; {detail}")

    eq = {(r["cache"], r["batch"], r["context"]): r for r in ok if "max_batch_in_gib" not in r}
    for (name, b, c), r in sorted(eq.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        s = eq.get(("static", b, c))
        if name == KVQ4G and s:
            judge(f"kvq-graph:kivi4/g32 vs compiled StaticCache, B={b} L={c}", r["tokens_per_s"] / s["tokens_per_s"],
                  1.0, f"{r['tokens_per_s']:.0f} vs {s['tokens_per_s']:.0f} tokens/s")
        if name not in (KVQ4, KVQ4G):
            continue
        qs = [eq[(q, b, c)] for q in ("quanto", "hqq") if (q, b, c) in eq]
        if qs:
            q = max(qs, key=lambda x: x["tokens_per_s"])
            label = (f"{name} vs the faster QuantizedCache ({q['cache']}, eager: transformers cannot compile it), "
                     f"B={b} L={c}")
            ratio = r["tokens_per_s"] / q["tokens_per_s"]
            detail = (f"{r['tokens_per_s']:.0f} vs {q['tokens_per_s']:.0f} tokens/s at {r['kv_bytes_per_token']:.0f} vs "
                      f"{q['kv_bytes_per_token']:.0f} KV bytes per token")
            if name == KVQ4G:  # each backend's fastest path: the target
                judge(label, ratio, 3.0, detail)
            else:  # both eager: the transformers forward's Python bounds it at batch 1 (information)
                lines.append(f"- {label}: {ratio:.2f}x, both eager (not judged); {detail}")
    mb = {(r["cache"], r["context"]): r for r in ok if "max_batch_in_gib" in r}
    for (name, c), r in sorted(mb.items()):
        s = mb.get(("static", c))
        if name == KVQ4G and s:
            judge(f"kvq-graph:kivi4/g32 vs compiled StaticCache at equal memory ({r['max_batch_in_gib']:g} GiB of KV, L={c})",
                  r["tokens_per_s"] / s["tokens_per_s"], 2.5,
                  f"B={r['batch']} {r['tokens_per_s']:.0f} vs B={s['batch']} {s['tokens_per_s']:.0f} tokens/s")
    return lines, missed


def plot(ok, stem):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("report_hf_generate: no matplotlib, no plot", file=sys.stderr)
        return []
    groups = sorted({(("max_batch_in_gib" in r), r["context"], 0 if "max_batch_in_gib" in r else r["batch"])
                     for r in ok})
    caches = sorted({r["cache"] for r in ok}, key=order)
    fig, ax = plt.subplots(figsize=(2.2 * len(groups) + 2, 4.2))
    width = 0.8 / len(caches)
    for i, name in enumerate(caches):
        xs, ys, labels = [], [], []
        for g, (mb, c, b) in enumerate(groups):
            r = next((r for r in ok if r["cache"] == name and r["context"] == c and ("max_batch_in_gib" in r) == mb
                      and (mb or r["batch"] == b)), None)
            if r:
                xs.append(g + (i - (len(caches) - 1) / 2) * width)
                ys.append(r["tokens_per_s"])
                labels.append(f"B{r['batch']}" if mb else "")
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name, "#333333"))
        for b_, lab in zip(bars, labels):
            if lab:
                ax.annotate(lab, (b_.get_x() + b_.get_width() / 2, b_.get_height()), ha="center", va="bottom",
                            fontsize=6)
    gib = next((r["max_batch_in_gib"] for r in ok if "max_batch_in_gib" in r), None)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"largest batch\nin {gib:g} GiB KV, {c // 1024}K" if mb else f"B={b}, {c // 1024}K"
                        for mb, c, b in groups], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s (log)")
    device = next((r.get("device") for r in ok), "?")
    ax.set_title(f"Llama-3-8B shape (random BF16 weights), transformers generate loop, {device}", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    paths = [stem + ".svg"]
    for p in paths:
        fig.savefig(p)
    return paths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--plot", help="path stem of the plot (.svg)")
    ap.add_argument("--md", help="write the report here too")
    a = ap.parse_args()
    rows = load(a.jsonl)
    out, ok = table(rows)
    t, missed = targets(ok)
    text = "\n".join(out + ["Targets:"] + t) + "\n"
    print(text, end="")
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)
    if a.plot:
        for p in plot(ok, a.plot):
            print(f"# plot: {p}")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
