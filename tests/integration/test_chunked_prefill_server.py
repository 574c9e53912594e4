"""Chunked prefill through a real server: `scheduler.enable_chunked_prefill` from the YAML splits a
long prompt over steps (the engine's step counter shows it), and concurrent greedy completions, with
full KV and with compressing policies, equal a server that prefills whole prompts.
"""
from __future__ import annotations

import json
import random
import threading
import urllib.request

import pytest

from kvserve_server import Server

BUDGET = 32
LONG = 300


def completion(url: str, prompt: list[int], policy: str, max_tokens: int = 8) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "kv_policy": policy}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def servers():
    yaml = f"scheduler:\n  max_num_batched_tokens: {BUDGET}\n"
    whole = Server(extra_yaml=yaml + "  enable_chunked_prefill: false\n")
    chunked = Server(extra_yaml=yaml)  # on by default
    yield whole, chunked
    for s in (whole, chunked):
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
        assert rc == 0, log[-4000:]


def prompts(vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (LONG, 12, 20)]


def test_a_long_prompt_takes_several_steps_only_when_chunked(servers):
    long_prompt = prompts()[0]
    steps = []
    for s in servers:
        before = s.metrics()["kvserve:engine_steps_total"]
        completion(s.url, long_prompt, "full", max_tokens=1)
        steps.append(s.metrics()["kvserve:engine_steps_total"] - before)
    # The response may come before its last step is counted, and the step freeing it may follow.
    assert steps[0] <= 2, steps
    assert steps[1] >= (LONG + BUDGET - 1) // BUDGET - 1, steps


@pytest.mark.parametrize("policy", ["full", "snapkv", "pyramidkv"])
def test_concurrent_completions_equal_whole_prefill(servers, policy):
    results = []
    for s in servers:
        out: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: out.__setitem__(i, completion(s.url, p, policy)))
                   for i, p in enumerate(prompts())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(out)
    whole, chunked = results
    for i in range(len(prompts())):
        a, b = whole[i], chunked[i]
        assert b["choices"][0]["text"] == a["choices"][0]["text"], (policy, i)
        assert b["usage"]["kv_kept_tokens"] == a["usage"]["kv_kept_tokens"], (policy, i)
        assert b["usage"]["kv_policy"] == policy
