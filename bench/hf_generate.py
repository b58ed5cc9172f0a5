#!/usr/bin/env python3
"""What a Python user of transformers would measure: decode tokens/s of a Llama-family model
generating with each KV cache, in one process (issue: kvq from Python).

The model is built from its config with **random weights** (Llama-3-8B's shape by default: 32
layers, hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336, vocabulary 128256, BF16);
decode speed does not depend on the weights' values. For each (batch, context) and cache:
a prompt of `context` random tokens is prefilled (one forward, `logits_to_keep=1`, timed apart),
then `--new-tokens` greedy decode steps run one forward each (argmax fed back), timed from a
synchronized start to a synchronized end. Caches:
  dynamic        transformers' DynamicCache (BF16, torch.cat every step), SDPA attention
  static         StaticCache (BF16, preallocated), decode step compiled (torch.compile,
                 mode reduce-overhead, fullgraph), SDPA attention
  quanto, hqq    QuantizedCache (4 bits, group 64, residual 128) where the backend's package is
                 installed (else reported as not run)
  kvq:<config>   kvq.hf.KVQCache with that kvq configuration, attention "kvq", the model's forward
                 eager (what model.generate runs)
  kvq-graph:<config>  the same cache, each decode step one replay of kvq.hf.DecodeGraph (the
                 forward captured once in a CUDA graph over a kvq.DecodeStep): the counterpart of
                 the compiled StaticCache
Per cache: decode tokens/s, prefill seconds, peak GPU memory (torch's allocator, the weights
included, plus kvq's arena, tables and workspaces, which it allocates itself), KV bytes per token counted with everything the cache stores (pages, scales, windows,
residuals). `--max-batch-kv-gib G`: also the largest batch of each cache whose KV at the largest
context fits G GiB (from its measured bytes per token), run at that batch. Writes JSON lines to
--out and prints the report's table (bench/report_hf_generate.py).

    python3 bench/hf_generate.py --out out/hf/generate.jsonl [--batches 1,8] [--contexts 8192,32768]
        [--caches "dynamic static quanto hqq kvq:fp16 kvq:kivi4/g32 kvq:kivi2/g32+rot+sink"]
        [--layers 32] [--new-tokens 256] [--prefill-tokens 65536] [--max-batch-kv-gib 40
        [--max-batch-only --bytes-from earlier.jsonl] [--max-batch-new-tokens N]]
The prompt is prefilled in chunks of --prefill-tokens over all rows (what bounds activations at
large batches). Rows are appended to --out as they are measured; bench/report_hf_generate.py
makes the table, the targets and the plot from one or more such files.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch
import transformers

import kvq
import kvq.hf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report_hf_generate  # noqa: E402  (the table)

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0)


def make_model(args, dev):
    shape = dict(LLAMA3_8B)
    if args.small:  # a tiny model of the same family, to check the script anywhere
        shape.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=2048)
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=max(args.contexts)
                                   + args.new_tokens + 16, **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


def stored_bytes(value, seen):
    """Bytes of every tensor reachable from `value`: plain tensors, the parts of quantized tensor
    subclasses (quanto's data, scale and shift), and tensors inside tuples, lists, dicts (HQQ's
    meta: scales, zeros) or objects; each storage counted once."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(stored_bytes(getattr(value, n), seen) for n in names)
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.numel())
        if value.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(stored_bytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(stored_bytes(v, seen) for v in value.values())
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(stored_bytes(v, seen) for v in vars(value).values())
    return 0


def kv_bytes_per_token(cache, model, tokens):
    """Bytes the cache holds per token (all layers), everything it stores counted."""
    if isinstance(cache, kvq.hf.KVQCache):
        st = cache.kvq.stats()  # pages (scales inside) and windows, over tokens summed over layers
        return (st["page_bytes"] + st["window_bytes"]) * model.config.num_hidden_layers / max(1, st["tokens"])
    seen = set()
    total = 0
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if name in ("optimizer", "quantizer"):
                continue
            total += stored_bytes(value, seen)
    return total / tokens


def peak_gib(cache, dev):
    """Peak device memory of the run: torch's allocator's peak plus what a kvq cache (anything
    holding a `kvq.Cache` as `.kvq`) allocates itself, its arena (the whole budget), tables and
    workspaces. NaN on the CPU."""
    if dev.type != "cuda":
        return float("nan")
    outside = 0
    if isinstance(getattr(cache, "kvq", None), kvq.Cache):
        st = cache.kvq.stats()
        outside = st["budget_bytes"] + st["overhead"]["device_tables"] + st["overhead"]["device_workspace"]
    return (torch.cuda.max_memory_allocated() + outside) / 2**30


def make_cache(name, model, batch, context, new_tokens, args, dev):
    cfg = model.config
    if name == "dynamic":
        return transformers.DynamicCache(config=cfg), "sdpa"
    if name == "static":
        return transformers.StaticCache(config=cfg, max_cache_len=context + new_tokens), "sdpa"
    if name in ("quanto", "hqq"):
        return transformers.QuantizedCache(backend=name, config=cfg, nbits=4, q_group_size=64,
                                           residual_length=128), "sdpa"
    if name.startswith(("kvq:", "kvq-graph:")):
        kvq_config = name.split(":", 1)[1]
        layers, q, kv, hd = kvq.hf.attention_shape(cfg)
        tokens = context + new_tokens + 256
        # the budget this batch needs in this configuration (pages, scales, windows), from kvq itself
        probe = kvq.Cache(layers, q, kv, hd, kvq_config, budget_bytes=64 << 20, device="cpu")
        budget = batch * probe.bytes_for(tokens) + (64 << 20)
        return kvq.hf.KVQCache(cfg, kvq_config, budget_bytes=budget, device=str(dev), max_sequences=max(batch, 1),
                               max_tokens=tokens), "kvq"
    raise ValueError(f"unknown cache '{name}'")


def run_one(name, model, batch, context, args, dev, new_tokens=None):
    new_tokens = new_tokens or args.new_tokens
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(batch * 1000003 + context)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(dev)
    if dev.type == "cuda":  # what earlier runs left (compiled graphs' pools, cached blocks) goes back first
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache, attn = make_cache(name, model, batch, context, new_tokens, args, dev)
    model.set_attn_implementation(attn)
    forward = model.forward
    if name == "static":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    chunk = max(128, args.prefill_tokens // batch)  # tokens per prefill forward, all rows together
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        for s in range(0, context, chunk):
            e = min(context, s + chunk)
            out = model(prompt[:, s:e], past_key_values=cache, logits_to_keep=1, use_cache=True,
                        cache_position=torch.arange(s, e, device=dev))
        sync()
        prefill_s = time.perf_counter() - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = context

        def step(tok, p):
            position = torch.full((batch, 1), p, device=dev, dtype=torch.long)
            cache_position = torch.tensor([p], device=dev, dtype=torch.long)
            return forward(input_ids=tok, past_key_values=cache, position_ids=position, cache_position=cache_position,
                           logits_to_keep=1, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)

        if name.startswith("kvq-graph:"):
            graphed = kvq.hf.DecodeGraph(model, cache)

            def step(tok, p):  # noqa: F811 (the graphed step)
                position = torch.full((batch, 1), p, device=dev, dtype=torch.long)
                return graphed(tok, position).argmax(-1, keepdim=True)

        warm = min(args.warmup, new_tokens - 1)
        for _ in range(warm):  # compiles / captures (static) and warms every cache alike
            token = step(token, pos)
            pos += 1
        sync()
        t0 = time.perf_counter()
        for _ in range(new_tokens - warm):
            token = step(token, pos)
            pos += 1
        sync()
        decode_s = time.perf_counter() - t0
    steps = new_tokens - warm
    row = dict(cache=name, batch=batch, context=context, new_tokens=new_tokens, prefill_chunk=chunk, timed_steps=steps,
               tokens_per_s=batch * steps / decode_s, ms_per_step=1e3 * decode_s / steps, prefill_s=prefill_s,
               peak_gib=peak_gib(cache, dev),
               kv_bytes_per_token=kv_bytes_per_token(cache, model, batch * pos))
    del cache
    return row


def available(name):
    if name == "quanto":
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            return "optimum-quanto is not installed"
    if name == "hqq":
        try:
            import hqq  # noqa: F401
        except ImportError:
            return "hqq is not installed"
    return None


def record(rows, args, row):
    """Keeps a row and appends it to --out at once: a run cut short keeps what it measured."""
    rows.append(dict(row, device=args.device_name))
    with open(args.out, "a") as f:
        f.write(json.dumps(rows[-1]) + "\n")


def run_logged(rows, label, name, model, b, c, args, dev, **extra):
    print(f"{label} {name} B={b} L={c} ...", end=" ", flush=True)
    try:
        row = run_one(name, model, b, c, args, dev, extra.get("new_tokens"))
    except Exception as e:  # one cache's failure is reported; the others still run
        row = dict(cache=name, batch=b, context=c, error=f"{type(e).__name__}: {e}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    record(rows, args, dict(row, **extra))
    row = rows[-1]
    print(row.get("error") or f"{row['tokens_per_s']:.0f} tok/s, {row['ms_per_step']:.1f} ms/step, "
          f"prefill {row['prefill_s']:.1f} s, peak {row['peak_gib']:.1f} GiB", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/hf/generate.jsonl")
    ap.add_argument("--caches", default="dynamic static quanto hqq kvq:fp16 kvq:kivi4/g32 kvq:kivi2/g32+rot+sink "
                    "kvq-graph:fp16 kvq-graph:kivi4/g32 kvq-graph:kivi2/g32+rot+sink")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=65536,
                    help="tokens per prefill forward over all rows (the prompt is prefilled in chunks)")
    ap.add_argument("--max-batch-kv-gib", type=float, default=0,
                    help="then run each cache at the largest batch whose KV at the largest context fits this")
    ap.add_argument("--max-batch-only", action="store_true", help="only the max-batch runs")
    ap.add_argument("--bytes-from", default="",
                    help="comma-separated JSON lines of earlier runs: KV bytes per token for the max-batch runs")
    ap.add_argument("--max-batch-new-tokens", type=int, default=0, help="new tokens of the max-batch runs")
    ap.add_argument("--small", action="store_true", help="a tiny model of the family (to check the script)")
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = make_model(args, dev)
    name_dev = args.device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    open(args.out, "w").close()
    print(f"# {name_dev}, torch {torch.__version__}, transformers {transformers.__version__}, kvq {kvq.__version__}; "
          f"{args.layers} layers{' (small)' if args.small else ''}, random weights", flush=True)
    rows = []
    caches = args.caches.split()
    unknown = [n for n in caches if n not in ("dynamic", "static", "quanto", "hqq")
               and not n.startswith(("kvq:", "kvq-graph:"))]
    if unknown:
        ap.error(f"unknown caches {unknown}: dynamic, static, quanto, hqq, kvq:<config> or kvq-graph:<config>")
    shapes = [(b, c) for c in args.contexts for b in args.batches]
    for name in caches:
        why = available(name)
        if why:
            print(f"{name}: not run ({why})", flush=True)
            record(rows, args, dict(cache=name, skipped=why))
    caches = [n for n in caches if not available(n)]
    if not args.max_batch_only:
        for name in caches:
            for i, (b, c) in enumerate(shapes):
                run_logged(rows, f"[{i + 1}/{len(shapes)}]", name, model, b, c, args, dev)
    if args.max_batch_kv_gib:
        c = max(args.contexts)
        known = list(rows)
        for path in filter(None, args.bytes_from.split(",")):
            known += [json.loads(line) for line in open(path) if line.strip()]
        for name in caches:
            per = [r for r in known if r.get("cache") == name and r.get("context") == c and "kv_bytes_per_token" in r]
            if not per:
                print(f"[max batch] {name}: no KV bytes per token measured at L={c}", flush=True)
                continue
            new = args.max_batch_new_tokens or args.new_tokens
            b = int(args.max_batch_kv_gib * 2**30 // (max(r["kv_bytes_per_token"] for r in per) * (c + new)))
            if b >= 1:
                run_logged(rows, "[max batch]", name, model, b, c, args, dev, new_tokens=new,
                           max_batch_in_gib=args.max_batch_kv_gib)
    print("\n".join(report_hf_generate.table(rows)[0]))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
