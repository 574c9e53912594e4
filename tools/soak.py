#!/usr/bin/env python3
"""Soak: many requests against a real `kvserve serve` on 127.0.0.1, with what the internet sends.

A mix of /v1/completions and /v1/chat/completions, streamed and not, across every named KV policy,
with prompts up to the context limit; a share of clients disconnect at random points (while
sending, before the answer, mid-stream), some cancel streams after a few events, and malformed
bodies and odd routes are interleaved. Every response must be correct or the intended error:

  - a generation answers 200 with a well-formed body (or SSE stream ending in [DONE]), the policy it
    asked for in X-KV-Policy, completion_tokens <= max_tokens and finish_reason stop/length;
  - greedy requests are repeated from a fixed set: each repetition (streamed or not, batched with
    whatever else runs) must produce the text of the first one;
  - a malformed body answers the 4xx it is designed to provoke, with an OpenAI error object;
  - no 5xx at all, no connection refused or reset the client did not cause.

Requests under kvzip and knorm_ctx often carry one of four documents as their context (a chat's
system message, a completion's `kv_context`): compressed by the first, taken from the context cache
by the next (the greedy repeats check that both give the same text). A share of chats are
structured: a JSON schema (the content must validate) or tools with a forced call (`required` or a
named function: the call must name a tool and its arguments validate against its parameters).

--overload offers twice what the server admits: its running and waiting limits are set to half the
client concurrency together, so a share of requests is refused. A refusal must be a 429 or 503 with
Retry-After (or, for a stream whose headers went out, an over-capacity error event), and its client
waits as Retry-After says (at most 2 s) before its next request, as SDK clients do; every other
request must be answered as above. Streams' time to first token is measured for admitted requests.
A share of clients hold conversations under `prefix_reuse: compressed` (turns that continue the
previous turn's parked KV). At the end the server must be idle (KV blocks used 0 besides the parked
conversations', running 0, waiting 0 on /metrics), its RSS
must not have grown by more than --max-rss-growth after the warm-up, and SIGTERM must stop it
cleanly. Prints a summary and writes it as JSON with --out.

usage: tools/soak.py --kvserve build/kvserve --requests 10000 [--concurrency 16] [--seed 1] [--overload]
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jsonschema

REPO = pathlib.Path(__file__).resolve().parents[1]
POLICIES = {
    "full": "{}",
    "snapkv": "{budget: 48, window: 8}",
    "pyramidkv": "{budget: 48, window: 8}",
    "dynamickv": "{budget: 48, window: 8}",
    "streamingllm": "{budget: 48}",
    "h2o": "{budget: 48}",
    "knorm": "{budget: 48}",
    "random": "{budget: 48}",
    # Head-wise budgets: the server's pool then uses head-wise blocks for every policy.
    "snapkv_ada": "{method: snapkv, budget: 48, window: 8, head_budgets: adaptive}",
    # Compressed contexts: a share of their requests carry one of a few documents as their context
    # (a chat's system message, a completion's kv_context), compressed once and then reused.
    "kvzip": "{budget: 0.25, chunk_size: 128}",
    "knorm_ctx": "{method: knorm, budget: 48, compress: context}",
}
CONTEXT_POLICIES = ("kvzip", "knorm_ctx")
# Structured chats: small enum-bounded schemas, so that a random model's forced output ends well
# inside max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                            "ok": {"type": "boolean"}},
           "required": ["city", "days", "ok"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_PARAMS = {"get_weather": WEATHER, "get_time": TIME}
WORDS = ("the quick brown fox jumps over lazy dog passkey is remember number city river mountain "
         "apple seven eleven green house window street music paper light answer question").split()


def config_text(model: str, max_model_len: int, kv_cache_bytes: str, max_num_seqs: int = 32,
                max_waiting: int = 1024, max_queue_time_s: float = 60) -> str:
    policies = "\n".join(f"  {name}: {spec}" for name, spec in POLICIES.items())
    return f"""model:
  path: {model}
  served_model_name: soak
  device: cpu
  max_model_len: {max_model_len}
server:
  host: 127.0.0.1
  port: 0
  max_body_bytes: 256KiB
  threads: 2
  header_timeout_s: 5
  write_timeout_s: 10
  drain_timeout_s: 30
