"""A Hugging Face transformers cache whose attention reads kvq's pages (pinned: transformers 5.17).

    import kvq.hf
    cache = kvq.hf.KVQCache(model.config, "kivi4/g32+rot", budget_bytes=1 << 30, device="cuda")
    model.set_attn_implementation("kvq")          # or from_pretrained(..., attn_implementation="kvq")
    model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

How it plugs in: a layer's `update` hands the new K and V to the cache and returns them as they
are (no copy, no history); the attention function registered as "kvq" (`AttentionInterface`)
finds the cache that received them through the layer index and runs kvq: a decode step is one
`append_batch` and one `attend` for the whole batch, a longer chunk a `prefill` per row (its
queries see the chunk causally in FP16 and the past as stored). Nothing is dequantized into a
BF16 copy. Each batch row is one kvq sequence holding only its real tokens: pad tokens (known
from the attention mask, registered as "kvq" in `AttentionMaskInterface` with sdpa's layout) are
never stored, and their output rows are zeros. The cache reports the padded length transformers
counts positions by (what `DynamicCache` would hold).

Beam search (`reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`) forks and
releases sequences (pages shared, FP16 windows copied); assisted decoding's `crop` truncates.
Sliding-window layers, cross-attention and attention weights output are refused with an error.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kvq

#: The attention implementation name this module registers.
ATTENTION = "kvq"


class KVQLayer(CacheLayerMixin):
    """One model layer's view of a KVQCache: it holds the K/V of the step until the attention
    function consumes them; the tokens themselves live in the kvq cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: "KVQCache", layer: int):
        super().__init__()
        self._owner = weakref.ref(owner)
        self.layer = layer
        self.pending = None  # (keys, values) of the step, [batch, kv_heads, tokens, head_dim]
        self.seen = 0  # tokens fed to this layer, pads included (transformers' positions)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self._owner()
        owner._begin(key_states)
        if self.pending is not None:
            raise kvq.InvalidArgument(f"kvq.hf: layer {self.layer} was updated twice without attention in between "
                                      f"(is the model's attention implementation '{ATTENTION}'?)")
        self.pending = (key_states, value_states)
        _active.cache = self._owner
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.pending, self.seen = None, 0

    # Row operations act on the kvq sequences, once for the whole cache (see KVQCache).
    def reorder_cache(self, beam_idx) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices) -> None:
        pass


# Per thread, the cache whose layer received the step's K/V last (a weak reference): the attention
# function reads it (transformers does not pass the cache to it). Models running in several
# threads each find their own.
_active = threading.local()


def attention_shape(config: Any):
    """(layers, q_heads, kv_heads, head_dim) of a Llama-family decoder's config; refuses layers
    other than full attention (sliding windows, linear attention) by name."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    q_heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise kvq.Unsupported(f"kvq.hf: layer types {sorted(set(layer_types))}: only full attention is supported")
    return text.num_hidden_layers, q_heads, kv_heads, head_dim


def own_stream_args(device: torch.device, cache_args: dict):
    """`kvq.Cache` arguments with a stream of the cache's own on CUDA (where replayed steps run;
    eager calls follow torch's current stream), and that stream (None elsewhere or when given)."""
    if device.type != "cuda" or cache_args.get("stream") is not None:
        return cache_args, None
    stream = torch.cuda.Stream(device)
    return dict(cache_args, stream=stream), stream


def check_scale(cache: kvq.Cache, layer: int, head_dim: int, scaling: Optional[float], dropout: float) -> None:
    """Refuses dropout and a logit scale other than the cache's (both by name)."""
    if dropout:
        raise kvq.Unsupported("kvq.hf: attention dropout (training) is not supported")
    scale = cache.softmax_scale or head_dim ** -0.5
    if scaling is not None and abs(scaling - scale) > 1e-6 * scale:
        raise kvq.Unsupported(f"kvq.hf: layer {layer} scales its logits by {scaling}, the kvq cache by {scale} "
                              "(KVQCache(..., softmax_scale=...))")


