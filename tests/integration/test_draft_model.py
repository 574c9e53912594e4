"""Speculative decoding with a draft model (issue 49, `method: draft_model`): a quantized copy of the
served model (`quantization: int8 | int4`, or the default model's own Q4_1 GGUF file as `model`) drafts
over the sequence's whole KV, which the served model wrote, and the served model verifies. Its draft
slots are truncated before the verify step, so the output must be plain decoding's exactly: every
request here is compared with the same request sent with `"speculative": false`."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import subprocess

import pytest

from kvserve_server import Server, kvserve_bin, model_dir
from kvserve_server import choice_ids as tokens, complete_ids as complete, with_and_without_speculation as both
from speculation_cases import (COPY_DRAFTS, DEFAULT_MODEL, FIXTURES, GGUF, SAME_TOKEN_CASES, STORY, assert_same_as_plain,
                               chi2_critical, concurrent_rounds, copy_draft_server, counts, greedy_runs_match, homogeneity)
PROMPTS = [STORY + "What happened next?", "Write a short poem about autumn leaves and rain on the window.",
           STORY * 2 + "Summarise the story in one sentence:", "List five facts about the moon."]


def spec_yaml(**fields) -> str:
    # auto_disable off: the tests check what the speculative steps compute, not whether they pay.
    lines = ["speculative_config:", "  method: draft_model", "  num_speculative_tokens: 4", "  auto_disable: false"]
    lines += [f"  {k}: {v}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", params=COPY_DRAFTS)
def srv(request):
    s = copy_draft_server(request.param, spec_yaml)
    yield s
    s.close()


def test_greedy_is_token_identical_and_drafts_are_accepted(srv):
    drafted, accepted = greedy_runs_match(srv, PROMPTS)
    if srv.param == "default-gguf":
        # The GGUF holds the weights the float32 checkpoint was converted from: only the 8-bit
        # activations of its products and the cache's rounding part the two.
        assert accepted / drafted > 0.7, (drafted, accepted)
    assert srv.wait_idle()["kvserve:kv_cache_blocks_used"] == 0


@pytest.mark.parametrize("extra", SAME_TOKEN_CASES)
def test_same_tokens_as_plain_decoding(srv, extra):
    assert_same_as_plain(srv, PROMPTS[2], extra)


def test_concurrent_chunked_and_preempted_match():
    # Mixed draft counts in one step, chunked prefill beside draft steps, and preemption of sequences
    # that draft, in a pool too small for all of them; prefix caching on (the default).
    s = Server(extra_yaml=spec_yaml(quantization="int4"), kv_cache_bytes="2MiB",
               extra_args=("--max-num-batched-tokens", "96", "--max-num-seqs", "6"))
    try:
        m = concurrent_rounds(s, 8, 160)
        assert m["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert m["kvserve:num_preemptions_total"] > 0, "the pool was meant to preempt"
        assert m["kvserve:kv_cache_blocks_used"] == 0
        assert m["kvserve:spec_decode_draft_steps_total"] >= m["kvserve:spec_decode_verify_steps_total"] > 0
    finally:
        s.close()


def test_generate_json_reports_the_draft_model():
    args = [kvserve_bin(), "generate", "--model", model_dir(), "--prompt", PROMPTS[0], "--max-tokens", "32",
            "--ignore-eos", "--json"]
    spec = subprocess.run(args + ["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3, '
                                  '"quantization": "int8", "auto_disable": false}'],
                          capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr[-2000:]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["config"] == {"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 0,
                           "auto_disable": False, "model": "", "quantization": "int8", "draft_sampling": "greedy"}
    assert s["drafts"] > 0 and s["draft_tokens"] >= s["drafts"]
    assert 0 < s["verify_steps"] <= s["draft_steps"] <= 3 * s["verify_steps"]
    assert s["draft_s"] > 0 and s["verify_s"] > 0
    assert "the draft model is" in spec.stderr and "(q8_0+" in spec.stderr
    assert "a cache of its own" not in spec.stderr  # a quantized copy shares the served model's cache


def run_bad(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([kvserve_bin(), "generate", "--prompt", "x", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("config, fragments", [
    ('{"method": "draft_model", "num_speculative_tokens": 3}',
     ["--speculative-config: method 'draft_model' needs a model"]),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "quantization": "none"}',
     ["method 'draft_model' needs a model"]),
    ('{"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"}',
     ["model and quantization name a draft model: they need method 'draft_model'"]),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int8", "draft_policy": "snapkv"}',
     ["draft_policy 'snapkv' needs method 'self'"]),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "model": "/nonexistent/draft"}',
     ["speculative_config.model: the draft model /nonexistent/draft did not load"]),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "quantization": "int3"}',
     ["speculative_config.quantization: the draft model", "int3"]),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "model": 5}',
     ["--speculative-config: model must be a path, got 5"]),
])
def test_draft_model_errors_name_the_field(config, fragments):
    bad = run_bad("--model", model_dir(), "--speculative-config", config)
    assert bad.returncode != 0 and all(f in bad.stderr for f in fragments), bad.stderr[-2000:]


def test_a_draft_of_another_vocabulary_is_refused():
    other = FIXTURES / "qwen3"
    if not (other / "config.json").exists():
        pytest.skip("no qwen3 fixture")
    bad = run_bad("--model", model_dir(), "--speculative-config",
                  json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": str(other)}))
    assert bad.returncode != 0, bad.stderr[-2000:]
    assert f"speculative_config.model: {other} has vocab_size 1577 (the served model: 2119)" in bad.stderr, bad.stderr[-2000:]


def mha_copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The same model with every query head its own KV head (k / v rows repeated per group): it
    computes what `src` computes, with another KV layout, so it drafts over a cache of its own and
    should predict `src`'s tokens almost always, if that cache follows the sequence right."""
    import shutil
    from safetensors.torch import load_file, save_file
    cfg = json.loads((src / "config.json").read_text())
    g = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w = load_file(str(src / "model.safetensors"))
    for k in list(w):
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            t = w[k]
            w[k] = t.view(-1, d, t.shape[1]).repeat_interleave(g, dim=0).reshape(-1, t.shape[1]).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