cache:
  block_size: 16
  kv_cache_bytes: {kv_cache_bytes}
scheduler:
  max_num_seqs: {max_num_seqs}
  max_num_batched_tokens: 4096
  max_waiting: {max_waiting}
  max_queue_time_s: {max_queue_time_s}
policies:
{policies}
default_policy: full
"""


class Server:
    def __init__(self, binary: str, model: str, max_model_len: int, workdir: pathlib.Path,
                 kv_cache_bytes: str = "256MiB", extra_args: list[str] | None = None, max_num_seqs: int = 32,
                 max_waiting: int = 1024, max_queue_time_s: float = 60):
        cfg = workdir / "soak.yaml"
        cfg.write_text(config_text(model, max_model_len, kv_cache_bytes, max_num_seqs, max_waiting,
                                   max_queue_time_s))
        self.log_path = workdir / "server.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([binary, "serve", "--config", str(cfg), "--quiet", *(extra_args or [])], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        self.port = 0
        while time.time() < deadline and not self.port:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log_path.read_text(errors="replace"))
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None:
                raise SystemExit(f"kvserve exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        while time.time() < deadline:
            try:
                if request(self.port, "GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"kvserve never became healthy:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def rss_bytes(self) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def metrics(self) -> dict[str, float]:
        status, _, body = request(self.port, "GET", "/metrics")
        assert status == 200
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
                out.setdefault(name.split("{", 1)[0], float(value))
        return out


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 300,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = {"Content-Type": "application/json"} if body is not None else {}
        h.update(headers or {})
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def first_token(line: bytes) -> bool:
    """Whether an SSE line is an event that carries generated output (a role-only chunk does not)."""
    try:
        ev = json.loads(line[6:])
    except ValueError:
        return False
    for ch in ev.get("choices") or []:
        d = ch.get("delta") or {}
        if ch.get("text") or d.get("content") or d.get("tool_calls") or ch.get("finish_reason"):
            return True
    return False


def exchange(port: int, path: str, body: bytes, timeout: float = 300) -> tuple[int, dict[str, str], bytes, float | None]:
    """request() for a generation: an SSE answer is read as it arrives, and the seconds from sending
    to its first event with output come back too (None for a whole answer or no such event)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        headers = {k.lower(): v for k, v in r.getheaders()}
        if r.status != 200 or not headers.get("content-type", "").startswith("text/event-stream"):
            return r.status, headers, r.read(), None
        lines, ttft = [], None
        for line in r:
            lines.append(line)
            if ttft is None and line.startswith(b"data: {") and first_token(line):
                ttft = time.perf_counter() - t0
        return r.status, headers, b"".join(lines), ttft
    finally:
        conn.close()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def word_costs(port: int) -> dict[str, float]:
    """Tokens each vocabulary word adds to a prompt (" word" after the first), measured through the
    server's own usage.prompt_tokens, so that prompts can be sized right up to the context limit."""
    def prompt_tokens(text: str) -> int:
        status, _, body = request(port, "POST", "/v1/completions",
                                  json.dumps({"model": "soak", "prompt": text, "max_tokens": 1}).encode())
        assert status == 200, body
        return json.loads(body)["usage"]["prompt_tokens"]
    costs = {}
    for w in WORDS:
        one, many = prompt_tokens(w), prompt_tokens(" ".join([w] * 33))
        costs[w] = (many - one) / 32
    return costs


