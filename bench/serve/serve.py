#!/usr/bin/env python3
"""End-to-end serving benchmark on one GPU (bench/serve/README.md): a Llama-3-8B-shaped model
with random BF16 weights decodes a seeded request trace with continuous batching under a fixed KV
memory, once per attention backend, in one process:

  peer          a BF16 cache (every request's K/V in its own exact range of one buffer per layer)
                and PyTorch's flash attention over it, one varlen launch per layer for the batch
                (`--peer-attention sdpa` instead: scaled_dot_product_attention per request)
  <kvq format>  kvq's CUDA cache (KVCache::append_batch + attend per layer, through the kvq
                Python package) with a static policy: fp16, sym8, kivi4/g32, kivi2/g32, ...
  echokv        kvq with EchoKV (tiers kivi2/4/8 g32, starting at kivi4/g32); its canary is on
                and off in alternating blocks of steps of the same run (the A/B of its cost)

Everything but attention and the cache (embedding, RMSNorm, RoPE, the cuBLAS matrix products of
QKV, O, the SwiGLU MLP and the LM head, argmax) is the same code for every backend. The weights
are random: decode speed does not depend on their values. A request's context is written into
the cache synthetically (random K/V, not a prompt pass through the model), timed apart from the
decode steps. Writes <out>/serve.json (summaries and the run's settings) and <out>/steps.csv.

With `--preempt swap` or `recompute` (or both, and `off`: comma-separated, one run each), a request
is admitted by what it needs now rather than its whole output, and the newest running request is
preempted when a step does not fit: swapped out to pinned host memory (kvq's swap_out / swap_in,
`--swap-gib` of swap space) or released and later prefilled again through the model (recompute;
the peer has no swap, so it recomputes in a swap run). README.md, "Preemption".

    PYTHONPATH=build-cuda/python python3 bench/serve/serve.py --out out/serve \
        [--backends "peer fp16 sym8 kivi4/g32 kivi2/g32 echokv"] [--kv-gib 40] [--requests 96] \
        [--max-steps 400] [--context 32768] [--spread 0.25] [--outputs 128:512] [--layers 32] \
        [--preempt off|swap|recompute[,...]] [--swap-gib 64] [--recompute-pass model|synthetic]
"""
import argparse
import csv
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_sched as ss  # noqa: E402

import kvq  # noqa: E402  (the package: pip install ., or PYTHONPATH=<build>/python)

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the CPU tests import nothing from here; running needs torch and a GPU
    torch = None

LLAMA3_8B = dict(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256, rope_theta=500000.0)
FILL_CHUNK = 4096


