"""kvq.hf on the GPU (marked gpu): randomly initialized Llama-family models (random weights: no
real model travels to the GPU machine) at head_dim 64 and 128, in bfloat16, against DynamicCache
on the same inputs. Tolerances, as KL to the float32 model with DynamicCache: fp16 pages within
1.5x of bf16 DynamicCache's own KL, kivi4/g32 at most 5e-4 more; padded batches
generate their rows' tokens run alone (90 %: bf16 GEMMs of other shapes); greedy generation from the same prompt equal for fp16."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

import kvq  # noqa: E402

if not (kvq.cuda and torch.cuda.is_available()):
    pytest.skip("no CUDA device (or kvq built without CUDA)", allow_module_level=True)
import kvq.hf  # noqa: E402

MB = 1 << 20


def random_llama(head_dim):
    torch.manual_seed(head_dim)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=8 * head_dim, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=head_dim, max_position_embeddings=4096, initializer_range=0.02)
    return transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def logits(m, ids, cache, chunks=(0,), mask=None):
    m.set_attn_implementation("kvq" if isinstance(cache, kvq.hf.KVQCache) else "sdpa")
    out = []
    bounds = list(chunks) + [ids.shape[1]]
    with torch.no_grad():
        for a, b in zip(bounds[:-1], bounds[1:]):
            kw = {} if mask is None else {"attention_mask": mask[:, :b]}
            out.append(m(ids[:, a:b], past_key_values=cache, **kw).logits.float())
    return torch.cat(out, dim=1)


def kl(ref, got):
    ref, got = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_random_llama_against_dynamic_cache(head_dim):
    """Against the same model in float32 with DynamicCache: the bf16 model with an fp16 kvq cache
    is as close as the bf16 model with DynamicCache (bf16 K/V, SDPA), within 1.5x of its KL;
    kivi4/g32 pages add at most 5e-4 (measured on an H100, 2026-12-06: 5.0e-6 / 1.0e-5 for fp16 at
    head_dim 64 / 128, the floor's own; 1.7e-5 / 6.7e-5 for kivi4/g32, 1.9e-5 / 7.8e-5 rotated)."""
    m = random_llama(head_dim)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (1, 700), generator=g).cuda()
    exact = logits(copy.deepcopy(m).float(), ids, transformers.DynamicCache(config=m.config), chunks=(0, 500))
    floor = kl(exact, logits(m, ids, transformers.DynamicCache(config=m.config), chunks=(0, 500)))[0].mean().item()
    print(f"head_dim {head_dim} bf16 DynamicCache: KL mean {floor:.2e}")
    for config, bound in (("fp16", 1.5 * floor), ("kivi4/g32", floor + 5e-4), ("kivi4/g32+rot", floor + 5e-4)):
        cache = kvq.hf.KVQCache(m.config, config, budget_bytes=64 * MB, device="cuda")
        # a prompt of 500 (prefill of a long chunk), then decode steps of one token
        got = logits(m, ids, cache, chunks=(0, 500) + tuple(range(501, 700)))
        d = kl(exact, got)[0].mean().item()
        print(f"head_dim {head_dim} {config}: KL mean {d:.2e} (bound {bound:.2e})")
        assert d < bound, config
        assert cache.kvq.length(0, 3) == 700


@pytest.mark.parametrize("head_dim", [64, 128])
def test_padded_batch_rows_equal_rows_alone_and_greedy_equal(head_dim):
    m = random_llama(head_dim)
    g = torch.Generator().manual_seed(2)
    lengths = [30, 200, 77]
    width = max(lengths)
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    rows = [torch.randint(0, 2048, (n,), generator=g) for n in lengths]
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    cache = kvq.hf.KVQCache(m.config, "fp16", budget_bytes=64 * MB, device="cuda")
    m.set_attn_implementation("kvq")
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False, max_new_tokens=16)
    for i, n in enumerate(lengths):
        assert cache.kvq.length(cache.rows[i], 0) == n + 15  # no pads stored
        alone = kvq.hf.KVQCache(m.config, "fp16", budget_bytes=64 * MB, device="cuda")
        with torch.no_grad():
            single = m.generate(rows[i][None].cuda(), past_key_values=alone, do_sample=False, max_new_tokens=16)
        # the same tokens up to bf16 GEMM shapes (a batch of 3 rows against 1): near ties may flip
        same = (out[i, width:] == single[0, n:]).float().mean().item()
        assert same >= 0.9, (i, same)
    # greedy: fp16 kvq and DynamicCache from the same prompt
    prompt = rows[1][None].cuda()
    m.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = m.generate(prompt, past_key_values=transformers.DynamicCache(config=m.config), do_sample=False,
                          max_new_tokens=32)
    m.set_attn_implementation("kvq")
    with torch.no_grad():
        got = m.generate(prompt, past_key_values=kvq.hf.KVQCache(m.config, "fp16", budget_bytes=64 * MB,
                                                                device="cuda"), do_sample=False, max_new_tokens=32)
    agree = (got == want).float().mean().item()
    print(f"head_dim {head_dim}: greedy agreement with DynamicCache {agree:.3f}")
    assert agree >= 0.95


