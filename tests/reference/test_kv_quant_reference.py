"""The quantized-KV fixture the gtest checks kvserve's encoder against is gguf's output: regenerated
here with the installed `gguf` package (llama.cpp's q8_0 / q4_0 / q4_1 quantizers) and compared with
the committed file, tensor by tensor."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_kv_quant_reference as ref  # noqa: E402


def test_committed_fixture_is_what_gguf_computes():
    committed = load_file(str(ROOT / "tests/cache_manager/data/kv_quant_reference.safetensors"))
    fresh = ref.build()
    assert set(committed) == set(fresh)
    for name, want in fresh.items():
        assert committed[name].dtype == want.dtype, name
        np.testing.assert_array_equal(committed[name], want, err_msg=name)


def test_row_layout_sizes():
    fresh = ref.build()
    # head_dim 64 = two groups: q8_0 64 + 2 x 2, q4_0 32 + 2 x 2, q4_1 32 + 2 x 4 bytes a row.
    assert fresh["q8_0"].shape[1] == 68
    assert fresh["q4_0"].shape[1] == 36
    assert fresh["q4_1"].shape[1] == 40
