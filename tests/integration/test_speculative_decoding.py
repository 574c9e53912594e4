"""Speculative decoding (issue 49), prompt lookup: one server with `speculative_config`, every request
compared with the same request sent with `"speculative": false` (plain decoding, one token a step).
Greedy and seeded sampling give the same tokens, with stop strings, max_tokens, logprobs, penalties,
structured outputs, n > 1, compressing policies, chunked prefill and preemption; /metrics counts drafts
and accepted tokens as vLLM names them; `generate --json` reports the acceptance rate."""
from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import subprocess

import pytest

from kvserve_server import Server, kvserve_bin, model_dir, raw
from kvserve_server import choice_ids as tokens, complete_ids as complete, with_and_without_speculation as both
from speculation_cases import (COPY, DEFAULT_MODEL, FIXTURES, PASSAGE, conversation_speculates_as_plainly,
                               drop_parted_stream)

# auto_disable off: these tests check what speculative steps compute, and on the tiny fixture the
# governor may well find that they do not pay (test_self_speculation.py tests the governor).
SPEC_YAML = """speculative_config:
  method: ngram
  num_speculative_tokens: 5
  prompt_lookup_min: 1
  prompt_lookup_max: 3
  auto_disable: false
"""


@pytest.fixture(scope="module", params=["tiny", "default"])
def srv(request):
    """The random-weights fixture (few drafts accepted) and the default model, which copies the passage
    (most drafts accepted, so runs of accepted tokens meet stop strings, max_tokens and grammars)."""
    if request.param == "default" and not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made (make model)")
    s = Server(extra_yaml=SPEC_YAML, model=str(DEFAULT_MODEL) if request.param == "default" else None,
               kv_cache_bytes="256MiB")
    s.param = request.param
    yield s
    s.close()


def spec_counts(srv) -> tuple[float, float, float]:
    m = srv.metrics()
    return (m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"],
            m["vllm:spec_decode_num_accepted_tokens_total"])


def test_greedy_copy_is_token_identical_and_accepts_drafts(srv):
    before = spec_counts(srv)
    a, b = both(srv, {"prompt": COPY, "max_tokens": 64, "temperature": 0})
    assert tokens(a) == tokens(b)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    usage = lambda r: {k: v for k, v in r["usage"].items() if k != "prompt_tokens_details"}  # the second hits the cache
    assert usage(a) == usage(b)
    drafts, draft_tokens, accepted = (x - y for x, y in zip(spec_counts(srv), before))
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens, (drafts, draft_tokens, accepted)
    if srv.param == "default":  # it copies: verify steps accept runs of drafts
        assert accepted >= drafts, (drafts, draft_tokens, accepted)
        assert srv.metrics()['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"}'] > 0
    m = srv.metrics()
    assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'] > 0
    # The opt-out request verified nothing: one more plain request leaves the counters alone.
    before = spec_counts(srv)
    complete(srv, {"prompt": COPY, "max_tokens": 16, "temperature": 0, "speculative": False})
    assert spec_counts(srv) == before


@pytest.mark.parametrize("extra", [
    {"seed": 2},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5},
    {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.4},
    {"temperature": 0, "logprobs": 3},
    {"temperature": 0, "stop": ["lake"]},
    {"temperature": 0, "max_tokens": 7},
    {"temperature": 0, "min_tokens": 30, "max_tokens": 40},
    {"temperature": 0.8, "seed": 3, "n": 3},
    # Sixteen seeded streams (seed + k each): each draws the same tokens as without speculation, which
    # is the sampling distribution's equality sample by sample (one may part: drop_parted_stream).
    {"temperature": 1.0, "seed": 100, "n": 16, "max_tokens": 24},
    {"temperature": 0, "kv_policy": "snapkv"},
    {"temperature": 0, "kv_policy": "pyramidkv"},
])
def test_same_tokens_as_plain_decoding(srv, extra):
    body = {"prompt": COPY, "max_tokens": 48, **extra}
    a, b = both(srv, body)
    drop_parted_stream(a, b, extra)
    assert tokens(a) == tokens(b), extra
    for ca, cb in zip(a["choices"], b["choices"]):
        assert ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"]
        if "logprobs" in extra:
            la, lb = ca["logprobs"], cb["logprobs"]
            assert la["tokens"] == lb["tokens"]
            assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
            assert [sorted(t) for t in la["top_logprobs"]] == [sorted(t) for t in lb["top_logprobs"]]
    if "stop" in extra:
        assert "lake" not in a["choices"][0]["text"]
    if extra.get("max_tokens") == 7:
        assert len(tokens(a)[0]) == 7 and a["choices"][0]["finish_reason"] == "length"


