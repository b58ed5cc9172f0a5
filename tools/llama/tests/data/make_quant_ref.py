#!/usr/bin/env python3
"""Generates quant_ref.gguf: the independent reference for kvq's GGUF dequantizers.

For each element type T it stores a tensor `T.q` of random blocks of type T (2 rows of 512
elements) and a tensor `T.ref` (F32, same shape) holding what gguf-py's numpy dequantizer
(`gguf.quants.dequantize`, written separately from ggml's C code and from kvq's C++) makes of
those blocks. Blocks whose reference holds NaN or Inf (random f16 scale bits) are redrawn, so
every reference value is finite. tests/test_quant.cpp dequantizes `T.q` with kvq's loader and
compares with `T.ref`.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install gguf==0.19.0
    /tmp/v/bin/python tools/llama/tests/data/make_quant_ref.py tools/llama/tests/data/quant_ref.gguf
"""
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
TYPES = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ROWS, COLS = 2, 512


def main(out_path):
    rng = np.random.default_rng(20240607)
    w = gguf.GGUFWriter(out_path, arch="quant_ref")
    w.add_string("kvq.generator", "tools/llama/tests/data/make_quant_ref.py")
    for t in TYPES:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
        n_blocks = ROWS * COLS // block_elems
        blocks = np.empty((n_blocks, block_bytes), dtype=np.uint8)
        ref = np.empty((n_blocks, block_elems), dtype=np.float32)
        for b in range(n_blocks):
            while True:
                raw = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
                deq = gguf.quants.dequantize(raw.reshape(1, block_bytes), t).reshape(-1).astype(np.float32)
                if np.all(np.isfinite(deq)) and np.max(np.abs(deq)) < 1e30:
                    break
            blocks[b] = raw
            ref[b] = deq
        w.add_tensor(f"{t.name}.q", blocks.reshape(ROWS, -1), raw_dtype=t)
        w.add_tensor(f"{t.name}.ref", ref.reshape(ROWS, COLS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
