#!/usr/bin/env python3
"""Quality of llama.cpp's own quantized KV caches on kvq-eval's positions: the peer of kvq's formats.

What kvq-eval measures for a kvq cache configuration against kvq's FP16 cache, this measures for a
llama.cpp cache type against llama.cpp's own f16 cache, on the same GGUF file, text and positions:
the text tokenized (BOS as the model asks), tokens 0..P+N-1 fed in order, and at every position
p in [P, P+N) the next-token distributions compared: KL(P_f16 || P_type) in nats, top-1 agreement,
and the log-likelihood of the true next token (perplexity). Positions are bucketed with kvq-eval's
edges (0, 512, 1K, 2K, 4K, 8K).

llama.cpp stores every token of a batch in its cache before the batch attends (its KV cache has no
full-precision window), so each query reads every earlier token quantized, as a one-token decode
step would; batches of 512 tokens give the same results as one token at a time up to the order of
float sums. Its CPU attention (flash attention on) converts the query to the K type's dot-product
format (q8_0 for q8_0/q5_0/q4_0 K), where kvq keeps the query in fp32. Its rotation (a Hadamard
transform of Q, K and V along the head dimension, on by default for quantized caches since
April 2026) is turned off for a context with LLAMA_ATTN_ROT_DISABLE=1 set while it is created.

The reference and the configurations run in lockstep, a chunk of 512 positions at a time; each
context keeps llama-cpp-python's full logits buffer (n_ctx x n_vocab float32, 1.6 GB at 8K for
SmolLM2), so --cache lists few types per process.

  python3 bench/peer_llamacpp_quality.py --model M.gguf --text T.txt [--prefill 256] [--tokens 7936] \
      [--cache q8_0,q4_0,q4_0:norot] [--threads 2] [--json out/peer-quality.json]

Prints a table (bits per element, mean KL, p99 KL, top-1, ΔPPL, and KL/top-1 per position bucket)
and writes a JSON record with the same numbers (and the llama-cpp-python version).
"""
import argparse
import json
import math
import os
import sys
import time

BITS = {"f16": 16.0, "q8_0": 8.5, "q5_0": 5.5, "q5_1": 6.0, "q4_0": 4.5, "q4_1": 5.0}


def bucket_edges(end):
    edges = [0, 512]
    while edges[-1] < end:
        edges.append(edges[-1] * 2)
    return edges


def parse_cache(spec):
    name, _, flag = spec.partition(":")
    if name not in BITS or name == "f16":
        sys.exit(f"peer_llamacpp_quality: unknown cache type '{name}' (one of {', '.join(k for k in BITS if k != 'f16')})")
    if flag not in ("", "norot"):
        sys.exit(f"peer_llamacpp_quality: '{spec}': the only flag is ':norot'")
    return name, flag != "norot"


def make_context(llama_cpp, model, n_ctx, threads, cache, rotate):
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q5_0": llama_cpp.GGML_TYPE_Q5_0,
             "q5_1": llama_cpp.GGML_TYPE_Q5_1, "q4_0": llama_cpp.GGML_TYPE_Q4_0, "q4_1": llama_cpp.GGML_TYPE_Q4_1}
    if rotate:
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
    else:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"  # read by llama.cpp when the context is created
    try:
        return llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                               n_threads_batch=threads, logits_all=True, flash_attn=True, type_k=types[cache],
                               type_v=types[cache], verbose=False)
    finally:
        os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)


