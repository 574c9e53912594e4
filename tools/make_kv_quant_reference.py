#!/usr/bin/env python3
"""Writes tests/cache_manager/data/kv_quant_reference.safetensors: K/V-like rows and their q8_0,
q4_0 and q4_1 encodings by the `gguf` package's quantizers (llama.cpp's formats, bit for bit), laid
out as kvserve's quantized KV rows (cache_manager/kv_quant.h): a row of head_dim values is its
groups' quantized values, then the groups' scales. gguf writes each group of 32 as one block
[scales][values]; only the order of those bytes changes here.

tests/reference/test_kv_quant_reference.py regenerates the file and checks it is unchanged, so the
committed fixture is always what the installed gguf computes; the gtest
(tests/cache_manager/test_kv_quant.cpp) checks kvserve's encoder against it byte for byte.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file

HEAD_DIM = 64
GROUP = 32
# (gguf type, bytes of scales per group at the front of gguf's block)
FORMATS = {"q8_0": (T.Q8_0, 2), "q4_0": (T.Q4_0, 2), "q4_1": (T.Q4_1, 4)}


def rows() -> np.ndarray:
    rng = np.random.default_rng(20261128)
    x = rng.standard_normal((96, HEAD_DIM)).astype(np.float32)
    x[1::7] *= 40.0                                   # large rows (keys have some)
    x[2::11, 5] = 300.0                               # one outlier channel
    x[3] = 0.0                                        # an all-zero row: scale 0
    x[4] = 1.25                                       # a constant row (q4_1: max == min)
    x[5, :GROUP] = -3.0                               # a constant group next to a random one
    x[6] = np.where(np.arange(HEAD_DIM) % 2 == 0, 7.0, -7.0)  # ties of |max|: the first one wins
    x[7] = np.linspace(-1, 1, HEAD_DIM, dtype=np.float32)     # halves that round away from zero
    x[8] = rng.standard_normal(HEAD_DIM).astype(np.float32) * 1e-6
    return x


def kvserve_rows(x: np.ndarray, fmt: str) -> np.ndarray:
    qtype, scale_bytes = FORMATS[fmt]
    blocks = quantize(x, qtype).reshape(x.shape[0], HEAD_DIM // GROUP, -1)  # [rows, groups, block bytes]
    scales = blocks[:, :, :scale_bytes].reshape(x.shape[0], -1)
    values = blocks[:, :, scale_bytes:].reshape(x.shape[0], -1)
    return np.ascontiguousarray(np.concatenate([values, scales], axis=1))


def build() -> dict[str, np.ndarray]:
    x = rows()
    out = {"x": x}
    for fmt, (qtype, _) in FORMATS.items():
        out[fmt] = kvserve_rows(x, fmt)
        out[fmt + ".decoded"] = dequantize(quantize(x, qtype), qtype).astype(np.float32).reshape(x.shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/cache_manager/data/kv_quant_reference.safetensors"))
    a = ap.parse_args()
    save_file(build(), a.out)
    print(a.out)


if __name__ == "__main__":
    main()