@pytest.fixture(scope="module")
def mha_draft(tmp_path_factory):
    src = pathlib.Path(model_dir())
    cfg = json.loads((src / "config.json").read_text())
    if cfg["num_attention_heads"] == cfg["num_key_value_heads"]:
        pytest.skip("the test model has one KV head per query head already")
    return mha_copy(src, tmp_path_factory.mktemp("mha-draft"))


def test_a_draft_of_another_shape_drafts_over_its_own_cache(mha_draft):
    # Mixed draft counts, chunked prefill beside draft steps, preemption (the draft's cache is
    # released and prefilled again with the recomputed prompt), plain steps while the governor would
    # pause, seeded sampling: the output is plain decoding's, and the draft (the same function with
    # another KV layout) keeps predicting the served model, which it cannot if its cache lags or leads.
    # disable_by_batch_size: while more than 3 sequences decode the steps are plain, so the draft
    # runs their tokens when drafting resumes.
    s = Server(extra_yaml=spec_yaml(model=str(mha_draft), disable_by_batch_size=3), kv_cache_bytes="2MiB",
               extra_args=("--max-num-batched-tokens", "96", "--max-num-seqs", "6"))
    try:
        assert "it drafts over a cache of its own" in s.log() and "with a prefix cache" in s.log()
        m = concurrent_rounds(s, 8, 120)
        drafted, accepted = m["vllm:spec_decode_num_draft_tokens_total"], m["vllm:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and accepted / drafted > 0.9, (drafted, accepted)
        # ...and no sequence stopped drafting for a cache out of step.
        assert accepted > 200, (drafted, accepted)
        assert "lost track" not in s.log() and "could not prefill" not in s.log()
        assert m["kvserve:num_preemptions_total"] > 0, "the pool was meant to preempt"
        assert m["kvserve:kv_cache_blocks_used"] == 0
        for extra in ({"temperature": 0.9, "seed": 3, "n": 3}, {"temperature": 0, "stop": ["the"]},
                      {"temperature": 0, "kv_policy": "snapkv"}):
            a, b = both(s, {"prompt": PROMPTS[2], "max_tokens": 32, **extra})
            assert tokens(a) == tokens(b), extra
    finally:
        s.close()


def test_a_draft_of_another_shape_drafts_over_blocks_from_its_prefix_cache(mha_draft):
    # The same prompt twice: the second time the draft takes the prompt's full blocks from its own
    # prefix cache (as the served model does from its own) and prefills only the rest. Its drafts over
    # those blocks predict the served model as well as the first time's, and the output is the same.
    s = Server(extra_yaml=spec_yaml(model=str(mha_draft)), kv_cache_bytes="64MiB")
    try:
        body = {"prompt": STORY * 3 + "Go on:", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        runs, hits = [], []
        for _ in range(2):
            before = counts(s)
            out = tokens(complete(s, body))
            runs.append((out, *(x - y for x, y in zip(counts(s), before))))
            hits.append(s.metrics()["kvserve:spec_decode_draft_prefix_cache_hits_total"])
        assert runs[0][0] == runs[1][0]
        # The draft's own prefix cache: nothing the first time, the prompt's full blocks the second.
        assert hits[0] == 0 and hits[1] > 0 and hits[1] % 16 == 0, hits
        for _, drafted, accepted in runs:
            assert drafted > 0 and accepted / drafted > 0.9, runs
        m = s.wait_idle()
        assert m["kvserve:prefix_cache_hits_total"] > 0
        assert m["kvserve:kv_cache_blocks_used"] == 0
        assert "lost track" not in s.log() and "could not prefill" not in s.log()
    finally:
        s.close()


def test_a_draft_of_another_shape_follows_a_conversation_resumed_from_its_parked_kv(mha_draft):
    # prefix_reuse: compressed: the second turn continues the served model's parked, compressed KV.
    # The draft prefills that whole prompt in its own cache (the first turn's blocks from its own
    # prefix cache) and drafts for it: both turns speculate, and decode as they do without. (Few
    # drafts are kept: the served model reads snapkv's 24 kept positions, the draft every position.)
    s = Server(extra_yaml=spec_yaml(model=str(mha_draft)), kv_cache_bytes="64MiB")
    try:
        prompt = [5 + (i * 37) % 900 for i in range(100)]

        def conversation(spec: bool):
            common = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "kv_policy": "snapkv",
                      "prefix_reuse": "compressed", "speculative": spec}
            first = complete(s, {"prompt": prompt, **common})
            ids = first["choices"][0]["token_ids"]
            before, hits = counts(s), s.metrics()["kvserve:spec_decode_draft_prefix_cache_hits_total"]
            second = complete(s, {"prompt": prompt + ids + prompt[:10], **common})
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + len(ids) - 1
            drafted, accepted = (x - y for x, y in zip(counts(s), before))
            hits = s.metrics()["kvserve:spec_decode_draft_prefix_cache_hits_total"] - hits
            return ids, second["choices"][0]["token_ids"], drafted, accepted, hits

        fast, slow = conversation(True), conversation(False)
        assert fast[:2] == slow[:2]
        drafted, accepted, hits = fast[2:]
        assert drafted > 0 and hits > 0, fast[2:]
        assert slow[2:] == (0, 0, 0)
        assert "lost track" not in s.log() and "could not prefill" not in s.log()
    finally:
        s.close()


@pytest.mark.parametrize("layout", [("--pp", "2"), ("--tp", "2")])
def test_a_draft_of_another_shape_drafts_on_the_sampling_rank(mha_draft, layout):
    # Under parallelism the rank that samples holds the whole draft and its cache, drafts alone and
    # broadcasts the drafts; every shard verifies. The draft predicts the served model, so a cache
    # out of step there shows as rejected drafts.
    s = Server(extra_yaml=spec_yaml(model=str(mha_draft)), kv_cache_bytes="64MiB", extra_args=layout)
    try:
        # Under --tp the sampling rank is rank 0; under --pp the last stage's.
        assert "it drafts over a cache of its own" in s.log()
        assert ("which samples" in s.log()) == (layout[0] == "--pp")
        drafted, accepted = greedy_runs_match(s, PROMPTS[:3], 32)
        assert accepted / drafted > 0.9, (drafted, accepted)
        # Seeded sampling (greedy drafts, so fewer are kept).
        a, b = both(s, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.9, "seed": 5, "n": 3})
        assert tokens(a) == tokens(b)
        assert "lost track" not in s.log()
        m = s.wait_idle()
        assert m["kvserve:kv_cache_blocks_used"] == 0
        # PROMPTS[0] ran several times: the sampling rank's draft took its blocks from its own prefix
        # cache, and rank 0 reports it.
        assert m["kvserve:spec_decode_draft_prefix_cache_hits_total"] > 0
    finally:
        s.close()