class Model:
    """A Llama-3-8B-shaped decoder with random BF16 weights ([in, out], so x @ w is one cuBLAS GEMM)."""

    def __init__(self, layers, max_positions, seed, dev):
        c = LLAMA3_8B
        self.layers, self.c = layers, c
        g = torch.Generator(device=dev).manual_seed(seed)
        bf = torch.bfloat16

        def w(rows, cols):
            return torch.randn(rows, cols, generator=g, device=dev, dtype=bf).mul_(1 / math.sqrt(rows))

        hq, hk, d = c["q_heads"], c["kv_heads"], c["head_dim"]
        self.embed = torch.randn(c["vocab"], c["hidden"], generator=g, device=dev, dtype=bf)
        self.wqkv = [w(c["hidden"], (hq + 2 * hk) * d) for _ in range(layers)]
        self.wo = [w(hq * d, c["hidden"]) for _ in range(layers)]
        self.wgu = [w(c["hidden"], 2 * c["mlp"]) for _ in range(layers)]
        self.wdown = [w(c["mlp"], c["hidden"]) for _ in range(layers)]
        self.norm = torch.ones(c["hidden"], device=dev, dtype=bf)
        self.lm_head = w(c["hidden"], c["vocab"])
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        ang = torch.arange(max_positions, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        self.rot = torch.polar(torch.ones_like(ang), ang)  # [positions, D/2] complex64

    def weight_bytes(self):
        ts = [self.embed, self.lm_head] + self.wqkv + self.wo + self.wgu + self.wdown
        return sum(t.numel() * t.element_size() for t in ts)

    def rms(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.norm, 1e-5)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * self.norm

    @staticmethod
    def rope(x, rot):
        """RoPE of x [B, heads, D] at the rows' positions (rot: [B, 1, D/2] complex), channels
        (2i, 2i + 1) rotated as a pair: three kernels for the q and k heads of a step together."""
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)

    def step(self, tokens, positions, attention):
        """One decode step: tokens, positions [B] on the device; attention(layer, q, k, v) -> o
        [B, q_heads, D], where q [B, q_heads, D] and k [B, kv_heads, D] are views of one RoPE output
        and v [B, kv_heads, D] a view of the QKV output (heads and channels contiguous, rows
        strided). Returns the next tokens (argmax) [B]."""
        return self.forward(tokens, positions, attention)

    def forward(self, tokens, positions, attention, last_only=False):
        """The model over B rows: one token of each of B sequences (a decode step), or B consecutive
        tokens of one sequence (a prefill chunk: `attention` is then the chunk's causal attention).
        last_only: the LM head over the last row alone (a prefill needs only its next token)."""
        c = self.c
        hq, hk, d = c["q_heads"], c["kv_heads"], c["head_dim"]
        B = tokens.shape[0]
        x = self.embed[tokens]
        rot = self.rot[positions][:, None, :]
        for layer in range(self.layers):
            qkv = self.rms(x) @ self.wqkv[layer]
            qk = self.rope(qkv[:, : (hq + hk) * d].view(B, hq + hk, d), rot)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hk) * d:].view(B, hk, d)
            o = attention(layer, q, k, v)
            x = x + o.reshape(B, hq * d) @ self.wo[layer]
            gu = self.rms(x) @ self.wgu[layer]
            x = x + (F.silu(gu[:, : c["mlp"]]) * gu[:, c["mlp"]:]) @ self.wdown[layer]
        if last_only:
            x = x[-1:]
        return (self.rms(x) @ self.lm_head).argmax(-1)


class Backend:
    """What both caches share: the decode step's tokens and positions, its timing, the fill data,
    the re-prefill of a request preempted by recompute."""

    def __init__(self, name, model, dev, seed, preempt_mode="off", recompute_pass="model"):
        self.name, self.model, self.dev = name, model, dev
        self.preempt_mode, self.recompute_pass = preempt_mode, recompute_pass
        c = LLAMA3_8B
        g = torch.Generator(device=dev).manual_seed(seed + 1)
        shape = (FILL_CHUNK, c["kv_heads"], c["head_dim"])
        self.fill_k = torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16)
        self.fill_v = torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16)
        self.prompt_tokens = torch.ones(FILL_CHUNK, device=dev, dtype=torch.long)  # a re-prefill's token ids
        self.prefill_at = None  # (request, offset) of the prefill chunk being computed
        self.next_token = {}
        self.issue_seconds = []  # per step: host time to issue the step's work (before its sync)

    def chunks(self, tokens):
        """(offset, length) of the fill chunks of a context."""
        return [(o, min(FILL_CHUNK, tokens - o)) for o in range(0, tokens, FILL_CHUNK)]

    def sync(self):
        torch.cuda.synchronize()

    def refill(self, req):
        """Recompute's resumption: writes the req.length tokens (its prompt and the tokens it
        generated) of req's re-created cache entry. "model" (--recompute-pass, the default): a
        prefill through the model in chunks of FILL_CHUNK tokens, each chunk's attention the
        backend's causal `prefill_attend` over what the sequence stored before and the chunk, the LM
        head over the last row only: what an engine pays to recompute (the prompt's token ids are
        synthetic, as its fill was). "synthetic": written like a context fill, without the model (a
        lower bound)."""
        if self.recompute_pass == "synthetic":
            self.fill(req, req.length)
            return
        for o, n in self.chunks(req.length):
            self.prefill_at = (req, o)
            pos = torch.arange(o, o + n, device=self.dev)
            self.model.forward(self.prompt_tokens[:n], pos, self.prefill_attend, last_only=True)
        self.prefill_at = None

    def prepare(self, running):
        """Per-step state of the backend (called before the timed step)."""

    def finish_step(self):
        torch.cuda.synchronize()

    def step(self, running):
        """One timed decode step (from a synchronized start to the end-of-step synchronization)."""
        toks = torch.tensor([self.next_token.get(r.rid, 1) for r in running], device=self.dev)
        pos = torch.tensor([r.length for r in running], device=self.dev)
        self.prepare(running)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.model.step(toks, pos, self.attend)
        self.issue_seconds.append(time.perf_counter() - t0)
        self.finish_step()
        seconds = time.perf_counter() - t0
        for r, t in zip(running, out.tolist()):
            self.next_token[r.rid] = t
        return seconds


