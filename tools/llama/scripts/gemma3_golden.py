#!/usr/bin/env python3
"""Golden logits of Gemma 3 270M from llama.cpp, for the runner's [gemma3] tests.

Tokenizes a fixed text (the first --chars characters of data/eval/eval_persuasion.txt: about
1,100 tokens, so that the sliding layers' 512-token windows matter), evaluates it with
llama-cpp-python (logits of every position, one sequence, K/V in f16 as llama.cpp stores them)
and writes tools/llama/tests/data/gemma3_golden.json: the token ids and, at --positions positions
spread over the text (many past 600), the logsumexp of the logits and the top-8 ids and logits.

Run with the throwaway venv of bench/peer_llamacpp.sh (llama-cpp-python built from source):
    out/peer-llamacpp/bin/python tools/llama/scripts/gemma3_golden.py
"""
import argparse
import json
import math
import os

import llama_cpp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data/eval/eval_persuasion.txt"))
    ap.add_argument("--chars", type=int, default=5200, help="characters of the text to take")
    ap.add_argument("--positions", type=int, default=40)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "tools/llama/tests/data/gemma3_golden.json"))
    a = ap.parse_args()

    with open(a.text, encoding="utf-8") as f:
        text = f.read()[: a.chars]
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=a.threads,
                          logits_all=True, verbose=False, seed=0)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    n = len(ids)
    llm.eval(ids)
    logits = np.array(llm.scores[:n], dtype=np.float64)  # [n][n_vocab]
    # 40 positions: every 16th of the first 128, then spread evenly to the end (many past 600).
    first = list(range(0, 128, 16))
    rest = np.linspace(140, n - 1, a.positions - len(first)).round().astype(int).tolist()
    positions = sorted(set(first + rest))
    rows = []
    for p in positions:
        row = logits[p]
        m = row.max()
        lse = float(m + math.log(np.exp(row - m).sum()))
        top = np.argsort(-row, kind="stable")[: a.top]
        rows.append({"pos": p, "logsumexp": round(lse, 5), "top_ids": [int(t) for t in top],
                     "top_logits": [round(float(row[t]), 5) for t in top]})
    out = {
        "what": "llama.cpp logits of Gemma 3 270M Q4_K_M on the first `chars` characters of `text`, BOS first "
                "(tools/llama/scripts/gemma3_golden.py)",
        "llama_cpp_python": llama_cpp.__version__,
        "model_sha256": "see scripts/gemma3.sha256",
        "text": os.path.relpath(a.text, ROOT),
        "chars": a.chars,
        "bytes": len(text.encode("utf-8")),
        "tokens": [int(t) for t in ids],
        "positions": rows,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    print(f"{n} tokens, {len(rows)} positions (last {positions[-1]}), wrote {a.out} ({os.path.getsize(a.out)} bytes)")


if __name__ == "__main__":
    main()
