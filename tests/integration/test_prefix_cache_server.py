"""Prefix caching through a real server: questions about one document, with the cache on (the
default) and off (`--no-enable-prefix-caching`), give the same greedy text and kept KV under full
and compressing policies; the official openai client reads `usage.prompt_tokens_details.cached_tokens`;
`/metrics` counts the lookups and shows the cached blocks; cancelled requests leave no block held.
"""
from __future__ import annotations

import json
import random
import urllib.request

import openai
import pytest

from kvserve_server import Server, kvserve_bin, model_dir

DOC = 200  # 12 full blocks of 16 and a bit


def completion(url: str, prompt: list[int], policy: str, max_tokens: int = 8) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "kv_policy": policy}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def servers():
    on = Server()
    off = Server(extra_args=("--no-enable-prefix-caching",))
    yield on, off
    for s in (on, off):
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
        assert rc == 0, log[-4000:]


def tokens(seed: int, n: int, vocab: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("policy", ["full", "snapkv", "pyramidkv"])
def test_questions_on_one_document_equal_the_uncached_server(servers, policy):
    on, off = servers
    doc = tokens({"full": 1, "snapkv": 2, "pyramidkv": 3}[policy], DOC)
    before = on.metrics()
    cached = []
    for q in range(3):
        prompt = doc + tokens(100 + q, 20)
        a, b = completion(on.url, prompt, policy), completion(off.url, prompt, policy)
        assert a["choices"][0]["text"] == b["choices"][0]["text"], (policy, q)
        assert a["usage"]["kv_kept_tokens"] == b["usage"]["kv_kept_tokens"], (policy, q)
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached.append(a["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    # Whole blocks of the document, the window (4 tokens) and the last token always computed.
    assert cached[1] == cached[2] == DOC // 16 * 16, cached
    after = on.metrics()
    assert after["kvserve:prefix_cache_queries_total"] - before["kvserve:prefix_cache_queries_total"] == 3 * (DOC + 20)
    assert after["kvserve:prefix_cache_hits_total"] - before["kvserve:prefix_cache_hits_total"] == sum(cached)
    assert after["kvserve:kv_cache_blocks_cached"] > 0
    assert after['kvserve:prefix_cache_bytes{model_name="tiny",tier="pool"}'] > 0
    assert off.metrics()["kvserve:kv_cache_blocks_cached"] == 0


def test_the_openai_client_reads_cached_tokens(servers):
    on, _ = servers
    client = openai.OpenAI(base_url=on.url + "/v1", api_key="none", max_retries=0, timeout=60)
    doc = tokens(7, DOC)
    first = client.completions.create(model="tiny", prompt=doc + [5, 6, 7], max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=doc + [8, 9], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == DOC // 16 * 16
    assert second.usage.prompt_tokens == DOC + 2


def test_finished_and_cancelled_requests_hold_no_blocks(servers):
    on, _ = servers
    doc = tokens(9, DOC)
    for q in range(3):
        completion(on.url, doc + tokens(300 + q, 10), "snapkv", max_tokens=2)
    # Cached blocks no request uses are free: nothing is in use once the requests are released
    # (within a step of their last response).
    m = on.wait_idle(10)
    assert m["kvserve:kv_cache_blocks_cached"] > 0


def test_a_host_tier_serves_a_document_the_pool_gave_up():
    """cache.prefix_cache_bytes: a pool with room for about one request (tiny-llama: 8 KiB a block,
    96 blocks) and a 2 MiB host tier. An unrelated prompt takes the pool, the document's cached
    blocks move to the tier, and the next question on the document is served from there with the
    same greedy text and kept KV as a server without any cache."""
    on = Server(kv_cache_bytes="768KiB", extra_args=("--prefix-cache-bytes", "2MiB"))
    off = Server(kv_cache_bytes="768KiB", extra_args=("--no-enable-prefix-caching",))
    try:
        # The sizes are there before the first request.
        fresh = on.metrics()
        assert fresh["kvserve:prefix_cache_host_capacity_bytes"] == 2 << 20, fresh
        assert fresh["kvserve:kv_cache_blocks_total"] == 96, fresh
        for i, policy in enumerate(["full", "snapkv", "pyramidkv"]):
            doc = tokens(40 + i, DOC)
            first = completion(on.url, doc + tokens(500 + i, 20), policy)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            before = on.metrics()
            assert before["kvserve:prefix_cache_host_capacity_bytes"] == 2 << 20
            completion(on.url, tokens(600 + i, DOC + 20), policy)
            moved = on.metrics()
            assert moved["kvserve:prefix_cache_host_stores_total"] > before["kvserve:prefix_cache_host_stores_total"], policy
            assert moved['kvserve:prefix_cache_bytes{model_name="tiny",tier="host"}'] > 0, policy
            prompt = doc + tokens(700 + i, 20)
            a, b = completion(on.url, prompt, policy), completion(off.url, prompt, policy)
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == DOC // 16 * 16, (policy, a["usage"])
            assert a["choices"][0]["text"] == b["choices"][0]["text"], policy
            assert a["usage"]["kv_kept_tokens"] == b["usage"]["kv_kept_tokens"], policy
            after = on.metrics()
            assert after["kvserve:prefix_cache_host_loads_total"] > moved["kvserve:prefix_cache_host_loads_total"], policy
        assert off.metrics()['kvserve:prefix_cache_bytes{model_name="tiny",tier="host"}'] == 0
    finally:
        for s in (on, off):
            rc = s.stop()
            log = s.log()
            s.tmp.cleanup()
            assert rc == 0, log[-4000:]


def test_requests_sharing_a_cached_document_are_admitted_for_what_they_add(tmp_path):
    """Admission counts a `full` prompt's cached blocks that running requests already use as shared,
    not new: in a pool (tiny-llama, 40 blocks of 16 tokens a layer) where one 336-token request
    takes 22 blocks a layer, four questions on one 320-token document run together with the cache
    and one at a time without it, with the same greedy tokens; the run the pool held to one at a time
    says so on stderr and counts more steps that held a prompt back (`kv_admission_waits`); the other
    prints no warning."""
    import subprocess
    doc = tokens(77, 320)
    prompts = [doc + tokens(900 + i, 16) for i in range(4)]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))

    def generate(*flags: str) -> tuple[dict, str]:
        cmd = [kvserve_bin(), "generate", "--model", model_dir(), "--prompts-file", str(path), "--max-tokens", "16",
               "--ignore-eos", "--kv-cache", "1280KiB", "--json", *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    (on, on_err), (off, off_err) = generate(), generate("--no-enable-prefix-caching")
    assert [r["token_ids"] for r in on["results"]] == [r["token_ids"] for r in off["results"]]
    assert off["max_running"] == 1, off["max_running"]
    assert on["max_running"] == 4, on["max_running"]
    assert "at most 1 of 4 prompts decoded together" in off_err and "--kv-cache 1280KiB" in off_err, off_err[-2000:]
    assert "decoded together" not in on_err, on_err[-2000:]
    assert off["kv_admission_waits"] > on["kv_admission_waits"], (off["kv_admission_waits"], on["kv_admission_waits"])
