"""Start and stop a real `kvserve serve` process on a free 127.0.0.1 port (used by conftest.py).

Environment: KVSERVE_BIN (the kvserve binary), KVSERVE_FIXTURES (fixture models; `llama-gqa` is used
when the committed `models/tiny-llama` is absent), KVSERVE_TEST_MODEL (optional model dir override).
"""
from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvserve_bin() -> str:
    path = os.environ.get("KVSERVE_BIN") or str(REPO / "build" / "kvserve")
    if not os.path.exists(path):
        pytest.skip(f"kvserve binary not found at {path} (set KVSERVE_BIN)")
    return path


def model_dir() -> str:
    override = os.environ.get("KVSERVE_TEST_MODEL")
    if override:
        return override
    tiny = REPO / "models" / "tiny-llama"
    if (tiny / "config.json").exists():
        return str(tiny)
    fixtures = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", REPO / ".fixtures"))
    gqa = fixtures / "llama-gqa"
    if (gqa / "config.json").exists():
        return str(gqa)
    pytest.skip("no model: neither models/tiny-llama nor $KVSERVE_FIXTURES/llama-gqa exists")


def raw(srv, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
    """One HTTP exchange with `srv`, outside the openai client: (status, headers, body bytes). The
    timeout is generous: a request of sixteen streams outlasted 30 s on a 2-core machine running two
    other busy processes, and a test must fail for what it checks, not for the machine's load."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    if isinstance(body, str):
        body = body.encode()
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    conn.request(method, path, body=body, headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def complete_ids(srv, body: dict) -> dict:
    """A /v1/completions response (asserted 200) with the generated token ids of every choice."""
    status, _, data = raw(srv, "POST", "/v1/completions", json.dumps({"model": "tiny", "return_token_ids": True, **body}))
    assert status == 200, data
    return json.loads(data)


def choice_ids(r: dict) -> list[list[int]]:
    return [c["token_ids"] for c in r["choices"]]


def with_and_without_speculation(srv, body: dict) -> tuple[dict, dict]:
    """The request as the server speculates, then the same with `"speculative": false`. A one-token
    request of the same prompt goes first, so that both find its blocks in the prefix cache: a prompt
    prefilled whole and one prefilled over cached blocks differ in the last bits (other products,
    another attention path), and at temperature 1 such a difference can move a draw."""
    warm = {**body, "max_tokens": 1, "n": 1, "temperature": 0, "speculative": False}
    for k in ("min_tokens", "logprobs", "stream", "best_of"):
        warm.pop(k, None)
    complete_ids(srv, warm)
    return complete_ids(srv, body), complete_ids(srv, {**body, "speculative": False})


class Server:
    """A running `kvserve serve`; `url` is its base URL; `log()` its stderr so far."""

    def __init__(self, extra_yaml: str = "", api_key: str | None = None, server_yaml: str = "",
                 extra_args: tuple[str, ...] = (), model: str | None = None, config: pathlib.Path | None = None,
                 kv_cache_bytes: str = "64MiB", drain_timeout_s: float = 20, preexec_fn=None):
        """config: serve this YAML file as it is (on a free port, from the repository root) instead of
        the small test config."""
        self.tmp = tempfile.TemporaryDirectory(prefix="kvserve-it-")
        self.api_key = api_key
        self.preexec_fn = preexec_fn
        if config is not None:
            self.model = None
            self._start([kvserve_bin(), "serve", "--config", str(config), "--port", "0", *extra_args])
            return
        self.model = model or model_dir()
        cfg = pathlib.Path(self.tmp.name) / "config.yaml"
        cfg.write_text(
            f"""model:
  path: {self.model}
  served_model_name: tiny
  device: cpu
server:
  host: 127.0.0.1
  port: 0
  max_body_bytes: 64KiB
  threads: 2
  drain_timeout_s: {drain_timeout_s}
{server_yaml}cache:
  block_size: 16
  kv_cache_bytes: {kv_cache_bytes}
policies:
  full: {{}}
  pyramidkv:
    budget: 24
    window: 4
  snapkv:
    budget: 24
    window: 4
{extra_yaml}"""
        )
        args = [kvserve_bin(), "serve", "--config", str(cfg)]
        if api_key:
            args += ["--api-key", api_key]
        self._start(args + list(extra_args))

    def _start(self, args: list[str]) -> None:
        self.log_path = pathlib.Path(self.tmp.name) / "server.log"
        self.log_file = open(self.log_path, "wb")
        env = dict(os.environ)
        env.pop("KVSERVE_API_KEY", None)
        self.proc = subprocess.Popen(args, stdout=self.log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     preexec_fn=self.preexec_fn)
        self.port = self._wait_for_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_healthy()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_port(self) -> int:
        deadline = time.time() + 60
        while time.time() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise RuntimeError(f"kvserve did not start listening:\n{self.log()}")

    def _wait_healthy(self) -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"kvserve never became healthy:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-policy gauges/counters: name (without labels) -> value of the first sample."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            out.setdefault(name_labels, float(value))
            out.setdefault(name_labels.split("{", 1)[0], float(value))
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Polls /metrics until no KV block is used and nothing runs or waits; returns the metrics.
        A finished request's blocks are released in the engine step after its last response."""
        deadline = time.time() + timeout
        m = self.metrics()
        while time.time() < deadline:
            m = self.metrics()
            if (m["kvserve:kv_cache_blocks_used"] == 0 and m["kvserve:num_requests_running"] == 0
                    and m["kvserve:num_requests_waiting"] == 0):
                return m
            time.sleep(0.05)
        raise AssertionError(f"the engine did not go idle: blocks {m['kvserve:kv_cache_blocks_used']}, running "
                             f"{m['kvserve:num_requests_running']}, waiting {m['kvserve:num_requests_waiting']}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.tmp.cleanup()
