"""Self-speculative decoding (issue 49, `method: self`): the model drafts over a compressed view of the
sequence's own KV (its first and last blocks) and verifies against all of it. The output must be plain
decoding's exactly: every request here is compared with the same request sent with
`"speculative": false`, on the random fixture, the default model and Gemma 3 (sliding-window layers),
under compressing and head-wise policies, seeded sampling, grammars, concurrency and preemption. The
view is small (one sink block, two window blocks of 16) so that every prompt here is longer than it."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import subprocess

import pytest

from kvserve_server import Server, kvserve_bin, model_dir
from kvserve_server import choice_ids as tokens, complete_ids as complete, with_and_without_speculation as both
from speculation_cases import (DEFAULT_MODEL, FIXTURES, HEADWISE, SAME_TOKEN_CASES, STORY, assert_same_as_plain,
                               chi2_critical, concurrent_rounds, conversation_speculates_as_plainly, counts,
                               greedy_runs_match, homogeneity)

# auto_disable off: on these small models and short contexts drafting does not pay on a CPU, and
# the tests check what the speculative steps compute (test_auto_disable_* below: the governor).
SELF_YAML = """speculative_config:
  method: self
  num_speculative_tokens: 4
  draft_sink_tokens: 16
  draft_window_tokens: 32
  draft_min_context_tokens: 0
  auto_disable: false
