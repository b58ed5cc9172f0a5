"""kvq's calls as PyTorch custom ops (`torch.library`), for `torch.compile` and CUDA graphs.

    import kvq, kvq.ops
    cache = kvq.Cache(..., device="cuda")
    def step(k, v, q):
        kvq.ops.append(cache, seq, layer, k, v)
        return kvq.ops.attend(cache, [seq], layer, q)
    torch.compile(step, fullgraph=True)

Each op is the `kvq.Cache` method of the same name (same checks, errors and streams: torch's
current stream). A cache's ops are ordered through a one-element `state` tensor of the cache
that the writing ops (append, append_batch, prefill) declare mutated and every op reads, so a
compiled graph keeps them in program order and never drops an append whose output nobody reads.
Their fake implementations allocate the outputs' shapes only. The ops are registered when this
module is first imported (it imports torch; the rest of kvq never does).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import Cache, _live

def _state(cache: Cache) -> torch.Tensor:
    if cache._op_state is None:  # the cache was made before torch was imported
        cache._op_state = torch.zeros(1, dtype=torch.int32, device=cache.device)
    return cache._op_state


def _cache(handle: int) -> Cache:
    cache = _live.get(handle)
    if cache is None:
        raise LookupError(f"kvq: cache handle {handle} is gone (its kvq.Cache was freed)")
    return cache


# The ops are defined through torch.library.Library, not `custom_op`: the dispatcher calls the
# implementation directly (custom_op's autograd and compile wrappers cost tens of microseconds a
# call in eager mode). No autograd formula: the cache's data is not differentiable.
_lib = torch.library.Library("kvq", "DEF")
_lib.define("append(Tensor(a!) state, int cache, int seq, int layer, Tensor k, Tensor v) -> ()")
_lib.define("append_batch(Tensor(a!) state, int cache, int[] seqs, int[] tokens, int layer, Tensor k, Tensor v) -> ()")
_lib.define("attend(Tensor state, int cache, int[] seqs, int[] q_lens, int layer, Tensor q) -> Tensor")
_lib.define("prefill(Tensor(a!) state, int cache, int seq, int layer, Tensor k, Tensor v, Tensor q) -> Tensor")
_lib.define("attend_prefix(Tensor state, int cache, int seq, int layer, int prefix, Tensor q) -> (Tensor, Tensor)")


def _append(state, cache, seq, layer, k, v):
    _cache(cache).append(seq, layer, k, v)


def _append_batch(state, cache, seqs, tokens, layer, k, v):
    _cache(cache).append_batch(seqs, tokens, layer, k, v)


def _attend(state, cache, seqs, q_lens, layer, q):
    return _cache(cache).attend(seqs, layer, q, q_lens=q_lens)


def _prefill(state, cache, seq, layer, k, v, q):
    return _cache(cache).prefill(seq, layer, k, v, q)


def _attend_prefix(state, cache, seq, layer, prefix, q):
    return _cache(cache).attend_prefix(seq, layer, prefix, q)


for _name, _fn in (("append", _append), ("append_batch", _append_batch), ("attend", _attend),
                   ("prefill", _prefill), ("attend_prefix", _attend_prefix)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("kvq::append")
def _(state, cache, seq, layer, k, v):
    return None


@torch.library.register_fake("kvq::append_batch")
def _(state, cache, seqs, tokens, layer, k, v):
    return None


@torch.library.register_fake("kvq::attend")
def _(state, cache, seqs, q_lens, layer, q):
    return torch.empty_like(q)


@torch.library.register_fake("kvq::prefill")
def _(state, cache, seq, layer, k, v, q):
    return torch.empty_like(q)


@torch.library.register_fake("kvq::attend_prefix")
def _(state, cache, seq, layer, prefix, q):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


def append(cache: Cache, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """`Cache.append` as the op `kvq::append`."""
    torch.ops.kvq.append(_state(cache), cache._op_handle, seq, layer, k, v)


def append_batch(cache: Cache, seqs: Sequence[int], tokens: Sequence[int], layer: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """`Cache.append_batch` as the op `kvq::append_batch`."""
    torch.ops.kvq.append_batch(_state(cache), cache._op_handle, list(seqs), list(tokens), layer, k, v)


def attend(cache: Cache, seqs: Sequence[int], layer: int, q: torch.Tensor,
           q_lens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`Cache.attend` as the op `kvq::attend`: a new output like q."""
    lens = list(q_lens) if q_lens is not None else [1] * len(seqs)
    return torch.ops.kvq.attend(_state(cache), cache._op_handle, list(seqs), lens, layer, q)


def prefill(cache: Cache, seq: int, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`Cache.prefill` as the op `kvq::prefill`: a new output like q."""
    return torch.ops.kvq.prefill(_state(cache), cache._op_handle, seq, layer, k, v, q)


def attend_prefix(cache: Cache, seq: int, layer: int, prefix: int, q: torch.Tensor):
    """`Cache.attend_prefix` as the op `kvq::attend_prefix`: (out, lse)."""
    out, lse = torch.ops.kvq.attend_prefix(_state(cache), cache._op_handle, seq, layer, prefix, q)
    return out, lse
