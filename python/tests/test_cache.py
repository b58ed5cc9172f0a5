"""The Python package on the CPU backend: the binding passes tensors, streams of calls and errors
through unchanged (checked against a NumPy attention over what the cache says it stores), and a
failing call raises kvq's exception and changes nothing."""
from pathlib import Path

import numpy as np
import pytest

import kvq

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


def make(config="fp16", layers=2, q_heads=4, kv_heads=2, head_dim=64, budget=16 * MB, **kw):
    return kvq.Cache(layers, q_heads, kv_heads, head_dim, config, budget_bytes=budget, **kw)


def rows(rng, n, heads, d=64, dtype=np.float32):
    return rng.standard_normal((n, heads, d)).astype(dtype)


def variant_reference(q, k, v, scale, window=0, softcap=0.0, sinks=None):
    """`reference` with a layer's attention rule: query i (position n - t + i) sees tokens from
    position - window + 1 on, scores soft-capped, a sink logit per query head in the softmax."""
    t, qh, _ = q.shape
    n, kvh, _ = k.shape
    g = qh // kvh
    out = np.zeros(q.shape, np.float64)
    for i in range(t):
        end = n - t + i + 1
        lo = max(0, end - window) if window else 0
        for h in range(qh):
            s = (k[lo:end, h // g].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            m = max(s.max(), sinks[h]) if sinks is not None else s.max()
            p = np.exp(s - m)
            total = p.sum() + (np.exp(sinks[h] - m) if sinks is not None else 0.0)
            out[i, h] = (p / total) @ v[lo:end, h // g].astype(np.float64)
    return out


def reference(q, k, v, scale):
    """Attention of each query row over every stored token: q [t, qh, d], k/v [n, kvh, d] float32;
    query i of a chunk of t sees tokens [0, n - t + i] (causal within the chunk)."""
    return variant_reference(q, k, v, scale)


@pytest.mark.parametrize("config", ["fp16", "kivi4/g32", "k=kivi4/g32,v=kivi2/g32", "kivi4/g32+rot+sink", "fp8"])
def test_attend_reads_what_the_cache_stores(config):
    rng = np.random.default_rng(1)
    c = make(config)
    assert c.config == config and c.layers == 2 and c.q_heads == 4
    for s in (0, 1):
        c.create_sequence(s)
        for layer in range(2):
            c.append(s, layer, rows(rng, 300 + 40 * s, 2), rows(rng, 300 + 40 * s, 2))
    q = rows(rng, 2, 4)
    out = c.attend([0, 1], 1, q)
    assert out.shape == q.shape and out.dtype == np.float32
    scale = 1 / np.sqrt(64)
    for i, s in enumerate((0, 1)):
        k, v = c.read(s, 1, "k"), c.read(s, 1, "v")
        assert k.shape == (300 + 40 * s, 2, 64)
        np.testing.assert_allclose(out[i:i + 1], reference(q[i:i + 1], k, v, scale), atol=2e-5, rtol=1e-4)
    st = c.stats()
    assert st["sequences"] == 2 and st["tokens"] == 2 * 300 + 2 * 340
    if config == "kivi4/g32":
        assert set(st["bytes_by_format"]) == {"kivi4/g32"} and 4 < c.total_bits() < 16


def test_fp16_cache_matches_numpy_attention_on_the_inputs():
    rng = np.random.default_rng(2)
    c = make("fp16")
    c.create_sequence(3)
    k, v = rows(rng, 500, 2), rows(rng, 500, 2)
    c.append(3, 0, k, v)
    q = rows(rng, 1, 4)
    ref = reference(q, k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32), 1 / 8)
    np.testing.assert_allclose(c.attend([3], 0, q), ref, atol=2e-5, rtol=1e-4)


def test_inputs_of_other_dtypes_and_strides_give_the_same_bytes():
    rng = np.random.default_rng(3)
    a, b = make("kivi4/g32"), make("kivi4/g32")
    for c in (a, b):
        c.create_sequence(0)
    # a fused [tokens, 3 * kv_heads, d] buffer: K and V are strided views of it, as an engine's QKV
    fused = rng.standard_normal((200, 6, 64)).astype(np.float16)
    k, v = fused[:, 0:2], fused[:, 2:4]
    assert not k.flags["C_CONTIGUOUS"]
    a.append(0, 0, k, v)
    b.append(0, 0, np.ascontiguousarray(k).astype(np.float32), np.ascontiguousarray(v).astype(np.float32))
    np.testing.assert_array_equal(a.read(0, 0, "k"), b.read(0, 0, "k"))
    np.testing.assert_array_equal(a.read(0, 0, "v"), b.read(0, 0, "v"))
    q = rows(rng, 1, 4, dtype=np.float16)
    out = np.empty_like(q)
    assert a.attend([0], 0, q, out=out) is out
    np.testing.assert_allclose(out.astype(np.float32), b.attend([0], 0, q.astype(np.float32)), atol=2e-3)
    # read-only inputs are accepted
    k2, v2 = rows(rng, 3, 2), rows(rng, 3, 2)
    k2.flags.writeable = False
    a.append(0, 0, k2, v2)
    assert a.length(0, 0) == 203


def test_append_batch_equals_appends_one_by_one():
    rng = np.random.default_rng(4)
    a, b = make("kivi2/g32"), make("kivi2/g32")
    n = [130, 7, 64]
    k, v = rows(rng, sum(n), 2), rows(rng, sum(n), 2)
    for c in (a, b):
        for s in range(3):
            c.create_sequence(10 + s)
    a.append_batch([10, 11, 12], n, 0, k, v)
    at = 0
    for s, t in enumerate(n):
        b.append(10 + s, 0, k[at:at + t], v[at:at + t])
        at += t
    for s in range(3):
        np.testing.assert_array_equal(a.read(10 + s, 0, "k"), b.read(10 + s, 0, "k"))
    q = rows(rng, 4, 4)
    np.testing.assert_array_equal(a.attend([10, 11, 12], 0, q[:3]), b.attend([10, 11, 12], 0, q[:3]))
    # an extend step: q_lens per sequence
    out = a.attend([10, 12], 0, q, q_lens=[3, 1])
    np.testing.assert_allclose(out[:3], reference(q[:3], a.read(10, 0, "k"), a.read(10, 0, "v"), 1 / 8), atol=2e-5)


def test_prefill_long_chunk_and_attend_prefix():
    rng = np.random.default_rng(5)
    c = make("kivi4/g32", window=128)
    c.create_sequence(0)
    k, v, q = rows(rng, 700, 2), rows(rng, 700, 2), rows(rng, 700, 4)
    out = c.prefill(0, 0, k, v, q)
    assert c.length(0, 0) == 700 and out.shape == (700, 4, 64)
    # the chunk's queries see the chunk in fp16 (causally)
    kf, vf = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(out[-3:], reference(q, kf, vf, 1 / 8)[-3:], atol=3e-5, rtol=1e-4)
    # attend_prefix: unmasked over the first 400 stored tokens, with the log-sum-exp
    q2 = rows(rng, 5, 4)
    o2, lse = c.attend_prefix(0, 0, 400, q2)
    assert lse.shape == (5, 4) and lse.dtype == np.float32
    ks, vs = c.read(0, 0, "k")[:400], c.read(0, 0, "v")[:400]
    # unmasked: each query alone sees every one of the 400 tokens
    np.testing.assert_allclose(o2, np.stack([reference(q2[i:i + 1], ks, vs, 1 / 8)[0] for i in range(5)]), atol=3e-5)
    s = np.einsum("thd,nhd->thn", q2.astype(np.float64), np.repeat(ks, 2, axis=1).astype(np.float64)) / 8
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-5)


def test_attention_variants_sliding_window_softcap_and_sinks():
    rng = np.random.default_rng(11)
    sinks = [0.5, -1.0, 2.0, 0.0]
    variants = [kvq.AttentionVariant(window=150), {"softcap": 3.0, "sink_logits": sinks}]
    c = make("kivi4/g32", attention=variants)
    assert c.attention == [kvq.AttentionVariant(150), kvq.AttentionVariant(0, 3.0, sinks)]
    c.create_sequence(0)
    for layer in range(2):
        c.prefill(0, layer, rows(rng, 900, 2), rows(rng, 900, 2), rows(rng, 900, 4))
    used = c.stats()["used_bytes"]
    for step in range(3):
        for layer, (window, softcap, snk) in enumerate([(150, 0.0, None), (0, 3.0, sinks)]):
            c.append(0, layer, rows(rng, 1, 2), rows(rng, 1, 2))
            q = rows(rng, 1, 4) * 2
            k, v = c.read(0, layer, "k"), c.read(0, layer, "v")
            want = variant_reference(q, k, v, 1 / 8, window, softcap, snk)
            np.testing.assert_allclose(c.attend([0], layer, q), want, atol=3e-5, rtol=1e-4)
    assert c.stats()["used_bytes"] <= used  # the sliding layer returned pages as it grew
    # the sliding layer's first tokens went back to the budget: read as 0, and a cut below them is refused
    assert not c.read(0, 0, "k")[:600].any()
    with pytest.raises(kvq.InvalidArgument, match="sliding layer"):
        c.truncate(0, 500)
    assert c.length(0, 0) == 903


@pytest.mark.parametrize("attention, words", [
    ([kvq.AttentionVariant(window=-1), None], "sliding window -1"),
    ([None], "1 variants for 2 layers"),
    ([{"softcap": -1.0}, None], "softcap -1"),
    ([{"sink_logits": [1.0]}, None], "1 sink logits for 4 query heads"),
    ([{"windw": 3}, None], "unknown field"),
    ([3, None], "expected an AttentionVariant"),
])
def test_bad_attention_variants_raise(attention, words):
    with pytest.raises(kvq.InvalidArgument, match=words):
        make("fp16", attention=attention)


def test_fork_and_truncate():
    rng = np.random.default_rng(6)
    c = make("kivi4/g32")
    c.create_sequence(0)
    for layer in range(2):
        c.append(0, layer, rows(rng, 400, 2), rows(rng, 400, 2))
    before = c.read(0, 1, "v")
    st = c.stats()
    c.fork(0, 1)
    after = c.stats()
    assert c.length(1, 1) == 400 and after["shared_pages"] == st["pages"] > 0
    # pages shared (stored once), windows copied
    assert after["page_bytes"] == st["page_bytes"] and after["window_bytes"] == 2 * st["window_bytes"]
    c.append(1, 1, rows(rng, 50, 2), rows(rng, 50, 2))
    np.testing.assert_array_equal(c.read(0, 1, "v"), before)  # the source never changes
    c.truncate(1, 300)
    assert c.length(1, 0) == 300 and c.length(1, 1) == 300
    np.testing.assert_allclose(c.read(1, 1, "v"), before[:300], atol=2e-3)
    c.release_sequence(1)
    assert not c.has_sequence(1)


def test_bytes_for_predicts_the_budget_an_append_takes():
    rng = np.random.default_rng(7)
    c = make("kivi4/g32", layers=1)
    c.create_sequence(0)
    c.append(0, 0, rows(rng, 100, 2), rows(rng, 100, 2))
    need = c.bytes_for(300, 0)
    used = c.stats()["used_bytes"]
    c.append(0, 0, rows(rng, 300, 2), rows(rng, 300, 2))
    assert c.stats()["used_bytes"] - used == need
    assert c.bytes_for(1000) > 0


# ---- failures raise kvq's exception class and change nothing ------------------------------------

def snapshot(c, seqs, layers):
    return {(s, l, r): c.read(s, l, r) for s in seqs for l in range(layers) for r in "kv"}, c.stats()


def assert_unchanged(c, before, seqs, layers):
    data, stats = snapshot(c, seqs, layers)
    assert stats == before[1]
    for key, value in before[0].items():
        np.testing.assert_array_equal(data[key], value)


@pytest.fixture
def filled():
    rng = np.random.default_rng(8)
    c = make("kivi4/g32")
    c.create_sequence(0)
    for layer in range(2):
        c.append(0, layer, rows(rng, 150, 2), rows(rng, 150, 2))
    return c, snapshot(c, [0], 2), rng


@pytest.mark.parametrize("case, error, words", [
    ("dtype", kvq.InvalidArgument, "dtype must be float32, float16 or bfloat16"),
    ("ndim", kvq.InvalidArgument, "expected shape (tokens, 2, 64)"),
    ("heads", kvq.InvalidArgument, "expected shape (tokens, 2, 64), got (4, 3, 64)"),
    ("transposed", kvq.InvalidArgument, "heads and channels must be contiguous"),
    ("tokens", kvq.InvalidArgument, "tokens"),
    ("nan", kvq.NonFinite, "is not finite"),
    ("inf", kvq.NonFinite, "is not finite"),
    ("big", kvq.InvalidArgument, "outside the fp16 range"),
    ("sequence", kvq.NotFound, "unknown sequence 9"),
    ("layer", kvq.InvalidArgument, "layer"),
])
def test_bad_append_raises_and_changes_nothing(filled, case, error, words):
    c, before, rng = filled
    k, v, seq, layer = rows(rng, 4, 2), rows(rng, 4, 2), 0, 1
    if case == "dtype":
        k = k.astype(np.float64)
    elif case == "ndim":
        k = k.reshape(4, 128)
    elif case == "heads":
        k = rows(rng, 4, 3)
    elif case == "transposed":
        k = np.ascontiguousarray(rows(rng, 4, 64, 2)).transpose(0, 2, 1)
    elif case == "tokens":
        v = rows(rng, 5, 2)
    elif case == "nan":
        k[2, 1, 7] = np.nan
    elif case == "inf":
        v[0, 0, 0] = -np.inf
    elif case == "big":
        v[1, 0, 3] = 1e6
    elif case == "sequence":
        seq = 9
    elif case == "layer":
        layer = 2
    with pytest.raises(error) as info:
        c.append(seq, layer, k, v)
    assert words in str(info.value)
    assert isinstance(info.value, kvq.Error)
    assert_unchanged(c, before, [0], 2)


def test_bad_attend_and_sequence_calls(filled):
    c, before, rng = filled
    q = rows(rng, 1, 4)
    with pytest.raises(kvq.NotFound, match="unknown sequence 5"):
        c.attend([5], 0, q)
    with pytest.raises(kvq.InvalidArgument, match="out: expected shape"):
        c.attend([0], 0, q, out=np.empty((1, 4, 32), np.float32))
    with pytest.raises(kvq.InvalidArgument, match="q_lens has 2 entries"):
        c.attend([0], 0, q, q_lens=[1, 1])
    with pytest.raises(kvq.InvalidArgument):
        c.attend([0], 0, rows(rng, 2, 4))  # two query rows for one sequence of q_len 1
    with pytest.raises(TypeError):  # not a tensor at all: Python's own error
        c.attend([0], 0, [[1.0]])
    with pytest.raises(kvq.InvalidArgument):
        c.truncate(0, 151)
    with pytest.raises(kvq.InvalidArgument):
        c.fork(0, 0)
    with pytest.raises(kvq.NotFound):
        c.fork(4, 5)
    with pytest.raises(kvq.NotFound):
        c.length(4)
    with pytest.raises(kvq.InvalidArgument, match="role must be"):
        c.read(0, 0, "q")
    assert_unchanged(c, before, [0], 2)


def test_full_budget_raises_out_of_budget_and_changes_nothing():
    rng = np.random.default_rng(9)
    c = make("fp16", layers=1, budget=1 * MB)
    c.create_sequence(0)
    c.append(0, 0, rows(rng, 1000, 2), rows(rng, 1000, 2))
    before = snapshot(c, [0], 1)
    with pytest.raises(kvq.OutOfBudget, match="budget"):
        c.append(0, 0, rows(rng, 4000, 2), rows(rng, 4000, 2))
    assert_unchanged(c, before, [0], 1)


def test_bad_configurations_name_the_problem():
    with pytest.raises(kvq.InvalidArgument, match="kivi5/g32"):
        make("kivi5/g32")
    with pytest.raises(kvq.InvalidArgument, match="unknown policy 'autokk'"):
        make("autokk:phi=0.5")
    with pytest.raises(kvq.InvalidArgument, match="device must be"):
        make(device="tpu")
    with pytest.raises(kvq.InvalidArgument, match="rot"):
        make("fp16+rot", head_dim=48)
    with pytest.raises(kvq.IOError):
        make("kl_budget:bits=3,artifact=/nonexistent.json", layers=1, q_heads=2, kv_heads=1, head_dim=32)
    with pytest.raises(kvq.InvalidArgument, match="layers"):
        make(layers=0)
    if not kvq.cuda:
        with pytest.raises(kvq.Unsupported, match="without CUDA"):
            make(device="cuda")


def test_every_policy_kind_from_its_string():
    rng = np.random.default_rng(10)
    artifact = ROOT / "tools/calib/fuzz/corpus/seed.json"
    names = [p[0] for p in kvq.policies()]
    assert names[0] == "static" and {"kl_budget", "autok", "echokv", "random"} <= set(names)
    for config in ["static:k=kivi4/g32,v=kivi2/g32", "echokv:seed=1,rate=0.5",
                   f"kl_budget:bits=3,artifact={artifact}", f"autok:phi=0.5,high=kivi4/g32,low=kivi2/g32,artifact={artifact}",
                   f"random:seed=3,like=kl_budget:bits=3,artifact={artifact}", "cb4/g32", "ra4/g32+sink2", "nvfp4"]:
        c = make(config, layers=1, q_heads=2, kv_heads=1, head_dim=32)
        c.create_sequence(0)
        c.append(0, 0, rows(rng, 300, 1, 32), rows(rng, 300, 1, 32))
        for _ in range(4):
            out = c.attend([0], 0, rows(rng, 1, 2, 32))
        c.sync_policy()
        assert np.isfinite(out).all() and c.stats()["pages"] > 0, config


def test_codebook_levels_and_clip_percentiles():
    c = make("cb3/g32", layers=1)
    levels = c.codebook_levels("cb3/g32")
    assert levels.shape == (1, 2, 2, 8) and (np.diff(levels, axis=-1) > 0).all()
    c.set_codebook_levels("cb3/g32", levels * 0.9)
    np.testing.assert_allclose(c.codebook_levels("cb3/g32"), levels * 0.9, rtol=1e-6)
    with pytest.raises(kvq.InvalidArgument, match="ascending"):
        c.set_codebook_levels("cb3/g32", levels[..., ::-1].copy())
    with pytest.raises(kvq.InvalidArgument):
        c.set_codebook_levels("kivi4/g32", levels)
    np.testing.assert_allclose(c.codebook_levels("cb3/g32"), levels * 0.9, rtol=1e-6)
    c.set_clip_percentiles(np.full((1, 2, 2), 99.0, np.float32))
    bad = np.full((1, 2, 2), 100.0, np.float32)
    bad[0, 1, 1] = 0.9  # a former clip ratio is not a percentile
    with pytest.raises(kvq.InvalidArgument, match=r"layer 0, head 1, V: clip percentile 0.9 is not in \[50, 100\]"):
        c.set_clip_percentiles(bad)
    with pytest.raises(kvq.InvalidArgument, match="keeps at most 16"):
        c.set_clip_percentiles(np.full((1, 2, 2), 60.0, np.float32))


def test_module_level_helpers():
    assert kvq.format_name("int4") == "sym4/g32"
    assert kvq.bits_per_element("kivi4/g32", "k", 64, 128) == pytest.approx(5.0)
    with pytest.raises(kvq.InvalidArgument):
        kvq.format_name("nope")
    assert kvq.__version__.count(".") == 2


def test_decode_step_is_cuda_only():
    c = make()
    with pytest.raises(kvq.Unsupported):
        kvq.DecodeStep(c, 4, 1024)


def test_export_import_and_files_bit_for_bit(tmp_path):
    rng = np.random.default_rng(11)
    a = make("k=kivi4/g32,v=kivi2/g32+rot+sink")
    a.create_sequence(1)
    for layer in range(2):
        a.append(1, layer, rows(rng, 300, 2), rows(rng, 300, 2))
    a.fork(1, 2)
    for layer in range(2):
        a.append(2, layer, rows(rng, 90, 2), rows(rng, 90, 2))
    blob = a.export_sequences([1, 2])
    assert len(blob) == a.export_bytes([1, 2])
    info = kvq.inspect_blob(blob)
    assert info["rotated"] and info["sink_pages"] == 1
    assert [s["tokens"] for s in info["sequences"]] == [[300, 300], [390, 390]]
    b = make("k=kivi4/g32,v=kivi2/g32+rot+sink")
    b.import_sequences(bytearray(blob), [10, 20])  # any bytes-like object
    assert b.stats()["shared_pages"] == a.stats()["shared_pages"] > 0
    q = rows(rng, 1, 4)
    for src, dst in ((1, 10), (2, 20)):
        for r in "kv":
            np.testing.assert_array_equal(b.read(dst, 1, r), a.read(src, 1, r))
        np.testing.assert_array_equal(b.attend([dst], 0, q), a.attend([src], 0, q))
    out = np.zeros(len(blob) + 5, np.uint8)
    assert a.export_into([1, 2], out) == len(blob) and bytes(out[:len(blob)]) == blob
    a.export_file(tmp_path / "seq.kvqseq", [1])
    c = make("k=kivi4/g32,v=kivi2/g32+rot+sink")
    c.import_file(tmp_path / "seq.kvqseq", [5])
    np.testing.assert_array_equal(c.attend([5], 1, q), a.attend([1], 1, q))


def test_bad_blobs_raise_and_change_nothing(tmp_path):
    rng = np.random.default_rng(12)
    a = make("kivi4/g32")
    a.create_sequence(1)
    a.append(1, 0, rows(rng, 200, 2), rows(rng, 200, 2))
    blob = a.export_sequences([1])
    b = make("kivi4/g32")
    b.create_sequence(3)
    b.append(3, 0, rows(rng, 100, 2), rows(rng, 100, 2))
    before = snapshot(b, [3], 2)
    corrupt = bytearray(blob)
    corrupt[len(blob) // 2] ^= 0xFF
    for bad, words in ((blob[:-1], "truncated"), (bytes(corrupt), "checksum"), (b"x" * 100, "magic"),
                       (blob[:20], "shorter than")):
        with pytest.raises(kvq.InvalidArgument, match=words):
            b.import_sequences(bad, [9])
        with pytest.raises(kvq.InvalidArgument, match=words):
            kvq.inspect_blob(bad)
    with pytest.raises(kvq.InvalidArgument, match="already exists"):
        b.import_sequences(blob, [3])
    with pytest.raises(kvq.InvalidArgument, match="head_dim is 64, this cache's 32"):
        make("kivi4/g32", head_dim=32).import_sequences(blob, [9])
    with pytest.raises(kvq.OutOfBudget, match="nothing was stored"):
        make("kivi4/g32", budget=140 * 1024).import_sequences(blob, [9])
    with pytest.raises(kvq.InvalidArgument, match="bytes-like"):
        b.import_sequences(12, [9])
    with pytest.raises(kvq.InvalidArgument, match="writable"):
        a.export_into([1], blob)
    with pytest.raises(kvq.InvalidArgument, match="holds"):
        a.export_into([1], bytearray(10))
    with pytest.raises(kvq.IOError, match="nonexistent"):
        b.import_file(tmp_path / "nonexistent.kvqseq", [9])
    assert_unchanged(b, before, [3], 2)


def test_swap_out_and_in():
    rng = np.random.default_rng(13)
    c = make("kivi4/g32", swap_bytes=4 * MB)
    c.create_sequence(1)
    for layer in range(2):
        c.append(1, layer, rows(rng, 400, 2), rows(rng, 400, 2))
    q = rows(rng, 1, 4)
    before = c.attend([1], 1, q)
    free = c.stats()["free_bytes"]
    c.swap_out(1)
    assert c.is_swapped(1) and c.has_sequence(1) and c.length(1) == 400
    assert c.stats()["free_bytes"] > free and c.stats()["swapped_sequences"] == 1
    assert c.swap_in_bytes(1) > 0
    with pytest.raises(kvq.InvalidArgument, match="swapped out"):
        c.attend([1], 1, q)
    with pytest.raises(kvq.InvalidArgument, match="swapped out"):
        c.append(1, 0, rows(rng, 1, 2), rows(rng, 1, 2))
    c.swap_in(1)
    np.testing.assert_array_equal(c.attend([1], 1, q), before)
    st = c.stats()
    assert st["swapped_out_bytes"] == st["swapped_in_bytes"] > 0 and st["swap_used_bytes"] == 0
    with pytest.raises(kvq.Unsupported, match="swap_bytes"):
        _no_swap_space(rng)


def _no_swap_space(rng):
    c = make("kivi4/g32")
    c.create_sequence(0)
    c.append(0, 0, rows(rng, 10, 2), rows(rng, 10, 2))
    c.swap_out(0)