class KVQCache(Cache):
    """A `transformers.Cache` backed by one `kvq.Cache` (a kvq sequence per batch row).

    Args:
        config: the model's config (a Llama-family decoder: num_hidden_layers, num_attention_heads,
            num_key_value_heads, head_dim or hidden_size).
        kvq_config: a kvq configuration string (`kvq.policies()`), e.g. "kivi4/g32+rot".
        budget_bytes: the kvq byte budget (pages and windows of every row).
        device: "cpu" or "cuda[:i]" (where the model runs).
        **cache_args: more `kvq.Cache` arguments (page_tokens, window, recent, max_tokens, ...).
    """

    def __init__(self, config: Any, kvq_config: str = "fp16", *, budget_bytes: int = 256 << 20,
                 device: Any = "cpu", **cache_args):
        layers, q_heads, kv_heads, head_dim = attention_shape(config)
        super().__init__(layers=[KVQLayer(self, i) for i in range(layers)])
        dev = torch.device(device)
        cache_args, self._own_stream = own_stream_args(dev, cache_args)  # where a DecodeGraph's steps run
        self.kvq = kvq.Cache(layers, q_heads, kv_heads, head_dim, kvq_config, budget_bytes=budget_bytes,
                             device=str(dev), **cache_args)
        self.rows: List[int] = []  # kvq sequence id of each batch row
        self._next_id = 0
        self._graph_step: Optional[kvq.DecodeStep] = None  # set while a DecodeGraph runs a step

    # ---- rows -------------------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _begin(self, key_states: torch.Tensor) -> None:
        batch = key_states.shape[0]
        if not self.rows:
            self.rows = [self._new_id() for _ in range(batch)]
            for s in self.rows:
                self.kvq.create_sequence(s)
        elif batch != len(self.rows):
            raise kvq.InvalidArgument(f"kvq.hf: a batch of {batch} rows for a cache of {len(self.rows)}")

    def _fork_rows(self, sources: List[int]) -> None:
        """New rows, row i a copy of old row sources[i]; the old rows released."""
        old = self.rows
        new = []
        for src in sources:
            s = self._new_id()
            self.kvq.fork(old[src], s)
            new.append(s)
        for s in old:
            self.kvq.release_sequence(s)
        self.rows = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.rows:
            self._fork_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self._fork_rows([i for i in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows:
            self._fork_rows([int(i) for i in indices.tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' rule: a negative -n removes the newest n tokens (rejected candidates of
        assisted decoding); a positive n (deprecated) keeps the first n."""
        seen = self.layers[0].seen
        n = -int(tokens_to_remove) if tokens_to_remove <= 0 else max(0, seen - int(tokens_to_remove))
        if n == 0:
            return
        if n > seen:
            raise kvq.InvalidArgument(f"kvq.hf: crop of {n} tokens from a cache of {seen}")
        for s in self.rows:  # a row holds its real tokens only: the newest n are real (generated)
            self.kvq.truncate(s, max(0, self.kvq.length(s, 0) - n))
        for layer in self.layers:
            layer.seen -= n

    def reset(self) -> None:
        for s in self.rows:
            self.kvq.release_sequence(s)
        self.rows = []
        for layer in self.layers:
            layer.reset()


def _real_tokens(mask: Optional[torch.Tensor], row: int, tokens: int) -> Optional[torch.Tensor]:
    """Indices of the chunk's real (non-pad) tokens of a row, or None when every token is real: a
    key no query of the chunk may see is a pad (sdpa's boolean mask, True = attend)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask == 0  # an additive float mask
    visible = mask[row, 0, :, -tokens:].any(dim=0)
    if bool(visible.all()):
        return None
    return visible.nonzero().flatten()


def kvq_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                  **kwargs):
    """The attention function registered as "kvq": query [batch, q_heads, tokens, head_dim], key and
    value the layer's K/V of the step as `update` returned them. Returns ([batch, tokens, q_heads,
    head_dim], None)."""
    ref = getattr(_active, "cache", None)
    cache = ref() if ref is not None else None
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or layer_idx is None or cache.layers[layer_idx].pending is None:
        raise kvq.InvalidArgument("kvq.hf: the 'kvq' attention needs a kvq.hf.KVQCache passed as past_key_values "
                                  f"(layer {layer_idx} has no pending K/V)")
    layer = cache.layers[layer_idx]
    k, v = layer.pending
    layer.pending = None
    if k is not key:
        raise kvq.InvalidArgument(f"kvq.hf: layer {layer_idx}: the attention got other keys than the cache's update")
    batch, q_heads, tokens, head_dim = query.shape
    check_scale(cache.kvq, layer_idx, head_dim, scaling, dropout)
    c = cache.kvq
    # token-major views [batch, tokens, heads, head_dim]; a decode step's are views, a chunk's copies
    qt, kt, vt = (x.transpose(1, 2) for x in (query, key, value))
    if tokens > 1:
        qt, kt, vt = qt.contiguous(), kt.contiguous(), vt.contiguous()
    step = cache._graph_step
    if step is not None:  # a DecodeGraph's step (eager or being captured): the prepared step's kernels
        if tokens != 1:
            raise kvq.InvalidArgument(f"kvq.hf: a DecodeGraph step takes one token per row, got {tokens}")
        out = torch.empty((batch, q_heads, head_dim), dtype=query.dtype, device=query.device)
        step.append(layer_idx, kt[:, 0], vt[:, 0])
        step.attend(layer_idx, qt[:, 0], out)
        return out.unsqueeze(1), None  # the DecodeGraph counts the step's token (replays run no Python)
    out = torch.zeros((batch, tokens, q_heads, head_dim), dtype=query.dtype, device=query.device)
    if tokens == 1:  # a decode step: the new token of every row is real
        c.append_batch(cache.rows, [1] * batch, layer_idx, kt[:, 0], vt[:, 0])
        c.attend(cache.rows, layer_idx, qt[:, 0], out=out[:, 0])
    else:
        for b, seq in enumerate(cache.rows):
            real = _real_tokens(attention_mask, b, tokens)
            if real is None:
                c.prefill(seq, layer_idx, kt[b], vt[b], qt[b], out=out[b])
            elif real.numel():
                out[b, real] = c.prefill(seq, layer_idx, kt[b, real], vt[b, real], qt[b, real])
    layer.seen += tokens
    return out, None


class DecodeGraph:
    """A model's decode forward over a KVQCache, captured once in a CUDA graph and replayed each
    step: what `torch.compile(mode="reduce-overhead")` gives a StaticCache, for kvq's pages.

        cache = kvq.hf.KVQCache(model.config, "kivi4/g32", budget_bytes=..., device="cuda")
        model(prompt, past_key_values=cache, attention_mask=mask)      # prefill (eager, any chunks)
        decode = kvq.hf.DecodeGraph(model, cache)
        for _ in range(n):
            logits = decode(tokens, positions)                        # [batch, vocab], one token per row

    Each call runs `kvq.DecodeStep.prepare` on the host (the step's bookkeeping, page allocation and
    descriptor copy on the cache's stream), copies the inputs into the graph's static buffers and
    replays the graph on the cache's stream, ordered after torch's current stream and before what
    follows on it. The first call runs the forward eagerly (lazy initializations, workspaces), the
    second captures it; both compute their step. `tokens`, `positions`: [batch, 1] (the batch the
    cache holds: its rows); positions as `DynamicCache` would count them (pads included). Returns
    the last position's logits in a buffer the next call overwrites. Every row must be real at
    each step (no attention mask: padded prompts decode through the eager path). What
    `kvq.DecodeStep` refuses is refused here with its error (EchoKV's canary, a GQA group above 8);
    the cache's eager calls (prefill, fork, truncate) stay usable between steps, with rows fixed
    while the graph lives (a new batch needs a new DecodeGraph).
    """

    def __init__(self, model: torch.nn.Module, cache: KVQCache, max_tokens: Optional[int] = None):
        if not cache.rows:
            raise kvq.InvalidArgument("kvq.hf.DecodeGraph: the cache holds no rows yet (prefill the prompts first)")
        if not cache.kvq.device.startswith("cuda"):
            raise kvq.Unsupported("kvq.hf.DecodeGraph: a CUDA cache is needed (graphs replay on the GPU)")
        self.model, self.cache = model, cache
        self.batch = len(cache.rows)
        self.rows = list(cache.rows)
        self.step = kvq.DecodeStep(cache.kvq, max_batch=self.batch, max_tokens=max_tokens or cache.kvq.max_tokens)
        self.stream = cache._own_stream or torch.cuda.current_stream()
        self.graph = None
        self.calls = 0
        self._in = self._logits = None

    def _forward(self):
        out = self.model(input_ids=self._in[0], position_ids=self._in[1], cache_position=self._in[2],
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if cache.rows != self.rows:
            raise kvq.InvalidArgument("kvq.hf.DecodeGraph: the cache's rows changed since the graph was made "
                                      "(beam reorder, reset): make a new DecodeGraph")
        if tuple(tokens.shape) != (self.batch, 1) or tuple(positions.shape) != (self.batch, 1):
            raise kvq.InvalidArgument(f"kvq.hf.DecodeGraph: tokens and positions must be [{self.batch}, 1], got "
                                      f"{list(tokens.shape)} and {list(positions.shape)}")
        self.step.prepare(self.rows)  # validates first: a refused step changes nothing
        current = torch.cuda.current_stream(tokens.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            if self._in is None:
                self._in = (tokens.clone(), positions.clone(), positions[0].clone())
            else:
                self._in[0].copy_(tokens)
                self._in[1].copy_(positions)
                self._in[2].copy_(positions[0])
            if self.graph is not None:
                self.graph.replay()
            else:
                cache._graph_step = self.step
                try:
                    with torch.no_grad():
                        if self.calls == 0:  # eager: lazy initializations and workspaces on this stream
                            self._logits = self._forward()
                        else:
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph, stream=self.stream):
                                self._logits = self._forward()
                            graph.replay()
                            self.graph = graph
                except BaseException:
                    # the prepared step never ran: its token goes back, leaving the cache as it was
                    for seq in self.rows:
                        cache.kvq.truncate(seq, cache.kvq.length(seq, 0) - 1)
                    raise
                finally:
                    cache._graph_step = None
                    for layer in cache.layers:
                        layer.pending = None
        current.wait_stream(self.stream)
        for layer in cache.layers:
            layer.seen += 1
        self.calls += 1
        return self._logits


AttentionInterface.register(ATTENTION, kvq_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
