"""A quantized KV cache (cache.kv_cache_dtype int8 / int4) behind a real server:
- prefix caching and chunked prefill compute what one forward computes: a full-KV prompt attends to
  its K/V as the pool stores them, so questions about one document give the same greedy tokens and
  logprobs with the cache on, off, and prefilled in chunks (the cached blocks are shared as stored);
- kvzip's compressed contexts and query-aware policies keep the same KV with the cache on and off;
- /metrics reports the pool in bytes as the dtype makes them;
- a short soak of every policy (kvzip's compressed contexts among them) over an int8 pool, with
  disconnects and cancels, ends with no block held.
"""
from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys
import urllib.request

import pytest

from kvserve_server import REPO, Server, kvserve_bin

DOC = 200
KVZIP = "  kvzip:\n    budget: 0.25\n    chunk_size: 64\n"


def completion(url: str, prompt: list[int], policy: str, max_tokens: int = 8, **extra) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "kv_policy": policy, "logprobs": 1, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def tokens(seed: int, n: int, vocab: int = 2000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module", params=["int8", "int4"])
def servers(request):
    kv = ("--kv-cache-dtype", request.param)
    on = Server(extra_yaml=KVZIP, extra_args=kv)
    off = Server(extra_yaml=KVZIP, extra_args=(*kv, "--no-enable-prefix-caching", "--no-enable-context-caching"))
    chunked = Server(extra_yaml=KVZIP, extra_args=(*kv, "--no-enable-prefix-caching", "--enable-chunked-prefill",
                                                    "--max-num-batched-tokens", "48"))
    yield request.param, on, off, chunked
    for s in (on, off, chunked):
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
        assert rc == 0, log[-4000:]


def logprobs(r: dict) -> list[float]:
    return r["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("policy", ["full", "snapkv", "kvzip"])
def test_prefix_cache_and_chunks_change_nothing(servers, policy):
    kv, on, off, chunked = servers
    doc = tokens({"full": 1, "snapkv": 2, "kvzip": 3}[policy], DOC)
    cached = []
    for q in range(3):
        # kvzip compresses the document alone (kv_context), once, and reuses it from the context cache.
        prompt = tokens(100 + q, 20) if policy == "kvzip" else doc + tokens(100 + q, 20)
        extra = {"kv_context": doc} if policy == "kvzip" else {}
        a, b = completion(on.url, prompt, policy, **extra), completion(off.url, prompt, policy, **extra)
        assert a["choices"][0]["text"] == b["choices"][0]["text"], (kv, policy, q)
        assert a["usage"]["kv_kept_tokens"] == b["usage"]["kv_kept_tokens"], (kv, policy, q)
        assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b))) <= 1e-3, (kv, policy, q, logprobs(a), logprobs(b))
        if policy == "full":
            c = completion(chunked.url, prompt, policy)
            assert c["choices"][0]["text"] == a["choices"][0]["text"], (kv, q)
            assert max(abs(x - y) for x, y in zip(logprobs(a), logprobs(c))) <= 1e-3, (kv, q)
        cached.append(a["usage"]["prompt_tokens_details"]["cached_tokens"])
    if policy == "full":
        assert cached[0] == 0 and cached[1] == cached[2] == DOC // 16 * 16, cached


def test_metrics_report_bytes(servers):
    kv, on, _, _ = servers
    m = on.metrics()
    total, blocks = m["kvserve:kv_cache_bytes_total"], m["kvserve:kv_cache_blocks_total"]
    # tiny-llama: 2 KV heads, head_dim 32: K and V rows of 34 (int8) or 18 (int4) bytes, 16 tokens a
    # block of one KV head (kvzip's per-head lengths make the pool head-wise): 64 MiB hold 1.88x /
    # 3.56x the blocks of float16's 2048-byte ones.
    row = {"int8": 34, "int4": 18}[kv]
    block = 16 * 2 * row
    assert total == blocks * block
    assert blocks == (64 << 20) // block
    assert m["kvserve:kv_cache_bytes_used"] <= total


def test_soak_int8_with_kvzip_ends_with_no_block_held(tmp_path: pathlib.Path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "soak.py"), "--kvserve", kvserve_bin(),
                           "--requests", "300", "--concurrency", "12", "--seed", "11", "--out", str(out),
                           "--server-arg=--kv-cache-dtype", "--server-arg=int8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["problems"] == [] and s["failures"] == []
    assert s["client_5xx"] == 0 and s["server_5xx"] == 0
    assert s["kv_blocks_used_at_end"] == s["kv_blocks_parked_at_end"]
    assert s["running_at_end"] == 0 and s["waiting_at_end"] == 0
    assert s["kinds"].get("cancel", 0) > 0 and s["aborted_requests"] > 0