def test_self_with_a_draft_of_another_shape_is_refused_under_parallelism(mha_draft):
    bad = run_bad("--model", model_dir(), "--pp", "2", "--speculative-config",
                  json.dumps({"method": "self", "num_speculative_tokens": 3, "model": str(mha_draft)}))
    assert bad.returncode != 0, bad.stderr[-2000:]
    assert ("method 'self' drafts over the served model's KV, so its draft model must share the served model's KV layout"
            in bad.stderr and "num_key_value_heads 4 (the served model: 2)" in bad.stderr), bad.stderr[-2000:]


@pytest.mark.parametrize("layout", [("--pp", "2"), ("--pp", "2", "--micro-batches", "2")])
def test_sharded_draft_model_matches_plain(layout):
    # Every rank loads its slice of the draft (here a stage's layers) and runs every draft step on
    # it; the sampling rank chooses the drafts and broadcasts them; every shard then verifies.
    s = Server(extra_yaml=spec_yaml(quantization="int8"), extra_args=layout)
    try:
        before = counts(s)
        for p in PROMPTS[:3]:
            a, b = both(s, {"prompt": p, "max_tokens": 32, "temperature": 0, "ignore_eos": True})
            assert tokens(a) == tokens(b), p[:40]
        a, b = both(s, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0.9, "seed": 5, "n": 3})
        assert tokens(a) == tokens(b)

        def run(i_spec):
            i, spec = i_spec
            return tokens(complete(s, {"prompt": PROMPTS[i % 4], "max_tokens": 24, "temperature": 0,
                                       "ignore_eos": True, "speculative": spec}))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            fast = list(pool.map(run, [(i, True) for i in range(4)]))
        assert fast == [run((i, False)) for i in range(4)]
        drafted, accepted = (x - y for x, y in zip(counts(s), before))
        assert drafted > 0 and 0 <= accepted <= drafted
        m = s.wait_idle()
        assert m["kvserve:kv_cache_blocks_used"] == 0
        assert m["kvserve:spec_decode_draft_steps_total"] >= m["kvserve:spec_decode_verify_steps_total"] > 0
    finally:
        s.close()


