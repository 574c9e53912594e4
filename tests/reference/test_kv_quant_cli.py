"""Quantized KV caches (cache.kv_cache_dtype int8 / int4 / q4_1 / fp8, cache_manager/kv_quant.h) end to end
through the CLI:
- policies score from the prompt's K/V as computed and only the kept rows are quantized: every
  policy (kvzip's reconstruction pass included) keeps the same positions as a float16 or float32
  cache, and a compressing policy's prompt logits are the float32 cache's bit for bit;
- a full-KV prompt attends to its K/V as the pool stores them, so prefix-cached and chunked prefills
  compute what one forward computes (tests/integration/test_kv_quant_server.py);
- TP 2 and PP 2 jobs equal one process (logits, kept positions, greedy tokens through the engine);
- the default model's greedy answer survives int8; the bench and `plan` report the bytes;
- fp8 and head sizes the format cannot take are refused with errors that name them.
"""
from __future__ import annotations

import json
import pathlib

import pytest
from safetensors.torch import load_file

from kvserve_testlib import POLICY_FLAGS, default_model_dir, fixtures_dir, run_kvserve, write_json

QUANT = ["int8", "int4", "q4_1", "fp8"]
KVZIP = ["--policy", "kvzip", "--budget", "16", "--policy-param", "chunk_size=16"]
POLICIES = {**POLICY_FLAGS, "kvzip": KVZIP,
            "pyramidkv-adaptive": [*POLICY_FLAGS["pyramidkv"], "--policy-param", "head_budgets=adaptive"]}
PROMPT = [(7 * i + 3) % 1500 + 5 for i in range(57)]  # within the qwen3 fixture's 1577 ids


def forward(tmp: pathlib.Path, model: str, kv: str, flags: list[str], *extra: str, prompt=PROMPT):
    tag = f"{kv}-{'-'.join(extra) or 'single'}"
    ids = write_json(tmp / "ids.json", prompt)
    out, dump = tmp / f"logits-{tag}.safetensors", tmp / f"kept-{tag}.json"
    run_kvserve("forward", "--model", model, "--input-ids", str(ids), "--output", str(out), "--dump-kept", str(dump),
                "--kv-cache-dtype", kv, *flags, *extra)
    return load_file(str(out))["logits"], json.loads(dump.read_text())


def generate(model: str, kv: str, flags: list[str], *extra: str, prompt=PROMPT, n: int = 12) -> list[int]:
    proc = run_kvserve("generate", "--model", model, "--prompt-ids", *map(str, prompt), "--max-tokens", str(n),
                       "--ignore-eos", "--json", "--kv-cache-dtype", kv, *flags, *extra)
    return json.loads(proc.stdout)["token_ids"]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_kept_positions_do_not_depend_on_the_kv_dtype(tmp_path, policy):
    model = str(fixtures_dir() / "qwen3")  # head_dim 32: one quantization group per row
    ref_logits, ref_kept = forward(tmp_path, model, "float32", POLICIES[policy])
    assert ref_kept["layers"]
    for kv in ["float16", *QUANT]:
        logits, kept = forward(tmp_path, model, kv, POLICIES[policy])
        assert kept["budgets"] == ref_kept["budgets"], (policy, kv)
        assert kept["layers"] == ref_kept["layers"], (policy, kv)
        if any(len(h) < len(PROMPT) for layer in ref_kept["layers"] for h in layer["kept"]):
            # A compressing policy's prompt attends to its K/V as computed (the pool is not read yet);
            # one that keeps everything (full; knorm, which skips both layers of this fixture) reads
            # them as stored, as a prefix hit or a later chunk would.
            assert (logits - ref_logits).abs().max().item() == 0.0, (policy, kv)


