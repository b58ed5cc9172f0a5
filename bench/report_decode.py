#!/usr/bin/env python3
"""Turns the decode benchmark's JSON and the peer's CSV (same GPU, same session) into the
markdown table of docs/performance.md: kvq time, cuDNN BF16 time, their ratio, achieved TB/s and
the fraction of the copy-bandwidth floor.

usage: report_decode.py out/gpu/bench.json out/gpu/peer.csv [--flashinfer out/gpu/peer_flashinfer.csv]
                        [--svg out/gpu/decode.svg] [--csv docs/data/decode_h200.csv] > out/gpu/decode.md

A peer CSV of `-`: no peer (the cuDNN and flash columns say n/a; the other tables are complete).

--flashinfer adds the quantized peer (bench/peer_flashinfer.py, same run): per shape the faster of
FlashInfer's two paged decode kernels (CUDA-core and tensor-core) over a BF16 cache and over an FP8
(e4m3) cache, and kvq's time over each (the columns "kvq / FI BF16" and "kvq / FI fp8").

--csv also writes the decode table's numbers as CSV (the compact data file docs/ keeps).

--svg also draws kvq / cuDNN per format and shape (8 x 32K, 32 x 32K, 1 x 128K) as a bar chart,
with the issue's targets marked (plain SVG, no dependencies).

A second table sets the codebook, nvfp4 and 3-bit formats beside kivi (sym3 beside sym4) at the
same or the next code width, each shape of the same run: their time ratio, and for the codebook
formats the issue's goal (within 10 % of kivi: ratio <= 1.10); 3-bit pages in mixed layers (striped
with 2- or 8-bit pages: `kivi3/g32|kivi2/g32`, `kivi3/g32|kivi8/g32`) beside the same stripes with
4-bit pages, goal 1.15.

A third table sets each sliding-window row (a 4096-token window over 8 x 32K) beside the row of the
same format at 8 x its window (8 x 4K), which reads the same bytes: their time ratio (goal: at
most 1.10).

A fourth table lists the append-step benchmarks (one token appended to each of 64 sequences by one
append_batch call and by 64 append calls, against the same batch's attention, all timed in the
same process): the append_batch call from an idle GPU (host work, launch latency and kernels
inside the events) and queued behind the step's attention (the host ahead of the GPU, as in an
engine's decode loop: the events enclose the device work).
"""
import csv
import json
import re
import sys

from svg_ratio import axis_and_save

bench = json.load(open(sys.argv[1]))
svg_path = sys.argv[sys.argv.index("--svg") + 1] if "--svg" in sys.argv else None
csv_path = sys.argv[sys.argv.index("--csv") + 1] if "--csv" in sys.argv else None
csv_rows = []
peer = {}


def md_cell(fmt):
    """A format name as a markdown table cell (a striped pair a|b keeps its bar)."""
    return fmt.replace("|", " \\| ")


def read_peer(path):
    """The rows `peer,backend,B,L,...,us,...` of a peer CSV (peer_decode.py, peer_flashinfer.py) into `peer`."""
    for row in csv.reader(line for line in open(path) if line.startswith("peer,") and "backend" not in line):
        _, backend, B, L, *_rest = row
        peer[(backend, int(B), int(L))] = float(row[7])


if sys.argv[2] != "-":
    read_peer(sys.argv[2])
if "--flashinfer" in sys.argv:
    read_peer(sys.argv[sys.argv.index("--flashinfer") + 1])


def flashinfer_best(cache, B, L):
    """The faster of FlashInfer's CUDA-core and tensor-core decode over a `cache` (bf16, fp8) cache."""
    times = [peer[k] for k in ((f"flashinfer_{cache}", B, L), (f"flashinfer_{cache}_tc", B, L)) if k in peer]
    return min(times) if times else None


has_fi = any(k[0].startswith("flashinfer_") for k in peer)
fi_head = " FI BF16 µs | kvq / FI BF16 | FI fp8 µs | kvq / FI fp8 |" if has_fi else ""

