"""Running streams keep decoding while a long prompt arrives (issue 50), against a real server with its
default scheduler: chunked prefill is on and, on a CPU, a step that decodes prefills at most
`long_prefill_token_threshold` prompt tokens, so a stream gets a token every step while a 3,000-token
prompt is prefilled over dozens of steps; with `--no-enable-chunked-prefill` the same prompt runs in
one step and the stream pauses for most of the prompt's wait. The chunked run is counted in tokens
(steps), not seconds. A client
that disconnects in the middle of a long prefill leaves `num_requests_running` promptly and its
blocks are freed."""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time

import pytest

from kvserve_server import REPO, Server, raw

LONG = 3000
THRESHOLD = 64  # kAutoLongPrefillTokensCpu (backend/engine/scheduler.h)


def stream(port: int, prompt: list[int], max_tokens: int, times: list[float], ready: threading.Event | None = None,
           stop: threading.Event | None = None) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for chunk in resp:
        line = chunk.decode().strip()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
            times.append(time.perf_counter())
            if ready is not None and len(times) == 3:
                ready.set()
        if stop is not None and stop.is_set():
            break
    conn.close()


def stream_during_long_prefill(srv) -> tuple[int, float, float]:
    """While a long prompt waits for its first token: the tokens a running stream got, the longest
    pause between two of them, and the long prompt's time to first token (seconds, as the client
    reads them)."""
    rng = random.Random(5)
    short = [rng.randrange(3, 2000) for _ in range(16)]
    long = [rng.randrange(3, 2000) for _ in range(LONG)]
    times: list[float] = []
    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=stream, args=(srv.port, short, 3000, times, ready, stop))
    t.start()
    assert ready.wait(60)
    first: list[float] = []
    submitted = time.perf_counter()
    stream(srv.port, long, 1, first)
    stop.set()
    t.join(60)
    window = [x for x in times if submitted < x < first[0]]
    edges = [submitted] + window + [next((x for x in times if x >= first[0]), first[0])]
    return len(window), max(b - a for a, b in zip(edges, edges[1:])), first[0] - submitted


@pytest.mark.parametrize("chunked", [True, False])
def test_running_stream_decodes_while_a_long_prompt_prefills(chunked):
    srv = Server(extra_args=() if chunked else ("--no-enable-chunked-prefill",), kv_cache_bytes="256MiB")
    try:
        got, pause, ttft = stream_during_long_prefill(srv)
        if chunked:
            # One token per step, and the prompt needs LONG / THRESHOLD steps.
            assert got >= LONG // THRESHOLD - 2, got
        else:
            # Frozen for the whole prefill: the stream still decodes in the steps between the
            # request's arrival and its admission (parse, tokenization), and a reader that lags on
            # a loaded machine counts tokens made before the arrival, so the tokens are not counted
            # here; the stream's longest pause is: it spans most of the long prompt's wait (a chunked
            # prefill pauses it for one chunk's step, ~1/47 of the wait).
            assert pause >= 0.5 * ttft, (got, pause, ttft)
        deadline = time.time() + 10  # the stream's client left: cancelled within a step or two
        while srv.metrics()["kvserve:num_requests_running"] > 0:
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        srv.close()


@pytest.mark.parametrize("policy", ["full", "kvzip"])
def test_disconnect_in_a_long_prefill_leaves_within_a_second(tmp_path, policy):
    """The default config and model on an idle server: a 3,000-token prompt runs in a 2,048-token step
    of ~4.5 s here and a 952-token one of ~2.8 s (kvzip: one whole forward, then its reconstruction
    passes); the request counts as running from its first step's start, and its client leaves a second
    into that step. The prefill stops at the next layer (~0.15 s), so the request leaves
    `num_requests_running` well within 1.5 s (waiting for the step's end took ~3.5 s) and holds no block."""
    cfg = tmp_path / "default-kvzip.yaml"
    cfg.write_text((REPO / "configs" / "default.yaml").read_text().replace(
        "default_policy: full", "  kvzip_test: {method: kvzip, budget: 0.25}\ndefault_policy: full"))
    srv = Server(config=cfg)
    try:
        rng = random.Random(6)
        prompt = [rng.randrange(3, 20000) for _ in range(LONG)]
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 100, "stream": True,
                           "kv_policy": "full" if policy == "full" else "kvzip_test"})
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        sent = time.time()
        deadline = sent + 60
        while srv.metrics()["kvserve:num_requests_running"] < 1:
            assert time.time() < deadline
            time.sleep(0.01)
        running = time.time()
        time.sleep(1.0)  # well inside the first step's forward
        sock.close()
        closed = time.time()
        while srv.metrics()["kvserve:num_requests_running"] > 0:
            assert time.time() - closed < 30, "the cancelled request is still running"
            time.sleep(0.01)
        left = time.time() - closed
        m = srv.wait_idle()
        assert m['kvserve:request_success_total{model_name="smollm2-135m-instruct",finished_reason="abort"}'] == 1
        assert m["kvserve:kv_cache_blocks_used"] == 0  # cached prompt blocks count as free
        # On a miss, say when the request was seen running (after its submission) and what the server said.
        assert left < 1.5, (f"the request left num_requests_running {left:.2f} s after its client (seen running "
                            f"{running - sent:.2f} s after it was sent, closed {closed - running:.2f} s later); "
                            f"server log:\n{srv.log()[-3000:]}")
        # The server goes on: the same prompt, not cancelled, is answered.
        status, _, data = raw(srv, "POST", "/v1/completions", json.dumps(
            {"model": "smollm2-135m-instruct", "prompt": prompt[:200], "max_tokens": 2,
             "kv_policy": "full" if policy == "full" else "kvzip_test"}))
        assert status == 200, data
    finally:
        srv.close()
