#!/usr/bin/env python3
"""Decode speed of kvq's CPU model runner beside llama.cpp's, on the same GGUF file, text and cores.

Both sides do what kvq-eval does: a prefill of P tokens, then N teacher-forced decode steps of one
token each, the logits of every step copied out, timed over the decode steps only. The runs
alternate (kvq, llama.cpp, kvq, ...) so a drift of the shared machine hits both; every run is
printed, then the best of each and their ratio.

llama.cpp is the peer, not a dependency: `bench/peer_llamacpp.sh` installs llama-cpp-python into
a throwaway virtual environment under out/ and runs this script with it.

  python3 bench/peer_llamacpp.py --model M.gguf --text T.txt --kvq-bench build/tools/llama/kvq_llama_bench \
      [--threads 2] [--points 64:128,2048:128] [--repeat 3] [--kvq-cache fp16,kivi4/g32] [--csv out/peer.csv]

--points is a list of prefill:tokens pairs (the decode positions measured are prefill..prefill+tokens-1).
"""
import argparse
import csv
import re
import subprocess
import sys
import time


def kvq_run(bench, model, text, threads, prefill, tokens, cache):
    cmd = [bench, model, text, "--threads", str(threads), "--prefill", str(prefill), "--tokens", str(tokens),
           "--repeat", "1", "--cache", cache]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.search(r"run 1: decode ([0-9.]+) tok/s", out)
    if not m:
        sys.exit(f"peer_llamacpp: cannot read the decode rate from: {' '.join(cmd)}\n{out}")
    return float(m.group(1))


class llamacpp_peer:
    def __init__(self, model, threads, n_ctx, cache):
        import llama_cpp
        self.version = llama_cpp.__version__
        kw = {}
        if cache != "f16":
            types = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
            kw = {"type_k": types[cache], "type_v": types[cache], "flash_attn": True}
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False, **kw)

    def tokenize(self, text):
        return self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def run(self, ids, prefill, tokens):
        import llama_cpp
        import numpy as np
        llm = self.llm
        llm.reset()  # position 0 again; eval drops the cache entries past n_tokens
        llm.eval(ids[:prefill])
        sink = np.empty(llm.n_vocab(), dtype=np.float32)
        elapsed = 0.0
        for t in range(tokens):
            t0 = time.perf_counter()
            llm.eval([ids[prefill + t]])
            # the step's logits, copied out
            sink[:] = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm._ctx.ctx), shape=(llm.n_vocab(),))
            elapsed += time.perf_counter() - t0
        return tokens / elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--kvq-bench", required=True, help="path of kvq_llama_bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--points", default="64:128,2048:128")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kvq-cache", default="fp16", help="comma-separated kvq cache specs")
    ap.add_argument("--peer-cache", default="f16", help="comma-separated llama.cpp cache types (f16, q8_0, q4_0)")
    ap.add_argument("--csv", help="write every run here")
    a = ap.parse_args()

    points = []
    for p in a.points.split(","):
        pre, _, n = p.partition(":")
        points.append((int(pre), int(n)))
    n_ctx = max(pre + n for pre, n in points) + 16
    text = open(a.text, encoding="utf-8").read()
    peers = {c: llamacpp_peer(a.model, a.threads, n_ctx, c) for c in a.peer_cache.split(",")}
    some = next(iter(peers.values()))
    ids = some.tokenize(text)
    if len(ids) < n_ctx - 16:
        sys.exit(f"peer_llamacpp: {a.text} has {len(ids)} tokens, the points need {n_ctx - 16}")
    print(f"llama-cpp-python {some.version}, threads {a.threads}, model {a.model}, text {a.text} ({len(ids)} tokens)")
    rows = []
    for pre, n in points:
        best = {}
        for r in range(a.repeat):
            for spec in a.kvq_cache.split(","):
                rate = kvq_run(a.kvq_bench, a.model, a.text, a.threads, pre, n, spec)
                rows.append(("kvq", spec, pre, n, r + 1, rate))
                best[("kvq", spec)] = max(best.get(("kvq", spec), 0), rate)
                print(f"  positions {pre}..{pre + n - 1} run {r + 1}: kvq {spec}: {rate:.1f} tok/s", flush=True)
            for c, peer in peers.items():
                rate = peer.run(ids, pre, n)
                rows.append(("llama.cpp", c, pre, n, r + 1, rate))
                best[("llama.cpp", c)] = max(best.get(("llama.cpp", c), 0), rate)
                print(f"  positions {pre}..{pre + n - 1} run {r + 1}: llama.cpp {c}: {rate:.1f} tok/s", flush=True)
        ref = best[("llama.cpp", "f16")] if ("llama.cpp", "f16") in best else None
        print(f"positions {pre}..{pre + n - 1}, best of {a.repeat}:")
        for (side, spec), rate in best.items():
            ratio = f"  {rate / ref:.2f}x llama.cpp f16" if ref else ""
            print(f"  {side:9s} {spec:10s} {rate:7.1f} tok/s{ratio}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["runner", "cache", "prefill", "tokens", "run", "tok_per_s"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
