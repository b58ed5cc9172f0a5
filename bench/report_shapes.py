#!/usr/bin/env python3
"""The decode benchmark over other models' attention shapes (`decode_shape/<model>/<format>/B<b>/L<l>`
of bench/decode_cuda.cpp) beside the BF16 peer run with the same heads (peer_decode.py --hq --hkv
--d, same GPU, same session): kvq time / cuDNN BF16 time per model, shape and format, and whether
the goals hold (every quantized format faster than cuDNN BF16: ratio < 1; the FP16 path at most
1.1x cuDNN).

usage: report_shapes.py out/gpu/shapes.json out/gpu/peer_shapes.csv [--svg out/gpu/shapes.svg]
                        [--csv docs/data/shapes_h200.csv] > out/gpu/shapes.md
Exits 1 when a goal is missed (the table says which).
"""
import csv
import json
import re
import sys

from svg_ratio import axis_and_save

FORMATS = ["fp16", "fp8", "int8", "kivi8/g32", "kivi4/g32", "kivi3/g32", "kivi2/g32", "cb4", "cb2", "nvfp4"]
COLORS = {"fp16": "#7F7F7F", "fp8": "#9467BD", "int8": "#8C564B", "kivi8/g32": "#E377C2", "kivi4/g32": "#4C78A8",
          "kivi3/g32": "#9ECAE9", "kivi2/g32": "#72B7B2", "cb4": "#F58518", "cb2": "#EECA3B", "nvfp4": "#54A24B"}


def meets(fmt, ratio):
    """The FP16 path at most 1.1x cuDNN; a quantized format faster than it."""
    return ratio <= 1.1 if fmt in ("fp16", "bf16") else ratio < 1.0


def load(bench_path, peer_path):
    peer = {}  # (backend, B, L, Hq, Hkv, D) -> us
    for row in csv.reader(l for l in open(peer_path) if l.startswith("peer,") and "backend" not in l):
        _, backend, B, L, Hq, Hkv, D, us, _tb = row
        peer[(backend, int(B), int(L), int(Hq), int(Hkv), int(D))] = float(us)
    runs = {}  # (model, B, L) -> {"heads": (Hq, Hkv, D), format: us}
    for b in json.load(open(bench_path))["benchmarks"]:
        m = re.match(r"decode_shape/([^/]+)/(.+)/B(\d+)/L(\d+)/", b["name"])
        if not m or "median_us" not in b:
            continue
        key = (m.group(1), int(m.group(3)), int(m.group(4)))
        runs.setdefault(key, {})[m.group(2)] = b["median_us"]
        runs[key]["heads"] = (int(b["hq"]), int(b["hkv"]), int(b["d"]))
    return peer, runs


def main():
    peer, runs = load(sys.argv[1], sys.argv[2])
    svg_path = sys.argv[sys.argv.index("--svg") + 1] if "--svg" in sys.argv else None
    csv_path = sys.argv[sys.argv.index("--csv") + 1] if "--csv" in sys.argv else None
    print("kvq decode time / cuDNN BF16 time (same GPU, same session); goals: quantized < 1, fp16 <= 1.1\n")
    print("| model | q heads / kv heads / head_dim (GQA) | B x context | cuDNN µs | flash µs | "
          + " | ".join(FORMATS) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in FORMATS) + " |")
    missed, rows, csv_rows = [], [], []
    for (model, B, L), r in runs.items():
        hq, hkv, d = r["heads"]
        cudnn = peer.get(("cudnn", B, L, hq, hkv, d))
        flash = peer.get(("flash", B, L, hq, hkv, d))
        cells, ratios = [], {}
        for f in FORMATS:
            us = r.get(f)
            if us is None or not cudnn:
                cells.append("n/a")
                continue
            ratios[f] = us / cudnn
            mark = "" if meets(f, ratios[f]) else " ✗"
            if mark:
                missed.append(f"{model} B{B} L{L} {f}: {ratios[f]:.2f}")
            cells.append(f"{ratios[f]:.2f}{mark}")
            csv_rows.append([model, hq, hkv, d, B, L, f, f"{us:.1f}", f"{cudnn:.1f}", f"{ratios[f]:.3f}"])
        rows.append((f"{model} {B}x{L // 1024}K", ratios))
        print(f"| {model} | {hq} / {hkv} / {d} ({hq // hkv}) | {B} x {L // 1024}K | {cudnn or 'n/a'} | {flash or 'n/a'} | "
              + " | ".join(cells) + " |")
    print()
    print("goals: " + ("all met" if not missed else "missed: " + "; ".join(missed)))
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["model", "q_heads", "kv_heads", "head_dim", "batch", "context", "format", "kvq_us", "cudnn_bf16_us",
                        "kvq_over_cudnn"])
            w.writerows(csv_rows)
    if svg_path:
        svg(svg_path, rows)
    return 1 if missed else 0


def svg(path, rows):
    """One row per (model, shape); a dot per format at its ratio; lines at 1 and 1.1."""
    left, width, step, xmax = 190, 460, 16, 1.6
    x = lambda v: left + width * min(v, xmax) / xmax
    legend_rows = (len(FORMATS) + 4) // 5
    height = 70 + 14 * (legend_rows - 1) + len(rows) * step + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">kvq decode time / cuDNN BF16 by model shape (H200)</text>']
    for i, f in enumerate(FORMATS):  # five to a legend row
        lx, ly = left + 90 * (i % 5), 33 + 14 * (i // 5)
        out.append(f'<circle cx="{lx + 5}" cy="{ly}" r="4" fill="{COLORS[f]}"/>'
                   f'<text x="{lx + 12}" y="{ly + 4}">{f}</text>')
    y = 56 + 14 * (legend_rows - 1)
    for label, ratios in rows:
        out.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{label}</text>'
                   f'<line x1="{left}" y1="{y}" x2="{left + width}" y2="{y}" stroke="#eee"/>')
        for f, v in ratios.items():
            out.append(f'<circle cx="{x(v):.1f}" cy="{y}" r="4" fill="{COLORS.get(f, "#000")}" fill-opacity="0.85"/>')
        y += step
    axis_and_save(path, out, x, y, [0, 0.25, 0.5, 0.75, 1.0, 1.1, 1.25, 1.5], (1.0, 1.1),
                  "kvq / cuDNN BF16 (lower is faster; red: 1 and 1.1)", left + width / 2)


if __name__ == "__main__":
    sys.exit(main())