print("| format | bits/elem | B | context | kvq µs | cuDNN BF16 µs | kvq / cuDNN | flash µs | kvq TB/s | floor fraction |"
      + fi_head)
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * (4 if has_fi else 0))
for b in bench["benchmarks"]:
    m = re.match(r"decode/(.+)/B(\d+)/L(\d+)/(?!W\d)", b["name"])
    if not m:
        continue
    fmt, B, L = md_cell(m.group(1)), int(m.group(2)), int(m.group(3))
    us = b["median_us"]
    cudnn = peer.get(("cudnn", B, L))
    flash = peer.get(("flash", B, L))
    ratio = f"{us / cudnn:.2f}" if cudnn else "n/a"
    row = [f"{b['bits']:.2f}", B, L, f"{us:.1f}", cudnn if cudnn else "n/a", ratio, flash if flash else "n/a",
           f"{b['TBps']:.2f}", f"{b['floor_frac']:.3f}"]
    if has_fi:
        for cache in ("bf16", "fp8"):
            fi = flashinfer_best(cache, B, L)
            row += [f"{fi:.1f}", f"{us / fi:.2f}"] if fi else ["n/a", "n/a"]
    print(f"| {fmt} | " + " | ".join(str(x) for x in row) + " |")
    csv_rows.append([m.group(1)] + row)

if csv_path:
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["format", "bits_per_elem", "batch", "context", "kvq_us", "cudnn_bf16_us", "kvq_over_cudnn",
                    "flash_us", "kvq_tbps", "floor_fraction"]
                   + (["flashinfer_bf16_us", "kvq_over_flashinfer_bf16", "flashinfer_fp8_us", "kvq_over_flashinfer_fp8"]
                      if has_fi else []))
        w.writerows(csv_rows)

# Codebook, nvfp4 and 3-bit formats against kivi (sym) at the same or the next code width, same run: the goal for a
# codebook format is a decode time within 10 % of kivi's (ratio <= 1.10).
decode_us = {}
for b in bench["benchmarks"]:
    m = re.match(r"decode/(.+)/B(\d+)/L(\d+)/(?!W\d)", b["name"])
    if m:
        decode_us[(m.group(1), int(m.group(2)), int(m.group(3)))] = b["median_us"]
SAME_BITS = [("cb4", "kivi4/g32", 1.10), ("cb2", "kivi2/g32", 1.10), ("nvfp4", "kivi4/g32", None),
             ("kivi3/g32", "kivi4/g32", None), ("sym3", "sym4", None),
             ("kivi3/g32|kivi2/g32", "kivi4/g32|kivi2/g32", 1.15), ("kivi3/g32|kivi8/g32", "kivi4/g32|kivi8/g32", 1.15)]
same_rows = []
for fmt, base, goal in SAME_BITS:
    for rot in ("", "+rot"):
        for (f, B, L), us in decode_us.items():
            ref = decode_us.get((base + rot, B, L))
            if f == fmt + rot and ref:
                verdict = ("met" if us / ref <= goal else "missed") if goal else "-"
                same_rows.append(f"| {md_cell(fmt + rot)} | {md_cell(base + rot)} | {B} | {L} | {us:.1f} | {ref:.1f} | {us / ref:.2f} | "
                                 f"{goal if goal else '-'} | {verdict} |")


def print_table(columns, rows):
    """A markdown table after a blank line, when there are rows."""
    if rows:
        print()
        print("| " + " | ".join(columns) + " |")
        print("|" + " --- |" * len(columns))
        print("\n".join(rows))


print_table(["format", "kivi at the same bits", "B", "context", "µs", "kivi µs", "ratio", "goal", "goal met"],
            same_rows)

# Sliding-window rows (decode/<format>/B<b>/L<context>/W<window>): a window of W tokens over contexts
# of L reads the bytes of the B x W row of its format, so its time over that row's, same run; the
# goal is at most 1.10.
window_rows = []
for b in bench["benchmarks"]:
    m = re.match(r"decode/(.+)/B(\d+)/L(\d+)/W(\d+)/", b["name"])
    if m:
        fmt, B, L, W = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        ref = decode_us.get((fmt, B, W))
        us = b["median_us"]
        ratio = f"{us / ref:.2f}" if ref else "n/a"
        verdict = ("met" if us / ref <= 1.10 else "missed") if ref else "-"
        window_rows.append(f"| {fmt} | {B} | {L} | {W} | {us:.1f} | {f'{ref:.1f}' if ref else 'n/a'} | {ratio} | "
                           f"{verdict} |")