#: The policies serve.py names, as kvq configuration strings: a static spec is itself; echokv runs
#: its tiers kivi2/4/8 g32 from kivi4/g32 (the middle tier).
POLICIES = {"echokv": "echokv:init=mid"}


class KvqBackend(ss.KvqPreempt, Backend):
    """kvq's CUDA cache through the kvq package, on torch's current stream. Preemption (fits_now,
    step_fits, preempt, resume, swap_traffic) is serve_sched.KvqPreempt's: swap_out / swap_in into
    `swap_bytes` of pinned host memory, or release and `refill`."""

    def __init__(self, name, model, dev, seed, policy, budget, max_batch, max_tokens, preempt_mode="off",
                 recompute_pass="model", swap_bytes=0):
        Backend.__init__(self, name, model, dev, seed, preempt_mode, recompute_pass)
        c = LLAMA3_8B
        # no value checks: one launch less per append, as an engine with finite inputs runs it
        self.cache = kvq.Cache(model.layers, c["q_heads"], c["kv_heads"], c["head_dim"], POLICIES.get(policy, policy),
                               budget_bytes=budget, device="cuda", max_sequences=max_batch, max_tokens=max_tokens,
                               check_values=False, swap_bytes=swap_bytes if preempt_mode == "swap" else 0)
        self.echo = policy == "echokv"
        self.canary_on = True
        self.running, self.seqs, self.ones = [], [], []

    def fill(self, req, tokens):
        """The first `tokens` tokens of req's sequence, synthetic K/V (FILL_CHUNK tokens a call per layer)."""
        for layer in range(self.model.layers):
            for _, n in self.chunks(tokens):
                self.cache.append(req.rid, layer, self.fill_k[:n], self.fill_v[:n])

    def prefill_attend(self, layer, q, k, v):
        """A re-prefill chunk's attention: `prefill` appends the chunk and attends its queries over
        the stored tokens and causally within it (contiguous copies: the decode path's strided
        views are what append_batch and attend take; a chunk's copies cost little beside its GEMMs)."""
        req, _ = self.prefill_at
        return self.cache.prefill(req.rid, layer, k.contiguous(), v.contiguous(), q.contiguous())

    def release(self, req):
        self.cache.release_sequence(req.rid)
        self.next_token.pop(req.rid, None)

    def kv_bytes_per_token(self):
        st = self.cache.stats()
        return st["used_bytes"] * self.model.layers / st["tokens"] if st["tokens"] else float("nan")

    def set_canary(self, on):
        if on != self.canary_on:
            self.cache.freeze_policy(not on)
            self.canary_on = on

    def prepare(self, running):
        self.running = running
        self.seqs = [r.rid for r in running]
        self.ones = [1] * len(self.seqs)

    def attend(self, layer, q, k, v):
        try:
            self.cache.append_batch(self.seqs, self.ones, layer, k, v)
        except kvq.OutOfBudget as e:  # the arena refused what the byte count let in: undone, retried
            self.refuse_step(self.running, layer, e)
        return self.cache.attend(self.seqs, layer, q)

    def finish_step(self):
        if self.echo:
            self.cache.sync_policy()  # the step's staged canary runs inside the step's time
        torch.cuda.synchronize()

    def close(self):
        self.cache = None


