"""ctypes binding of the serving benchmark's C ABI (bench/serve/kvq_serve.h). Torch-free: tensors
are passed as raw addresses (a torch tensor's data_ptr(), or a ctypes buffer's address on the CPU
backend). Python-side checks reject wrong argument types and ranges before the library is called;
the library validates everything again and its message comes back in `KvqError`."""
import ctypes
import os

ERRC = ["ok", "invalid_argument", "non_finite", "out_of_budget", "not_found", "io_error", "cuda_error",
        "unsupported", "comm_error"]
DTYPES = {"f32": 0, "f16": 1, "bf16": 2}


class KvqError(RuntimeError):
    """A failed kvq call: `code` is the kvq::errc name, the message kvq's."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class Stats(ctypes.Structure):
    """kvq_serve_stats."""
    _fields_ = [(n, ctypes.c_uint64) for n in ("budget_bytes", "used_bytes", "free_bytes", "largest_free_block",
                                                 "page_bytes", "window_bytes", "encoded_elements",
                                                 "overhead_device_bytes")] + \
               [("sequences", ctypes.c_int64), ("tokens", ctypes.c_int64)]


def _int(name, x, lo=None, hi=None):
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, not {type(x).__name__}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"{name} = {x} outside [{lo}, {hi}]")
    return x


def _ptr(name, x):
    _int(name, x, 1)
    return ctypes.c_void_p(x)


def _dtype(x):
    if x not in DTYPES:
        raise ValueError(f"dtype {x!r} is not one of {sorted(DTYPES)}")
    return DTYPES[x]


def load(path):
    """Loads libkvq_serve.so and declares its functions."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no kvq_serve library at {path}")
    lib = ctypes.CDLL(path)
    i32, i64, u64, vp = ctypes.c_int, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
    i64p = ctypes.POINTER(ctypes.c_int64)
    sigs = {
        "kvq_serve_create": (vp, [ctypes.c_char_p, i32, i32, i32, i32, i32, u64, i32, i64, vp, ctypes.c_char_p, i32]),
        "kvq_serve_destroy": (None, [vp]),
        "kvq_serve_error": (ctypes.c_char_p, [vp]),
        "kvq_serve_create_sequence": (i32, [vp, i64]),
        "kvq_serve_release_sequence": (i32, [vp, i64]),
        "kvq_serve_bytes_for": (i32, [vp, i64, i64, ctypes.POINTER(u64)]),
        "kvq_serve_stats_get": (i32, [vp, ctypes.POINTER(Stats)]),
        "kvq_serve_append": (i32, [vp, i64, i32, vp, vp, i64, i64, i64, i32]),
        "kvq_serve_append_batch": (i32, [vp, i32, i64p, i32, vp, vp, i64, i64, i32]),
        "kvq_serve_attend": (i32, [vp, i32, i64p, i32, vp, i64, vp, i32]),
        "kvq_serve_set_canary": (i32, [vp, i32]),
        "kvq_serve_sync_policy": (i32, [vp]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


class Cache:
    """One kvq cache through the C ABI. `stream`: a cudaStream_t address (0: the legacy default)."""

    def __init__(self, lib, policy, *, cuda, layers, q_heads, kv_heads, head_dim, budget_bytes, max_sequences,
                 max_tokens, stream=0):
        self.h = None
        if not isinstance(policy, str) or not policy:
            raise ValueError("policy must be a non-empty string")
        for n, v, lo in (("layers", layers, 1), ("q_heads", q_heads, 1), ("kv_heads", kv_heads, 1),
                         ("head_dim", head_dim, 1), ("budget_bytes", budget_bytes, 0),
                         ("max_sequences", max_sequences, 1), ("max_tokens", max_tokens, 1), ("stream", stream, 0)):
            _int(n, v, lo)
        self.lib = lib
        self.q_heads, self.kv_heads, self.head_dim, self.layers = q_heads, kv_heads, head_dim, layers
        self.max_sequences = max_sequences
        err = ctypes.create_string_buffer(512)
        self.h = lib.kvq_serve_create(policy.encode(), 1 if cuda else 0, layers, q_heads, kv_heads, head_dim,
                                      budget_bytes, max_sequences, max_tokens, ctypes.c_void_p(stream or None),
                                      err, len(err))
        if not self.h:
            msg = err.value.decode()
            raise KvqError(msg.split(":", 1)[0].replace(" ", "_"), f"kvq_serve_create({policy}): {msg}")
        self._seqs = (ctypes.c_int64 * max_sequences)()

    def close(self):
        if self.h:
            self.lib.kvq_serve_destroy(self.h)
            self.h = None

    def __del__(self):
        self.close()

    def _check(self, rc, what):
        if rc != 0:
            code = ERRC[rc] if 0 <= rc < len(ERRC) else str(rc)
            raise KvqError(code, f"{what}: {self.lib.kvq_serve_error(self.h).decode()}")

    def create_sequence(self, seq):
        self._check(self.lib.kvq_serve_create_sequence(self.h, _int("seq", seq, 0)), "create_sequence")

    def release_sequence(self, seq):
        self._check(self.lib.kvq_serve_release_sequence(self.h, _int("seq", seq, 0)), "release_sequence")

    def bytes_for(self, tokens, seq=None):
        """Budget bytes of `tokens` more tokens of `seq`, or of a new sequence of `tokens` tokens."""
        out = ctypes.c_uint64()
        s = -1 if seq is None else _int("seq", seq, 0)
        self._check(self.lib.kvq_serve_bytes_for(self.h, _int("tokens", tokens, 0), s, ctypes.byref(out)),
                    "bytes_for")
        return out.value

    def stats(self):
        st = Stats()
        self._check(self.lib.kvq_serve_stats_get(self.h, ctypes.byref(st)), "stats")
        return {n: getattr(st, n) for n, _ in Stats._fields_}

    def append(self, seq, layer, k, v, tokens, k_stride=0, v_stride=0, dtype="bf16"):
        """`tokens` tokens of K/V at addresses k, v ([tokens][kv_heads][head_dim], the strides in
        elements between tokens, 0: packed)."""
        self._check(self.lib.kvq_serve_append(self.h, _int("seq", seq, 0), _int("layer", layer, 0), _ptr("k", k),
                                              _ptr("v", v), _int("tokens", tokens, 1), _int("k_stride", k_stride, 0),
                                              _int("v_stride", v_stride, 0), _dtype(dtype)), "append")

    def _load_seqs(self, seqs):
        n = len(seqs)
        if not 1 <= n <= self.max_sequences:
            raise ValueError(f"{n} sequences outside [1, max_sequences = {self.max_sequences}]")
        for i, s in enumerate(seqs):
            self._seqs[i] = _int("seq", s, 0)
        return n

    def set_batch(self, seqs):
        """Loads the sequence ids of the next append_batch / attend calls (one step's batch, shared
        by every layer, so that a step converts them once)."""
        self._n = self._load_seqs(seqs)

    def append_batch(self, layer, k, v, k_stride=0, v_stride=0, dtype="bf16"):
        """One token for each sequence of `set_batch`; k, v: [n][kv_heads][head_dim] addresses."""
        self._check(self.lib.kvq_serve_append_batch(self.h, layer, self._seqs, self._n, k, v, k_stride, v_stride,
                                                    DTYPES[dtype]), "append_batch")

    def attend(self, layer, q, o, q_stride=0, dtype="bf16"):
        """One query row for each sequence of `set_batch`; q, o: [n][q_heads][head_dim] addresses."""
        self._check(self.lib.kvq_serve_attend(self.h, layer, self._seqs, self._n, q, q_stride, o, DTYPES[dtype]),
                    "attend")

    def set_canary(self, on):
        self._check(self.lib.kvq_serve_set_canary(self.h, 1 if on else 0), "set_canary")

    def sync_policy(self):
        self._check(self.lib.kvq_serve_sync_policy(self.h), "sync_policy")
