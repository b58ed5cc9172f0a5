"""Moving sequences: blob bytes per token per format against BF16, export and import GB/s, and the
swap-out / swap-in latency of one long sequence, on the GPU (docs/performance.md, "Moving
sequences").

Shape: Llama-3-8B (32 layers, 32 query heads, 8 KV heads, head_dim 128), pages of 64 tokens,
window 128, recent 64; one sequence of `--tokens` tokens (32768) of random fp16 K/V appended in
chunks of 4096 per layer. Per format:
  - blob bytes / token and their ratio to BF16's 131072 bytes / token (32 x 8 x 128 x 2 x 2);
  - export into pinned host memory (`Cache.export_into`: the device-to-host copies, the host's
    scrub of unused window slots and the CRC-32Cs) and into a new `bytes` (pageable);
  - import from that pinned buffer into a second cache (the CRC-32C checks, then host-to-device);
  - swap_out and swap_in of the sequence (pinned swap space, on torch's stream, no checksums),
    each timed to the stream's completion: the latency of bringing a preempted sequence back.
Each time is the median of `--reps` runs. GB/s counts the blob's (or the swapped payload's) bytes.

    PYTHONPATH=build/python python3 bench/transfer.py --out out/transfer    # on the GPU machine
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

import kvq

BF16_PER_TOKEN = 32 * 8 * 128 * 2 * 2


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def fill(cache, seq, tokens, chunk=4096):
    cache.create_sequence(seq)
    g = torch.Generator(device=DEVICE).manual_seed(seq)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        for layer in range(cache.layers):
            k = torch.randn(n, cache.kv_heads, cache.head_dim, device=DEVICE, dtype=torch.float16, generator=g)
            v = torch.randn(n, cache.kv_heads, cache.head_dim, device=DEVICE, dtype=torch.float16, generator=g)
            cache.append(seq, layer, k, v)
    sync()


def timed(fn, reps):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp16,fp8,sym8,kivi4/g32,kivi2/g32,cb4/g32,nvfp4,kivi4/g32+rot+sink")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="out/transfer")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a quick check of the script")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in args.formats.split(","):
        budget = int(args.tokens * BF16_PER_TOKEN * 1.05) + (256 << 20)
        budget = budget * args.layers // 32

        def make(swap):
            return kvq.Cache(args.layers, 32, 8, 128, config, budget_bytes=budget, device=DEVICE, max_sequences=4,
                             max_tokens=args.tokens + 256, check_values=False, swap_bytes=budget if swap else 0)

        a, b = make(True), make(False)
        fill(a, 1, args.tokens)
        size = a.export_bytes([1])
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        view = pinned.numpy()
        t_export = timed(lambda: a.export_into([1], view), args.reps)
        blob = a.export_sequences([1])
        assert bytes(view) == blob, "the pinned and the pageable export differ"
        t_export_bytes = timed(lambda: a.export_sequences([1]), 1)
        info = kvq.inspect_blob(view)

        def import_once():
            b.import_sequences(view, [1])
            sync()

        def release_b():
            b.release_sequence(1)

        t_import = []
        for _ in range(args.reps):
            t_import.append(timed(import_once, 1))
            release_b()
        t_import = statistics.median(t_import)
        swapped = []
        for _ in range(args.reps):
            before = a.stats()["swapped_out_bytes"]
            t_out = timed(lambda: a.swap_out(1), 1)
            payload = a.stats()["swapped_out_bytes"] - before
            t_in = timed(lambda: a.swap_in(1), 1)
            swapped.append((t_out, t_in, payload))
        assert a.export_sequences([1]) == blob, "a swap changed the sequence"
        t_out = statistics.median(s[0] for s in swapped)
        t_in = statistics.median(s[1] for s in swapped)
        payload = swapped[0][2]
        row = {
            "format": config,
            "tokens": args.tokens,
            "blob_bytes": size,
            "bytes_per_token": size / args.tokens,
            "vs_bf16": size / (args.tokens * BF16_PER_TOKEN * args.layers / 32),
            "page_bytes": info["block_bytes"],
            "window_bytes": info["window_bytes"],
            "export_pinned_ms": t_export * 1e3,
            "export_pinned_gbs": size / t_export / 1e9,
            "export_bytes_ms": t_export_bytes * 1e3,
            "export_bytes_gbs": size / t_export_bytes / 1e9,
            "import_ms": t_import * 1e3,
            "import_gbs": size / t_import / 1e9,
            "swap_bytes": payload,
            "swap_out_ms": t_out * 1e3,
            "swap_out_gbs": payload / t_out / 1e9,
            "swap_in_ms": t_in * 1e3,
            "swap_in_gbs": payload / t_in / 1e9,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a, b, pinned, view, blob
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "kvq": kvq.__version__, "argv": sys.argv}
    (out / "transfer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['device']}, {args.tokens} tokens, Llama-3-8B shape ({args.layers} layers), median of {args.reps}", "",
             "| format | bytes/token | vs BF16 | export pinned GB/s | export bytes GB/s | import GB/s | "
             "swap out ms (GB/s) | swap in ms (GB/s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['bytes_per_token']:.0f} | {r['vs_bf16']:.3f} | {r['export_pinned_gbs']:.1f} | "
                     f"{r['export_bytes_gbs']:.1f} | {r['import_gbs']:.1f} | {r['swap_out_ms']:.1f} "
                     f"({r['swap_out_gbs']:.1f}) | {r['swap_in_ms']:.1f} ({r['swap_in_gbs']:.1f}) |")
    (out / "transfer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
