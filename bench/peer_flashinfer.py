#!/usr/bin/env python3
"""The quantized peer (issue 48): FlashInfer's paged attention over BF16 and FP8 (e4m3) KV caches,
at the shapes of bench/decode_cuda.cpp and bench/peer_decode.py (Llama-8B: 32 query heads, 8 kv
heads, head_dim 128; pages of 64 tokens, NHD layout), and its paged prefill over the chunks of
bench/peer_prefill.py. Written against flashinfer-python 0.7.4 (checked against 0.7.2.post1 too):
the plan/run API of `BatchDecodeWithPagedKVCacheWrapper` and `BatchPrefillWithPagedKVCacheWrapper`
(flashinfer/decode.py, flashinfer/prefill.py of those wheels). Its kernels are compiled by
FlashInfer's JIT at first use (nvcc and ninja on the machine; bench/stage_flashinfer.sh stages the
wheels), one module per (backend, q/kv/o dtype, head_dim), cached under
$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer.

--mode decode (default) prints one CSV row per (variant, shape), the format of peer_decode.py:

    peer,backend,B,L,Hq,Hkv,D,us,TBps

us is the median time of one run() call (CUDA events around each call, as peer_decode.py); TBps is
the K+V bytes the kernel must read / time: 2 bytes per element for bf16, 1 for fp8 (FlashInfer's
fp8 scales are per-tensor floats passed as kernel arguments: no scale bytes are read). Inputs
rotate over sets of sequences (own caches and queries; one page table, each sequence's pages in
order) of at least 512 MB in all, as bench/decode_cuda.cpp does, so repeated calls do not run from
L2. Variants (--decode-variants):
  flashinfer_bf16     BF16 cache, the CUDA-core decode kernel (use_tensor_cores=False, backend fa2)
  flashinfer_bf16_tc  BF16 cache, the tensor-core path (use_tensor_cores=True: fa2's prefill kernel)
  flashinfer_fp8      FP8 e4m3 cache, BF16 queries and output, CUDA-core kernel
  flashinfer_fp8_tc   FP8 e4m3 cache, tensor-core path
FP8 scales (--fp8-scales): `tensor` (default) quantizes each set's K and V with one scale each
(amax / 448) and passes them as run(k_scale=, v_scale=), as engines do: k_scale is folded into
sm_scale, v_scale costs FlashInfer one more elementwise kernel (`out *= v_scale`) that the row
includes; `unit` passes no scales (the kernel alone, data quantized with scale 1).

--mode prefill prints the format of bench/peer_prefill.py (backend,ms_per_prompt,tflops): a
32K-token prompt fed as 8 chunks of 4K; each chunk's K/V are written into a preallocated paged
cache (512 pages of 64 tokens), then its queries attend to every earlier token and causally within
the chunk (FlashInfer's causal mask is aligned to the last key: the lower-right mask of
peer_prefill.py). The plan of each chunk is made once, outside the timing (an engine plans once a
step for all its layers). Variants (--prefill-variants): fa3 (Hopper; what backend="auto" picks
there for BF16), fa2, fa2_fp8 (an FP8 cache written by quantizing each chunk in the timed loop).
Run decode and prefill as two invocations when the CSVs are parsed (bench/run_gpu.sh reads each
format from its own file).

Each shape's first set is checked against PyTorch SDPA (on the dequantized cache for fp8) where
B*L <= --check-max; a `# check` line reports ||out - ref|| / ||ref|| (ok below 5e-2), as does the
prefill's last chunk. --compile-only runs every variant once on a tiny shape (to fill the JIT cache
in one device call and time it) and prints only `# jit` lines.
If flashinfer (or CUDA) is not available the script prints one `# flashinfer: not available (...)`
line and exits 0.

usage: peer_flashinfer.py [--mode decode|prefill|both] [--shapes B:L,...] [--hq 32] [--hkv 8] [--d 128]
                          [--page 64] [--iters 50] [--decode-variants bf16,bf16_tc,fp8,fp8_tc]
                          [--fp8-scales tensor|unit] [--prefill-variants fa3,fa2] [--prompt 32768]
                          [--chunk 4096] [--prefill-iters 20] [--check-max 262144] [--compile-only]
"""
import argparse
import math
import os
import sys
import time

