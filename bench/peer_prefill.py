#!/usr/bin/env python3
"""The peer of bench/prefill_cuda.cpp: a 32K-token prompt fed as 8 chunks of 4K through PyTorch's
scaled_dot_product_attention in BF16, Llama-8B shape (32 query heads, 8 kv heads, head_dim 128),
one layer. Each chunk's K/V are written into a preallocated BF16 cache, then its 4K queries attend
to every earlier token and causally within the chunk (a lower-right causal mask over the cached
keys). Prints one CSV row per SDPA backend that runs: backend, ms per prompt (median), TFLOP/s.
The lower-right causal mask (`causal_lower_right`) dispatches inside PyTorch to the flash or the
memory-efficient kernel as the inputs allow, so a row's name is the `sdpa_kernel` context it ran
under; `cudnn_bool_mask` passes an explicit boolean mask to cuDNN. The ratio step of
bench/run_gpu.sh takes the fastest row.

    python3 bench/peer_prefill.py [--prompt 32768] [--chunk 4096] [--iters 20]
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

HQ, H, D = 32, 8, 128


def attention_flops(prompt, chunk):
    """Multiply-adds x 2 of QK^T and PV over the visible (query, key) pairs of every chunk."""
    pairs = 0
    for c0 in range(0, prompt, chunk):
        t = min(chunk, prompt - c0)
        pairs += t * c0 + t * (t + 1) // 2
    return 4.0 * pairs * HQ * D


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    P, C = args.prompt, args.chunk
    q = torch.randn(1, HQ, P, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, H, P, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, H, P, D, device=dev, dtype=torch.bfloat16, generator=g)
    k_cache = torch.empty(1, H, P, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    out = torch.empty(1, HQ, P, D, device=dev, dtype=torch.bfloat16)
    gqa = "enable_gqa" in F.scaled_dot_product_attention.__doc__

    masks = {}  # explicit boolean masks of the "bool" variant, one per chunk shape

    def mask_of(variant, t, n):
        if variant == "lower_right":
            return causal_lower_right(t, n)
        if (t, n) not in masks:
            masks[(t, n)] = torch.ones(t, n, device=dev, dtype=torch.bool).tril(diagonal=n - t)
        return masks[(t, n)]

    def prompt_pass(variant):
        for c0 in range(0, P, C):
            t = min(C, P - c0)
            k_cache[:, :, c0:c0 + t].copy_(k[:, :, c0:c0 + t])
            v_cache[:, :, c0:c0 + t].copy_(v[:, :, c0:c0 + t])
            kk, vv = k_cache[:, :, :c0 + t], v_cache[:, :, :c0 + t]
            if not gqa:  # (older PyTorch: the kv heads repeated for the query heads)
                kk, vv = kk.repeat_interleave(HQ // H, 1), vv.repeat_interleave(HQ // H, 1)
            mask = mask_of(variant, t, c0 + t)
            kw = {"enable_gqa": True} if gqa else {}
            out[:, :, c0:c0 + t] = F.scaled_dot_product_attention(q[:, :, c0:c0 + t], kk, vv, attn_mask=mask, **kw)

    flops = attention_flops(P, C)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} prompt {P} chunk {C} gqa_native {gqa}")
    print("backend,ms_per_prompt,tflops")
    for name, be, variant in (("flash", SDPBackend.FLASH_ATTENTION, "lower_right"),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION, "lower_right"),
                              ("cudnn_bool_mask", SDPBackend.CUDNN_ATTENTION, "bool"),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION, "lower_right")):
        try:
            with sdpa_kernel([be]):
                for _ in range(3):
                    prompt_pass(variant)
                torch.cuda.synchronize()
                times = []
                for _ in range(args.iters):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    prompt_pass(variant)
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1))
        except RuntimeError as e:  # a backend that does not take this mask / shape
            print(f"# {name}: not available ({str(e).splitlines()[0][:120]})")
            continue
        times.sort()
        ms = times[len(times) // 2]
        print(f"{name},{ms:.3f},{flops / (ms * 1e-3) / 1e12:.1f}")
    assert math.isfinite(out.float().abs().max().item())


if __name__ == "__main__":
    main()
