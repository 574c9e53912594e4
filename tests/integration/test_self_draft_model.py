"""Self-speculation with a quantized copy (issue 49: `method: self` with `quantization` or `model`): a
copy of the served model's weights quantized at load (or the default model's own Q4_1 GGUF) drafts
through the compressed view of the sequence's KV that self-drafts use (sinks + window, or a policy's
kept blocks), so a draft step reads small weights and little KV, and the served model verifies over
the whole cache. Every request here is compared with the same request sent with
`"speculative": false`: the output must be plain decoding's exactly. The view is small (one sink
block, two window blocks of 16) so that every prompt here is longer than it."""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from kvserve_server import Server, kvserve_bin, model_dir
from kvserve_server import choice_ids as tokens, with_and_without_speculation as both
from speculation_cases import (COPY_DRAFTS, SAME_TOKEN_CASES, STORY, assert_same_as_plain, concurrent_rounds,
                               copy_draft_server, greedy_runs_match)

PROMPTS = [STORY + "What happened next?", "Write a short poem about autumn leaves and rain on the window.\n" * 3,
           STORY * 2 + "Summarise the story in one sentence:", "List five facts about the moon. " * 5]


def spec_yaml(**fields) -> str:
    # auto_disable off: the tests check what the speculative steps compute, not whether they pay.
    # draft_min_context_tokens is left unset: with a draft copy it means 0 (draft at any length).
    lines = ["speculative_config:", "  method: self", "  num_speculative_tokens: 4", "  auto_disable: false",
             "  draft_sink_tokens: 16", "  draft_window_tokens: 32"]
    lines += [f"  {k}: {v}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", params=COPY_DRAFTS)
def srv(request):
    s = copy_draft_server(request.param, spec_yaml)
    yield s
    s.close()


def test_greedy_is_token_identical_and_drafts_are_accepted(srv):
    assert "the draft model is" in srv.log() and "a cache of its own" not in srv.log()
    drafted, accepted = greedy_runs_match(srv, PROMPTS)
    if srv.param == "default-gguf":
        # The trained model's own GGUF over sinks + window mostly agrees with full attention.
        assert accepted / drafted > 0.3, (drafted, accepted)


@pytest.mark.parametrize("extra", SAME_TOKEN_CASES)
def test_same_tokens_as_plain_decoding(srv, extra):
    assert_same_as_plain(srv, PROMPTS[2], extra)


def test_concurrent_chunked_and_preempted_match():
    s = Server(extra_yaml=spec_yaml(quantization="int4"), kv_cache_bytes="2MiB",
               extra_args=("--max-num-batched-tokens", "96", "--max-num-seqs", "6"))
    try:
        m = concurrent_rounds(s, 8, 160)
        assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert m["kvserve:num_preemptions_total"] > 0, "the pool was meant to preempt"
        assert m["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_policys_view_with_a_quantized_copy_changes_no_token(chunked):
    # draft_policy: the view adds the blocks holding most of what snapkv keeps of the prompt, chosen
    # as its prefill ends and again every 8 tokens; the int8 copy drafts through it.
    extra = ("--max-num-batched-tokens", "40") if chunked else ()
    s = Server(extra_yaml=spec_yaml(quantization="int8", draft_policy="snapkv", draft_budget=48, draft_refresh_tokens=8),
               kv_cache_bytes="256MiB", extra_args=extra)
    try:
        greedy_runs_match(s, PROMPTS[:3])
        assert s.wait_idle()["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()


def test_generate_json_reports_the_copy_and_drafts_from_any_length():
    args = [kvserve_bin(), "generate", "--model", model_dir(), "--prompt", PROMPTS[0], "--max-tokens", "32",
            "--ignore-eos", "--json"]
    spec = subprocess.run(args + ["--speculative-config", '{"method": "self", "num_speculative_tokens": 3, '
                                  '"quantization": "int8", "draft_sink_tokens": 16, "draft_window_tokens": 16, '
                                  '"auto_disable": false}'],
                          capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr[-2000:]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["config"] == {"method": "self", "num_speculative_tokens": 3, "disable_by_batch_size": 0, "auto_disable": False,
                           "draft_sink_tokens": 16, "draft_window_tokens": 16, "draft_min_context_tokens": 0,
                           "draft_sampling": "greedy", "model": "", "quantization": "int8"}
    assert s["drafts"] > 0 and 0 < s["verify_steps"] <= s["draft_steps"] <= 3 * s["verify_steps"]
    assert "the draft model is" in spec.stderr and "(q8_0+" in spec.stderr


@pytest.mark.parametrize("layout", [("--pp", "2"), ("--pp", "2", "--micro-batches", "2")])
def test_sharded_self_draft_with_a_copy_matches_plain(layout):
    # Every rank loads its slice of the int8 copy and drafts through its shard's view. (The tiny
    # model's 176-wide MLP split over two tensor-parallel ranks would cut int8's 32-value blocks.)
    s = Server(extra_yaml=spec_yaml(quantization="int8"), extra_args=layout)
    try:
        greedy_runs_match(s, PROMPTS[:3], 32)
        a, b = both(s, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.9, "seed": 5, "n": 3})
        assert tokens(a) == tokens(b)
        m = s.wait_idle()
        assert m["kvserve:kv_cache_blocks_used"] == 0
        assert m["kvserve:spec_decode_draft_steps_total"] >= m["kvserve:spec_decode_verify_steps_total"] > 0
    finally:
        s.close()


def test_a_copy_of_another_shape_is_refused(tmp_path):
    from test_draft_model import mha_copy
    src = pathlib.Path(model_dir())
    cfg = json.loads((src / "config.json").read_text())
    if cfg["num_attention_heads"] == cfg["num_key_value_heads"]:
        pytest.skip("the test model has one KV head per query head already")
    other = mha_copy(src, tmp_path / "mha")
    bad = subprocess.run([kvserve_bin(), "generate", "--prompt", "x", "--model", str(src), "--speculative-config",
                          json.dumps({"method": "self", "num_speculative_tokens": 3, "model": str(other)})],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0, bad.stderr[-2000:]
    assert ("method 'self' drafts over the served model's KV, so its draft model must share the served model's KV "
            "layout" in bad.stderr and "num_key_value_heads" in bad.stderr), bad.stderr[-2000:]