@pytest.mark.parametrize("policy", ["full", "snapkv", "kvzip"])
def test_default_model_kept_positions_as_float16(tmp_path, policy):
    flags = {"full": [], "snapkv": ["--policy", "snapkv", "--budget", "64"],
             "kvzip": ["--policy", "kvzip", "--budget", "0.25"]}[policy]
    prompt = [(37 * i + 11) % 40000 + 100 for i in range(300)]
    _, ref = forward(tmp_path, str(default_model_dir()), "float16", flags, prompt=prompt)
    for kv in QUANT:
        _, kept = forward(tmp_path, str(default_model_dir()), kv, flags, prompt=prompt)
        assert kept["layers"] == ref["layers"], (policy, kv)


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("policy", ["full", "snapkv", "kvzip"])
def test_sharded_equals_single_process(tmp_path, kv, policy):
    model = str(fixtures_dir() / "qwen3")
    flags = POLICIES[policy]
    ref_logits, ref_kept = forward(tmp_path, model, kv, flags)
    ref_tokens = generate(model, kv, flags)
    for tp, pp in [(2, 1), (1, 2)]:
        layout = ("--tp", str(tp), "--pp", str(pp))
        logits, kept = forward(tmp_path, model, kv, flags, *layout)
        assert (logits - ref_logits).abs().max().item() <= 1e-4, (kv, policy, tp, pp)
        assert kept["layers"] == ref_kept["layers"], (kv, policy, tp, pp)
        # Decode reads the quantized rows: each shard stores its own heads' rows exactly as one process.
        assert generate(model, kv, flags, *layout) == ref_tokens, (kv, policy, tp, pp)


# Leading greedy tokens that must equal the float32 cache's on the default model (measured 2026-11-28;
# fp8 2026-11-30: 7 of 16).
@pytest.mark.parametrize("kv,equal", [("int8", 7), ("int4", 1), ("fp8", 7)])
def test_default_model_greedy_tokens(kv, equal):
    def gen(dtype):
        out = run_kvserve("generate", "--model", str(default_model_dir()), "--prompt",
                          "The three primary colours are", "--max-tokens", "16", "--json", "--kv-cache-dtype", dtype)
        return json.loads(out.stdout)["token_ids"]
    want, got = gen("float32"), gen(kv)
    assert got[:equal] == want[:equal], (kv, got, want)


def test_bench_and_plan_report_the_bytes():
    model = str(fixtures_dir() / "qwen3")
    rows = {}
    for dt in ("float16", "int8", "int4", "q4_1", "fp8"):
        out = run_kvserve("bench", "decode", "--model", model, "--context", "100", "--steps", "2", "--warmup", "0",
                          "--kv-cache-dtype", dt)
        rows[dt] = json.loads(out.stdout.strip().splitlines()[-1])
        assert rows[dt]["kv_cache_dtype"] == dt
    # head_dim 32: float16 64 bytes a row, q8_0 32 + 2, q4_0 16 + 2, q4_1 16 + 4.
    for dt, row in (("int8", 34), ("int4", 18), ("q4_1", 20), ("fp8", 34)):
        assert rows[dt]["kv_bytes_per_token_layer"] * 64 == rows["float16"]["kv_bytes_per_token_layer"] * row
    cfg = str(default_model_dir() / "config.json")
    plan = {dt: json.loads(run_kvserve("plan", "--model-config", cfg, "--gpu-memory", "2GiB", "--context", "4096",
                                       "--kv-dtype", dt, "--json").stdout) for dt in ("float16", "int8", "int4")}
    per_token = {dt: p["stages"][0]["kv_bytes_per_token"] for dt, p in plan.items()}
    assert per_token["float16"] / per_token["int8"] >= 1.85
    assert per_token["float16"] / per_token["int4"] >= 3.2


