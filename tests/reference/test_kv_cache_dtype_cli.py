"""--kv-cache-dtype and cache.kv_cache_dtype through the CLI: greedy generation of the default model
with a 16-bit KV cache against an fp32 one, the bench's KV bytes, and the errors for bad values."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvserve_testlib import default_model_dir, fixtures_dir, run_kvserve  # noqa: E402

PROMPT = "The three primary colours are"


def generate(kv_dtype: str, *extra: str) -> dict:
    out = run_kvserve("generate", "--model", str(default_model_dir()), "--prompt", PROMPT, "--max-tokens", "16",
                      "--json", "--kv-cache-dtype", kv_dtype, *extra)
    return json.loads(out.stdout)


# Leading greedy tokens that must equal the fp32 cache's. Measured (2026-11-23): float16 gives the
# same 16 tokens; bfloat16 (8 significand bits) the same 7, then picks "," over ":" (a near-tie).
@pytest.mark.parametrize("kv_dtype,equal", [("float16", 16), ("bfloat16", 4)])
def test_greedy_tokens_match_an_fp32_cache(kv_dtype, equal):
    # The logits themselves are compared step by step in tests/backend/test_kv_cache_dtype.cpp.
    want = generate("float32")["token_ids"]
    got = generate(kv_dtype)["token_ids"]
    assert len(want) == 16
    assert got[:equal] == want[:equal], (kv_dtype, got, want)


def test_bench_reports_half_the_kv_bytes():
    model = str(fixtures_dir() / "llama-gqa")
    rows = {}
    for dt in ("auto", "float16", "bfloat16"):
        out = run_kvserve("bench", "decode", "--model", model, "--context", "100", "--steps", "2", "--warmup", "0",
                          "--kv-cache-dtype", dt)
        rows[dt] = json.loads(out.stdout.strip().splitlines()[-1])
    assert rows["auto"]["kv_cache_dtype"] == "float32"
    for dt in ("float16", "bfloat16"):
        assert rows[dt]["kv_cache_dtype"] == dt
        assert 2 * rows[dt]["kv_bytes_per_seq"] == rows["auto"]["kv_bytes_per_seq"]
        assert 2 * rows[dt]["pool_bytes_per_seq"] == rows["auto"]["pool_bytes_per_seq"]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "decode"], ["serve", "--port", "0"],
                                     ["forward", "--input-ids", "ids.json", "--output", "out.safetensors"]])
def test_unknown_value_names_the_flag(command):
    proc = run_kvserve(*command, "--model", str(fixtures_dir() / "llama-gqa"), "--kv-cache-dtype", "fp8_e5m2",
                       check=False)
    assert proc.returncode != 0
    assert "--kv-cache-dtype" in proc.stderr and "fp8_e5m2" in proc.stderr, proc.stderr


def test_yaml_error_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("cache:\n  block_size: 16\n  kv_cache_dtype: int2\n")
    proc = run_kvserve("config", "check", str(cfg), check=False)
    assert proc.returncode != 0
    assert "bad.yaml:3" in proc.stderr + proc.stdout
    assert "cache.kv_cache_dtype" in proc.stderr + proc.stdout


def test_cuda_takes_only_the_compute_dtype():
    # Rejected while validating the config, before any device is touched (no GPU needed).
    proc = run_kvserve("serve", "--model", str(fixtures_dir() / "llama-gqa"), "--device", "cuda", "--dtype", "bfloat16",
                       "--kv-cache-dtype", "float16", "--port", "0", check=False)
    assert proc.returncode != 0
    assert "cache.kv_cache_dtype" in proc.stderr and "CUDA pools take only model.dtype" in proc.stderr, proc.stderr


def test_plan_kv_dtype_auto_is_the_weight_dtype():
    cfg = str(default_model_dir() / "config.json")
    auto = json.loads(run_kvserve("plan", "--model-config", cfg, "--dtype", "float32", "--kv-dtype", "auto",
                                  "--json").stdout)
    default = json.loads(run_kvserve("plan", "--model-config", cfg, "--dtype", "float32", "--json").stdout)
    half = json.loads(run_kvserve("plan", "--model-config", cfg, "--dtype", "float32", "--kv-dtype", "float16",
                                  "--json").stdout)
    assert auto["kv_dtype_bytes"] == default["kv_dtype_bytes"] == 4
    assert half["kv_dtype_bytes"] == 2