@pytest.mark.parametrize("config", ["fp16", "kivi4/g32+rot"])
def test_decode_graph_replays_the_eager_steps(config):
    """kvq.hf.DecodeGraph (the decode forward captured once, replayed per step over a kvq
    DecodeStep) against the eager kvq path on the same prefilled batch: the same tokens stored
    (lengths) and logits equal up to the attention's summation order (splits planned for
    max_tokens); a changed batch is refused by name and a refused step changes nothing."""
    m = random_llama(128)
    m.set_attn_implementation("kvq")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 2048, (3, 300), generator=g).cuda()
    steps = torch.randint(0, 2048, (3, 40), generator=g).cuda()
    caches = [kvq.hf.KVQCache(m.config, config, budget_bytes=64 * MB, device="cuda", max_tokens=1024)
              for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            m(ids, past_key_values=c)
    graph = kvq.hf.DecodeGraph(m, caches[1])
    worst = 0.0
    for t in range(steps.shape[1]):
        pos = torch.full((3, 1), 300 + t, device="cuda", dtype=torch.long)
        with torch.no_grad():
            want = m(steps[:, t:t + 1], past_key_values=caches[0], position_ids=pos).logits[:, -1].float()
        got = graph(steps[:, t:t + 1], pos).float()
        worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
    print(f"{config}: DecodeGraph vs eager, worst relative logit difference {worst:.2e}")
    assert worst < 2e-2  # bf16 activations: one summation-order rounding carried through 4 layers
    assert graph.graph is not None and graph.calls == 40
    for s0, s1 in zip(*(c.rows for c in caches)):
        assert caches[1].kvq.length(s1, 3) == caches[0].kvq.length(s0, 3) == 340
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 340
    with pytest.raises(kvq.InvalidArgument, match=r"\[3, 1\]"):
        graph(steps[:2, :1], pos[:2])
    assert caches[1].kvq.length(caches[1].rows[0], 0) == 340


def test_continuous_batching_on_the_gpu():
    """kvq.hf_paged.generate_batch on the GPU (bf16 random Llama, head_dim 128): prompts of three
    lengths through transformers' continuous batching with fp16 kvq pages generate what the same
    loop generates with transformers' paged BF16 cache (90 %: fp16 pages against bf16 blocks may
    flip near ties), and every kvq sequence is released at the end."""
    import kvq.hf_paged
    m = random_llama(128)
    m.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (37, 300, 5)]
    gc = transformers.GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # the reference: transformers' own continuous batching (its paged BF16 cache, the same loop:
    # the loop's packed shapes already flip near ties of a random model against generate)
    m.set_attn_implementation("paged|sdpa")
    ref = m.generate_batch(inputs=prompts, generation_config=gc,
                           continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=64))
    m.set_attn_implementation("sdpa")
    want = [ref[k].generated_tokens for k in sorted(ref, key=lambda k: int(k.split("_")[1]))]
    made = set()
    seq = kvq.hf_paged.KVQPagedCache._seq

    def spy(self, request_id, past):  # the kvq cache the requests ran in
        made.add(self)
        return seq(self, request_id, past)

    kvq.hf_paged.KVQPagedCache._seq = spy
    try:
        out = kvq.hf_paged.generate_batch(m, prompts, gc, "fp16", budget_bytes=64 * MB)
    finally:
        kvq.hf_paged.KVQPagedCache._seq = seq
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[1]))]
    same = sum(a == b for w, o in zip(want, got) for a, b in zip(w, o)) / sum(len(w) for w in want)
    print(f"continuous batching on the GPU: {same:.3f} of tokens equal transformers' paged cache's")
    assert same >= 0.9
    assert len(made) == 1 and next(iter(made)).kvq.stats()["sequences"] == 0
