#!/usr/bin/env python3
"""Turns the decode benchmark's JSON and the peer's CSV (same GPU, same session) into the
markdown table of docs/results: kvq time, cuDNN BF16 time, their ratio, achieved TB/s and the
fraction of the copy-bandwidth floor.

usage: report_decode.py bench.json peer.csv > table.md
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
    fmt, B, L = m.group(1), int(m.group(2)), int(m.group(3))
    us = b["median_us"]
    cudnn = peer.get(("cudnn", B, L))
    flash = peer.get(("flash", B, L))
    ratio = f"{us / cudnn:.2f}" if cudnn else "n/a"
    print(f"| {fmt} | {b['bits']:.2f} | {B} | {L} | {us:.1f} | {cudnn if cudnn else 'n/a'} | {ratio} | "
          f"{flash if flash else 'n/a'} | {b['TBps']:.2f} | {b['floor_frac']:.3f} |")
