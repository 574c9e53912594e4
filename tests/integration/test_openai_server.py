"""A real `kvserve serve` driven with the official openai client (and raw HTTP for malformed input)."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.request

import openai
import pytest

from kvserve_server import Server, kvserve_bin, raw

PROMPT = "The passkey is 4711. Remember it. The passkey is"


def client(srv, key="none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def test_health_models_version(server):
    assert raw(server, "GET", "/health")[0] == 200
    status, _, body = raw(server, "GET", "/version")
    assert status == 200 and "version" in json.loads(body)
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_usage_and_policy_header(server):
    c = client(server)
    resp = c.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert resp.headers["x-kv-policy"] == "full"
    r = resp.parse()
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens > 5
    assert r.usage.model_extra["kv_policy"] == "full"


def test_completion_stream_equals_non_stream(server):
    c = client(server)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"]


def test_chat_stream_and_non_stream(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content


def test_stop_strings(server):
    c = client(server)
    base = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    # A stop string from the middle of the greedy text: the output ends right before it.
    stop = base[len(base) // 2:len(base) // 2 + 3]
    if len(stop) < 2 or not stop.strip():
        pytest.skip(f"greedy text too short to pick a stop string: {base!r}")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index(stop)]


def test_seed_reproducibility_and_n(server):
    c = client(server)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b
    r = c.completions.create(n=3, **kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 36


def test_logprobs(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        assert tok.logprob <= 0
        assert len(tok.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert tok.logprob >= max(t.logprob for t in tok.top_logprobs) - 1e-4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    cr = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                              extra_body={"ignore_eos": True})
    lp = cr.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_kv_policy_extra_body(server):
    c = client(server)
    long_prompt = " ".join(f"item {i} is {i * 7 % 13}." for i in range(30))
    resp = c.completions.with_raw_response.create(model="tiny", prompt=long_prompt, max_tokens=4, temperature=0,
                                                  extra_body={"kv_policy": "pyramidkv", "ignore_eos": True})
    assert resp.headers["x-kv-policy"] == "pyramidkv"
    r = resp.parse()
    assert r.usage.model_extra["kv_policy"] == "pyramidkv"
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"kv_policy": "no-such-policy"})
    assert "kv_policy" in str(e.value)
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert 'kvserve:kv_kept_tokens_total{model_name="tiny",policy="pyramidkv"}' in text


def test_error_statuses(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=5)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    status, _, body = raw(server, "GET", "/v1/no/such/route")
    assert status == 404 and "error" in json.loads(body)
    status, headers, _ = raw(server, "GET", "/v1/completions")
    assert status == 405
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="tiny", prompt="word " * 20000, max_tokens=2)
    assert e.value.status_code == 413


@pytest.mark.parametrize("body,param", [
    (b'{"model": "tiny", "prompt": "x", ', None),                        # truncated JSON
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "prompt"),             # invalid UTF-8
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999999}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "stop": 7}', "stop"),
    (b'{"model": "tiny"}', "prompt"),
    (b'[]', None),
    (b'', None),
])
def test_malformed_bodies(server, body, param):
    status, _, data = raw(server, "POST", "/v1/completions", body)
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["message"]
    if param:
        assert err["param"] == param, err
    assert raw(server, "GET", "/health")[0] == 200


def test_malformed_chat_bodies(server):
    for body, param in [(b'{"messages": "hi"}', "messages"),
                        (b'{"messages": [{"role": "user"}]}', "messages[0].content"),
                        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
                        (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n")]:
        status, _, data = raw(server, "POST", "/v1/chat/completions", body)
        assert status == 400, data
        assert json.loads(data)["error"]["param"] == param


def test_32_concurrent_streams(server):
    c = client(server)
    results: list = [None] * 32
    n_tokens = 6

    def run(i: int):
        try:
            text, usage, finish = "", None, None
            for ch in c.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=n_tokens,
                                           temperature=0.7, seed=i, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if ch.choices:
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage:
                    usage = ch.usage
            results[i] = (usage.completion_tokens, finish)
        except Exception as e:  # recorded, asserted below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [(n_tokens, "length")] * 32


def test_greedy_http_equals_generate(server):
    out = subprocess.run([kvserve_bin(), "generate", "--model", server.model, "--prompt", PROMPT,
                          "--max-tokens", "12", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = json.loads(out.stdout.strip().splitlines()[-1])["text"]
    r = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected


def test_disconnect_mid_stream_frees_blocks(server):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(4096)
        assert chunk, "stream ended early"
        got += chunk
    assert server.metrics()["kvserve:kv_cache_blocks_used"] > 0
    sock.close()
    m = server.wait_idle(10)
    assert m['kvserve:request_success_total{model_name="tiny",finished_reason="abort"}'] >= 1
    assert raw(server, "GET", "/health")[0] == 200


def test_api_key_and_overload(strict_server):
    with pytest.raises(openai.AuthenticationError):
        client(strict_server, key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
    ok = client(strict_server, key="sekret")
    assert ok.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    # One running + one waiting fill it; more at once must be refused with 429 or 503.
    statuses: list[int] = []
    lock = threading.Lock()

    def run():
        try:
            ok.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, extra_body={"ignore_eos": True})
            code = 200
        except openai.APIStatusError as e:
            code = e.status_code
        with lock:
            statuses.append(code)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert any(s in (429, 503) for s in statuses), statuses
    assert 200 in statuses, statuses


def test_sigterm_drains_in_flight_stream():
    s = Server()
    try:
        c = client(s)
        stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, stream=True,
                                      extra_body={"ignore_eos": True})
        first = next(iter(stream))
        s.proc.send_signal(15)
        text = (first.choices[0].text if first.choices else "") + "".join(
            ch.choices[0].text for ch in stream if ch.choices)
        assert s.proc.wait(timeout=60) == 0, s.log()
        assert "draining" in s.log()
        assert text
    finally:
        s.close()


def test_queue_time_is_the_wait_before_scheduling_not_ttft():
    """kvserve:request_queue_time_seconds = arrival -> first admitted by the scheduler. With one
    sequence at a time, B (sent while A streams) waits for A; A hardly waits. Queue time ends before
    the prefill, so its sum is below time-to-first-token's (it used to be TTFT itself: equal sums)."""
    s = Server(extra_yaml="scheduler:\n  max_num_seqs: 1\n")
    try:
        c = client(s)
        q, ttft = "kvserve:request_queue_time_seconds", "kvserve:time_to_first_token_seconds"
        fast_bucket = q + '_bucket{model_name="tiny",le="0.3"}'
        m0 = s.metrics()
        stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)  # A is running
        result: list = []
        b = threading.Thread(target=lambda: result.append(
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})))
        b.start()
        for _ in chunks:
            pass
        b.join(timeout=120)
        assert result and result[0].usage.completion_tokens == 4
        m1 = s.metrics()
        assert m1[q + "_count"] - m0[q + "_count"] == 2
        assert m1[ttft + "_count"] - m0[ttft + "_count"] == 2
        queued, to_first = m1[q + "_sum"] - m0[q + "_sum"], m1[ttft + "_sum"] - m0[ttft + "_sum"]
        assert 0 < queued < to_first, (queued, to_first)
        assert m1[fast_bucket] - m0[fast_bucket] >= 1  # A was admitted at once
    finally:
        s.close()
