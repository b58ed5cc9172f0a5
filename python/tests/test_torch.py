"""Torch tensors on the CPU backend and the custom ops (kvq.ops): bf16/f16 inputs, outputs
allocated like the queries, the ops under torch.compile(fullgraph=True) against eager calls."""
import numpy as np
import pytest

import kvq

torch = pytest.importorskip("torch")
import kvq.ops  # noqa: E402  (registers the ops; needs torch)

MB = 1 << 20


def cache(config="kivi4/g32", **kw):
    return kvq.Cache(2, 4, 2, 64, config, budget_bytes=32 * MB, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_tensors_of_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = cache(), cache()
    k, v = torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
    for c in (a, b):
        c.create_sequence(0)
    a.append(0, 0, k.to(dtype), v.to(dtype))
    b.append(0, 0, k.to(dtype).float().numpy(), v.to(dtype).float().numpy())  # the same values as float32
    np.testing.assert_array_equal(a.read(0, 0, "k"), b.read(0, 0, "k"))
    q = torch.randn(1, 4, 64, generator=g).to(dtype)
    out = a.attend([0], 0, q)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    ref = b.attend([0], 0, q.float().numpy())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(out.float().numpy(), ref, atol=tol)


def test_torch_errors_are_kvq_errors():
    c = cache()
    c.create_sequence(0)
    with pytest.raises(kvq.InvalidArgument, match="dtype"):
        c.append(0, 0, torch.zeros(2, 2, 64, dtype=torch.float64), torch.zeros(2, 2, 64, dtype=torch.float64))
    with pytest.raises(kvq.InvalidArgument, match="contiguous"):
        c.append(0, 0, torch.zeros(2, 64, 2).transpose(1, 2), torch.zeros(2, 2, 64))
    with pytest.raises(kvq.InvalidArgument, match="int64|dtype"):
        c.append(0, 0, torch.zeros(2, 2, 64, dtype=torch.int64), torch.zeros(2, 2, 64))
    bad = torch.zeros(2, 2, 64)
    bad[1, 1, 1] = float("nan")
    with pytest.raises(kvq.NonFinite):
        c.append(0, 0, bad, torch.zeros(2, 2, 64))
    assert c.length(0, 0) == 0 and c.stats()["tokens"] == 0


def test_ops_compiled_fullgraph_equal_eager():
    g = torch.Generator().manual_seed(1)
    eager, compiled = cache("kivi4/g32+rot"), cache("kivi4/g32+rot")
    for c in (eager, compiled):
        c.create_sequence(0)

    def step(c, k, v, q):
        kvq.ops.append(c, 0, 1, k, v)
        return kvq.ops.attend(c, [0], 1, q) * 2.0

    prompt_k, prompt_v = torch.randn(150, 2, 64, generator=g), torch.randn(150, 2, 64, generator=g)
    prompt_q = torch.randn(150, 4, 64, generator=g)
    want = kvq.ops.prefill(eager, 0, 1, prompt_k, prompt_v, prompt_q)
    got = torch.compile(lambda k, v, q: kvq.ops.prefill(compiled, 0, 1, k, v, q), fullgraph=True)(
        prompt_k, prompt_v, prompt_q)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    fn = torch.compile(lambda k, v, q: step(compiled, k, v, q), fullgraph=True)
    for _ in range(70):  # past a page boundary: appends encode pages in between
        k, v, q = (torch.randn(1, 2, 64, generator=g), torch.randn(1, 2, 64, generator=g),
                   torch.randn(1, 4, 64, generator=g))
        torch.testing.assert_close(fn(k, v, q), step(eager, k, v, q), rtol=0, atol=0)
    assert compiled.length(0, 1) == eager.length(0, 1) == 220
    np.testing.assert_array_equal(compiled.read(0, 1, "k"), eager.read(0, 1, "k"))
    out, lse = torch.compile(lambda q: kvq.ops.attend_prefix(compiled, 0, 1, 100, q), fullgraph=True)(prompt_q[:3])
    out2, lse2 = kvq.ops.attend_prefix(eager, 0, 1, 100, prompt_q[:3])
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=0)