def test_verify_steps_of_many_rows_match_plain_steps(srv):
    # Eight seeded streams whose verify steps hold up to 48 rows, against plain steps of 8: the same
    # tokens and logprobs. A decode step gives a row the same bits whatever the step's row count, and
    # the eight prompts are prefilled alike in both runs (one request's choices are queued together,
    # and both runs find the prompt's blocks in the prefix cache): in measured runs the logprobs are
    # equal to the bit; 1e-4 and drop_parted_stream leave room for a prefill's last bits.
    body = {"prompt": COPY, "max_tokens": 32, "temperature": 1.0, "seed": 7, "n": 8, "logprobs": 2}
    a, b = both(srv, body)
    drop_parted_stream(a, b, body)
    assert tokens(a) == tokens(b)
    for ca, cb in zip(a["choices"], b["choices"]):
        assert ca["logprobs"]["token_logprobs"] == pytest.approx(cb["logprobs"]["token_logprobs"], abs=1e-4)
        assert [sorted(t) for t in ca["logprobs"]["top_logprobs"]] == [sorted(t) for t in cb["logprobs"]["top_logprobs"]]


def test_structured_output_follows_its_grammar_under_speculation(srv):
    # A regex the passage's copy would break: drafts the grammar refuses are rejected.
    body = {"prompt": COPY, "max_tokens": 24, "temperature": 0, "guided_regex": "(the river runs )+[a-z ]{0,12}"}
    a, b = both(srv, body)
    assert tokens(a) == tokens(b)
    assert re.fullmatch("(the river runs )+[a-z ]{0,12}", a["choices"][0]["text"]), a["choices"][0]["text"]