def log_softmax(np, x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--prefill", type=int, default=256, help="tokens fed before the measured positions")
    ap.add_argument("--tokens", type=int, default=7936, help="measured positions")
    ap.add_argument("--cache", default="q4_0,q4_0:norot", help="comma-separated types, ':norot' = rotation off")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", help="write the record here")
    a = ap.parse_args()
    if a.prefill < 0 or a.tokens <= 0 or a.chunk <= 0:
        sys.exit("peer_llamacpp_quality: --prefill >= 0, --tokens > 0 and --chunk > 0")
    import llama_cpp
    import numpy as np

    caches = [parse_cache(s) for s in a.cache.split(",") if s]
    total = a.prefill + a.tokens + 1  # the last measured position's next token is needed
    n_ctx = a.prefill + a.tokens
    text = open(a.text, encoding="utf-8").read()
    t0 = time.time()
    ref = make_context(llama_cpp, a.model, n_ctx, a.threads, "f16", False)
    ids = ref.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    if len(ids) < total:
        sys.exit(f"peer_llamacpp_quality: {a.text} has {len(ids)} tokens; --prefill {a.prefill} + --tokens "
                 f"{a.tokens} needs {total}")
    ids = ids[:total]
    ctxs = [make_context(llama_cpp, a.model, n_ctx, a.threads, c, r) for c, r in caches]
    names = [c + ("" if r else ":norot") for c, r in caches]
    print(f"llama-cpp-python {llama_cpp.__version__}; {a.model}; {a.text} ({len(ids)} tokens used); "
          f"positions {a.prefill}..{n_ctx - 1}; threads {a.threads}; caches f16 (reference), {', '.join(names)}",
          flush=True)

    kl = [[] for _ in caches]
    agree = [[] for _ in caches]
    nll = [[] for _ in caches]
    nll_ref = []
    for start in range(0, n_ctx, a.chunk):
        end = min(n_ctx, start + a.chunk)
        ref.eval(ids[start:end])
        for c in ctxs:
            c.eval(ids[start:end])
        lo = max(start, a.prefill)
        if lo < end:
            nxt = np.asarray(ids[lo + 1:end + 1])
            rows = np.arange(end - lo)
            lp_ref = log_softmax(np, ref.scores[lo:end])
            p_ref = np.exp(lp_ref)
            top_ref = lp_ref.argmax(axis=1)
            nll_ref.extend((-lp_ref[rows, nxt]).tolist())
            for i, c in enumerate(ctxs):
                lp = log_softmax(np, c.scores[lo:end])
                kl[i].extend(np.maximum((p_ref * (lp_ref - lp)).sum(axis=1), 0.0).tolist())
                agree[i].extend((lp.argmax(axis=1) == top_ref).astype(int).tolist())
                nll[i].extend((-lp[rows, nxt]).tolist())
        done = end
        el = time.time() - t0
        print(f"  position {done}/{n_ctx}: {el:.0f} s elapsed, {done * (1 + len(ctxs)) / max(el, 1e-9):.0f} "
              f"positions/s over all contexts, about {el / done * (n_ctx - done):.0f} s left", file=sys.stderr,
              flush=True)

    edges = bucket_edges(n_ctx)
    ppl_ref = math.exp(sum(nll_ref) / len(nll_ref))
    record = {"peer": "llama.cpp", "version": llama_cpp.__version__, "model": a.model, "text": a.text,
              "prefill": a.prefill, "tokens": a.tokens, "threads": a.threads, "chunk": a.chunk,
              "reference_perplexity": ppl_ref, "wall_seconds": time.time() - t0, "configs": []}
    for i, name in enumerate(names):
        k = np.asarray(kl[i])
        rec = {"cache": name, "type": caches[i][0], "rotation": caches[i][1], "bits_per_element": BITS[caches[i][0]],
               "mean_kl": float(k.mean()), "p99_kl": float(np.sort(k)[max(0, math.ceil(0.99 * len(k)) - 1)]),
               "top1_agreement": float(np.mean(agree[i])),
               "delta_ppl": math.exp(sum(nll[i]) / len(nll[i])) - ppl_ref, "buckets": []}
        for e in range(len(edges) - 1):
            lo, hi = max(edges[e] - a.prefill, 0), min(edges[e + 1] - a.prefill, len(k))
            if hi <= lo:
                continue
            ppl_b = math.exp(sum(nll[i][lo:hi]) / (hi - lo)) - math.exp(sum(nll_ref[lo:hi]) / (hi - lo))
            rec["buckets"].append({"first": edges[e], "end": edges[e + 1], "mean_kl": float(k[lo:hi].mean()),
                                   "top1_agreement": float(np.mean(agree[i][lo:hi])), "delta_ppl": ppl_b})
        record["configs"].append(rec)

    def label(b):
        f = lambda v: f"{v // 1024}K" if v >= 1024 else str(v)
        return f"{f(b['first'])}-{f(b['end'])}"

    heads = [label(b) for b in record["configs"][0]["buckets"]] if record["configs"] else []
    print(f"\nreference: llama.cpp f16 cache, perplexity {ppl_ref:.3f}; wall {record['wall_seconds']:.0f} s")
    print("| cache | bits/el | KL all | p99 KL | top-1 all | ΔPPL all | " + " | ".join(f"KL {h}" for h in heads) + " | "
          + " | ".join(f"top-1 {h}" for h in heads) + " |")
    print("| --- " * (6 + 2 * len(heads)) + "|")
    for r in record["configs"]:
        print(f"| llama.cpp {r['cache']} | {r['bits_per_element']:.2f} | {r['mean_kl']:.2e} | {r['p99_kl']:.2e} | "
              f"{r['top1_agreement']:.4f} | {r['delta_ppl']:+.3f} | "
              + " | ".join(f"{b['mean_kl']:.2e}" for b in r["buckets"]) + " | "
              + " | ".join(f"{b['top1_agreement']:.4f}" for b in r["buckets"]) + " |")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
