"""kvq: a quantized KV cache with fused dequant-attention, from Python.

The package is a thin layer over the C++ library (python/README.md): every call is the C++ call of
the same name. Tensors (torch, numpy, or any DLPack producer: f32, f16 or bf16, on the cache's
device) go in without a copy; a CUDA call runs on the stream given, else torch's current stream
when torch is loaded, else the cache's own (a DecodeStep: always the cache's own), and never
synchronizes the host (``read``, ``check`` and
``sync_policy`` do, as in C++). A failed call raises the exception class of its error code with
kvq's message, and changes nothing stored.

    import kvq, torch
    cache = kvq.Cache(layers=2, q_heads=8, kv_heads=2, head_dim=128, config="kivi4/g32+rot",
                      budget_bytes=256 << 20, device="cuda")
    cache.create_sequence(0)
    cache.append(0, layer, k, v)                 # k, v: [tokens, kv_heads, head_dim]
    out = cache.attend([0], layer, q)            # q: [sum q_len, q_heads, head_dim]
"""
from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Optional, Sequence

from . import _kvq
from ._kvq import (  # noqa: F401  (re-exported)
    CommError,
    CudaError,
    Error,
    InvalidArgument,
    IOError,
    NonFinite,
    NotFound,
    OutOfBudget,
    Unsupported,
    bits_per_element,
    format_name,
    inspect_blob,
    policies,
)

__version__ = _kvq.version
#: True when this build has the CUDA backend.
cuda = _kvq.cuda

__all__ = [
    "AttentionVariant",
    "Cache",
    "DecodeStep",
    "Error",
    "InvalidArgument",
    "NonFinite",
    "OutOfBudget",
    "NotFound",
    "IOError",
    "CudaError",
    "Unsupported",
    "CommError",
    "format_name",
    "inspect_blob",
    "bits_per_element",
    "policies",
    "cuda",
]


class AttentionVariant:
    """One layer's attention rule (`kvq::attention_variant`): a query at position p attends to the
    keys p - window < j <= p (``window`` 0: every earlier key), each scaled score s becomes
    ``softcap * tanh(s / softcap)`` (0: off), and ``sink_logits`` (one per query head, or None)
    join each head's softmax without a value (gpt-oss). A sliding layer returns the pages its
    window left behind to the budget."""

    __slots__ = ("window", "softcap", "sink_logits")

    def __init__(self, window: int = 0, softcap: float = 0.0, sink_logits: Optional[Sequence[float]] = None) -> None:
        self.window = int(window)
        self.softcap = float(softcap)
        self.sink_logits = None if sink_logits is None else [float(x) for x in sink_logits]

    def _tuple(self) -> tuple:
        return (self.window, self.softcap, self.sink_logits or [])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttentionVariant) and self._tuple() == other._tuple()

    def __repr__(self) -> str:
        return (f"kvq.AttentionVariant(window={self.window}, softcap={self.softcap}, "
                f"sink_logits={self.sink_logits!r})")


def _variant_tuples(attention: Optional[Sequence[Any]]) -> list:
    """Per-layer variants as the binding takes them: AttentionVariant, a dict of its fields, or
    None (a plain global layer)."""
    if attention is None:
        return []
    out = []
    for i, v in enumerate(attention):
        if v is None:
            v = AttentionVariant()
        elif isinstance(v, dict):
            unknown = set(v) - {"window", "softcap", "sink_logits"}
            if unknown:
                raise InvalidArgument(f"attention of layer {i}: unknown field(s) {sorted(unknown)} "
                                      "(window, softcap, sink_logits)")
            v = AttentionVariant(**v)
        elif not isinstance(v, AttentionVariant):
            raise InvalidArgument(f"attention of layer {i}: {type(v).__name__}, expected an AttentionVariant, a dict "
                                  "or None")
        out.append(v._tuple())
    return out


# Every live cache by handle: the torch custom ops (kvq.ops) name a cache by this int.
_handles = itertools.count(1)
_live: "weakref.WeakValueDictionary[int, Cache]" = weakref.WeakValueDictionary()


