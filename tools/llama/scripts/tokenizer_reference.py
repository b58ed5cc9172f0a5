#!/usr/bin/env python3
"""Prints reference token ids for the known-encoding tests of tools/llama/tests/test_tokenizer.cpp.

The reference is Hugging Face `tokenizers` (Rust), configured from the GGUF file's own vocabulary:
- gpt2 vocabularies (SmolLM2): BPE(vocab, merges) with the pre-tokenizer
  Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)] (SmolLM2's
  tokenizer.json), control tokens added as special tokens;
- llama vocabularies (stories260K): BPE with byte fallback whose merges are every split a+b of a
  token into two tokens, ordered by the token's score (highest first), as transformers' converter
  from sentencepiece does, after the normalizer Prepend("▁") + Replace(" ", "▁").

    python3 -m venv /tmp/v && /tmp/v/bin/pip install gguf==0.19.0 tokenizers==0.23.3
    /tmp/v/bin/python tools/llama/scripts/tokenizer_reference.py MODEL.gguf "text" ...
"""
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers


def strings(r, name):
    f = r.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def numbers(r, name):
    f = r.fields[name]
    return [f.parts[i][0].item() for i in f.data]


def build(path):
    r = gguf.GGUFReader(path)
    kind = bytes(r.fields["tokenizer.ggml.model"].parts[-1]).decode()
    toks = strings(r, "tokenizer.ggml.tokens")
    types = numbers(r, "tokenizer.ggml.token_type")
    if kind == "gpt2":
        vocab = {t: i for i, t in reversed(list(enumerate(toks)))}
        merges = [tuple(m.split(" ", 1)) for m in strings(r, "tokenizer.ggml.merges")]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tk.add_special_tokens([AddedToken(toks[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3])
        return tk
    scores = numbers(r, "tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(toks)}
    merges = []
    for t, i in vocab.items():
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                merges.append((-scores[i], i, t[:k], t[k:]))
    merges.sort()
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in merges], byte_fallback=True,
                              unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tk


if __name__ == "__main__":
    tk = build(sys.argv[1])
    for text in sys.argv[2:]:
        ids = tk.encode(text).ids if text else []
        print(f"{text!r}: {{{', '.join(map(str, ids))}}}")