def test_default_model_tp3_gguf_draft_equals_one_process():
    # The GGUF's blocks split over 3 tensor-parallel ranks (576 / 3 and 1536 / 3 columns: whole
    # blocks), drafting for the float32 checkpoint split alike: the one-process plain run's tokens.
    if not GGUF.exists():
        pytest.skip("the default model is not made")
    prompt = STORY * 2 + "Summarise the story in one sentence:"
    args = [kvserve_bin(), "generate", "--model", str(DEFAULT_MODEL), "--prompt", prompt, "--max-tokens", "40",
            "--ignore-eos", "--json"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    spec = subprocess.run(args + ["--tp", "3", "--speculative-config",
                                  json.dumps({"method": "draft_model", "num_speculative_tokens": 5, "model": str(GGUF),
                                              "auto_disable": False})],
                          capture_output=True, text=True, timeout=600)
    assert spec.returncode == 0, spec.stderr[-2000:]
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["draft_tokens"] > 0 and s["accepted_tokens"] / s["draft_tokens"] > 0.7, s


def test_yaml_speculative_config_takes_a_draft_model(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"model:\n  path: {model_dir()}\nspeculative_config:\n  method: drafts\n  model: 3\n")
    out = subprocess.run([kvserve_bin(), "config", "check", str(cfg)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "must be one of none, ngram, self, draft_model; got 'drafts'" in out.stdout + out.stderr


def test_sampled_drafts_keep_plain_samplings_distribution():
    # draft_sampling: sample draws a sampling request's drafts from the int4 draft's distribution and
    # keeps them by speculative sampling: the first three tokens of 480 seeded streams must be
    # distributed as those of 480 streams without speculation (chi-square test of homogeneity).
    s = Server(extra_yaml=spec_yaml(quantization="int4", draft_sampling="sample"), kv_cache_bytes="256MiB")
    try:
        before = counts(s)
        fast, slow = [], []
        for seed in range(30):
            body = {"prompt": STORY, "max_tokens": 3, "temperature": 1.0, "top_k": 5, "n": 16, "seed": 1000 * seed,
                    "ignore_eos": True}
            x, y = both(s, body)
            fast += [tuple(t) for t in tokens(x)]
            slow += [tuple(t) for t in tokens(y)]
        drafted, accepted = (p - q for p, q in zip(counts(s), before))
        assert drafted > 0 and 0 < accepted < drafted
        stat, df = homogeneity(fast, slow)
        assert df >= 2 and stat < chi2_critical(df, 1e-3), (stat, df)
        assert s.wait_idle()["kvserve:kv_cache_blocks_used"] == 0
    finally:
        s.close()