def _torch_of(t: Any):
    """The torch module when `t` is a torch tensor (torch is never imported by kvq itself)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(t, torch.Tensor) else None


def _dl(t: Any) -> Any:
    """What the binding imports: a torch tensor as its DLPack capsule (torch's C exporter, a
    fraction of a microsecond, where `Tensor.__dlpack__` costs several), anything else as it is."""
    torch = _torch_of(t)
    if torch is None:
        return t
    try:
        return torch._C._to_dlpack(t.detach() if t.requires_grad else t)
    except (AttributeError, BufferError, RuntimeError, TypeError) as e:
        raise InvalidArgument(f"a {t.dtype} tensor of shape {tuple(t.shape)} cannot be passed to kvq: {e}") from None


def _stream_handle(stream: Any) -> Optional[int]:
    """A cudaStream_t as an int: an int, or an object with `cuda_stream` (torch/cupy streams)."""
    if stream is None:
        return None
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        handle = getattr(stream, "ptr", None)
    if not isinstance(handle, int):
        raise InvalidArgument(f"stream must be an int (cudaStream_t) or have .cuda_stream, got {type(stream).__name__}")
    return handle


def _empty_like(t: Any, heads: Optional[int] = None):
    """A new output for input `t`: its shape and dtype, or float32 [tokens, heads] (an lse)."""
    torch = _torch_of(t)
    np = sys.modules.get("numpy")
    if torch is not None:
        if heads is None:
            return torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return torch.empty((t.shape[0], heads), dtype=torch.float32, device=t.device)
    if np is not None and isinstance(t, np.ndarray):
        return np.empty(t.shape, t.dtype) if heads is None else np.empty((t.shape[0], heads), np.float32)
    if hasattr(t, "__dlpack__"):
        raise InvalidArgument(f"pass `out` for inputs of type {type(t).__name__} (kvq allocates torch and numpy "
                              "outputs)")
    raise TypeError(f"expected a tensor (torch, numpy or a DLPack producer), got {type(t).__name__}")


class Cache:
    """A quantized KV cache (`kvq::KVCache`).

    Args:
        layers, q_heads, kv_heads, head_dim: the model's attention shape.
        config: a format spec or policy with optional suffixes, as kvq-eval takes them:
            ``"fp16"``, ``"kivi4/g32"``, ``"k=kivi4/g32,v=kivi2/g32;0=fp16"``, ``"kivi4/g32+rot+sink"``,
            ``"echokv:seed=1"``, ``"kl_budget:bits=4,artifact=a.json"``, ``"autok:..."`` (`policies()`).
        budget_bytes: one byte budget for every page and FP16 window.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``.
        page_tokens, window, recent: tokens per page, FP16 ring, newest tokens never encoded.
        max_sequences, max_tokens: CUDA page tables' rows and tokens per sequence.
        softmax_scale: 0 means 1/sqrt(head_dim).
        check_values: refuse NaN/Inf/beyond-fp16 K/V (CPU: at the call; CUDA: on the device, reported
            by `check()`, docs/architecture.md "Value checks on the device").
        cpu_threads: threads of the CPU attention.
        stream: the cache's own CUDA stream (int or torch stream), for calls that name none and
            are not given torch tensors.
        attention: one `AttentionVariant` (or dict of its fields, or None) per layer: sliding
            windows, soft-capping, sink logits; None (the default): every layer global and plain.
    """

    def __init__(
        self,
        layers: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        config: str = "fp16",
        *,
        budget_bytes: int,
        device: str = "cpu",
        page_tokens: int = 64,
        window: int = 128,
        recent: int = 64,
        max_sequences: int = 256,
        max_tokens: int = 1 << 17,
        softmax_scale: float = 0.0,
        check_values: bool = True,
        cpu_threads: int = 1,
        stream: Any = None,
        swap_bytes: int = 0,
        attention: Optional[Sequence[Any]] = None,
    ) -> None:
        self._c = _kvq._Cache(
            layers, q_heads, kv_heads, head_dim, config, budget_bytes, str(device), page_tokens, window, recent,
            max_sequences, max_tokens, softmax_scale, check_values, cpu_threads, _stream_handle(stream), swap_bytes,
            _variant_tuples(attention))
        self._cuda = self._c.device != "cpu"
        self._device_index = int(self._c.device.split(":")[1]) if self._cuda else -1
        # For kvq.ops: a handle, and the one-element tensor that orders this cache's ops in a
        # compiled graph (made here when torch is loaded, so that compiled code only reads it).
        self._op_handle = next(_handles)
        _live[self._op_handle] = self
        torch = sys.modules.get("torch")
        self._op_state = torch.zeros(1, dtype=torch.int32, device=self.device) if torch is not None else None

    # ---- shape and configuration ----
    layers = property(lambda self: self._c.layers)
    q_heads = property(lambda self: self._c.q_heads)
    kv_heads = property(lambda self: self._c.kv_heads)
    head_dim = property(lambda self: self._c.head_dim)
    page_tokens = property(lambda self: self._c.page_tokens)
    window = property(lambda self: self._c.window)
    recent = property(lambda self: self._c.recent)
    config = property(lambda self: self._c.config, doc="The configuration string the cache was made from.")
    device = property(lambda self: self._c.device, doc="'cpu' or 'cuda:<index>'.")
    policy = property(lambda self: self._c.policy, doc="The policy's name.")
    budget_bytes = property(lambda self: self._c.budget_bytes)
    softmax_scale = property(lambda self: self._c.softmax_scale)
    sink_pages = property(lambda self: self._c.sink_pages)
    rotated = property(lambda self: self._c.rotated)
    attention = property(
        lambda self: [AttentionVariant(w, c, s or None) for w, c, s in self._c.attention],
        doc="Each layer's AttentionVariant ([] when every layer is global and plain).")
    max_sequences = property(lambda self: self._c.max_sequences)
    max_tokens = property(lambda self: self._c.max_tokens)

    def __repr__(self) -> str:
        return (f"kvq.Cache(layers={self.layers}, q_heads={self.q_heads}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, config={self.config!r}, device={self.device!r})")

    def _stream(self, stream: Any, t: Any = None) -> Optional[int]:
        """The stream of a call: the one given, else torch's current stream (of the tensor's
        device, or the cache's) when torch is loaded, else None (the cache's own)."""
        if stream is not None:
            return _stream_handle(stream)
        if self._cuda:
            torch = sys.modules.get("torch")
            if torch is not None:
                device = t.get_device() if isinstance(t, torch.Tensor) else self._device_index
                if device >= 0:  # (a CPU tensor: the binding names the mismatch)
                    return torch._C._cuda_getCurrentRawStream(device)
        return None

    # ---- sequences ----
    def create_sequence(self, seq: int, stream: Any = None) -> None:
        """Starts an empty sequence."""
        self._c.create_sequence(seq, self._stream(stream))

    def release_sequence(self, seq: int) -> None:
        """Returns every page and window of the sequence to the budget."""
        self._c.release_sequence(seq)

    def has_sequence(self, seq: int) -> bool:
        return self._c.has_sequence(seq)

    def length(self, seq: int, layer: int = 0) -> int:
        """Tokens stored for (sequence, layer)."""
        return self._c.length(seq, layer)

    def tokens_before_encode(self, seq: int, layer: int = 0) -> int:
        """Tokens an append can add to (sequence, layer) before one encodes a page."""
        return self._c.tokens_before_encode(seq, layer)

    def fork(self, src: int, dst: int, stream: Any = None) -> None:
        """Starts `dst` as a copy of `src`: encoded pages shared, FP16 windows copied."""
        self._c.fork(src, dst, self._stream(stream))

    def truncate(self, seq: int, length: int, stream: Any = None) -> None:
        """Keeps the first `length` tokens of every layer of the sequence (on the device on CUDA)."""
        self._c.truncate(seq, length, self._stream(stream))

    def bytes_for(self, tokens: int, seq: Optional[int] = None) -> int:
        """Budget bytes `tokens` more tokens of `seq` (or a new sequence of `tokens`) would take."""
        return self._c.bytes_for(tokens, seq)

    # ---- data ----
    def append(self, seq: int, layer: int, k: Any, v: Any, stream: Any = None) -> None:
        """Appends K and V ([tokens, kv_heads, head_dim]) of new tokens of one sequence and layer."""
        self._c.append(seq, layer, _dl(k), _dl(v), self._stream(stream, k))

    def append_batch(self, seqs: Sequence[int], tokens: Sequence[int], layer: int, k: Any, v: Any,
                     stream: Any = None) -> None:
        """Appends the new tokens of several sequences of one layer; k, v: [sum tokens, kv_heads, head_dim]."""
        self._c.append_batch(seqs, tokens, layer, _dl(k), _dl(v), self._stream(stream, k))

    def attend(self, seqs: Sequence[int], layer: int, q: Any, out: Any = None,
               q_lens: Optional[Sequence[int]] = None, stream: Any = None):
        """Attention of one layer for a batch; q: [sum q_len, q_heads, head_dim] (q_len 1 each by
        default). Returns `out` (allocated like q when not given)."""
        if out is None:
            out = _empty_like(q)
        self._c.attend(seqs, q_lens, layer, _dl(q), _dl(out), self._stream(stream, q))
        return out

    def prefill(self, seq: int, layer: int, k: Any, v: Any, q: Any, out: Any = None, stream: Any = None):
        """Appends a chunk of any length and attends its queries causally; returns `out`."""
        if out is None:
            out = _empty_like(q)
        self._c.prefill(seq, layer, _dl(k), _dl(v), _dl(q), _dl(out), self._stream(stream, q))
        return out

    def attend_prefix(self, seq: int, layer: int, prefix: int, q: Any, out: Any = None, lse: Any = None,
                      stream: Any = None):
        """Unmasked attention of q over the first `prefix` stored tokens; returns (out, lse), lse
        float32 [tokens, q_heads] (natural-log log-sum-exp of the scaled scores)."""
        if out is None:
            out = _empty_like(q)
        if lse is None:
            lse = _empty_like(q, self.q_heads)
        self._c.attend_prefix(seq, layer, prefix, _dl(q), _dl(out), _dl(lse), self._stream(stream, q))
        return out, lse

    def read(self, seq: int, layer: int, role: str, stream: Any = None):
        """What the next step reads for (sequence, layer, role 'k' or 'v'), as a float32 numpy
        array [length, kv_heads, head_dim]. CUDA: synchronizes the stream."""
        return self._c.read(seq, layer, role, self._stream(stream))

    def check(self, stream: Any = None) -> None:
        """Raises NonFinite for rows the device-side value checks refused (the sequence restored)."""
        self._c.check(self._stream(stream))

    # ---- policy parameters ----
    def set_clip_percentiles(self, percentiles: Any) -> None:
        """rolealign clip percentiles, float32 [layers, kv_heads, 2] (K then V): each group's range
        becomes its (100-p)-th..p-th percentile; p in [50, 100], 100 clips nothing (the default),
        and p must need at most 16 order statistics per end of a 128-value group (p >= ~88.2)."""
        self._c.set_clip_percentiles(percentiles)

    def set_codebook_levels(self, format: str, levels: Any) -> None:
        """Levels of codebook format `format`, float32 [layers, kv_heads, 2, 2^bits], ascending."""
        self._c.set_codebook_levels(format, levels)

    def codebook_levels(self, format: str):
        """The levels of a codebook format now, numpy float32 [layers, kv_heads, 2, 2^bits]."""
        return self._c.codebook_levels(format)

    def sync_policy(self) -> None:
        """Waits for the policy's canaries in flight and feeds them to the policy (EchoKV)."""
        self._c.sync_policy()

    def freeze_policy(self, frozen: bool = True) -> None:
        """EchoKV: stops (or, with False, resumes) every move and measurement, after landing the
        measurements in flight; raises Unsupported for other policies."""
        self._c.freeze_policy(frozen)

    def flush_policy(self) -> None:
        """Launches the staged canaries without waiting (CUDA)."""
        self._c.flush_policy()

    def stats(self) -> dict:
        """Budget, bytes, pages and formats now (`kvq::cache_stats`) as a dict."""
        return self._c.stats()

    # ---- moving sequences ----
    def export_sequences(self, seqs: Sequence[int], stream: Any = None) -> bytes:
        """The sequences' pages and FP16 windows bit for bit, with their formats, rotation and
        shape, as a checksummed blob (pages a fork shares stored once). CUDA: synchronizes the stream."""
        return self._c.export_sequences(list(seqs), self._stream(stream))

    def export_bytes(self, seqs: Sequence[int]) -> int:
        """Bytes the blob of `seqs` takes."""
        return self._c.export_bytes(list(seqs))

    def export_into(self, seqs: Sequence[int], out: Any, stream: Any = None) -> int:
        """`export_sequences` into a writable buffer of at least `export_bytes(seqs)` bytes (a
        bytearray, a uint8 numpy array; a pinned torch tensor's `.numpy()` copies fastest from a
        GPU); returns the blob's size."""
        return self._c.export_into(list(seqs), out, self._stream(stream))

    def import_sequences(self, blob: Any, seqs: Sequence[int], stream: Any = None) -> None:
        """Creates `seqs` (one per sequence of the blob, in order) from a blob of a cache of the
        same shape, rotation and sink pages. A bad blob or a full budget raises and changes nothing.
        CUDA: returns once the copies have read the blob (the stream is synchronized)."""
        self._c.import_sequences(blob, list(seqs), self._stream(stream))

    def export_file(self, path: Any, seqs: Sequence[int], stream: Any = None) -> None:
        """`export_sequences` into a file (written whole, then renamed into place)."""
        self._c.export_file(str(path), list(seqs), self._stream(stream))

    def import_file(self, path: Any, seqs: Sequence[int], stream: Any = None) -> None:
        """`import_sequences` from a file."""
        self._c.import_file(str(path), list(seqs), self._stream(stream))

    def swap_out(self, seq: int, stream: Any = None) -> None:
        """Moves the sequence's bytes to the swap space (`swap_bytes`; pinned host memory on CUDA),
        asynchronously on the stream, and frees its budget; it refuses attention until `swap_in`."""
        self._c.swap_out(seq, self._stream(stream))

    def swap_in(self, seq: int, stream: Any = None) -> None:
        """Brings a swapped-out sequence back, bit for bit, asynchronously on the stream."""
        self._c.swap_in(seq, self._stream(stream))

    def is_swapped(self, seq: int) -> bool:
        return self._c.is_swapped(seq)

    def swap_in_bytes(self, seq: int) -> int:
        """Budget bytes `swap_in(seq)` would allocate now."""
        return self._c.swap_in_bytes(seq)

    def total_bits(self) -> float:
        """Bits per stored K/V element of everything held (pages and windows)."""
        return self._c.stats()["total_bits"]


class DecodeStep:
    """A decode step replayable from one CUDA graph (`kvq::decode_step`): `prepare(seqs)` outside
    the capture, then `append` / `attend` per layer, captured once on the cache's stream and
    replayed after each `prepare`. Inputs are [max_batch, heads, head_dim]."""

    def __init__(self, cache: Cache, max_batch: int, max_tokens: int) -> None:
        self._s = _kvq._DecodeStep(cache._c, max_batch, max_tokens)
        self.cache = cache

    max_batch = property(lambda self: self._s.max_batch)
    max_tokens = property(lambda self: self._s.max_tokens)
    batch = property(lambda self: self._s.batch)
    descriptor_bytes = property(lambda self: self._s.descriptor_bytes)

    def prepare(self, seqs: Sequence[int]) -> None:
        self._s.prepare(seqs)

    def append(self, layer: int, k: Any, v: Any) -> None:
        self._s.append(layer, _dl(k), _dl(v))

    def attend(self, layer: int, q: Any, out: Any) -> None:
        self._s.attend(layer, _dl(q), _dl(out))
