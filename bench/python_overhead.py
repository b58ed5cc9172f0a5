#!/usr/bin/env python3
"""What one `attend` costs from Python against the same call from C++ (issue: at most 10 us more).

On a CUDA kvq.Cache, the same decode attention (batch B, context L, Llama-3-8B's per-layer heads:
32 query heads, 8 KV heads, head_dim 128, kivi4/g32) is issued `--iters` times back to back:
  - C++: the binding's `_attend_loop`, KVCache::attend called in a C++ loop (the library's cost);
  - Python: `cache.attend(seqs, layer, q, out=out)`, the package's method (torch's current stream);
  - Python, new output: `cache.attend(seqs, layer, q)` (allocates the output with torch);
  - op: `kvq.ops.attend` (the torch custom op, eager).
Host time per call is the time to issue the calls (no synchronization inside; below the launch
queue's depth, so the host, not the GPU, is measured); per-call wall time includes the GPU's.
Prints a markdown table and the differences against C++; --json writes the numbers.

    PYTHONPATH=<build>/python python3 bench/python_overhead.py [--iters 200] [--json out.json]
"""
import argparse
import json
import statistics
import time

import torch

import kvq
import kvq.ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for batch, context in ((1, 4096), (8, 4096), (1, 32768)):
        cache = kvq.Cache(1, 32, 8, 128, "kivi4/g32", budget_bytes=(batch * context * 8 * 128 * 2 * 2) + (256 << 20),
                          device="cuda", max_tokens=context + 256)
        g = torch.Generator(device="cuda").manual_seed(0)
        seqs = list(range(batch))
        for s in seqs:
            cache.create_sequence(s)
            for start in range(0, context, 4096):
                n = min(4096, context - start)
                cache.append(s, 0, torch.randn(n, 8, 128, generator=g, device="cuda", dtype=torch.float16),
                             torch.randn(n, 8, 128, generator=g, device="cuda", dtype=torch.float16))
        q = torch.randn(batch, 32, 128, generator=g, device="cuda", dtype=torch.float16)
        out = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream
        ways = {
            "C++ KVCache::attend": lambda n: cache._c._attend_loop(seqs, None, 0, q, out, stream, n),
            "Python cache.attend(out=)": lambda n: loop(lambda: cache.attend(seqs, 0, q, out=out), n),
            "Python cache.attend()": lambda n: loop(lambda: cache.attend(seqs, 0, q), n),
            "torch op kvq.ops.attend": lambda n: loop(lambda: kvq.ops.attend(cache, seqs, 0, q), n),
        }
        for fn in ways.values():  # warm-up (workspaces, torch's allocator)
            fn(20)
        torch.cuda.synchronize()
        host = {name: [] for name in ways}
        wall = {name: [] for name in ways}
        for _ in range(args.rounds):  # interleaved rounds; medians
            for name, fn in ways.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                issued = fn(args.iters)
                torch.cuda.synchronize()
                host[name].append(issued / args.iters * 1e6)
                wall[name].append((time.perf_counter() - t0) / args.iters * 1e6)
        base = statistics.median(host["C++ KVCache::attend"])
        for name in ways:
            h, w = statistics.median(host[name]), statistics.median(wall[name])
            rows.append(dict(batch=batch, context=context, way=name, host_us=h, wall_us=w, host_minus_cpp_us=h - base))
    print(f"device: {torch.cuda.get_device_name()}, kvq {kvq.__version__}, torch {torch.__version__}, "
          f"{args.iters} calls x {args.rounds} rounds, medians")
    print("| B x L | way | host us / call | wall us / call | host - C++ us |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch']} x {r['context']} | {r['way']} | {r['host_us']:.2f} | {r['wall_us']:.2f} | "
              f"{r['host_minus_cpp_us']:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def loop(call, n):
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