def test_concurrent_requests_chunked_and_preempted_match(srv):
    # Many long copy prompts at once in a small pool: chunked prefill, mixed accept counts in one
    # step, and preemption (recompute) of speculating sequences.
    small = Server(extra_yaml=SPEC_YAML, kv_cache_bytes="3MiB",
                   extra_args=("--max-num-batched-tokens", "96", "--max-num-seqs", "6"))
    try:
        prompts = [f"Copy {i}: " + PASSAGE * (2 + i % 3) + PASSAGE[: 10 + 7 * i] for i in range(8)]

        def run(i_spec):
            i, spec = i_spec
            return tokens(complete(small, {"prompt": prompts[i], "max_tokens": 40, "temperature": 0,
                                           "speculative": spec}))

        # Whether the requests overlap enough to preempt depends on when they arrive: on a loaded
        # machine one round may not, so up to three rounds run (each compared as a whole).
        for _ in range(3):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                fast = list(pool.map(run, [(i, True) for i in range(8)]))
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                slow = list(pool.map(run, [(i, False) for i in range(8)]))
            assert fast == slow
            m = small.wait_idle()
            if m["kvserve:num_preemptions_total"] > 0:
                break
        assert m["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert m["kvserve:num_preemptions_total"] > 0, "the pool was meant to preempt"
    finally:
        small.close()


@pytest.mark.parametrize("param", ["tiny", "default"])
def test_a_conversation_continued_from_its_parked_kv_speculates_and_decodes_as_plainly(param):
    # Prompt lookup over a conversation's turns (speculation_cases.conversation_speculates_as_plainly).
    # A server of its own: parked conversations keep their blocks.
    if param == "default" and not (DEFAULT_MODEL / "config.json").exists():
        pytest.skip("the default model is not made (make model)")
    srv = Server(extra_yaml=SPEC_YAML, model=str(DEFAULT_MODEL) if param == "default" else None, kv_cache_bytes="256MiB")
    try:
        conversation_speculates_as_plainly(srv, param)
    finally:
        srv.close()


def test_decode_evicting_policy_decodes_plainly():
    s = Server(extra_yaml="  streaming:\n    method: streamingllm\n    budget: 32\n    window: 8\n    decode_budget: 40\n"
               + SPEC_YAML)
    try:
        a, b = both(s, {"prompt": COPY, "max_tokens": 40, "temperature": 0, "kv_policy": "streaming"})
        assert tokens(a) == tokens(b)
        assert s.metrics()["vllm:spec_decode_num_drafts_total"] == 0
    finally:
        s.close()


ROLLOUT_SPEC = """rollout:
  rules:
    - name: plain
      match: {headers: {x-tenant: plain}}
      policy: full
      speculative: false
    - name: one-draft
      match: {headers: {x-tenant: one}}
      policy: full
      speculative: {num_speculative_tokens: 1}
"""


def test_rollout_rules_turn_speculation_off_or_cap_it_and_models_names_the_config(tmp_path):
    s = Server(extra_yaml=SPEC_YAML + ROLLOUT_SPEC)
    try:
        status, _, data = raw(s, "GET", "/v1/models")
        assert status == 200
        assert json.loads(data)["data"][0]["speculative_config"] == {
            "method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": 0, "auto_disable": False,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}

        def send(tenant: str | None) -> list[list[int]]:
            body = json.dumps({"model": "tiny", "prompt": COPY, "max_tokens": 48, "temperature": 0,
                               "return_token_ids": True})
            status, headers, data = raw(s, "POST", "/v1/completions", body, {"x-tenant": tenant} if tenant else None)
            assert status == 200, data
            rule = {k.lower(): v for k, v in headers.items()}.get("x-kv-rollout-rule")
            assert rule == ({"plain": "plain", "one": "one-draft"}[tenant] if tenant else "default")
            return tokens(json.loads(data))

        before = spec_counts(s)
        plain = send("plain")
        assert spec_counts(s) == before  # the rule's requests verify nothing
        one = send("one")
        drafts, draft_tokens, _ = (x - y for x, y in zip(spec_counts(s), before))
        assert drafts > 0 and draft_tokens == drafts, (drafts, draft_tokens)  # one draft token a step at most
        before = spec_counts(s)
        full = send(None)
        drafts, draft_tokens, _ = (x - y for x, y in zip(spec_counts(s), before))
        assert draft_tokens > drafts, (drafts, draft_tokens)  # the server's own gamma elsewhere
        assert plain == one == full
    finally:
        s.close()
    good = tmp_path / "good.yaml"  # the CLI shows what each rule does to speculation
    good.write_text(f"model:\n  path: {model_dir()}\npolicies:\n  full: {{}}\n" + SPEC_YAML + ROLLOUT_SPEC)
    listed = subprocess.run([kvserve_bin(), "config", "check", str(good)], capture_output=True, text=True, timeout=60)
    assert "plain -> full, no speculation" in listed.stdout and "one-draft -> full, at most 1 draft tokens" in listed.stdout
    explained = subprocess.run([kvserve_bin(), "config", "explain", str(good), "--header", "x-tenant=one"],
                               capture_output=True, text=True, timeout=60)
    assert "rule: one-draft" in explained.stdout and "speculative: at most 1 draft tokens" in explained.stdout
    cfg = tmp_path / "bad.yaml"  # a bad rule value is a config error naming the key
    cfg.write_text(f"model:\n  path: {model_dir()}\npolicies:\n  full: {{}}\nrollout:\n  rules:\n"
                   "    - name: r\n      policy: full\n      speculative: sometimes\n")
    out = subprocess.run([kvserve_bin(), "serve", "--config", str(cfg), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "rollout.rules[0].speculative" in out.stderr and "sometimes" in out.stderr, out.stderr


def test_request_field_and_config_errors(srv, tmp_path):
    status, _, data = raw(srv, "POST", "/v1/completions",
                          json.dumps({"model": "tiny", "prompt": "x", "speculative": "no"}))
    assert status == 400 and "speculative" in json.loads(data)["error"]["message"]
    bad = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", "x",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--speculative-config: num_speculative_tokens must be in [1, 64]" in bad.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {model_dir()}\nspeculative_config:\n  method: medusa\n")
    bad = subprocess.run([kvserve_bin(), "serve", "--config", str(cfg), "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "speculative_config.method" in bad.stderr and "medusa" in bad.stderr


def test_generate_json_reports_acceptance():
    out = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", COPY, "--max-tokens", "48",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                          '"auto_disable": false}',
                          "--json"], capture_output=True, text=True, timeout=300, check=True)
    plain = subprocess.run([kvserve_bin(), "generate", "--model", model_dir(), "--prompt", COPY, "--max-tokens", "48",
                            "--json"], capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(out.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"]
    s = j["speculative"]
    assert s["config"]["method"] == "ngram" and s["config"]["num_speculative_tokens"] == 4
    assert s["drafts"] > 0 and s["draft_tokens"] >= s["drafts"] and 0 <= s["acceptance_rate"] <= 1
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"])
    assert p["speculative"]["config"] is None and p["speculative"]["drafts"] == 0


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2", "--micro-batches", "2")])
def test_sharded_speculation_matches_plain(layout):
    # Every shard appends a verify step's rows and drops the rejected ones; the sampling rank
    # verifies and tells rank 0 each sequence's count. Concurrent requests split the step's rows
    # into pipeline micro-batches.
    if not (FIXTURES / "llama-kvfew" / "config.json").exists():
        pytest.skip("no llama-kvfew fixture")
    # The governor on (the default): the sampling rank times each step's decode part and rank 0
    # reports it (kvserve:spec_decode_verify_seconds_total), which the governor judges.
    s = Server(model=str(FIXTURES / "llama-kvfew"), extra_yaml=SPEC_YAML.replace("  auto_disable: false\n", ""),
               extra_args=layout)
    try:
        prompts = [COPY[i * 7:] for i in range(4)]

        def run(i_spec):
            i, spec = i_spec
            return tokens(complete(s, {"prompt": prompts[i], "max_tokens": 32, "temperature": 0, "speculative": spec}))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            fast = list(pool.map(run, [(i, True) for i in range(4)]))
        slow = [run((i, False)) for i in range(4)]
        assert fast == slow
        m = s.wait_idle()
        assert m["vllm:spec_decode_num_drafts_total"] > 0
        assert m["kvserve:spec_decode_verify_steps_total"] > 0
        assert m["kvserve:spec_decode_verify_seconds_total"] > 0
    finally:
        s.close()


def test_disconnects_and_finishes_mid_verify_free_every_block(srv):
    # Streams cut after a few chunks (their sequences cancelled between a verify step and the
    # truncation of its rejected rows) beside streams that run to a stop string inside a run of
    # accepted drafts: once all are over, no block is held and the server still answers.
    def cut(i: int) -> None:
        body = json.dumps({"model": "tiny", "prompt": COPY[i:], "max_tokens": 200, "stream": True,
                           "ignore_eos": True}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data: ") < 2 + i % 5:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
        sock.close()

    def stop(i: int) -> str:
        return complete(srv, {"prompt": COPY[i:], "max_tokens": 60, "temperature": 0, "stop": ["bridge", "lake"]})[
            "choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        cuts = [pool.submit(cut, i) for i in range(6)]
        stops = [pool.submit(stop, i) for i in range(6)]
        for f in cuts:
            f.result()
        assert {f.result() for f in stops} <= {"stop", "length"}
    m = srv.wait_idle(30)
    assert m["kvserve:kv_cache_blocks_used"] == 0
    assert raw(srv, "GET", "/health")[0] == 200