class RangeAllocator:
    """First-fit token ranges of one buffer: the peer's per-request storage."""

    def __init__(self, tokens):
        self.free = [(0, tokens)]  # sorted, coalesced (start, end)

    def take(self, n):
        for i, (s, e) in enumerate(self.free):
            if e - s >= n:
                self.free[i:i + 1] = [(s + n, e)] if e - s > n else []
                return s
        return None

    def give(self, s, n):
        self.free.append((s, s + n))
        self.free.sort()
        merged = [self.free[0]]
        for a, b in self.free[1:]:
            if a == merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self.free = merged


class PeerBackend(Backend):
    """The BF16 peer: K and V of every layer in one [tokens, kv_heads, D] buffer each; a request
    holds an exact range of context + output tokens. Admission counts exact bytes against the KV
    budget; the buffers hold `slack` x the budget plus one request so that first-fit ranges never
    refuse a request the count admits (fragmentation-free: generous to the peer)."""

    def __init__(self, model, dev, seed, budget, max_request, attention, sdpa_backend, slack=1.25,
                 preempt_mode="off", recompute_pass="model"):
        super().__init__("peer", model, dev, seed, preempt_mode, recompute_pass)
        c = LLAMA3_8B
        self.bpt = model.layers * 2 * c["kv_heads"] * c["head_dim"] * 2
        self.budget = budget
        cap = int(budget * slack) // self.bpt + max_request
        shape = (model.layers, cap, c["kv_heads"], c["head_dim"])
        self.k = torch.empty(shape, device=dev, dtype=torch.bfloat16)
        self.v = torch.empty(shape, device=dev, dtype=torch.bfloat16)
        self.cap = cap
        self.ranges = RangeAllocator(cap)
        self.start = {}
        self.attention = attention
        self.sdpa_backend = sdpa_backend

    def can_admit(self, req, running):
        return ss.exact_fits(req, running, self.bpt, self.budget)

    def admit(self, req):
        s = self.ranges.take(req.context + req.output)
        if s is None:
            return False
        self.start[req.rid] = s
        self.fill(req, req.context)
        torch.cuda.synchronize()
        return True

    def fill(self, req, tokens):
        """The first `tokens` rows of req's range, synthetic K/V."""
        s = self.start[req.rid]
        for layer in range(self.model.layers):
            for o, n in self.chunks(tokens):
                self.k[layer, s + o: s + o + n].copy_(self.fill_k[:n])
                self.v[layer, s + o: s + o + n].copy_(self.fill_v[:n])

    def release(self, req):
        self.ranges.give(self.start.pop(req.rid), req.context + req.output)
        self.next_token.pop(req.rid, None)

    # preemption: recompute only (the peer has no swap space); exact bytes of the tokens held
    def fits_now(self, req, running):
        return ss.exact_fits_now(req, running, self.bpt, self.budget)

    def step_fits(self, running):
        return ss.exact_step_fits(running, self.bpt, self.budget)

    def preempt(self, req):
        """Gives req's range back (its next token is kept for when it resumes)."""
        self.ranges.give(self.start.pop(req.rid), req.context + req.output)
        return "recompute"

    def resume(self, req):
        """A range again, and its prompt and generated tokens prefilled into it (`refill`)."""
        s = self.ranges.take(req.context + req.output)
        if s is None:
            return False
        self.start[req.rid] = s
        self.refill(req)
        torch.cuda.synchronize()
        return True

    def prefill_attend(self, layer, q, k, v):
        """A re-prefill chunk's attention: its K/V written into the request's range after the rows
        before it, then SDPA of its queries over those rows and the chunk with a lower-right causal
        mask (query i sees the rows before the chunk and chunk rows 0..i), as bench/peer_prefill.py
        measures the peer's prefill. The math backend is left out: at a 4K chunk over 40K rows its
        scores alone would take ~20 GiB, so a fused kernel runs or the call fails."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        req, o0 = self.prefill_at
        s, n = self.start[req.rid], q.shape[0]
        kb, vb = self.k[layer], self.v[layer]
        kb[s + o0: s + o0 + n].copy_(k)
        vb[s + o0: s + o0 + n].copy_(v)
        ki = kb[s: s + o0 + n].permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, rows, D]
        vi = vb[s: s + o0 + n].permute(1, 0, 2).unsqueeze(0)
        qi = q.permute(1, 0, 2).unsqueeze(0)                   # [1, q_heads, n, D]
        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(fused):
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(n, o0 + n), enable_gqa=True)
        return o[0].permute(1, 0, 2)                           # [n, q_heads, D]

    def kv_bytes_per_token(self):
        return float(self.bpt)

    def prepare(self, running):
        starts = [self.start[r.rid] for r in running]
        lens = [r.length for r in running]
        i32 = torch.int32
        self.rows = [(s, n + 1) for s, n in zip(starts, lens)]
        self.write = torch.tensor([s + n for s, n in zip(starts, lens)], device=self.dev)
        self.cu_q = torch.arange(len(running) + 1, device=self.dev, dtype=i32)
        self.cu_k = torch.tensor(starts + [self.cap], device=self.dev, dtype=i32)
        self.used_k = torch.tensor([n + 1 for n in lens], device=self.dev, dtype=i32)
        self.max_k = max(lens) + 1

    def attend(self, layer, q, k, v):
        kb, vb = self.k[layer], self.v[layer]
        kb.index_copy_(0, self.write, k)
        vb.index_copy_(0, self.write, v)
        if self.attention == "varlen":
            return varlen_flash(q.contiguous(), kb, vb, self.cu_q, self.cu_k, self.max_k, self.used_k)
        o = torch.empty(q.shape, device=self.dev, dtype=q.dtype)
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(self.sdpa_backend):
            for i, (s, n) in enumerate(self.rows):
                ki = kb[s: s + n].permute(1, 0, 2).unsqueeze(0)
                vi = vb[s: s + n].permute(1, 0, 2).unsqueeze(0)
                o[i] = F.scaled_dot_product_attention(q[i][None, :, None, :], ki, vi, enable_gqa=True)[0, :, 0, :]
        return o

    def close(self):
        del self.k, self.v


def varlen_flash(q, k, v, cu_q, cu_k, max_k, used_k):
    """PyTorch's flash attention (the kernel behind SDPA's flash backend) in its varlen form: one
    query row per sequence, sequence i's keys the used_k[i] rows from cu_k[i] of k and v."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 1, max_k, 0.0, False, False,
                                                   seqused_k=used_k)[0]