def test_plan_holds_a_policy_in_its_own_kv_dtype():
    # A policy with kv_dtype: its KV in that dtype out of the cache's bytes; a ladder with budget_bytes
    # shows the rung a prompt of --context tokens gets (policies/kv_dtype_ladder.h).
    cfg = str(default_model_dir() / "config.json")

    def plan(*param):
        flags = [f for p in param for f in ("--param", p)]
        out = run_kvserve("plan", "--model-config", cfg, "--gpu-memory", "2GiB", "--context", "4096", "--kv-dtype",
                          "float16", "--policy", "snapkv", *flags, "--json").stdout
        return {p["policy"]: p for p in json.loads(out)["policies"]}

    base = plan("budget=1024")["snapkv"]
    int4 = plan("budget=1024", "kv_dtype=int4")["snapkv"]
    assert "kv_dtype" not in base and int4["kv_dtype"] == "int4"
    assert int4["kept_per_layer"] == base["kept_per_layer"]
    # head_dim 64: a float16 row is 128 bytes, a q4_0 row 32 + 4.
    assert int4["kv_bytes_per_seq_per_stage"][0] * 128 == base["kv_bytes_per_seq_per_stage"][0] * 36
    assert int4["max_seqs"] >= 3.2 * base["max_seqs"]
    assert plan("budget=1024", "kv_dtype=int4")["full"] == plan("budget=1024")["full"]
    # 26 MiB a sequence over 30 layers of 3 KV heads: 1,183 float16 tokens a layer (29 % of 4,096),
    # 2,227 int8 (54 %), so the ladder stops at int8 for snapkv (>= 50 %) ...
    ladder = plan("budget_bytes=26MiB", "kv_dtype=ladder")
    assert "snapkv@int8" in ladder, ladder.keys()
    assert ladder["snapkv@int8"]["kv_dtype"] == "int8"
    # ... and goes on to int4 with 20 MiB (42 % in int8), or where kv_ladder asks int8 to keep 60 %.
    assert "snapkv@int4" in plan("budget_bytes=20MiB", "kv_dtype=ladder")
    assert "snapkv@int4" in plan("budget_bytes=26MiB", "kv_dtype=ladder", "kv_ladder=int8:0.6,int4")
    proc = run_kvserve("plan", "--model-config", cfg, "--policy", "snapkv", "--param", "kv_dtype=int3",
                       "--param", "budget=64", check=False)
    assert proc.returncode != 0 and "int3" in proc.stderr, proc.stderr


def test_errors_name_what_is_wrong(tmp_path):
    proc = run_kvserve("generate", "--model", str(fixtures_dir() / "llama-gqa"), "--prompt", "hi",
                       "--kv-cache-dtype", "int8", check=False)  # head_dim 16
    assert proc.returncode != 0
    assert "head_dim is 16" in proc.stderr and "int8" in proc.stderr, proc.stderr
    cfg = tmp_path / "fp8.yaml"
    cfg.write_text("cache:\n  kv_cache_dtype: fp8_e5m2\n")
    proc = run_kvserve("config", "check", str(cfg), check=False)
    assert proc.returncode != 0
    assert "cache.kv_cache_dtype" in proc.stdout + proc.stderr and "fp8" in proc.stdout + proc.stderr
    # A quantized pool on CUDA is read by the quantized decode kernel; a 16-bit pool there must still be
    # the compute dtype.
    cfg.write_text("model:\n  device: cuda\ncache:\n  kv_cache_dtype: int8\n")
    proc = run_kvserve("config", "check", str(cfg), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg.write_text("model:\n  device: cuda\n  dtype: bfloat16\ncache:\n  kv_cache_dtype: float16\n")
    proc = run_kvserve("config", "check", str(cfg), check=False)
    assert proc.returncode != 0
    assert "cache.kv_cache_dtype" in proc.stdout + proc.stderr and "compute dtype" in proc.stdout + proc.stderr


def test_budget_bytes_keeps_more_tokens_in_fewer_bits():
    # 1 MiB of KV per sequence: the same bytes hold 1.88x the tokens at int8 (snapkv, 400-token prompt).
    prompt = [str((37 * i + 11) % 40000 + 100) for i in range(400)]
    got = {}
    for kv in ("float16", "int8"):
        out = run_kvserve("generate", "--model", str(default_model_dir()), "--prompt-ids", *prompt, "--max-tokens",
                          "2", "--json", "--kv-cache-dtype", kv, "--policy", "snapkv", "--policy-param",
                          "budget_bytes=1MiB")
        got[kv] = json.loads(out.stdout)
        assert got[kv]["kv_bytes_kept"] <= (1 << 20), got[kv]
        assert got[kv]["kv_bytes_kept"] > 0.95 * (1 << 20), got[kv]  # 30 layers x the window's rounding
    assert got["int8"]["kv_tokens_kept"] >= 1.85 * got["float16"]["kv_tokens_kept"]
    proc = run_kvserve("generate", "--model", str(default_model_dir()), "--prompt", "hi", "--kv-cache-dtype", "int4",
                       "--policy", "snapkv", "--policy-param", "budget_bytes=10KB", check=False)
    assert proc.returncode != 0 and "budget_bytes" in proc.stderr and "window" in proc.stderr, proc.stderr
