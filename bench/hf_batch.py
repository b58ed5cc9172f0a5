#!/usr/bin/env python3
"""transformers' continuous batching (`generate_batch`) in a fixed KV memory: its own paged BF16
cache against kvq's pages (kvq.hf_paged), in one process (issue: kvq from Python).

The model is built from its config with **random weights** (Llama-3-8B's shape by default, BF16
on a GPU; `--small`: a tiny model of the family, float32 on the CPU, to check the script). Each
backend generates `--new-tokens` greedy tokens (no end of sequence) for `--requests` prompts of
`--prompt` random tokens, with `--kv-gib` GiB for the KV cache: transformers' blocks sized to it
(`num_blocks` = that memory over a block's BF16 bytes), kvq's budget set to it (its blocks,
admission units, follow from `bytes_for`). Reported: generated tokens/s over the whole call
(prefill included, the scheduler deciding the batch), the peak memory (torch's allocator plus
kvq's arena and tables) and, for kvq, the largest number of requests it held at once.

    python3 bench/hf_batch.py --out out/hf/batch.jsonl [--backends "sdpa kvq:kivi4/g32 kvq:kivi2/g32+rot+sink"]
        [--requests 64] [--prompt 4096] [--new-tokens 256] [--kv-gib 16] [--block-size 256]
"""
import argparse
import gc
import json
import os
import sys
import time

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig

import kvq
import kvq.hf_paged

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_generate import make_model, peak_gib  # noqa: E402  (the same model, shapes and seed)


def cb_config(args, num_blocks=None):
    return ContinuousBatchingConfig(block_size=args.block_size, num_blocks=num_blocks,
                                    max_batch_tokens=args.max_batch_tokens, use_cuda_graph=args.cuda_graph)


def run(backend, model, prompts, args, dev):
    cfg = model.config
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kv_bytes = int(args.kv_gib * 2**30)
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held = {"max": 0, "cache": None}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if backend == "sdpa":  # transformers' paged BF16 cache
        block_bytes = args.block_size * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * model.dtype.itemsize
        model.set_attn_implementation("paged|sdpa")
        out = model.generate_batch(inputs=prompts, generation_config=gen,
                                   continuous_batching_config=cb_config(args, max(1, kv_bytes // block_bytes)))
        model.set_attn_implementation("sdpa")
    else:
        seq = kvq.hf_paged.KVQPagedCache._seq

        def counting(self, request_id, past):  # the most requests the cache held at once
            held["cache"] = self
            held["max"] = max(held["max"], self.kvq.stats()["sequences"] + (request_id not in self.seqs))
            return seq(self, request_id, past)

        kvq.hf_paged.KVQPagedCache._seq = counting
        try:
            out = kvq.hf_paged.generate_batch(model, prompts, gen, backend.split(":", 1)[1], budget_bytes=kv_bytes,
                                              continuous_batching_config=cb_config(args))
        finally:
            kvq.hf_paged.KVQPagedCache._seq = seq
    sync()
    seconds = time.perf_counter() - t0
    generated = sum(len(o.generated_tokens) for o in out.values())
    return dict(backend=backend, requests=len(prompts), prompt=args.prompt, new_tokens=args.new_tokens,
                kv_gib=args.kv_gib, generated=generated, seconds=seconds, tokens_per_s=generated / seconds,
                max_requests_held=held["max"] or None,
                peak_gib=peak_gib(held["cache"], dev))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/hf/batch.jsonl")
    ap.add_argument("--backends", default="sdpa kvq:kivi4/g32 kvq:kivi2/g32+rot+sink")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=16)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--cuda-graph", action="store_true", help="transformers' CUDA graphs for its own backend")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="a tiny model of the family (to check the script)")
    args = ap.parse_args()
    args.contexts = [args.prompt]  # what make_model sizes positions by
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = make_model(args, dev)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# {device}, torch {torch.__version__}, transformers {transformers.__version__}; {args.requests} requests "
          f"of {args.prompt} + {args.new_tokens} tokens in {args.kv_gib:g} GiB of KV; random weights", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.requests, args.prompt), generator=g).tolist()
    open(args.out, "w").close()
    failed = False
    for backend in args.backends.split():
        print(f"{backend} ...", end=" ", flush=True)
        try:
            row = run(backend, model, prompts, args, dev)
        except Exception as e:  # one backend's failure is reported; the others still run
            row, failed = dict(backend=backend, error=f"{type(e).__name__}: {e}"), True
        row["device"] = device
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(row.get("error") or f"{row['tokens_per_s']:.0f} tokens/s ({row['seconds']:.1f} s), peak "
              f"{row['peak_gib']:.1f} GiB, held {row['max_requests_held']}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
