#!/usr/bin/env python3
"""Turns the decode benchmark's JSON and the peer's CSV (same GPU, same session) into the
markdown table of docs/results: kvq time, cuDNN BF16 time, their ratio, achieved TB/s and the
fraction of the copy-bandwidth floor.

usage: report_decode.py bench.json peer.csv > table.md

A second table lists the append-step benchmarks (one token appended to each of 64 sequences by one
append_batch call and by 64 append calls, against the same batch's attention, all timed in the
same process): the append_batch call from an idle GPU (host work, launch latency and kernels
inside the events) and queued behind the step's attention (the host ahead of the GPU, as in an
engine's decode loop: the events enclose the device work).
"""
import csv
import json
import re
import sys

bench = json.load(open(sys.argv[1]))
peer = {}
for row in csv.reader(line for line in open(sys.argv[2]) if line.startswith("peer,") and "backend" not in line):
    _, backend, B, L, *_rest = row
    peer[(backend, int(B), int(L))] = float(row[7])

print("| format | bits/elem | B | context | kvq µs | cuDNN BF16 µs | kvq / cuDNN | flash µs | kvq TB/s | floor fraction |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for b in bench["benchmarks"]:
    m = re.match(r"decode/(.+)/B(\d+)/L(\d+)/", b["name"])
    if not m:
        continue
    fmt, B, L = m.group(1).replace("|", " \\| "), int(m.group(2)), int(m.group(3))  # (a striped pair: a|b)
    us = b["median_us"]
    cudnn = peer.get(("cudnn", B, L))
    flash = peer.get(("flash", B, L))
    ratio = f"{us / cudnn:.2f}" if cudnn else "n/a"
    print(f"| {fmt} | {b['bits']:.2f} | {B} | {L} | {us:.1f} | {cudnn if cudnn else 'n/a'} | {ratio} | "
          f"{flash if flash else 'n/a'} | {b['TBps']:.2f} | {b['floor_frac']:.3f} |")

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
