"""Overload and hostile clients against a real `kvserve serve` over real sockets: a full queue and a
connection flood answer 429/503 with Retry-After, a slowloris client and a client that stops
reading are cut off by their timeouts with their KV blocks freed, a request that fails inside the
engine fails alone, and SIGTERM drains within drain_timeout_s. Every test ends by checking /metrics:
no KV block, running or waiting request left behind."""
from __future__ import annotations

import json
import os
import resource
import socket
import threading
import time

import pytest

from kvserve_server import Server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def http(port: int, method: str, path: str, body: dict | bytes | None = None, timeout: float = 60,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection; returns (status, lower-cased headers, body)."""
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(data)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + b"\r\n" + data)
        raw = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    return parse_response(raw)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            n = int(size_line, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return status, headers, body


def sse_payloads(body: bytes) -> list:
    out = []
    for block in body.decode().split("\n\n"):
        if block.startswith("data: "):
            p = block[6:]
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def closed_count(m: dict[str, float], reason: str) -> float:
    return m.get(f'kvserve:http_connections_closed_total{{model_name="tiny",reason="{reason}"}}', 0.0)


def test_full_queue_answers_429_with_retry_after():
    s = Server(server_yaml="  retry_after_s: 3\n", extra_yaml="scheduler:\n  max_num_seqs: 1\n  max_waiting: 1\n")
    try:
        results: list[tuple[int, dict[str, str], bytes]] = []
        lock = threading.Lock()

        def one():
            r = http(s.port, "POST", "/v1/completions",
                     {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        statuses = sorted(r[0] for r in results)
        assert len(results) == 8 and 200 in statuses and 429 in statuses, statuses
        for status, headers, body in results:
            if status == 429:
                assert headers.get("retry-after") == "3", headers
                err = json.loads(body)["error"]
                assert err["type"] == "rate_limit_exceeded" and err["code"] == "engine_overloaded", err
                assert "waiting" in err["message"]
            else:
                assert status == 200, (status, body[:300])
                assert json.loads(body)["usage"]["completion_tokens"] == 150
        s.wait_idle()
    finally:
        s.close()


def test_connection_cap_answers_503_with_retry_after_and_recovers():
    s = Server(server_yaml="  max_concurrent_connections: 4\n  retry_after_s: 2\n")
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(4)]
        time.sleep(0.2)  # the server has accepted them
        status, headers, body = http(s.port, "POST", "/v1/completions",
                                     {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 503, body
        assert headers.get("retry-after") == "2"
        assert "too many open connections" in json.loads(body)["error"]["message"]
        # A flood beyond the cap: every connection gets an answer (503 or a served request), none hangs.
        flood: list[int] = []
        lock = threading.Lock()

        def knock():
            try:
                st = http(s.port, "GET", "/health", timeout=20)[0]
            except OSError as e:  # refused or reset under the flood is a clean refusal too
                st = -1 if isinstance(e, (ConnectionRefusedError, ConnectionResetError)) else -2
            with lock:
                flood.append(st)

        threads = [threading.Thread(target=knock) for _ in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(flood) == 200 and all(st in (503, -1) for st in flood), sorted(set(flood))
        assert flood.count(503) >= 150, flood.count(503)
        for c in idle:
            c.close()
        deadline = time.time() + 10
        while time.time() < deadline and http(s.port, "GET", "/health")[0] != 200:
            time.sleep(0.1)
        status, _, body = http(s.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert status == 200, body
        m = s.wait_idle()
        assert closed_count(m, "over_capacity") >= 151
    finally:
        s.close()


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_descriptor_exhaustion_backs_off_and_recovers():
    """A flood beyond the process's descriptor limit: accept() fails with EMFILE while the
    connection stays in the backlog. The server must neither spin on it nor stop accepting."""
    limit = 96
    s = Server(server_yaml="  max_concurrent_connections: 100000\n",
               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    try:
        flood = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(limit + 40)]
        time.sleep(1.0)
        before = cpu_seconds(s.proc.pid)
        time.sleep(2.0)
        used = cpu_seconds(s.proc.pid) - before
        assert used < 0.3, f"the server burnt {used:.2f} s of CPU in 2 s with accept() failing"
        for c in flood:
            c.close()
        deadline = time.time() + 10
        status = None
        while time.time() < deadline:
            try:
                status = http(s.port, "GET", "/health", timeout=5)[0]
                if status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert status == 200
        m = s.wait_idle()
        assert closed_count(m, "accept_error") >= 1
    finally:
        s.close()


def test_slowloris_is_cut_off_by_the_header_timeout_but_idle_keepalive_is_not():
    s = Server(server_yaml="  header_timeout_s: 1\n  idle_timeout_s: 30\n")
    try:
        # Nothing sent for longer than header_timeout_s: an idle keep-alive connection, still usable.
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as quiet:
            time.sleep(2.0)
            quiet.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert quiet.recv(4096).startswith(b"HTTP/1.1 200")
        # Headers trickling in a byte at a time: closed about header_timeout_s after the first byte.
        slow = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 200 + b"\r\n\r\n"
        t0 = time.time()
        cut_after = None
        for byte in request:
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                cut_after = time.time() - t0
                break
            time.sleep(0.05)
            # A closed peer shows as a readable socket with no data.
            slow.setblocking(False)
            try:
                if slow.recv(1) == b"":
                    cut_after = time.time() - t0
                    break
            except BlockingIOError:
                pass
            except OSError:
                cut_after = time.time() - t0
                break
            finally:
                slow.setblocking(True)
        slow.close()
        assert cut_after is not None, "the slowloris client was never cut off"
        # Cut about 1 s in (the whole request would take 11 s to trickle); slack for a loaded machine.
        assert 0.9 <= cut_after <= 5.0, cut_after
        m = s.wait_idle()
        assert closed_count(m, "header_timeout") == 1
        assert http(s.port, "GET", "/health")[0] == 200
    finally:
        s.close()


def test_stalled_reader_is_cut_off_by_the_write_timeout_and_its_blocks_freed():
    s = Server(server_yaml="  write_timeout_s: 1\n")
    try:
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "n": 4,
                           "max_tokens": 2500, "stream": True, "logprobs": True, "top_logprobs": 20,
                           "ignore_eos": True, "temperature": 0}).encode()
        sock = socket.socket()
        # A small receive window so that the server's writes stall soon after the client stops reading.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(2048).startswith(b"HTTP/1.1 200")
        deadline = time.time() + 60
        while time.time() < deadline and closed_count(s.metrics(), "write_timeout") < 1:
            time.sleep(0.1)
        m = s.wait_idle()
        assert closed_count(m, "write_timeout") == 1
        assert m['kvserve:request_success_total{model_name="tiny",finished_reason="abort"}'] == 4
        # What the client still finds in its buffers ends without the stream's end: it was cut off.
        rest = b""
        try:
            while chunk := sock.recv(1 << 20):
                rest += chunk
        except OSError:
            pass
        assert b"data: [DONE]" not in rest
        sock.close()
        assert http(s.port, "GET", "/health")[0] == 200
    finally:
        s.close()


def stream_text(port: int, prompt: str, max_tokens: int, out: dict, key: str, started: threading.Event | None = None):
    """Streams a greedy completion; out[key] = (text, finish_reason, error message or None)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
            if started is not None and b'"text"' in raw:
                started.set()
    status, _, payload = parse_response(raw)
    assert status == 200, payload[:300]
    text, reason, error = "", None, None
    for ev in sse_payloads(payload):
        if ev == "[DONE]":
            continue
        if "error" in ev:
            error = ev["error"]["message"]
            continue
        for ch in ev["choices"]:
            text += ch["text"]
            reason = ch["finish_reason"] or reason
    out[key] = (text, reason, error)


def test_a_request_failing_in_the_engine_fails_alone():
    """The pool (256 blocks = 1024 tokens per layer) holds three 200-token prompts growing by 100
    tokens each, but not a fourth request that wants 1200 more: it is preempted while the others
    decode, resumes alone and fails when it outgrows the whole pool. The three finish with the
    tokens they produce without it."""
    prompts = [f"Request {i}: " + "lorem ipsum dolor sit amet " * 30 for i in range(3)]
    alone = Server(kv_cache_bytes="2MiB")
    try:
        ref: dict = {}
        for i, p in enumerate(prompts):
            stream_text(alone.port, p, 100, ref, str(i))
        assert all(r[1] == "length" and r[2] is None for r in ref.values()), ref
        alone.wait_idle()

        out: dict = {}
        started = [threading.Event() for _ in prompts]
        threads = [threading.Thread(target=stream_text, args=(alone.port, p, 100, out, str(i), started[i]))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        big = threading.Thread(target=stream_text, args=(alone.port, "The big one: " + "x y z " * 60, 1500, out, "big"))
        big.start()
        for t in threads + [big]:
            t.join(timeout=300)
        for i in range(3):
            assert out[str(i)] == ref[str(i)], (i, out[str(i)][1:], ref[str(i)][1:])
        text, reason, error = out["big"]
        assert reason == "error" or error is not None, out["big"]
        assert error and "more KV cache than the whole pool holds" in error, error
        assert text, "the failing request produced tokens before the pool ran dry"
        m = alone.wait_idle()
        assert m["kvserve:num_preemptions_total"] >= 1
        assert m['kvserve:request_success_total{model_name="tiny",finished_reason="error"}'] == 1
    finally:
        alone.close()


def test_a_prompt_bigger_than_the_pool_is_the_clients_error():
    """A prompt that needs more KV than the whole pool holds can never run: it is refused as a bad
    request (HTTP 400, invalid_request_error, as vLLM refuses an over-long prompt), in a stream too,
    and the server goes on serving."""
    server = Server(kv_cache_bytes="2MiB")  # 1024 tokens per layer
    try:
        body = {"model": "tiny", "prompt": "x y z " * 700, "max_tokens": 4}
        status, _, raw = http(server.port, "POST", "/v1/completions", body)
        err = json.loads(raw)["error"]
        assert status == 400, (status, raw)
        assert err["type"] == "invalid_request_error" and "more KV cache than the whole pool holds" in err["message"], err
        status, _, raw = http(server.port, "POST", "/v1/completions", dict(body, stream=True))
        assert status == 200
        events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert errors and errors[0]["type"] == "invalid_request_error", events
        status, _, raw = http(server.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length", raw
    finally:
        server.close()


def test_sigterm_drains_within_drain_timeout():
    # The long request (3,900 tokens) needs ~1.5 s of decode on a quiet 2-core machine: the drain
    # deadline must be well below that, or the request finishes before it and is not aborted.
    drain = 0.4
    s = Server(drain_timeout_s=drain)
    s_port = s.port
    try:
        out: dict = {}
        short_started, long_started = threading.Event(), threading.Event()
        short = threading.Thread(target=stream_text, args=(s_port, PROMPT, 30, out, "short", short_started))
        long = threading.Thread(target=stream_text, args=(s_port, PROMPT, 3900, out, "long", long_started))
        long.start()
        assert long_started.wait(60)
        short.start()
        assert short_started.wait(60)
        t0 = time.time()
        s.proc.send_signal(15)
        short.join(timeout=60)
        long.join(timeout=60)
        rc = s.proc.wait(timeout=30)
        took = time.time() - t0
        assert rc == 0, s.log()[-3000:]
        # The drain deadline, then at most a couple of seconds to flush the aborted streams.
        assert took < drain + 5.0, took
        assert out["short"][1] == "length" and out["short"][2] is None, out["short"]
        assert out["long"][1] == "abort", out["long"][1:]
        assert "aborted 1 request(s) still running at the drain deadline" in s.log()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", s_port), timeout=5)
    finally:
        s.close()