DECODE_VARIANTS = ("bf16", "bf16_tc", "fp8", "fp8_tc")
PREFILL_VARIANTS = ("fa3", "fa2", "fa2_fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn

ap = argparse.ArgumentParser()
ap.add_argument("--mode", choices=("decode", "prefill", "both"), default="decode")
ap.add_argument("--shapes", default="1:4096,8:4096,32:4096,1:32768,8:32768,32:32768,1:131072,8:131072")
ap.add_argument("--hq", type=int, default=32)
ap.add_argument("--hkv", type=int, default=8)
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--page", type=int, default=64)
ap.add_argument("--iters", type=int, default=50)
ap.add_argument("--decode-variants", default=",".join(DECODE_VARIANTS))
ap.add_argument("--fp8-scales", choices=("tensor", "unit"), default="tensor")
ap.add_argument("--prefill-variants", default="fa3,fa2")
ap.add_argument("--prompt", type=int, default=32768)
ap.add_argument("--chunk", type=int, default=4096)
ap.add_argument("--prefill-iters", type=int, default=20)
ap.add_argument("--check-max", type=int, default=262144, help="check shapes with B*L at most this (0: none)")
ap.add_argument("--workspace-mb", type=int, default=256)
ap.add_argument("--compile-only", action="store_true")
a = ap.parse_args()
for name in a.decode_variants.split(","):
    if name and name not in DECODE_VARIANTS:
        ap.error(f"unknown decode variant {name!r} (known: {', '.join(DECODE_VARIANTS)})")
for name in a.prefill_variants.split(","):
    if name and name not in PREFILL_VARIANTS:
        ap.error(f"unknown prefill variant {name!r} (known: {', '.join(PREFILL_VARIANTS)})")

try:
    import torch
    import torch.nn.functional as F
    import flashinfer
except Exception as ex:  # ImportError, or a broken install failing at import
    print(f"# flashinfer: not available ({type(ex).__name__}: {str(ex).splitlines()[0][:160] if str(ex) else ''})")
    sys.exit(0)
if not torch.cuda.is_available():
    print("# flashinfer: not available (no CUDA device)")
    sys.exit(0)

dev = torch.device("cuda")
props = torch.cuda.get_device_properties(0)
try:
    from flashinfer.jit.cpp_ext import get_cuda_version
    nvcc = str(get_cuda_version())
except Exception as ex:  # older or newer layouts: informative only
    nvcc = f"? ({type(ex).__name__})"
print(f"# device={props.name} sms={props.multi_processor_count} torch={torch.__version__} "
      f"flashinfer={flashinfer.__version__} cuda(nvcc)={nvcc} fp8_scales={a.fp8_scales} page={a.page}")


def median_ms(fn, iters):
    """peer_decode.py's timing: 5 warm-up calls, then the median of per-call CUDA-event times."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def quantize_fp8(x):
    """One per-tensor scale (amax / 448) and x / scale in float8_e4m3fn (saturated)."""
    scale = max(x.abs().max().item(), 1e-6) / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in fp32 (a scale-free error: decode outputs over long contexts are small)."""
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


REL_TOL = 5e-2  # bf16 and fp8 paths against SDPA on the same (dequantized) values: ~1e-2 expected


def short(ex):
    text = str(ex).strip().splitlines()
    return f"{type(ex).__name__}: {text[-1][:160] if text else ''}"


# ---------------------------------------------------------------------------------------------- decode

class DecodeSet:
    """One rotating set: paged K and V [pages, page, Hkv, D] (bf16 or fp8), queries, an output."""

    def __init__(self, B, L, fp8):
        pages = B * (L // a.page)
        shape = (pages, a.page, a.hkv, a.d)
        k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        self.k_scale = self.v_scale = None
        if fp8:
            if a.fp8_scales == "tensor":
                k, self.k_scale = quantize_fp8(k)
                v, self.v_scale = quantize_fp8(v)
            else:
                k = k.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                v = v.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.k, self.v = k, v
        self.q = torch.randn(B, a.hq, a.d, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

    def reference(self, B, L):
        """SDPA over the (dequantized) cache in BF16: [B, Hq, D]."""
        def dense(x, s):
            x = x.view(B, L, a.hkv, a.d).transpose(1, 2)
            x = x.to(torch.bfloat16)
            return x * s if s is not None else x
        k, v = dense(self.k, self.k_scale), dense(self.v, self.v_scale)
        return F.scaled_dot_product_attention(self.q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


def page_table(B, L):
    per_seq = L // a.page
    indptr = torch.arange(B + 1, device=dev, dtype=torch.int32) * per_seq
    indices = torch.arange(B * per_seq, device=dev, dtype=torch.int32)
    last = torch.full((B,), a.page, device=dev, dtype=torch.int32)  # L is a multiple of the page
    return indptr, indices, last


def decode_wrapper(variant, B, L):
    """A planned BatchDecodeWithPagedKVCacheWrapper for one variant (plan made once, as an engine
    does per step for all its layers)."""
    fp8 = variant.startswith("fp8")
    ws = torch.zeros(a.workspace_mb << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=variant.endswith("_tc"),
                                                      backend="fa2")
    indptr, indices, last = page_table(B, L)
    w.plan(indptr, indices, last, a.hq, a.hkv, a.d, a.page,
           pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16,
           kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16,
           o_data_type=torch.bfloat16)
    return w


def run_decode(w, s):
    return w.run(s.q, (s.k, s.v), k_scale=s.k_scale, v_scale=s.v_scale, out=s.out)


def decode_rows(shapes, variants, iters, check_max, quiet=False):
    if not quiet:
        print("peer,backend,B,L,Hq,Hkv,D,us,TBps", flush=True)
    for B, L in shapes:
        if L % a.page:
            print(f"# B={B} L={L}: L is not a multiple of the page ({a.page}); skipped")
            continue
        for fp8 in (False, True):
            mine = [v for v in variants if v.startswith("fp8") == fp8]
            if not mine:
                continue
            kv_bytes = 2 * B * L * a.hkv * a.d * (1 if fp8 else 2)
            n_sets = 1 if quiet else int(min(64, max(1, math.ceil(512e6 / kv_bytes))))
            sets = [DecodeSet(B, L, fp8) for _ in range(n_sets)]
            ref = sets[0].reference(B, L) if 0 < B * L <= check_max else None
            for variant in mine:
                name = f"flashinfer_{variant}"
                t0 = time.time()
                try:
                    w = decode_wrapper(variant, B, L)
                    o = run_decode(w, sets[0]).clone()
                    torch.cuda.synchronize()
                    if quiet:
                        print(f"# jit {name}: {time.time() - t0:.1f} s "
                              f"(backend {getattr(w, 'resolved_backend', '?')})", flush=True)
                        continue
                    i = [0]

                    def call():
                        run_decode(w, sets[i[0] % n_sets])
                        i[0] += 1

                    ms = median_ms(call, iters)
                except Exception as ex:  # a JIT failure, an unsupported combination
                    print(f"# {name} B={B} L={L} unavailable: {short(ex)}", flush=True)
                    continue
                print(f"peer,{name},{B},{L},{a.hq},{a.hkv},{a.d},{ms * 1e3:.1f},{kv_bytes / ms / 1e9:.2f}", flush=True)
                if ref is not None:
                    err = rel_err(o, ref)
                    print(f"# check {name} B={B} L={L} sets={n_sets}: |out - sdpa| / |sdpa| = {err:.2e} "
                          f"({'ok' if err <= REL_TOL else 'MISMATCH'})", flush=True)
                del w
            del sets, ref
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- prefill

def attention_flops(prompt, chunk, hq, d):
    """bench/peer_prefill.py's count: multiply-adds x 2 of QK^T and PV over the visible pairs."""
    pairs = 0
    for c0 in range(0, prompt, chunk):
        t = min(chunk, prompt - c0)
        pairs += t * c0 + t * (t + 1) // 2
    return 4.0 * pairs * hq * d


def prefill_rows(variants, prompt, chunk, iters, quiet=False):
    from torch.nn.attention.bias import causal_lower_right

    P, C, page = prompt, chunk, a.page
    g = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(P, a.hq, a.d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(P, a.hkv, a.d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(P, a.hkv, a.d, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty_like(q)
    n_pages = -(-P // page)
    flops = attention_flops(P, C, a.hq, a.d)
    if not quiet:
        print(f"# {props.name} flashinfer {flashinfer.__version__} prompt {P} chunk {C} page {page}")
        print("backend,ms_per_prompt,tflops", flush=True)
    for variant in variants:
        name = f"flashinfer_{variant}"
        fp8 = variant.endswith("_fp8")
        backend = variant.split("_")[0]
        kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        t0 = time.time()
        try:
            k_pool = torch.zeros(n_pages, page, a.hkv, a.d, device=dev, dtype=kv_dtype)
            v_pool = torch.zeros_like(k_pool)
            k_flat, v_flat = k_pool.view(n_pages * page, a.hkv, a.d), v_pool.view(n_pages * page, a.hkv, a.d)
            ks = vs = None
            if fp8:  # one scale per tensor, known before the prompt (a calibrated scale, as engines use)
                ks = max(k.abs().max().item(), 1e-6) / FP8_MAX
                vs = max(v.abs().max().item(), 1e-6) / FP8_MAX
            plans = []
            for c0 in range(0, P, C):
                t = min(C, P - c0)
                n = c0 + t  # keys visible to this chunk: every earlier token and the chunk itself
                np_ = -(-n // page)
                ws = torch.zeros(a.workspace_mb << 20, dtype=torch.uint8, device=dev)
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(torch.tensor([0, t], dtype=torch.int32, device=dev),
                       torch.tensor([0, np_], dtype=torch.int32, device=dev),
                       torch.arange(np_, dtype=torch.int32, device=dev),
                       torch.tensor([n - (np_ - 1) * page], dtype=torch.int32, device=dev),
                       a.hq, a.hkv, a.d, page,
                       causal=True,
                       pos_encoding_mode="NONE",
                       q_data_type=torch.bfloat16,
                       kv_data_type=kv_dtype,
                       o_data_type=torch.bfloat16)
                plans.append((c0, t, w))

            def prompt_pass():
                for c0, t, w in plans:
                    if fp8:
                        k_flat[c0:c0 + t] = (k[c0:c0 + t] * (1.0 / ks)).clamp_(-FP8_MAX, FP8_MAX).to(kv_dtype)
                        v_flat[c0:c0 + t] = (v[c0:c0 + t] * (1.0 / vs)).clamp_(-FP8_MAX, FP8_MAX).to(kv_dtype)
                    else:
                        k_flat[c0:c0 + t].copy_(k[c0:c0 + t])
                        v_flat[c0:c0 + t].copy_(v[c0:c0 + t])
                    w.run(q[c0:c0 + t], (k_pool, v_pool), k_scale=ks, v_scale=vs, out=out[c0:c0 + t])

            if quiet:
                prompt_pass()
                torch.cuda.synchronize()
                print(f"# jit {name} (prefill): {time.time() - t0:.1f} s", flush=True)
                continue
            ms = median_ms(prompt_pass, iters)
        except Exception as ex:
            print(f"# {name}: not available ({short(ex)})", flush=True)
            continue
        print(f"{name},{ms:.3f},{flops / (ms * 1e-3) / 1e12:.1f}", flush=True)
        # the last chunk against SDPA with the lower-right causal mask (peer_prefill.py's method)
        c0, t = plans[-1][0], plans[-1][1]
        kk, vv = k[:c0 + t], v[:c0 + t]
        if fp8:
            kk = k_flat[:c0 + t].to(torch.bfloat16) * ks
            vv = v_flat[:c0 + t].to(torch.bfloat16) * vs
        def heads_first(x):  # [n, H, D] -> [1, H, n, D]
            return x.transpose(0, 1).unsqueeze(0)

        ref = F.scaled_dot_product_attention(heads_first(q[c0:c0 + t]), heads_first(kk), heads_first(vv),
                                             attn_mask=causal_lower_right(t, c0 + t), enable_gqa=True)
        ref = ref.squeeze(0).transpose(0, 1)
        err = rel_err(out[c0:c0 + t], ref)
        verdict = "ok" if err <= REL_TOL else "MISMATCH"
        print(f"# check {name}: last chunk |out - sdpa| / |sdpa| = {err:.2e} ({verdict})", flush=True)
        del plans, k_pool, v_pool, k_flat, v_flat, ref
        torch.cuda.empty_cache()


def main():
    decode_variants = [v for v in a.decode_variants.split(",") if v]
    prefill_variants = [v for v in a.prefill_variants.split(",") if v]
    if a.compile_only:
        t0 = time.time()
        if a.mode in ("decode", "both"):
            decode_rows([(1, 2 * a.page)], decode_variants, 1, 0, quiet=True)
        if a.mode in ("prefill", "both"):
            prefill_rows(prefill_variants, 2 * 256, 256, 1, quiet=True)
        base = os.environ.get("FLASHINFER_WORKSPACE_BASE", "~")
        print(f"# jit total: {time.time() - t0:.1f} s, cache {base}/.cache/flashinfer")
        return
    if a.mode in ("decode", "both"):
        shapes = [tuple(map(int, s.split(":"))) for s in a.shapes.split(",") if s]
        decode_rows(shapes, decode_variants, a.iters, a.check_max)
    if a.mode in ("prefill", "both"):
        prefill_rows(prefill_variants, a.prompt, a.chunk, a.prefill_iters)


if __name__ == "__main__":
    main()
