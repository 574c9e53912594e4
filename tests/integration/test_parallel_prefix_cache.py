"""Prefix caching under tensor and pipeline parallelism (issue 23): each shard caches its own layers
and KV heads, rank 0 makes the lookup and the shards agree on it; questions about one document give
the same greedy text and kept KV as one process without the cache, for `full` and the compressing
policies (DynamicKV's scores cross the pipeline; with 1 KV head over 2 TP ranks the window's queries
are gathered), and the hits show in usage and /metrics. A conversation's second turn under
`prefix_reuse: compressed` continues from the first turn's parked KV on every shard, as in one process.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import time
import urllib.request

import pytest

from kvserve_server import Server

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = 120  # 7 full blocks of 16 and a bit
POLICIES = ["full", "snapkv", "pyramidkv", "dynamickv"]
EXTRA = """  dynamickv:
    budget: 24
    window: 4
"""


def fixture(name: str) -> str:
    path = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", REPO / ".fixtures")) / name
    if not (path / "config.json").exists():
        pytest.skip(f"fixture {name} missing (run make fixtures)")
    return str(path)


def tokens(seed: int, n: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab) for _ in range(n)]


def completion(url: str, prompt: list[int], policy: str, **extra) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                       "kv_policy": policy, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def workload(policy: str) -> list[list[int]]:
    doc = tokens(POLICIES.index(policy) + 1, DOC)
    return [doc + tokens(100 + q, 12) for q in range(3)]


def conversation(url: str, policy: str) -> dict:
    """Two turns, the second continuing the first's compressed KV: the second turn's response."""
    doc = tokens(50 + POLICIES.index(policy), DOC)
    first = completion(url, doc, policy, prefix_reuse="compressed", return_token_ids=True)
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 6
    second = completion(url, doc + answer + tokens(60, 10), policy, prefix_reuse="compressed")
    # The first turn's prompt and every generated token but the last (never fed) were parked.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == DOC + 5, second["usage"]
    return second


@pytest.fixture(scope="module")
def reference():
    """One process, no prefix cache: what every sharded run must reproduce."""
    s = Server(model=fixture("llama-kvfew"), extra_yaml=EXTRA, extra_args=("--no-enable-prefix-caching",))
    try:
        out = {p: [completion(s.url, prompt, p) for prompt in workload(p)] for p in POLICIES}
        out["conversation"] = {p: conversation(s.url, p) for p in POLICIES[1:]}
        yield out
    finally:
        s.stop()
        s.tmp.cleanup()


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ("--tp", "2", "--pp", "2")])
def test_sharded_prefix_cache_equals_one_process_without_it(layout, reference):
    s = Server(model=fixture("llama-kvfew"), extra_yaml=EXTRA, extra_args=layout)
    try:
        before = s.metrics()
        hits = 0
        for policy in POLICIES:
            cached = []
            for q, prompt in enumerate(workload(policy)):
                got, want = completion(s.url, prompt, policy), reference[policy][q]
                assert got["choices"][0]["text"] == want["choices"][0]["text"], (layout, policy, q)
                assert got["usage"]["kv_kept_tokens"] == want["usage"]["kv_kept_tokens"], (layout, policy, q)
                cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
            # The document's whole blocks (the window and the last token are always computed).
            assert cached == [0, DOC // 16 * 16, DOC // 16 * 16], (layout, policy, cached)
            hits += sum(cached)
        after = s.metrics()
        assert after["kvserve:prefix_cache_hits_total"] - before["kvserve:prefix_cache_hits_total"] == hits
        assert after["kvserve:kv_cache_blocks_cached"] > 0
        assert after['kvserve:prefix_cache_bytes{model_name="tiny",tier="pool"}'] > 0
        # Requests are over: no block is held by one within a step of the last response (idle cached
        # blocks count as free).
        m = s.wait_idle(10)
        for policy in POLICIES[1:]:
            got, want = conversation(s.url, policy), reference["conversation"][policy]
            assert got["choices"][0]["text"] == want["choices"][0]["text"], (layout, policy)
            assert got["usage"]["kv_kept_tokens"] == want["usage"]["kv_kept_tokens"], (layout, policy)
        # The last turn is parked in the engine step that sends its response; /metrics shows it once
        # that step has recorded the pools' usage.
        deadline = time.time() + 10
        m = s.metrics()
        while m["kvserve:conversations_parked"] != len(POLICIES) - 1 and time.time() < deadline:
            time.sleep(0.05)
            m = s.metrics()
        assert m["kvserve:conversations_parked"] == len(POLICIES) - 1
        assert m['kvserve:prefix_cache_bytes{model_name="tiny",tier="conversation"}'] > 0
    finally:
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
    assert rc == 0, log[-4000:]


def test_sharded_host_tier_equals_one_process_without_a_cache(reference):
    """cache.prefix_cache_bytes under TP 2 x PP 2: every shard has its own host tier. The pool
    (64 KiB a shard: 32 blocks on the first stage, which holds 2 of the 3 layers, 32 single-layer
    blocks on the second) is short on the first stage only, so an unrelated prompt moves the
    document's blocks to the tier there while the second stage keeps them in its pool; the next
    question still takes the whole document from the cache on every shard, with one process's text.
    DynamicKV's first prompt here (candidates of every layer at its peak) leaves no room for a cache
    copy on the first stage: the scheduler must see that from the shard's geometry (a sharded job
    once sent it without `prefix_caching`, so copies were made without room and the job died)."""
    s = Server(model=fixture("llama-kvfew"), extra_yaml=EXTRA, kv_cache_bytes="64KiB",
               extra_args=("--tp", "2", "--pp", "2", "--prefix-cache-bytes", "64KiB"))
    try:
        for i, policy in enumerate(POLICIES):
            first, second = workload(policy)[:2]
            assert completion(s.url, first, policy)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            before = s.metrics()
            completion(s.url, tokens(900 + i, DOC + 30), policy)
            moved = s.metrics()
            got, want = completion(s.url, second, policy), reference[policy][1]
            assert got["choices"][0]["text"] == want["choices"][0]["text"], policy
            assert got["usage"]["kv_kept_tokens"] == want["usage"]["kv_kept_tokens"], policy
            if policy == "dynamickv":
                # No room for the copy at admission: the document was never cached, nothing failed.
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, got["usage"]
                continue
            assert moved["kvserve:prefix_cache_host_stores_total"] > before["kvserve:prefix_cache_host_stores_total"], policy
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == DOC // 16 * 16, (policy, got["usage"])
            assert s.metrics()["kvserve:prefix_cache_host_loads_total"] > moved["kvserve:prefix_cache_host_loads_total"], policy
    finally:
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
    assert rc == 0, log[-4000:]


# Compressed contexts (issue 32) under TP / PP: every shard compresses its layers and heads of a
# completion's kv_context under kvzip and caches them; rank 0 asks whether the context is cached and
# the shards agree before any of them takes it.
KVZIP = "  kvzip:\n    budget: 24\n"
CONTEXT_MODELS = ["llama-kvfew", "gemma3"]


def context_requests(model: str) -> list[tuple[list[int], list[int]]]:
    """(kv_context, prompt) pairs: one context asked three questions, then another context."""
    seed = CONTEXT_MODELS.index(model)
    ctx, other = tokens(70 + seed, DOC), tokens(80 + seed, DOC - 17)
    return [(ctx, tokens(200 + q, 10)) for q in range(3)] + [(other, tokens(300, 9))]


def ask_with_context(url: str, context: list[int], prompt: list[int]) -> dict:
    return completion(url, prompt, "kvzip", kv_context=context)


@pytest.fixture(scope="module")
def context_reference():
    """One process with the context cache off: each question compresses its context afresh."""
    out = {}
    for model in CONTEXT_MODELS:
        s = Server(model=fixture(model), extra_yaml=KVZIP, extra_args=("--no-enable-context-caching",))
        try:
            out[model] = [ask_with_context(s.url, c, p) for c, p in context_requests(model)]
        finally:
            rc = s.stop()
            log = s.log()
            s.tmp.cleanup()
        assert rc == 0, log[-4000:]
    return out


@pytest.mark.parametrize("model", CONTEXT_MODELS)
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ("--tp", "2", "--pp", "2")])
def test_sharded_compressed_context_equals_one_process(layout, model, context_reference):
    s = Server(model=fixture(model), extra_yaml=KVZIP, extra_args=layout)
    try:
        cached = []
        for i, (c, p) in enumerate(context_requests(model)):
            got, want = ask_with_context(s.url, c, p), context_reference[model][i]
            assert got["choices"][0]["text"] == want["choices"][0]["text"], (layout, model, i)
            assert got["usage"]["kv_kept_tokens"] == want["usage"]["kv_kept_tokens"], (layout, model, i)
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, DOC, DOC, 0], (layout, model, cached)
        m = s.metrics()
        assert m["kvserve:compressed_contexts"] == 2, m
        assert 0 < m["kvserve:kv_cache_blocks_compressed_contexts"] < m["kvserve:compressed_context_full_blocks"]
        m = s.wait_idle(10)
        assert m["kvserve:num_requests_running"] == 0
    finally:
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
    assert rc == 0, log[-4000:]
