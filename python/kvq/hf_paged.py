"""kvq in transformers' continuous batching (`generate_batch`; pinned: transformers 5.17).

    import kvq.hf_paged
    out = kvq.hf_paged.generate_batch(model, prompts, generation_config, "kivi4/g32",
                                      budget_bytes=8 << 30)

transformers' continuous batching owns its scheduler, its batch builder and a `PagedAttentionCache`
of BF16 blocks, and runs the model's `"paged|<impl>"` attention over each step's packed batch
(prefill chunks and decode tokens of many requests as one sequence). This module keeps transformers'
scheduler and block accounting (admission, preemption, request lifetimes) and replaces where the
K/V live and how attention reads them:
- `KVQPagedCache`, a `PagedAttentionCache` whose block tensors are never allocated (made on the
  meta device): its blocks are admission units only, as many as kvq's budget holds in the
  configuration's bytes per token (`kvq.Cache.bytes_for`); each request is a kvq sequence, made at
  its first tokens and released when transformers frees the request's blocks;
- the attention `"paged|kvq"`: the batch builder tells the cache, request by request, what each
  contributes to the packed batch (`extend_read_and_write_indices`); the attention function then
  runs one `append_batch` + `attend` for the requests decoding a token and a `prefill` per request
  feeding a chunk, from kvq's pages, and writes nothing into BF16 blocks.
The block-table decode path, prefix sharing, CUDA graphs and asynchronous batching of
transformers' loop are turned off for kvq (they assume BF16 blocks or a replayable step).
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import AttentionInterface, ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api

import kvq
from kvq.hf import attention_shape, check_scale, own_stream_args

#: The attention implementation this module registers (transformers adds "paged|" itself).
ATTENTION = "paged|kvq"


class KVQPagedCache(cb_cache.PagedAttentionCache):
    """A `PagedAttentionCache` whose requests live in one `kvq.Cache` (see the module's text).
    Made by transformers' continuous batching manager inside `generate_batch` below."""

    settings: Dict[str, Any] = {}  # set by generate_batch for the manager it starts

    def __init__(self, config, continuous_batching_config, device, distributed_helper, tp_plan, dtype=torch.float16):
        s = dict(self.settings)
        if distributed_helper.tp_size > 1:
            raise kvq.Unsupported("kvq.hf_paged: tensor-parallel continuous batching is not supported")
        layers, q_heads, kv_heads, head_dim = attention_shape(config)
        dev = torch.device(device)
        cache_args, self._own_stream = own_stream_args(dev, s.get("cache_args", {}))
        self.kvq = kvq.Cache(layers, q_heads, kv_heads, head_dim, s["config"], budget_bytes=s["budget_bytes"],
                             device=str(dev), **cache_args)
        # Blocks: admission units of block_size tokens. A block stands for the page bytes of
        # block_size tokens (the rate of a long sequence, scales included); a request's first
        # allocation also takes `window_blocks` more for its FP16 window (the bytes of a sequence
        # of `window` tokens, a bound on its ring and unencoded tokens). A request of b blocks
        # then never needs more budget than its blocks stand for.
        bs = continuous_batching_config.block_size
        t = max(bs, self.kvq.max_tokens // 2 // bs * bs)
        per_block = (self.kvq.bytes_for(2 * t) - self.kvq.bytes_for(t)) * bs / t
        self.window_blocks = -(-self.kvq.bytes_for(self.kvq.window) // int(per_block))
        continuous_batching_config.num_blocks = max(1, int(s["budget_bytes"] * 0.98 // per_block))
        # transformers' block tensors: shapes only (meta), never memory
        super().__init__(config, continuous_batching_config, "meta", distributed_helper, tp_plan, dtype)
        self.device = dev
        self.seqs: Dict[str, int] = {}  # request id -> kvq sequence
        self._next = 0
        self._pending: List[Tuple[str, int, int]] = []  # the batch being built: (request, past, query tokens)
        self._plan = ([], None, [])  # the running forward's decode sequences and rows, and chunks

    # ---- the batch builder's calls ----------------------------------------------------------------
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        self._pending.append((request_id, int(past_length), int(query_length)))
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def blocks_needed(self, num_requested_blocks: int, allocated_blocks: int) -> int:
        extra = self.window_blocks if allocated_blocks == 0 else 0  # a new request's window
        return super().blocks_needed(num_requested_blocks + extra, allocated_blocks)

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> Optional[int]:
        """transformers' allocation, plus the window's blocks at a request's first (held in its
        block table, so freed and forked with it); returns the blocks the scheduler asked for."""
        extra = self.window_blocks if self.blocks_in_use(request_id) == 0 else 0
        if super().blocks_needed(n_blocks + extra, allocated_blocks) > self.get_num_free_blocks():
            return None
        for cm in self.group_cache_managers:
            if cm.allocate_blocks(n_blocks + extra, request_id, self._block_manager) is None:
                raise kvq.OutOfBudget(f"kvq.hf_paged: {n_blocks + extra} blocks for request {request_id}")
        return n_blocks

    def fill_block_table(self, request_id, past_length, query_length, block_table):
        raise kvq.Unsupported("kvq.hf_paged: the block-table decode path reads BF16 blocks (max_blocks_per_request=0)")

    def free_blocks(self, request_id: str) -> None:
        super().free_blocks(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kvq.release_sequence(seq)

    def free_all_requests(self) -> None:
        super().free_all_requests()
        for seq in self.seqs.values():
            self.kvq.release_sequence(seq)
        self.seqs.clear()

    def fork_request(self, source_request_id: str, destination_request_ids: List[str]):
        out = super().fork_request(source_request_id, destination_request_ids)
        src = self.seqs.get(source_request_id)
        if src is not None:
            for dst in destination_request_ids:
                self.seqs[dst] = self._new_seq(fork_of=src)
        return out

    def copy_cache(self, list_source_blocks, list_forked_blocks) -> None:
        pass  # forks are kvq forks (fork_request): pages shared, windows copied

    def update(self, *args, **kwargs):
        raise kvq.InvalidArgument("kvq.hf_paged: the model's attention must be 'paged|kvq' with a KVQPagedCache")

    # ---- sequences --------------------------------------------------------------------------------
    def _new_seq(self, fork_of: Optional[int] = None) -> int:
        seq = self._next
        self._next += 1
        if fork_of is None:
            self.kvq.create_sequence(seq)
        else:
            self.kvq.fork(fork_of, seq)
        return seq

    def _seq(self, request_id: str, past: int) -> int:
        seq = self.seqs.get(request_id)
        if seq is None:
            seq = self.seqs[request_id] = self._new_seq()
        stored = self.kvq.length(seq, 0)
        if stored != past:  # a request re-run from an earlier position (preempted, then resumed)
            if stored < past:
                raise kvq.InvalidArgument(f"kvq.hf_paged: request {request_id} resumes at position {past} but its "
                                          f"kvq sequence holds {stored} tokens")
            self.kvq.truncate(seq, past)
        return seq


def kvq_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs):
    """The attention `"paged|kvq"`: query [1, q_heads, T, head_dim] and key/value [1, kv_heads, T,
    head_dim] of the packed batch; returns ([1, T, q_heads, head_dim], None)."""
    cache = kwargs.get("cache")
    if not isinstance(cache, KVQPagedCache):
        raise kvq.InvalidArgument("kvq.hf_paged: 'paged|kvq' runs inside kvq.hf_paged.generate_batch "
                                  "(transformers' continuous batching with a KVQPagedCache)")
    layer = module.layer_idx
    c = cache.kvq
    check_scale(c, layer, query.shape[-1], scaling, dropout)
    if layer == 0:  # a new forward: the batch the builder described since the last one, planned once
        batch, cache._pending = cache._pending, []
        decode_rows, decode_seqs, chunks, offset = [], [], [], 0
        for request_id, past, n in batch:
            seq = cache._seq(request_id, past)
            if n == 1:
                decode_rows.append(offset)
                decode_seqs.append(seq)
            else:
                chunks.append((seq, offset, n))
            offset += n
        rows = torch.tensor(decode_rows, device=query.device) if decode_seqs else None
        cache._plan = (decode_seqs, rows, chunks)
    decode_seqs, rows, chunks = cache._plan
    q = query[0].transpose(0, 1)  # [T, q_heads, head_dim] views
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = torch.zeros_like(q)  # rows of padding tokens (past the batch) stay zero
    for seq, o, n in chunks:
        out[o:o + n] = c.prefill(seq, layer, k[o:o + n].contiguous(), v[o:o + n].contiguous(),
                                 q[o:o + n].contiguous())
    if decode_seqs:
        kd, vd, qd = k.index_select(0, rows), v.index_select(0, rows), q.index_select(0, rows)
        c.append_batch(decode_seqs, [1] * len(decode_seqs), layer, kd, vd)
        out.index_copy_(0, rows, c.attend(decode_seqs, layer, qd))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION, kvq_paged_attention)


@contextlib.contextmanager
def _kvq_blocks(settings: Dict[str, Any]):
    """transformers' continuous batching manager makes KVQPagedCache instead of its BF16 cache."""
    saved = continuous_api.PagedAttentionCache
    KVQPagedCache.settings = settings
    continuous_api.PagedAttentionCache = KVQPagedCache
    try:
        yield
    finally:
        continuous_api.PagedAttentionCache = saved
        KVQPagedCache.settings = {}


def generate_batch(model, inputs: Sequence[Sequence[int]], generation_config=None, kvq_config: str = "fp16", *,
                   budget_bytes: int, continuous_batching_config: Optional[ContinuousBatchingConfig] = None,
                   cache_args: Optional[Dict[str, Any]] = None, **kwargs):
    """`model.generate_batch(inputs, generation_config, ...)` with every request's K/V in one kvq
    cache of `kvq_config` and `budget_bytes` (`kvq.Cache` arguments in `cache_args`). Returns
    transformers' result (request id -> GenerationOutput). The model's attention is switched to
    "paged|kvq" for the call and restored after."""
    cb = copy.copy(continuous_batching_config) if continuous_batching_config else ContinuousBatchingConfig()
    cb.max_blocks_per_request = 0  # no block-table decode path: it reads BF16 blocks
    cb.allow_block_sharing = False  # no prefix sharing of BF16 blocks (kvq forks share pages)
    cb.use_cuda_graph = False  # the attention runs host code per step (kvq's bookkeeping)
    cb.use_async_batching = False  # the batch builder describes the batch the model runs next
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        with _kvq_blocks(dict(config=kvq_config, budget_bytes=budget_bytes, cache_args=cache_args or {})):
            return model.generate_batch(inputs=[list(x) for x in inputs], generation_config=generation_config,
                                        continuous_batching_config=cb, **kwargs)
    finally:
        model.set_attn_implementation(previous)