def check_varlen(dev):
    """Whether varlen_flash runs here and equals per-sequence attention (float reference) on ranges
    given out of order; the reason when not."""
    try:
        g = torch.Generator(device=dev).manual_seed(5)
        c = LLAMA3_8B
        hq, hk, d = c["q_heads"], c["kv_heads"], c["head_dim"]
        total = 70000
        k = torch.randn(total, hk, d, generator=g, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(3, hq, d, generator=g, device=dev, dtype=torch.bfloat16)
        rows = [(36000, 33001), (0, 20000), (30000, 3)]  # decode-sized lengths, out of order, gaps
        i32 = torch.int32
        o = varlen_flash(q, k, v, torch.arange(4, device=dev, dtype=i32),
                         torch.tensor([s for s, _ in rows] + [total], device=dev, dtype=i32), 33001,
                         torch.tensor([n for _, n in rows], device=dev, dtype=i32))
        for i, (s, n) in enumerate(rows):
            kk = k[s: s + n].float().repeat_interleave(hq // hk, 1)
            vv = v[s: s + n].float().repeat_interleave(hq // hk, 1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) / math.sqrt(d), -1)
            ref = torch.einsum("hn,nhd->hd", p, vv)
            err = (o[i].float() - ref).abs().max().item()
            if not err < 2e-2:
                return f"sequence {i}: max |error| {err:.3g} against the float reference"
        return None
    except Exception as e:  # an op signature this torch does not have
        return f"{type(e).__name__}: {str(e)[:200]}"


def time_us(fn, iters=20):
    """Median microseconds of fn() on the GPU (CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def peer_kernel_check(dev, batch=8, length=32768):
    """One layer's decode attention at an equal-length batch (no growth, one shape): the peer's
    varlen flash against SDPA's cuDNN and flash backends on the batched [B, heads, L, D] layout,
    so a reader sees how strong the peer's kernel is (microseconds; None where a backend fails)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    c = LLAMA3_8B
    hq, hk, d = c["q_heads"], c["kv_heads"], c["head_dim"]
    k = torch.randn(batch, hk, length, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
    out = {"batch": batch, "context": length}
    for name, be in (("sdpa_cudnn_us", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash_us", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(be):
                out[name] = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        except RuntimeError:
            out[name] = None
    kp, vp = k.transpose(1, 2).reshape(batch * length, hk, d), v.transpose(1, 2).reshape(batch * length, hk, d)
    i32 = torch.int32
    cu_q = torch.arange(batch + 1, device=dev, dtype=i32)
    cu_k = torch.arange(0, (batch + 1) * length, length, device=dev, dtype=i32)
    used = torch.full((batch,), length, device=dev, dtype=i32)
    qv = q[:, :, 0, :].contiguous()
    try:
        out["varlen_flash_us"] = time_us(lambda: varlen_flash(qv, kp, vp, cu_q, cu_k, length, used))
    except RuntimeError:
        out["varlen_flash_us"] = None
    return out


#: The peer's preemption in a run of each mode: it has no swap space, so a swap run's peer recomputes.
PEER_MODE = {"off": "off", "swap": "recompute", "recompute": "recompute"}


def label(name, mode):
    """A result's name: the backend, with its preemption mode unless off."""
    return name if mode == "off" else f"{name} [{mode}]"


def run_backend(name, args, model, dev, trace_args, budget, max_request, peer_attention, sdpa_backend, mode="off"):
    """Runs the trace on one backend with preemption `mode`; returns its summary and its steps.csv rows."""
    if name == "peer":
        be = PeerBackend(model, dev, args.seed, budget, max_request, peer_attention, sdpa_backend,
                         preempt_mode=mode, recompute_pass=args.recompute_pass)
    else:
        be = KvqBackend(name, model, dev, args.seed, name, budget, args.max_batch, max_request + 64,
                        preempt_mode=mode, recompute_pass=args.recompute_pass, swap_bytes=int(args.swap_gib * 2**30))
    tag_name = label(name, mode)
    try:
        log = ss.RunLog(name)
        tagger = canary_tagger(be, args.canary_block) if name == "echokv" else None
        t0 = [time.perf_counter()]

        def progress(step, running, waiting, log):
            s = log.step_seconds[-25:]
            if s and (step % 25 == 0 or time.perf_counter() - t0[0] > 10):
                t0[0] = time.perf_counter()
                print(f"{tag_name:>10}: step {step:4d}  batch {len(running):3d}  waiting {len(waiting):3d}  "
                      f"finished {len(log.finished):3d}  step {1e3 * sum(s) / len(s):7.2f} ms"
                      + (f"  preemptions {log.preemptions}" if mode != "off" else ""), flush=True)

        ss.run_trace(be, ss.make_trace(**trace_args), args.max_batch, log,
                     max_steps=args.max_steps + args.warmup_steps, tagger=tagger, progress=progress,
                     warmup=args.warmup_steps, preempt=mode)
        s = ss.summary(log)
        counted = be.issue_seconds[args.warmup_steps:]
        s["issue_ms_mean"] = 1e3 * sum(counted) / len(counted) if counted else float("nan")
        if isinstance(be, KvqBackend):
            over = be.cache.stats()["overhead"]
            s["overhead_device_mib"] = (over["device_tables"] + over["device_workspace"]) / 2**20
        if mode == "swap":
            s["swap_capacity_bytes"] = be.cache.stats()["swap_capacity_bytes"]
        rows = [(name, i, b, f"{1e3 * sec:.3f}", tag, mode, f"{1e3 * moved:.3f}")
                for i, (sec, b, tag, moved) in enumerate(zip(log.step_seconds, log.step_batch, log.step_tag,
                                                            log.step_preempt_seconds))]
        if mode != "off":
            traffic = (f"swap {s['swapped_out_bytes'] / 2**30:.2f} GiB out, {s['swapped_in_bytes'] / 2**30:.2f} GiB in, "
                       f"{s['swap_out_s']:.2f} + {s['swap_in_s']:.2f} s" if mode == "swap" else "")
            if s["recomputed_tokens"] or mode == "recompute":
                traffic += ((", " if traffic else "") + f"{s['recomputed_tokens']} tokens recomputed in "
                            f"{s['recompute_s']:.2f} s")
            print(f"{tag_name:>10}: {s['preemptions']} preemptions ({s['swap_fallbacks']} swap fallbacks), "
                  f"{s['resumes']} resumed, {traffic}; steps alone {s['step_tokens_per_s']:.0f} tok/s", flush=True)
        print(f"{tag_name:>10}: {s['tokens_per_s']:.0f} tok/s, TPOT {s['tpot_ms_mean']:.2f} ms (p90 "
              f"{s['tpot_ms_p90']:.2f}), max batch {s['max_batch']}, {s['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
              f"host issue {s['issue_ms_mean']:.2f} ms, fill {s['fill_s']:.1f} s"
              + (f", canary on-off {s['ab_overhead_pct']:+.3f} % (sem {s['ab_overhead_sem_pct']:.3f} %)"
                 if "ab_pairs" in s else ""), flush=True)
        return s, rows
    finally:
        be.close()


def write_results(out, meta, results, steps_rows):
    """serve.json (the settings and every backend's summary, with its ratio to the tokens/s of the
    peer run with the same preemption, PEER_MODE) and steps.csv (every counted step: its preemption
    mode, and the ms of the preemptions and resumptions before it); rewritten after each backend so a
    failure keeps the rest."""
    for r in results:
        if "error" not in r:
            mode = PEER_MODE[r.get("preempt", "off")]
            peer = next((p for p in results if p["backend"] == "peer" and "error" not in p
                         and p.get("preempt", "off") == mode), None)
            r["ratio_to_peer"] = r["tokens_per_s"] / peer["tokens_per_s"] if peer and peer["tokens_per_s"] else None
    with open(os.path.join(out, "serve.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "steps.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["backend", "step", "batch", "ms", "tag", "preempt", "preempt_ms"])
        w.writerows(steps_rows)


def canary_tagger(backend, block):
    """The A/B of EchoKV's canary: on for `block` steps, off for the next `block`, and so on."""
    def tag(step):
        on = (step // block) % 2 == 0
        backend.set_canary(on)
        return "on" if on else "off"
    return tag


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/serve")
    ap.add_argument("--backends", default="peer fp16 sym8 kivi4/g32 kivi2/g32 echokv",
                    help="space-separated: peer, echokv, or a kvq format spec (k=kivi4/g32,v=kivi2/g32 too)")
    ap.add_argument("--kv-gib", type=float, default=40.0, help="KV memory of every backend, GiB")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-steps", type=int, default=400, help="decode steps per backend (after warm-up)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="first steps left out of the numbers")
    ap.add_argument("--context", type=int, default=32768, help="mean context length")
    ap.add_argument("--spread", type=float, default=0.25, help="contexts uniform in mean x [1 - s, 1 + s]")
    ap.add_argument("--outputs", default="128:512", help="output lengths, uniform in min:max")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peer-attention", choices=["varlen", "sdpa"], default="varlen")
    ap.add_argument("--sdpa-backend", choices=["cudnn", "flash"], default="flash",
                    help="SDPA backend of --peer-attention sdpa")
    ap.add_argument("--canary-block", type=int, default=8, help="EchoKV: steps per canary on/off block")
    ap.add_argument("--preempt", default="off",
                    help="preemption modes, comma-separated, one run each: off (admission reserves the whole "
                         "output), swap (kvq: swap_out / swap_in; the peer recomputes), recompute")
    ap.add_argument("--swap-gib", type=float, default=64.0,
                    help="swap mode: each kvq cache's host swap space (pinned), GiB")
    ap.add_argument("--recompute-pass", choices=["model", "synthetic"], default="model",
                    help="recompute: prefill through the model again, or write the K/V synthetically (a lower bound)")
    args = ap.parse_args()
    modes = list(dict.fromkeys(m for m in args.preempt.replace(",", " ").split()))
    bad = [m for m in modes if m not in ss.PREEMPT_MODES]
    if bad or not modes:
        sys.exit(f"--preempt: {' '.join(bad) or 'nothing'}: expected off, swap or recompute, comma-separated")
    if torch is None or not torch.cuda.is_available():
        sys.exit("serve.py needs torch with a CUDA device")
    dev = torch.device("cuda")
    omin, omax = map(int, args.outputs.split(":"))
    backends = args.backends.split()
    trace_args = dict(n=args.requests, seed=args.seed, context_mean=args.context, context_spread=args.spread,
                      output_min=omin, output_max=omax)
    probe = ss.make_trace(**trace_args)
    max_request = max(r.context + r.output for r in probe)
    budget = int(args.kv_gib * (1 << 30))
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    model = Model(args.layers, max_request + 64, args.seed, dev)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "commit": os.environ.get("KVQ_COMMIT", ""), "args": vars(args), "weights_gib": model.weight_bytes() / 2**30,
            "trace": {"requests": len(probe), "context_mean": sum(r.context for r in probe) / len(probe),
                      "context_min": min(r.context for r in probe), "context_max": max(r.context for r in probe),
                      "output_mean": sum(r.output for r in probe) / len(probe)}}
    peer_attention = args.peer_attention
    if "peer" in backends and peer_attention == "varlen":
        why = check_varlen(dev)
        if why:
            print(f"# peer: varlen flash unavailable or wrong ({why}); using SDPA per request "
                  f"({args.sdpa_backend})", flush=True)
            peer_attention = "sdpa"
    meta["peer_attention"] = peer_attention if peer_attention == "varlen" else f"sdpa-{args.sdpa_backend}"
    if "peer" in backends:
        meta["peer_kernels"] = peer_kernel_check(dev)
        torch.cuda.empty_cache()
        print(f"# peer kernels, one layer at 8 x 32K: {meta['peer_kernels']}", flush=True)
    print(f"# {props.name}, torch {torch.__version__}; model {args.layers} layers, random BF16 weights "
          f"{meta['weights_gib']:.1f} GiB; KV memory {args.kv_gib:g} GiB; trace {meta['trace']}", flush=True)
    from torch.nn.attention import SDPBackend
    sdpa_backend = SDPBackend.CUDNN_ATTENTION if args.sdpa_backend == "cudnn" else SDPBackend.FLASH_ATTENTION
    # every backend once per mode; the peer once per mode of its own (a swap run's is recompute)
    runs = []
    for mode in modes:
        for name in backends:
            run = (name, PEER_MODE[mode] if name == "peer" else mode)
            if run not in runs:
                runs.append(run)
    results, steps_rows = [], []
    for name, mode in runs:
        try:
            summary, rows = run_backend(name, args, model, dev, trace_args, budget, max_request, peer_attention,
                                        sdpa_backend, mode)
        except Exception as e:  # one backend's failure is reported; the others still run
            print(f"{label(name, mode):>10}: FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
            summary, rows = {"backend": name, "error": f"{type(e).__name__}: {e}"}, []
            if mode != "off":
                summary["preempt"] = mode
        torch.cuda.empty_cache()
        results.append(summary)
        steps_rows += rows
        write_results(args.out, meta, results, steps_rows)
    print(f"# wrote {args.out}/serve.json and steps.csv", flush=True)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
