"""The package on the CUDA backend with torch tensors (marked gpu: run by kvq:python_gpu, skipped
without a GPU): the same bytes as the CPU backend, torch's streams, no synchronization (CUDA
graph capture of the eager calls and of a replayed decode_step), value checks on the device,
device errors, and the custom ops compiled."""
import numpy as np
import pytest

import kvq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not (kvq.cuda and torch.cuda.is_available()):
    pytest.skip("no CUDA device (or kvq built without CUDA)", allow_module_level=True)
import kvq.ops  # noqa: E402

MB = 1 << 20


def pair(config, head_dim=64, layers=2, q_heads=8, kv_heads=2, **kw):
    args = dict(budget_bytes=64 * MB, **kw)
    return (kvq.Cache(layers, q_heads, kv_heads, head_dim, config, device="cuda", **args),
            kvq.Cache(layers, q_heads, kv_heads, head_dim, config, device="cpu", **args))


def randn(g, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("config, head_dim", [("fp16", 64), ("kivi4/g32", 64), ("kivi4/g32", 128),
                                              ("k=kivi4/g32,v=kivi2/g32", 128), ("kivi2/g32+rot+sink", 128),
                                              ("fp8", 64), ("cb4/g32", 128)])
def test_cuda_stores_the_cpu_bytes_and_attends_alike(config, head_dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    gpu, cpu = pair(config, head_dim)
    lengths = [700, 130]
    for s, n in enumerate(lengths):
        k, v = randn(g, n, 2, head_dim), randn(g, n, 2, head_dim)
        for c, kk, vv in ((gpu, k, v), (cpu, k.cpu(), v.cpu())):
            c.create_sequence(s)
            for layer in range(2):
                c.append(s, layer, kk, vv)
    for s in range(2):
        for role in "kv":
            np.testing.assert_array_equal(gpu.read(s, 1, role), cpu.read(s, 1, role))
    q = randn(g, 2, 8, head_dim, dtype=torch.bfloat16)
    out = gpu.attend([0, 1], 1, q)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    ref = cpu.attend([0, 1], 1, q.float().cpu())
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=1.5e-2)
    assert gpu.stats()["bytes_by_format"] == cpu.stats()["bytes_by_format"]


def test_calls_run_on_torch_current_stream():
    g = torch.Generator(device="cuda").manual_seed(1)
    a, _ = pair("kivi4/g32")
    b, _ = pair("kivi4/g32")
    k, v, q = randn(g, 500, 2, 64), randn(g, 500, 2, 64), randn(g, 1, 8, 64)
    for c in (a, b):
        c.create_sequence(0)
    a.append(0, 0, k, v)
    want = a.attend([0], 0, q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kvq's calls follow torch's current stream
        b.append(0, 0, k, v)
        got = b.attend([0], 0, q)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_eager_calls_capture_into_a_cuda_graph():
    """A decode step, a prefill of a chunk longer than the window, truncate, fork and another
    step, inside torch.cuda.graph (global capture mode: any synchronization or allocation fails
    it), replayed once: equal to the same calls run eagerly (value checks on)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    eager, _ = pair("kivi4/g32+rot")
    graphed, _ = pair("kivi4/g32+rot")
    prompt, pre = randn(g, 300, 2, 64), randn(g, 100, 2, 64)
    ck, cv, cq = randn(g, 300, 2, 64), randn(g, 300, 2, 64), randn(g, 300, 8, 64)
    sk, sv, sq = randn(g, 2, 2, 64), randn(g, 2, 2, 64), randn(g, 2, 8, 64)
    capture = torch.cuda.Stream()  # torch captures on a side stream; kvq follows torch's current stream
    for c, stream in ((eager, torch.cuda.current_stream()), (graphed, capture)):
        with torch.cuda.stream(stream):
            for s in (0, 1, 2, 9):
                c.create_sequence(s)
                for layer in range(2):
                    c.append(s, layer, prompt if s < 2 else pre, prompt if s < 2 else pre)
            for layer in range(2):  # warm-up: a stream's workspaces grow to these shapes before the capture
                c.prefill(9, layer, ck, cv, cq)
                c.attend([0, 1], layer, sq)
    torch.cuda.synchronize()

    def calls(c):
        outs = []
        for layer in range(2):
            c.append_batch([0, 1], [1, 1], layer, sk, sv)
            outs.append(c.attend([0, 1], layer, sq))
        for layer in range(2):
            outs.append(c.prefill(2, layer, ck, cv, cq))
        c.truncate(0, 150)
        c.fork(1, 5)
        for layer in range(2):
            c.append_batch([0, 5], [1, 1], layer, sk, sv)
            outs.append(c.attend([0, 5], layer, sq))
        return outs

    want = calls(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture, capture_error_mode="global"):
        got = calls(graphed)
    graph.replay()
    torch.cuda.synchronize()
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    for s in (0, 1, 2, 5):
        assert graphed.length(s, 1) == eager.length(s, 1)
        for role in "kv":
            np.testing.assert_array_equal(graphed.read(s, 1, role), eager.read(s, 1, role))
    graphed.check()


def test_decode_step_replays_from_torch_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(3)
    stream = torch.cuda.Stream()
    graphed, _ = pair("kivi4/g32", stream=stream)
    eager, _ = pair("kivi4/g32")
    seqs, layers = [0, 1, 2], 2
    for c in (graphed, eager):
        for s in seqs:
            c.create_sequence(s)
            for layer in range(layers):
                c.append(s, layer, randn(torch.Generator(device="cuda").manual_seed(s), 90 + 40 * s, 2, 64),
                         randn(torch.Generator(device="cuda").manual_seed(s + 9), 90 + 40 * s, 2, 64))
    step = kvq.DecodeStep(graphed, max_batch=4, max_tokens=4096)
    k = torch.zeros(layers, 4, 2, 64, dtype=torch.float16, device="cuda")
    v, q = torch.zeros_like(k), torch.zeros(layers, 4, 8, 64, dtype=torch.float16, device="cuda")
    out = torch.zeros_like(q)
    torch.cuda.synchronize()
    step.prepare(seqs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for layer in range(layers):
            step.append(layer, k[layer], v[layer])
            step.attend(layer, q[layer], out[layer])
    for t in range(80):  # across page boundaries
        k.copy_(randn(g, layers, 4, 2, 64))
        v.copy_(randn(g, layers, 4, 2, 64))
        q.copy_(randn(g, layers, 4, 8, 64))
        if t:
            step.prepare(seqs)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # after prepare's descriptor copy on the cache's stream
            graph.replay()
        torch.cuda.current_stream().wait_stream(stream)
        for layer in range(layers):
            eager.append_batch(seqs, [1] * 3, layer, k[layer, :3], v[layer, :3])
            want = eager.attend(seqs, layer, q[layer, :3])
            torch.testing.assert_close(out[layer, :3], want, rtol=2e-3, atol=2e-3)
    for s in seqs:
        np.testing.assert_array_equal(graphed.read(s, 1, "k"), eager.read(s, 1, "k"))


def test_bad_values_are_held_on_the_device_and_reported_by_check():
    g = torch.Generator(device="cuda").manual_seed(4)
    c, _ = pair("kivi4/g32")
    c.create_sequence(0)
    c.append(0, 0, randn(g, 200, 2, 64), randn(g, 200, 2, 64))
    before = c.read(0, 0, "k")
    bad = randn(g, 3, 2, 64)
    bad[1, 0, 5] = float("nan")
    c.append(0, 0, bad, randn(g, 3, 2, 64))  # no synchronization: refused on the device
    with pytest.raises(kvq.NonFinite, match="sequence 0"):
        c.check()
    assert c.length(0, 0) == 200
    np.testing.assert_array_equal(c.read(0, 0, "k"), before)
    c.append(0, 0, randn(g, 3, 2, 64), randn(g, 3, 2, 64))  # takes appends again
    c.check()
    assert c.length(0, 0) == 203


def test_device_mismatches_raise():
    c, _ = pair("fp16")
    c.create_sequence(0)
    with pytest.raises(kvq.InvalidArgument, match="not on a CUDA device"):
        c.append(0, 0, torch.zeros(2, 2, 64), torch.zeros(2, 2, 64))
    with pytest.raises(kvq.InvalidArgument, match="cpu"):
        kvq.Cache(1, 8, 2, 64, budget_bytes=MB).append(0, 0, torch.zeros(2, 2, 64, device="cuda"),
                                                       torch.zeros(2, 2, 64, device="cuda"))
    with pytest.raises(kvq.InvalidArgument, match="only"):
        kvq.Cache(1, 8, 2, 64, budget_bytes=MB, device="cuda:%d" % torch.cuda.device_count())
    assert c.length(0, 0) == 0


def test_ops_compiled_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(5)
    eager, _ = pair("kivi2/g32+rot")
    compiled, _ = pair("kivi2/g32+rot")
    for c in (eager, compiled):
        c.create_sequence(0)
        c.append(0, 0, randn(torch.Generator(device="cuda").manual_seed(7), 300, 2, 64),
                 randn(torch.Generator(device="cuda").manual_seed(8), 300, 2, 64))

    def step(c, k, v, q):
        kvq.ops.append(c, 0, 0, k, v)
        return kvq.ops.attend(c, [0], 0, q).float().sum(-1)

    fn = torch.compile(lambda k, v, q: step(compiled, k, v, q), fullgraph=True)
    for _ in range(20):
        k, v, q = randn(g, 1, 2, 64), randn(g, 1, 2, 64), randn(g, 1, 8, 64)
        torch.testing.assert_close(fn(k, v, q), step(eager, k, v, q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["kivi4/g32", "k=kivi4/g32,v=kivi2/g32+rot+sink", "nvfp4"])
def test_blobs_move_between_gpu_and_cpu_bit_for_bit(config):
    g = torch.Generator(device="cuda").manual_seed(1)
    gpu, cpu = pair(config, 128)
    k, v = randn(g, 500, 2, 128), randn(g, 500, 2, 128)
    for c, kk, vv in ((gpu, k, v), (cpu, k.cpu(), v.cpu())):
        c.create_sequence(1)
        for layer in range(2):
            c.append(1, layer, kk, vv)
    blob = gpu.export_sequences([1])
    assert blob == cpu.export_sequences([1])
    gpu2, cpu2 = pair(config, 128)
    cpu2.import_sequences(blob, [7])
    gpu2.import_sequences(cpu2.export_sequences([7]), [7])
    again = gpu2.export_sequences([7])
    assert kvq.inspect_blob(again)["sequences"][0]["id"] == 7 and len(again) == len(blob)
    for role in "kv":
        np.testing.assert_array_equal(gpu2.read(7, 1, role), gpu.read(1, 1, role))
    q = randn(g, 1, 8, 128)
    assert torch.equal(gpu2.attend([7], 1, q), gpu.attend([1], 1, q))


def test_swap_on_a_torch_stream_gives_the_same_attention():
    g = torch.Generator(device="cuda").manual_seed(2)
    gpu, _ = pair("kivi4/g32", 128, swap_bytes=16 * MB)
    gpu.create_sequence(1)
    for layer in range(2):
        gpu.append(1, layer, randn(g, 600, 2, 128), randn(g, 600, 2, 128))
    q = randn(g, 1, 8, 128)
    before = gpu.attend([1], 0, q).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gpu.swap_out(1)
        assert gpu.is_swapped(1)
        with pytest.raises(kvq.InvalidArgument, match="swapped out"):
            gpu.attend([1], 0, q)
        gpu.swap_in(1)
        after = gpu.attend([1], 0, q)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(after, before)
    st = gpu.stats()
    assert st["swapped_out_bytes"] == st["swapped_in_bytes"] > 0
