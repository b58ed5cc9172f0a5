"""Writes the seed blobs of the sequence blob fuzzer (tests/fuzz/fuzz_blob.cpp) into
tests/fuzz/blob_corpus/: small caches (1 layer, 1 kv head, head_dim 32, pages of 32 tokens) whose
blobs reach every part of the reader. Each file is the fuzzer's input: a first byte (1, odd: the
fuzzer recomputes the checksums; even: read as it is) and the blob. The *_v2.bin seeds are the same
caches written by this script at blob version 2 (they keep the reader's version-2 path fuzzed).

    PYTHONPATH=build/python python3 tests/fuzz/make_blob_seeds.py
"""
import pathlib

import numpy as np

import kvq

out = pathlib.Path(__file__).parent / "blob_corpus"
out.mkdir(exist_ok=True)
rng = np.random.default_rng(0)


def cache(config):
    return kvq.Cache(1, 2, 1, 32, config, budget_bytes=1 << 20, page_tokens=32, window=64, recent=16)


def feed(c, seq, n):
    c.append(seq, 0, rng.standard_normal((n, 1, 32), dtype=np.float32),
             rng.standard_normal((n, 1, 32), dtype=np.float32))


# one sequence of kivi4/g32: a page and a full window
a = cache("kivi4/g32")
a.create_sequence(1)
feed(a, 1, 70)
# a fork of codebook pages, rotated, with a sink page: shared blocks, level tables, rotation flags
b = cache("cb2/g32+rot+sink")
b.create_sequence(1)
feed(b, 1, 100)
b.fork(1, 2)
feed(b, 2, 40)
# mixed K/V formats, a short second sequence of one lane
c = cache("k=sym4,v=nvfp4")
c.create_sequence(3)
feed(c, 3, 120)
c.create_sequence(4)
feed(c, 4, 5)
# a sliding layer (window 40) whose first pages went back to the budget: released blocks (blob v3)
d = kvq.Cache(1, 2, 1, 32, "kivi2/g32", budget_bytes=1 << 20, page_tokens=32, window=64, recent=16,
              attention=[kvq.AttentionVariant(window=40)])
d.create_sequence(5)
for _ in range(4):
    feed(d, 5, 40)
for name, blob in [("kivi4", a.export_sequences([1])), ("cb2_fork_rot_sink", b.export_sequences([1, 2])),
                   ("mixed_two", c.export_sequences([3, 4])), ("sliding_released", d.export_sequences([5]))]:
    (out / f"{name}.bin").write_bytes(b"\x01" + blob)
    print(name, len(blob), "bytes")