print_table(["format", "B", "context", "window", "µs", "B x window µs", "ratio", "goal 1.10 met"], window_rows)

steps = [b for b in bench["benchmarks"] if b["name"].startswith("append_step/")]
if steps:
    print()
    print("| format | B | context | append_batch µs (idle GPU) | append_batch µs (behind attention) | attention µs | "
          "idle / attention | behind / attention | B append calls µs | B calls / attention |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b in steps:
        m = re.match(r"append_step/(.+)/B(\d+)/L(\d+)/", b["name"])
        nan = float("nan")
        print(f"| {m.group(1)} | {m.group(2)} | {m.group(3)} | {b['append_us']:.1f} | {b.get('append_busy_us', nan):.1f} | "
              f"{b['attend_us']:.1f} | {b['append_frac']:.3f} | {b.get('append_busy_frac', nan):.3f} | "
              f"{b.get('append_each_us', nan):.1f} | {b.get('append_each_frac', nan):.3f} |")


# Targets of the issue (kvq / cuDNN BF16): (format, B, L) -> goal.
TARGETS = {("kivi4/g32", 8, 32768): 0.33, ("kivi4/g32", 1, 131072): 0.4, ("kivi2/g32", 8, 32768): 0.22,
           ("sym8", 8, 32768): 0.6, ("kivi8/g32", 8, 32768): 0.6, ("fp8", 8, 32768): 0.6, ("fp16", 8, 32768): 1.1}
SHAPES = [(8, 32768, "8 x 32K", "#4C78A8"), (32, 32768, "32 x 32K", "#72B7B2"), (1, 131072, "1 x 128K", "#F58518")]


def svg_chart(path):
    rows = {}  # format -> {(B, L): ratio}
    for b in bench["benchmarks"]:
        m = re.match(r"decode/(.+)/B(\d+)/L(\d+)/(?!W\d)", b["name"])
        if not m:
            continue
        key = (int(m.group(2)), int(m.group(3)))
        cudnn = peer.get(("cudnn",) + key)
        if cudnn and any(key == s[:2] for s in SHAPES):
            rows.setdefault(m.group(1), {})[key] = b["median_us"] / cudnn
    left, bar, gap, width, xmax = 190, 11, 10, 480, 1.3
    x = lambda r: left + width * min(r, xmax) / xmax
    height = 60 + len(rows) * (len(SHAPES) * bar + gap) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 40}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">kvq decode time / cuDNN BF16 (H200, 32 q heads, 8 kv heads, '
           'head_dim 128)</text>']
    for i, (_, _, label, color) in enumerate(SHAPES):
        out.append(f'<rect x="{left + 110 * i}" y="28" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + 110 * i + 14}" y="37">{label}</text>')
    out.append('<rect x="{0}" y="28" width="3" height="10" fill="#D62728"/><text x="{1}" y="37">target</text>'
               .format(left + 340, left + 347))
    y = 50
    for fmt, shapes in rows.items():
        y0 = y
        for (B, L, _, color) in SHAPES:
            r = shapes.get((B, L))
            if r is not None:
                goal = TARGETS.get((fmt, B, L))
                end = max(x(r), x(goal) + 2 if goal else 0)  # the value's label right of the bar and its target
                out.append(f'<rect x="{left}" y="{y}" width="{x(r) - left:.1f}" height="{bar - 1}" fill="{color}"/>'
                           f'<text x="{end + 3:.1f}" y="{y + bar - 2}">{r:.2f}</text>')
                if goal:
                    out.append(f'<rect x="{x(goal) - 1:.1f}" y="{y - 1}" width="3" height="{bar + 1}" fill="#D62728"/>')
            y += bar
        out.append(f'<text x="{left - 6}" y="{(y0 + y) / 2 + 4:.0f}" text-anchor="end">{fmt}</text>')
        y += gap
    axis_and_save(path, out, x, y, [0, 0.25, 0.5, 0.75, 1.0, 1.25], (1.0,), "kvq / cuDNN BF16 (lower is faster; 1 = the peer)",
                  left + width / 2)


if svg_path:
    svg_chart(svg_path)
