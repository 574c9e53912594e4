"""Chunked prefill end to end through `kvserve generate`: a batch of one long prompt and three short
ones, generated greedily with a small `--max-num-batched-tokens` so that the long prompt is
prefilled in chunks while the short ones decode, gives the same tokens and keeps as many KV tokens
as the same batch without chunking, for every policy (H2O's prompts are prefilled whole either way),
on a fixture model and on the default model.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvserve_testlib import POLICY_FLAGS, default_model_dir, fixtures_dir, random_ids, run_kvserve, write_json  # noqa: E402


def generate(model: Path, prompts_file: Path, policy: str, chunked: bool, budget: int) -> dict:
    args = ["generate", "--model", str(model), "--prompts-file", str(prompts_file), "--max-tokens", "12",
            "--temperature", "0", "--ignore-eos", "--json", "--max-num-batched-tokens", str(budget),
            *POLICY_FLAGS[policy]]
    if chunked:
        args.append("--enable-chunked-prefill")
    return json.loads(run_kvserve(*args).stdout)


def check_equal(model: Path, vocab: int, long_len: int, budget: int, policy: str, tmp_path: Path) -> None:
    prompts = [random_ids(long_len, vocab, seed=1)] + [random_ids(n, vocab, seed=n) for n in (20, 33, 47)]
    f = write_json(tmp_path / "prompts.json", prompts)
    whole_run = generate(model, f, policy, False, budget)
    chunked_run = generate(model, f, policy, True, budget)
    whole, chunked = whole_run["results"], chunked_run["results"]  # (the batch's step counts vary: see below)
    assert len(whole) == len(chunked) == len(prompts)
    for i, (a, b) in enumerate(zip(whole, chunked)):
        assert b["token_ids"] == a["token_ids"], f"prompt {i}: chunked {b['token_ids']} != whole {a['token_ids']}"
        assert b["kv_tokens_kept"] == a["kv_tokens_kept"], f"prompt {i}"
        assert b["kv_tokens_full"] == a["kv_tokens_full"], f"prompt {i}"


@pytest.mark.parametrize("policy", sorted(POLICY_FLAGS))
def test_fixture_greedy_tokens_equal(policy, tmp_path):
    model = fixtures_dir() / "llama-gqa"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    check_equal(model, vocab, long_len=300, budget=64, policy=policy, tmp_path=tmp_path)


def test_gemma3_greedy_tokens_equal(tmp_path):
    """Sliding-window layers (window 12) under chunks of 64: each chunk attends to the window's
    blocks the earlier chunks left, and decodes the same tokens as whole prompts."""
    model = fixtures_dir() / "gemma3"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    check_equal(model, vocab, long_len=300, budget=64, policy="full", tmp_path=tmp_path)


@pytest.mark.parametrize("policy", ["full", "snapkv", "pyramidkv"])
def test_default_model_greedy_tokens_equal(policy, tmp_path):
    model = default_model_dir()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    check_equal(model, vocab, long_len=1500, budget=512, policy=policy, tmp_path=tmp_path)


@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o"])
def test_generate_prefills_a_long_prompt_in_chunks(policy, tmp_path):
    """Alone, a prompt of T tokens takes ceil(T / budget) - 1 more steps chunked (H2O's: none). (The
    batches above submit their prompts while the engine already runs, so their step counts vary.)"""
    model = fixtures_dir() / "llama-gqa"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    f = write_json(tmp_path / "prompt.json", [random_ids(600, vocab, seed=1)])
    whole = generate(model, f, policy, False, 64)
    chunked = generate(model, f, policy, True, 64)
    assert chunked["results"][0]["token_ids"] == whole["results"][0]["token_ids"]
    # Each count may be one short or one over: the request's last event comes before its step is
    # counted, and the step that frees it may run before or after generate reads the count.
    extra = 0 if policy == "h2o" else (600 + 63) // 64 - 1
    assert abs(chunked["steps"] - whole["steps"] - extra) <= 2, (whole["steps"], chunked["steps"])