"""
PROMPTS = [STORY + "What happened next?", "Write a short poem about autumn leaves and rain on the window.\n" * 3,
           STORY * 2 + "Summarise the story in one sentence:", "List five facts about the moon. " * 5]


@pytest.fixture(scope="module", params=["tiny", "default", "gemma3"])
def srv(request):
    model = {"tiny": None, "default": DEFAULT_MODEL, "gemma3": FIXTURES / "gemma3"}[request.param]
    if model is not None and not (model / "config.json").exists():
        pytest.skip(f"{model} is not made")
    s = Server(extra_yaml=HEADWISE + SELF_YAML, model=str(model) if model else None, kv_cache_bytes="256MiB")
    s.param = request.param
    yield s
    s.close()


def test_greedy_is_token_identical_and_drafts_are_accepted(srv):
    drafted, accepted = greedy_runs_match(srv, PROMPTS)
    if srv.param == "default":
        # The trained model's draft over sinks + window mostly agrees with full attention.
        assert accepted / drafted > 0.3, (drafted, accepted)


@pytest.mark.parametrize("extra", SAME_TOKEN_CASES)
def test_same_tokens_as_plain_decoding(srv, extra):
    assert_same_as_plain(srv, PROMPTS[2], extra)


def test_concurrent_chunked_and_preempted_match():
    # Mixed draft counts in one step, chunked prefill beside draft steps, and preemption of
    # sequences that draft, in a pool too small for all of them.
    s = Server(extra_yaml=SELF_YAML, kv_cache_bytes="2MiB",
               extra_args=("--max-num-batched-tokens", "96", "--max-num-seqs", "6"))
    try:
        m = concurrent_rounds(s, 8, 160)
        assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert m["kvserve:num_preemptions_total"] > 0, "the pool was meant to preempt"
        assert m["kvserve:kv_cache_blocks_used"] == 0
        assert m["kvserve:spec_decode_draft_steps_total"] >= m["kvserve:spec_decode_verify_steps_total"] > 0
        assert m["kvserve:spec_decode_draft_seconds_total"] > 0 and m["kvserve:spec_decode_verify_seconds_total"] > 0
    finally:
        s.close()


@pytest.mark.parametrize("param, layout", [("tiny", ()), ("default", ()), ("tiny", ("--tp", "2"))])
def test_a_conversation_continued_from_its_parked_kv_self_drafts_and_decodes_as_plainly(param, layout):
    # prefix_reuse: compressed: the resumed turn's self-drafts read the sinks and window of the rows it
    # holds (the first turn's kept positions, then its own), and the first turn's KV is trimmed to its
    # fed tokens before it is parked (speculation_cases.conversation_speculates_as_plainly); under TP
    # every rank trims and parks its shard alike.
    if param == "default" and not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made (make model)")
    s = Server(extra_yaml=SELF_YAML, model=str(DEFAULT_MODEL) if param == "default" else None, kv_cache_bytes="256MiB",
               extra_args=layout)
    try:
        conversation_speculates_as_plainly(s, param)
        assert "lost track" not in s.log()
    finally:
        s.close()


@pytest.mark.parametrize("layout, draft_policy", [
    (("--tp", "2"), False),
    (("--pp", "2", "--micro-batches", "2"), False),
    (("--tp", "2"), True),
])
def test_sharded_self_drafts_match_plain(layout, draft_policy):
    # Every rank runs each draft step on its shard through the view (a pipeline's stages in turn);
    # the sampling rank chooses the drafts and broadcasts them for the next step; every shard then
    # verifies and drops what was rejected. With draft_policy every shard also selects the view's
    # blocks of its own layers and heads (through the shards' score exchange).
    fixture = FIXTURES / "llama-kvfew"
    if not (fixture / "config.json").exists():
        pytest.skip("no llama-kvfew fixture")
    yaml = SELF_YAML + ("  draft_policy: snapkv\n  draft_budget: 48\n  draft_refresh_tokens: 8\n" if draft_policy else "")
    s = Server(model=str(fixture), extra_yaml=yaml, extra_args=layout)
    try:
        prompts = [f"{i}: " + STORY * (1 + i % 2) for i in range(4)]

        def run(i_spec):
            i, spec = i_spec
            return tokens(complete(s, {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                       "speculative": spec}))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            fast = list(pool.map(run, [(i, True) for i in range(4)]))
        slow = [run((i, False)) for i in range(4)]
        assert fast == slow
        for extra in ({"temperature": 0.9, "seed": 5}, {"temperature": 0, "kv_policy": "snapkv"}):
            a, b = both(s, {"prompt": prompts[1], "max_tokens": 16, "ignore_eos": True, **extra})
            assert tokens(a) == tokens(b), extra
        m = s.wait_idle()
        assert m["kvserve:spec_decode_draft_steps_total"] >= m["kvserve:spec_decode_verify_steps_total"] > 0
        assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert m["kvserve:spec_decode_draft_seconds_total"] > 0 and m["kvserve:spec_decode_verify_seconds_total"] > 0
        assert m["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()


def test_default_model_sharded_self_drafts_equal_one_process():
    # The trained model over 6 ranks (3 KV heads split 3 ways, 2 stages) with a snapkv draft view:
    # the tokens are the one-process plain run's, and most drafts are accepted.
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made (make model)")
    args = [kvserve_bin(), "generate", "--model", str(DEFAULT_MODEL), "--prompt", STORY * 3 + "Quote the first sentence:",
            "--max-tokens", "32", "--ignore-eos", "--json"]
    plain = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=300, check=True).stdout)
    spec = json.loads(subprocess.run(
        args + ["--tp", "3", "--pp", "2", "--speculative-config",
                '{"method": "self", "num_speculative_tokens": 4, "draft_sink_tokens": 16, "draft_window_tokens": 32, '
                '"draft_min_context_tokens": 0, "auto_disable": false, "draft_policy": "snapkv", "draft_budget": 48}'],
        capture_output=True, text=True, timeout=300, check=True).stdout)
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["speculative"]
    assert s["draft_steps"] >= s["verify_steps"] > 0 and s["draft_tokens"] > 0
    assert s["accepted_tokens"] / s["draft_tokens"] > 0.3, s


def test_self_draft_config_errors_name_the_field():
    bad = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", "x", "--speculative-config",
                          '{"method": "self", "num_speculative_tokens": 3, "draft_window_tokens": 0}'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--speculative-config: draft_window_tokens must be >= 1" in bad.stderr
    fixture = FIXTURES / "llama-kvfew"
    if not (fixture / "config.json").exists():
        return
    # A sharded job checks the draft policy on rank 0 before any worker changes.
    bad = subprocess.run([kvserve_bin(), "generate", "--model", str(fixture), "--prompt", "x", "--tp", "2",
                          "--speculative-config", '{"method": "self", "num_speculative_tokens": 3, "draft_policy": "nope"}'],
                         capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0 and "speculative_config.draft_policy: policy 'nope' is neither" in bad.stderr, \
        bad.stderr[-2000:]


def test_generate_json_reports_self_drafts():
    args = [kvserve_bin(), "generate", "--model", model_dir(), "--prompt", PROMPTS[0], "--max-tokens", "32",
            "--ignore-eos", "--json"]
    spec = subprocess.run(args + ["--speculative-config", '{"method": "self", "num_speculative_tokens": 3, '
                                  '"draft_sink_tokens": 16, "draft_window_tokens": 16, "draft_min_context_tokens": 0, '
                                  '"auto_disable": false}'],
                          capture_output=True, text=True, timeout=300, check=True)
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["config"] == {"method": "self", "num_speculative_tokens": 3, "disable_by_batch_size": 0, "auto_disable": False,
                           "draft_sink_tokens": 16, "draft_window_tokens": 16, "draft_min_context_tokens": 0,
                           "draft_sampling": "greedy"}
    assert s["drafts"] > 0 and s["draft_tokens"] >= s["drafts"]
    # Batch 1: every verify step follows at most num_speculative_tokens draft steps.
    assert 0 < s["verify_steps"] <= s["drafts"] and s["verify_steps"] <= s["draft_steps"] <= 3 * s["verify_steps"]
    assert s["draft_s"] > 0 and s["verify_s"] > 0
    assert p["speculative"]["draft_steps"] == 0 and p["speculative"]["verify_s"] == 0


def test_short_contexts_decode_plainly_by_default():
    # A draft step still reads every weight: below draft_min_context_tokens (default 4096) there is
    # nothing to gain, so a short prompt verifies no drafts.
    out = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", PROMPTS[0], "--max-tokens",
                          "16", "--json", "--speculative-config", '{"method": "self", "num_speculative_tokens": 3}'],
                         capture_output=True, text=True, timeout=300, check=True)
    s = json.loads(out.stdout)["speculative"]
    assert s["config"]["draft_min_context_tokens"] == 4096
    assert s["drafts"] == 0 and s["draft_steps"] == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_a_draft_view_from_a_policys_kept_set_changes_no_token(chunked):
    # draft_policy: the view adds, per layer, the blocks holding most of what snapkv keeps of the
    # prompt (budget 48 tokens), chosen as the prefill ends (whole, or at its last chunk of 40 tokens)
    # and again every 8 tokens from the latest decode queries.
    # Drafts only propose: every token must be plain decoding's.
    yaml = SELF_YAML + "  draft_policy: snapkv\n  draft_budget: 48\n  draft_refresh_tokens: 8\n"
    extra = ("--max-num-batched-tokens", "40", "--max-num-seqs", "4") if chunked else ()
    s = Server(extra_yaml=yaml, model=str(DEFAULT_MODEL), kv_cache_bytes="256MiB", extra_args=extra)
    try:
        before = counts(s)
        for p in PROMPTS + [STORY * 4 + "Quote the first sentence of the story:"]:
            a, b = both(s, {"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
            assert tokens(a) == tokens(b), p[:40]
        drafted, accepted = (x - y for x, y in zip(counts(s), before))
        assert drafted > 0 and 0 <= accepted <= drafted
        assert s.wait_idle()["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()


@pytest.mark.parametrize("config, fragments", [
    ('{"method": "self", "num_speculative_tokens": 3, "draft_policy": "nope"}',
     ["speculative_config.draft_policy: policy 'nope' is neither"]),
    ('{"method": "self", "num_speculative_tokens": 3, "draft_policy": "kvzip"}',
     ["policy 'kvzip'", "scores after the prefill"]),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "snapkv"}',
     ["draft_policy 'snapkv' needs method 'self'"]),
    ('{"method": "self", "num_speculative_tokens": 3, "draft_sampling": "nucleus"}',
     ["draft_sampling must be greedy or sample, got 'nucleus'"]),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_sampling": "sample"}',
     ["draft_sampling 'sample' needs method 'self'"]),
])
def test_self_draft_errors_name_the_field(config, fragments):
    bad = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", "x", "--speculative-config",
                          config], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and all(f in bad.stderr for f in fragments), bad.stderr


def test_sampled_drafts_keep_plain_samplings_distribution():
    # draft_sampling: sample draws a sampling request's drafts from the draft distribution and keeps
    # them by speculative sampling. The draft sees only the last 16 tokens, and the prompt asks to
    # repeat a list it cannot see, so its q is far from the full model's p: the first tokens of 480
    # seeded streams (choice k of a request with seed s draws from stream s + k: the seeds are 1000
    # apart) must still be distributed as those of 480 streams without speculation (a chi-square test
    # of homogeneity over the first three tokens); greedy requests stay token-identical.
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made")
    yaml = SELF_YAML.replace("draft_sink_tokens: 16", "draft_sink_tokens: 0").replace(
        "draft_window_tokens: 32", "draft_window_tokens: 16") + "  draft_sampling: sample\n"
    s = Server(extra_yaml=yaml, model=str(DEFAULT_MODEL), kv_cache_bytes="256MiB")
    prompt = ("Remember this list of numbers: 4 8 1 5 9 2 6 3 7 0.\n" + STORY +
              "\nNow repeat the list of numbers exactly: 4 8")
    try:
        a, b = both(s, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert tokens(a) == tokens(b)
        before = counts(s)
        fast, slow = [], []
        for seed in range(30):
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 1.0, "top_k": 5, "n": 16, "seed": 1000 * seed,
                    "ignore_eos": True}
            x, y = both(s, body)
            fast += [tuple(t) for t in tokens(x)]
            slow += [tuple(t) for t in tokens(y)]
        drafted, accepted = (p - q for p, q in zip(counts(s), before))
        assert drafted > 0 and 0 < accepted <= drafted
        stat, df = homogeneity(fast, slow)
        assert df >= 2 and stat < chi2_critical(df, 1e-3), (stat, df, collections.Counter(fast).most_common(6),
                                                            collections.Counter(slow).most_common(6))
        assert s.wait_idle()["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()


def test_auto_disable_pauses_self_drafts_that_do_not_pay():
    # On this CPU a draft step of the default model at a few hundred tokens costs nearly a plain
    # step, so a speculative step (drafts, then a verify step of several rows) emits fewer tokens per
    # second than a plain one: with auto_disable (the default) the engine measures that and pauses
    # speculation; the tokens stay plain decoding's.
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made")
    args = [kvserve_bin(), "generate", "--model", str(DEFAULT_MODEL), "--prompt", STORY * 4 + "What happened next?",
            "--max-tokens", "96", "--ignore-eos", "--json"]
    spec = subprocess.run(args + ["--speculative-config", '{"method": "self", "num_speculative_tokens": 4, '
                                  '"draft_sink_tokens": 16, "draft_window_tokens": 32, "draft_min_context_tokens": 0}'],
                          capture_output=True, text=True, timeout=300, check=True)
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["config"]["auto_disable"] is True
    assert s["drafts"] > 0 and s["pauses"] >= 1, s
    assert p["speculative"]["pauses"] == 0