def sized_prompt(rng: random.Random, costs: dict[str, float], tokens: int) -> str:
    """Random words adding up to about `tokens` prompt tokens (never more, by the measured costs)."""
    out, total = [], 2.0  # BOS + the first word's difference
    while True:
        w = rng.choice(WORDS)
        if total + costs[w] > tokens:
            return " ".join(out)
        out.append(w)
        total += costs[w]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.kinds: collections.Counter = collections.Counter()
        self.statuses: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.greedy: dict[str, str] = {}
        self.greedy_checked = 0
        self.done = 0
        self.ttfts: list[float] = []  # admitted streams: seconds to their first output
        self.refused: collections.Counter = collections.Counter()  # --overload: 429 / 503 / in-stream

    def fail(self, what: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(what)
            self.kinds["FAILED"] += 1


def response_complete(buf: bytes) -> bool:
    """Whether `buf` holds a whole HTTP response (the connection stays open for keep-alive, so a
    reader that waits for EOF would wait for the server's idle timeout)."""
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if m:
        return len(body) >= int(m.group(1))
    return body.endswith(b"0\r\n\r\n")


def sse_events(payload: bytes) -> tuple[list, bool]:
    events, done = [], False
    for block in payload.decode().split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[6:]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


class Soak:
    def __init__(self, server: Server, args, stats: Stats):
        self.server, self.args, self.stats = server, args, stats
        self.costs = word_costs(server.port)
        # Greedy requests repeated throughout: (endpoint, prompt, policy, max_tokens).
        rng = random.Random(args.seed)
        # Documents of an eighth to a third of the context (60-170 tokens at 512, up to 340 at 1024).
        self.docs = [f"Document {d}. " + sized_prompt(rng, self.costs, rng.randint(args.max_model_len // 8,
                                                                                   args.max_model_len // 3))
                     for d in range(4)]
        self.canon = []
        for i in range(28):
            policy = list(POLICIES)[i % len(POLICIES)]
            doc = self.docs[i % len(self.docs)] if policy in CONTEXT_POLICIES else None
            tokens = rng.choice([8, 40]) if doc else rng.choice([8, 40, 200, args.max_model_len - 80])
            self.canon.append(("chat" if i % 3 == 0 else "completions",
                               f"canon {i}: " + sized_prompt(rng, self.costs, tokens), policy, rng.choice([4, 16, 32]), doc))

    # ---- request builders -------------------------------------------------------------------
    def generation_body(self, rng: random.Random) -> tuple[str, dict, bool]:
        """A valid generation request: (path, body, greedy-canonical?)."""
        if rng.random() < 0.3:
            endpoint, prompt, policy, max_tokens, doc = rng.choice(self.canon)
            body = {"model": "soak", "max_tokens": max_tokens, "temperature": 0, "kv_policy": policy,
                    "ignore_eos": True}
            canonical = True
        else:
            endpoint = rng.choice(["completions", "chat"])
            policy = rng.choice(list(POLICIES))
            max_tokens = rng.choice([1, 2, 8, 16, 32])
            # Most prompts short, some long, a few right up to the context limit (the chat template
            # adds a dozen tokens: leave it room).
            r = rng.random()
            limit = self.args.max_model_len - max_tokens - (24 if endpoint == "chat" else 2)
            tokens = rng.randint(1, 40) if r < 0.6 else rng.randint(40, limit // 2) if r < 0.9 else rng.randint(limit // 2, limit)
            doc = rng.choice(self.docs) if policy in CONTEXT_POLICIES and rng.random() < 0.6 else None
            if doc:
                tokens = min(tokens, 40)
            prompt = sized_prompt(rng, self.costs, max(tokens, 3)) or "hello"
            body = {"model": "soak", "max_tokens": max_tokens, "kv_policy": policy}
            if rng.random() < 0.5:
                body["temperature"] = 0.8
                body["seed"] = rng.randint(0, 1 << 30)
            else:
                body["temperature"] = 0
            if rng.random() < 0.2:
                body["n"] = 2
            if rng.random() < 0.15:
                if endpoint == "chat":
                    body["logprobs"] = True
                    body["top_logprobs"] = 3
                else:
                    body["logprobs"] = 3
            canonical = False
        if endpoint == "chat":
            body["messages"] = ([{"role": "system", "content": doc}] if doc else []) + [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
            if doc:
                body["kv_context"] = doc
        body["stream"] = rng.random() < 0.5
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        return path, body, canonical

    MALFORMED = [
        # (path, raw body, expected status, expected param or None)
        ("/v1/completions", b"", 400, None),
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -5}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "n": 1000}', 400, "n"),
        ("/v1/completions", b'{"prompt": "x", "logprobs": 1000}', 400, "logprobs"),
        ("/v1/completions", b'{"prompt": [1, 2, 99999999]}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "kv_policy": "../../etc/passwd"}', 400, "kv_policy"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'["an", "array"]', 400, None),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ]

    # ---- one request --------------------------------------------------------------------------
    def one(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + i)
        r = rng.random()
        a = self.args
        if r < a.disconnect_share:
            return self.disconnect(rng)
        r -= a.disconnect_share
        if r < a.cancel_share:
            return self.cancel(rng)
        r -= a.cancel_share
        if r < a.malformed_share:
            return self.malformed(rng)
        r -= a.malformed_share
        if r < 0.03:
            return self.other_route(rng)
        r -= 0.03
        if r < 0.05:
            return self.conversation(rng)
        r -= 0.05
        if r < a.structured_share:
            return self.structured(rng)
        return self.generate(rng)

    def refused(self, status: int, headers: dict[str, str], what: str) -> bool:
        """Under --overload, whether the answer is a refusal (429 or 503): it must say when to retry."""
        if not self.args.overload or status not in (429, 503):
            return False
        if "retry-after" not in headers:
            self.stats.fail(f"{what}: {status} without Retry-After")
            return True
        with self.stats.lock:
            self.stats.refused[str(status)] += 1
        # As an SDK client does: wait as told (at most 2 s) before the next request.
        time.sleep(min(2.0, float(headers["retry-after"])))
        return True

    def refused_in_stream(self, events: list) -> bool:
        """Under --overload, whether a stream (its headers sent) ended in the over-capacity error."""
        errors = [ev["error"] for ev in events if "error" in ev]
        if not self.args.overload or not errors or "over capacity" not in str(errors[0].get("message")):
            return False
        with self.stats.lock:
            self.stats.refused["in_stream"] += 1
        return True

    def admitted(self, ttft: float | None) -> None:
        if ttft is not None:
            with self.stats.lock:
                self.stats.ttfts.append(ttft)

    def structured(self, rng: random.Random) -> None:
        """A chat with a JSON schema or a forced tool call: the output must validate."""
        kind = rng.choice(["schema", "required", "named"])
        body = {"model": "soak", "max_tokens": 160, "kv_policy": rng.choice(list(POLICIES)), "stream": rng.random() < 0.5,
                "messages": [{"role": "user", "content": sized_prompt(rng, self.costs, rng.randint(3, 40)) or "weather"}]}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body["temperature"] = 0.8
            body["seed"] = rng.randint(0, 1 << 30)
        named = None
        if kind == "schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                                              "strict": True}}
        else:
            body["tools"] = TOOLS
            named = rng.choice(list(TOOL_PARAMS)) if kind == "named" else None
            body["tool_choice"] = {"type": "function", "function": {"name": named}} if named else "required"
        status, headers, payload, ttft = exchange(self.server.port, "/v1/chat/completions", json.dumps(body).encode())
        self.record(f"structured_{kind}", status)
        what = f"structured {kind} policy={body['kv_policy']} stream={body['stream']}"
        if self.refused(status, headers, what):
            return
        if status != 200:
            return self.stats.fail(f"{what}: status {status}: {payload[:300]!r}")
        try:
            content, finish, calls = "", None, {}
            if body["stream"]:
                events, done = sse_events(payload)
                if self.refused_in_stream(events):
                    return
                if not done or any("error" in ev for ev in events):
                    return self.stats.fail(f"{what}: stream {events[-1:]} done={done}")
                for ev in events:
                    for ch in ev["choices"]:
                        d = ch["delta"]
                        content += d.get("content") or ""
                        for t in d.get("tool_calls") or []:
                            c = calls.setdefault(t["index"], ["", ""])
                            c[0] += t.get("function", {}).get("name") or ""
                            c[1] += t.get("function", {}).get("arguments") or ""
                        finish = ch.get("finish_reason") or finish
            else:
                m = json.loads(payload)["choices"][0]
                content, finish = m["message"].get("content") or "", m["finish_reason"]
                for i, t in enumerate(m["message"].get("tool_calls") or []):
                    calls[i] = [t["function"]["name"], t["function"]["arguments"]]
            if kind == "schema":
                if finish != "stop":
                    return self.stats.fail(f"{what}: finish {finish}: {content!r}")
                jsonschema.validate(json.loads(content), WEATHER)
            else:
                if finish != "tool_calls" or not calls:
                    return self.stats.fail(f"{what}: finish {finish}, calls {calls}: {content!r}")
                for name, arguments in calls.values():
                    if name not in TOOL_PARAMS or (named and name != named):
                        return self.stats.fail(f"{what}: a call of {name!r}")
                    jsonschema.validate(json.loads(arguments), TOOL_PARAMS[name])
        except (KeyError, TypeError, ValueError, jsonschema.ValidationError) as e:
            return self.stats.fail(f"{what}: {type(e).__name__}: {e}: {payload[:300]!r}")
        self.admitted(ttft)

    def conversation(self, rng: random.Random) -> None:
        """Two to four turns under prefix_reuse: compressed, each prompt the previous one, its answer
        and more: a turn continues the last one's parked KV unless it was evicted meanwhile."""
        policy = rng.choice([p for p in POLICIES if p != "full"])
        base = {"model": "soak", "max_tokens": rng.choice([2, 8]), "temperature": 0, "kv_policy": policy,
                "prefix_reuse": "compressed", "return_token_ids": True}
        prompt: list | str = sized_prompt(rng, self.costs, rng.randint(20, self.args.max_model_len // 4)) or "hello"
        for turn in range(rng.randint(2, 4)):
            status, headers, payload = request(self.server.port, "POST", "/v1/completions",
                                               json.dumps({**base, "prompt": prompt}).encode())
            self.record("conversation_turn", status)
            if self.refused(status, headers, f"conversation {policy} turn {turn}"):
                return
            if status != 200:
                return self.stats.fail(f"conversation {policy} turn {turn}: status {status}: {payload[:300]!r}")
            try:
                c = json.loads(payload)["choices"][0]
                ids = c["prompt_token_ids"] + c["token_ids"]
                if not 0 < len(c["token_ids"]) <= base["max_tokens"]:
                    return self.stats.fail(f"conversation {policy} turn {turn}: {len(c['token_ids'])} token ids")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                return self.stats.fail(f"conversation {policy} turn {turn}: {e}: {payload[:300]!r}")
            room = self.args.max_model_len - len(ids) - base["max_tokens"] - 2
            if room < 2:
                return
            prompt = ids + ids[:rng.randint(1, min(room, 24))]

    def record(self, kind: str, status: int | None = None) -> None:
        with self.stats.lock:
            self.stats.kinds[kind] += 1
            if status is not None:
                self.stats.statuses[status] += 1

    def generate(self, rng: random.Random) -> None:
        path, body, canonical = self.generation_body(rng)
        status, headers, payload, ttft = exchange(self.server.port, path, json.dumps(body).encode())
        self.record("generate", status)
        what = f"{path} policy={body['kv_policy']} stream={body['stream']}"
        if self.refused(status, headers, what):
            return
        if status != 200:
            return self.stats.fail(f"{what}: status {status}: {payload[:300]!r}")
        if headers.get("x-kv-policy") != body["kv_policy"]:
            return self.stats.fail(f"{what}: X-KV-Policy {headers.get('x-kv-policy')}")
        n = body.get("n", 1)
        texts = [""] * n
        reasons: list[str | None] = [None] * n
        chat = path.endswith("chat/completions")
        try:
            if body["stream"]:
                events, done = sse_events(payload)
                if self.refused_in_stream(events):
                    return
                if not done:
                    return self.stats.fail(f"{what}: stream without [DONE]")
                usage = None
                for ev in events:
                    if "error" in ev:
                        return self.stats.fail(f"{what}: error event {ev['error']}")
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev["choices"]:
                        k = ch["index"]
                        texts[k] += (ch["delta"].get("content") or "") if chat else ch["text"]
                        reasons[k] = ch.get("finish_reason") or reasons[k]
                if body.get("stream_options") and (usage is None or usage["completion_tokens"] > n * body["max_tokens"]):
                    return self.stats.fail(f"{what}: usage {usage}")
            else:
                j = json.loads(payload)
                if len(j["choices"]) != n:
                    return self.stats.fail(f"{what}: {len(j['choices'])} choices")
                for ch in j["choices"]:
                    k = ch["index"]
                    texts[k] = ch["message"]["content"] if chat else ch["text"]
                    reasons[k] = ch["finish_reason"]
                u = j["usage"]
                if not 0 < u["completion_tokens"] <= n * body["max_tokens"] or u["kv_policy"] != body["kv_policy"]:
                    return self.stats.fail(f"{what}: usage {u}")
        except (KeyError, TypeError, ValueError) as e:
            return self.stats.fail(f"{what}: malformed response ({e!r}): {payload[:300]!r}")
        if any(x not in ("stop", "length") for x in reasons):
            return self.stats.fail(f"{what}: finish reasons {reasons}")
        self.admitted(ttft)
        if canonical and (self.args.check_greedy == "all" or body["kv_policy"] == "full"):
            key = json.dumps([path, body.get("prompt") or body["messages"], body.get("kv_context"), body["kv_policy"],
                              body["max_tokens"]])
            with self.stats.lock:
                first = self.stats.greedy.setdefault(key, texts[0])
                self.stats.greedy_checked += 1
            if texts[0] != first:
                self.stats.fail(f"{what}: greedy output differs from its first run: {texts[0]!r} vs {first!r}")

    def raw_request(self, path: str, body: bytes) -> bytes:
        return (f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    def disconnect(self, rng: random.Random) -> None:
        """Closes the connection at a random point: while sending, before the answer, or mid-answer."""
        path, body, _ = self.generation_body(rng)
        data = self.raw_request(path, json.dumps(body).encode())
        point = rng.choice(["sending", "sent", "reading"])
        s = socket.create_connection(("127.0.0.1", self.server.port), timeout=60)
        try:
            if rng.random() < 0.3:  # an abrupt close (RST) rather than FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            if point == "sending":
                s.sendall(data[:rng.randint(0, len(data) - 1)])
            else:
                s.sendall(data)
                if point == "reading":
                    want = rng.randint(1, 2000)
                    got = b""
                    while len(got) < want and not response_complete(got):
                        chunk = s.recv(want - len(got))
                        if not chunk:
                            break
                        got += chunk
        except OSError as e:
            return self.stats.fail(f"disconnect({point}): the server broke the connection first: {e!r}")
        finally:
            s.close()
        self.record(f"disconnect_{point}")

    def cancel(self, rng: random.Random) -> None:
        """A streaming client that stops after a few events (what SDK users' `break` does)."""
        path, body, _ = self.generation_body(rng)
        body["stream"] = True
        body["ignore_eos"] = True
        s = socket.create_connection(("127.0.0.1", self.server.port), timeout=120)
        try:
            s.sendall(self.raw_request(path, json.dumps(body).encode()))
            want = rng.randint(1, 6)
            buf = b""
            while buf.count(b"data: ") < want and not response_complete(buf):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            status = int(buf.split(b" ", 2)[1]) if buf.startswith(b"HTTP/1.1 ") else 0
            head = {k.strip().lower(): v.strip() for k, _, v in
                    (h.decode(errors="replace").partition(":") for h in buf.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])}
            if status != 200:
                if self.refused(status, head, "cancel"):
                    return self.record("cancel", status)
                return self.stats.fail(f"cancel: {buf[:300]!r}")
        finally:
            s.close()
        self.record("cancel", 200)

    def malformed(self, rng: random.Random) -> None:
        path, raw, want, param = rng.choice(self.MALFORMED)
        r = rng.random()
        if r < 0.15:  # over max_body_bytes
            path, raw, want, param = "/v1/completions", b'{"prompt": "' + b"x" * (300 << 10) + b'"}', 413, None
        elif r < 0.3:  # longer than the context
            prompt = sized_prompt(rng, self.costs, self.args.max_model_len + 200)
            path, raw, want, param = "/v1/completions", json.dumps({"prompt": prompt}).encode(), 400, "prompt"
        try:
            status, _, payload = request(self.server.port, "POST", path, raw)
        except (ConnectionResetError, BrokenPipeError) as e:
            return self.stats.fail(f"malformed {raw[:60]!r}: connection error {e!r}")
        self.record("malformed", status)
        if status != want:
            return self.stats.fail(f"malformed {raw[:80]!r}: status {status} (want {want}): {payload[:200]!r}")
        try:
            err = json.loads(payload)["error"]
        except (ValueError, KeyError):
            return self.stats.fail(f"malformed {raw[:80]!r}: not an OpenAI error: {payload[:200]!r}")
        if not err.get("message") or (param is not None and err.get("param") != param):
            self.stats.fail(f"malformed {raw[:80]!r}: error {err}")

    def other_route(self, rng: random.Random) -> None:
        method, path, want = rng.choice([("GET", "/v1/models", 200), ("GET", "/health", 200), ("GET", "/version", 200),
                                         ("GET", "/metrics", 200), ("GET", "/v1/nope", 404),
                                         ("DELETE", "/v1/completions", 405), ("GET", "/v1/models/other", 404)])
        status, _, payload = request(self.server.port, method, path)
        self.record("route", status)
        if status != want:
            self.stats.fail(f"{method} {path}: {status} (want {want})")


def held_by_requests(m: dict) -> float:
    """KV blocks in use less those parked conversations keep for their next turn."""
    return m["kvserve:kv_cache_blocks_used"] - m["kvserve:kv_cache_blocks_parked"]


def parse_bytes(text: str) -> float:
    """"256MiB" -> bytes (the binary and decimal units kvserve's config takes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", text)
    if not m:
        raise SystemExit(f"--kv-cache-bytes: cannot read {text!r}")
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return float(m.group(1)) * units[m.group(2) or "B"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=0, help="requests before the RSS baseline (default: 10 %%)")
    ap.add_argument("--disconnect-share", type=float, default=0.20)
    ap.add_argument("--cancel-share", type=float, default=0.05)
    ap.add_argument("--malformed-share", type=float, default=0.05)
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-cache-bytes", default="256MiB",
                    help="the KV pool; a small one (e.g. 4MiB) makes the scheduler preempt under load")
    ap.add_argument("--check-greedy", choices=["all", "full"], default="all",
                    help="which policies' greedy repeats must match exactly: after a preemption a "
                         "compressing policy selects again over prompt + generated tokens, so use "
                         "'full' with a small pool")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra `kvserve serve` flag, repeatable (e.g. --server-arg=--tp --server-arg=2, "
                         "--server-arg=--prefix-cache-bytes --server-arg=64MiB)")
    ap.add_argument("--structured-share", type=float, default=0.08,
                    help="share of chats with a JSON schema or a forced tool call")
    ap.add_argument("--overload", action="store_true",
                    help="offer twice what the server admits: max_num_seqs + max_waiting = concurrency / 2; "
                         "refusals (429 / 503 with Retry-After, after which the client waits as told) then "
                         "count as answers")
    ap.add_argument("--out", help="write the summary as JSON here")
    args = ap.parse_args()
    warmup = args.warmup or max(1, args.requests // 10)

    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as tmp:
        limits = {}
        if args.overload:
            # Admitted = running + waiting = half the clients: the rest is refused (429 for a full queue;
            # 503 once the oldest waiting request waited half of a short max_queue_time_s).
            half = max(2, args.concurrency // 2)
            limits = {"max_num_seqs": (half + 1) // 2, "max_waiting": half // 2, "max_queue_time_s": 0.1}
        server = Server(args.kvserve, args.model, args.max_model_len, pathlib.Path(tmp), args.kv_cache_bytes,
                        args.server_arg, **limits)
        stats = Stats()
        soak = Soak(server, args, stats)
        next_i = 0
        lock = threading.Lock()
        rss = {"start": server.rss_bytes(), "warm": 0, "max_after_warm": 0}
        high_water = {"warm": 0.0}
        # The readiness polls saw 503s while the model loaded: count only what the soak causes.
        m0 = server.metrics()
        t0 = time.time()

        def worker():
            nonlocal next_i
            while True:
                with lock:
                    if next_i >= args.requests:
                        return
                    i = next_i
                    next_i += 1
                try:
                    soak.one(i)
                except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the soak
                    stats.fail(f"request {i}: {type(e).__name__}: {e}")
                with stats.lock:
                    stats.done += 1
                    done = stats.done
                if done == warmup:
                    rss["warm"] = server.rss_bytes()
                    high_water["warm"] = server.metrics()["kvserve:kv_cache_blocks_high_water"]
                elif done > warmup and done % 200 == 0:
                    rss["max_after_warm"] = max(rss["max_after_warm"], server.rss_bytes())
                if done % 1000 == 0:
                    print(f"soak: {done}/{args.requests} requests, {time.time() - t0:.0f} s, "
                          f"{stats.kinds['FAILED']} failed", flush=True)

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0

        # Idle: every disconnect and cancel must have given its blocks back.
        deadline = time.time() + 30
        m = server.metrics()
        while time.time() < deadline:
            m = server.metrics()
            if held_by_requests(m) == 0 and m["kvserve:num_requests_running"] == 0 and \
                    m["kvserve:num_requests_waiting"] == 0:
                break
            time.sleep(0.1)
        rss["end"] = server.rss_bytes()
        rss["max_after_warm"] = max(rss["max_after_warm"], rss["end"])
        # Refusals (503 with Retry-After under --overload) are answers, not server errors.
        server_5xx = sum(v - m0.get(k, 0.0) for k, v in m.items() if k.startswith("kvserve:http_responses_total{")
                         and re.search(r'status="5\d\d"', k) and not (args.overload and 'status="503"' in k))
        client_5xx = sum(n for s, n in stats.statuses.items() if 500 <= s < 600) - stats.refused["503"]
        ttfts = sorted(stats.ttfts)

        def pct(q: float) -> float | None:
            return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3) if ttfts else None
        # The KV pool is allocated untouched and its pages count once first used: with prefix caching
        # the cache keeps filling it after the warm-up by design. Those pages (blocks beyond the
        # warm-up's high-water mark) are not growth.
        pool_pages = max(0.0, m["kvserve:kv_cache_blocks_high_water"] - high_water["warm"]) * \
            parse_bytes(args.kv_cache_bytes) / max(1.0, m["kvserve:kv_cache_blocks_total"])
        rss["pool_pages_after_warm"] = pool_pages
        growth = (rss["max_after_warm"] - pool_pages - rss["warm"]) / rss["warm"] if rss["warm"] else 0.0
        server.proc.send_signal(signal.SIGTERM)
        try:
            rc = server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            rc = "killed after 60 s"
        summary = {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "wall_s": round(wall, 1),
            "requests_per_s": round(args.requests / wall, 1),
            "kinds": dict(stats.kinds),
            "statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
            "client_5xx": client_5xx,
            "server_5xx": server_5xx,
            "refused": dict(stats.refused),
            "admitted_stream_ttft_s": {"n": len(ttfts), "p50": pct(0.50), "p90": pct(0.90), "p99": pct(0.99),
                                       "max": round(ttfts[-1], 3) if ttfts else None},
            "server_limits": limits or {"max_num_seqs": 32, "max_waiting": 1024, "max_queue_time_s": 60},
            "greedy_repeats_checked": stats.greedy_checked,
            "kv_blocks_used_at_end": m["kvserve:kv_cache_blocks_used"],
            "kv_blocks_parked_at_end": m["kvserve:kv_cache_blocks_parked"],
            "conversations_parked_at_end": m["kvserve:conversations_parked"],
            "running_at_end": m["kvserve:num_requests_running"],
            "waiting_at_end": m["kvserve:num_requests_waiting"],
            "kv_blocks_high_water": m["kvserve:kv_cache_blocks_high_water"],
            "preemptions": m["kvserve:num_preemptions_total"],
            "aborted_requests": m.get('kvserve:request_success_total{model_name="soak",finished_reason="abort"}', 0),
            "connections_closed": {k.split('reason="')[1][:-2]: v for k, v in m.items()
                                   if k.startswith("kvserve:http_connections_closed_total{")},
            "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
            "rss_growth_after_warmup": round(growth, 4),
            "sigterm_exit": rc,
            "failures": stats.failures,
        }
        problems = []
        if stats.kinds["FAILED"]:
            problems.append(f"{stats.kinds['FAILED']} responses were wrong")
        if client_5xx or server_5xx:
            problems.append(f"5xx: {client_5xx} seen by clients, {server_5xx} counted by the server")
        if held_by_requests(m) or m["kvserve:num_requests_running"] or m["kvserve:num_requests_waiting"]:
            problems.append("the engine did not go idle (leaked KV blocks or stuck requests)")
        if growth > args.max_rss_growth:
            problems.append(f"RSS grew {growth:.1%} after the warm-up (limit {args.max_rss_growth:.0%})")
        if rc != 0:
            problems.append(f"SIGTERM exit: {rc}")
        summary["problems"] = problems
        print(json.dumps(summary, indent=2))
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
        if problems:
            print("soak FAILED: " + "; ".join(problems), file=sys.stderr)
            print(server.tail(), file=sys.stderr)
            return 1
        print(f"soak passed: {args.requests} requests in {wall:.0f} s ({args.requests / wall:.1f}/s)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
