"""Issue 5: `kvserve serve --tensor-parallel-size/--pipeline-parallel-size` end to end, over HTTP with
the official openai client: the launcher's worker processes, rank 0 hosting HTTP, the same greedy
output as one process, a worker killed mid-generation (error within 30 s, /health unhealthy, no
process left behind), and two "nodes" on one machine joined through --nnodes/--node-rank.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvserve_server import Server, kvserve_bin

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [(5 * i + 11) % 1800 + 5 for i in range(30)]


def fixture(name: str) -> str:
    path = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", REPO / ".fixtures")) / name
    if not (path / "config.json").exists():
        pytest.skip(f"fixture {name} missing (run make fixtures)")
    return str(path)


def children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [(int(p), st) for p, st in (line.split() for line in out.splitlines() if line.strip())]


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def greedy(url: str, n: int = 12) -> list[str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens


def metrics(url: str, *names: str) -> list[float]:
    """The named values from one /metrics snapshot (two fetches could straddle a step)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        values = {}
        for line in r.read().decode().splitlines():
            key = line.split("{", 1)[0].split(" ", 1)[0]
            if key in names:
                values[key] = float(line.rsplit(" ", 1)[1])
    assert set(values) == set(names), f"missing from /metrics: {set(names) - set(values)}"
    return [values[n] for n in names]


# Logit edits travel to the sampling rank inside the plan's sampling params.
EDITS = {"logit_bias": {"7": 5.0, "100": 3.0}, "allowed_token_ids": list(range(5, 400)), "bad_words": ["ab", "c"],
         "ignore_eos": True}


def edited(url: str) -> list[str]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, extra_body=EDITS)
    return r.choices[0].logprobs.tokens


@pytest.fixture(scope="module")
def single_process_tokens():
    s = Server(model=fixture("llama-kvfew"))
    try:
        yield greedy(s.url), edited(s.url)
    finally:
        s.close()


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ("--tp", "2", "--pp", "2")])
def test_sharded_server_matches_single_process(layout, single_process_tokens):
    s = Server(model=fixture("llama-kvfew"), extra_args=layout)
    try:
        world = 4 if len(layout) == 4 else 2
        assert len(children(s.proc.pid)) == world - 1, "rank 0 starts the other ranks as its children"
        assert greedy(s.url) == single_process_tokens[0]
        assert edited(s.url) == single_process_tokens[1]
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
        # The control path: one broadcast of the plan and one all-reduce of the shards' pools per
        # step (a short prompt's plan fits the broadcast frame), plus one all-reduce in a step whose
        # prompt hit rank 0's prefix cache (the shards agree on the hit): the edited request's.
        steps, collectives, hits = metrics(s.url, "kvserve:engine_steps_total", "kvserve:step_collectives_total",
                                           "kvserve:prefix_cache_hits_total")
        print(f"{layout}: {collectives:.0f} control collectives over {steps:.0f} steps")
        assert hits > 0
        assert steps >= 12 and collectives <= 2 * steps + 1
        # Several concurrent streams through the pipeline (decode micro-batches).
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        r = c.completions.create(model="tiny", prompt=[PROMPT, PROMPT[:20], PROMPT[5:]], max_tokens=6, temperature=0)
        assert len(r.choices) == 3 and all(ch.finish_reason in ("length", "stop") for ch in r.choices)
        pids = [p for p, _ in children(s.proc.pid)]
    finally:
        rc = s.stop()
        s.tmp.cleanup()
    assert rc == 0
    for p in pids:  # the workers exited with the server (reaped, not zombies)
        assert not pathlib.Path(f"/proc/{p}").exists(), f"worker {p} outlived the server"


def test_worker_killed_mid_generation_fails_fast_and_cleanly():
    s = Server(model=fixture("llama-kvfew"), extra_args=("--tp", "2", "--pp", "2"))
    try:
        workers = children(s.proc.pid)
        assert len(workers) == 3
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        killed_at = None
        error = None
        chunks = 0
        finish = None
        try:
            for ch in stream:
                chunks += 1
                if chunks == 3:
                    os.kill(workers[1][0], signal.SIGKILL)  # rank 2: the second pipeline stage
                    killed_at = time.time()
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
        except openai.APIError as e:
            error = e
        assert killed_at is not None
        elapsed = time.time() - killed_at
        assert elapsed < 30, f"the request took {elapsed:.1f} s to fail"
        assert error is not None or finish == "error", "the interrupted request must end with an error"
        if error is not None:
            assert "rank" in str(error) and "unhealthy" in str(error)
        assert health(s.url) == 503
        # New requests are refused clearly instead of hanging.
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503
        # No process is left behind: every worker is gone and reaped.
        deadline = time.time() + 10
        while time.time() < deadline and children(s.proc.pid):
            time.sleep(0.1)
        assert children(s.proc.pid) == []
        for p, _ in workers:
            assert not pathlib.Path(f"/proc/{p}").exists(), f"worker {p} still exists"
        assert "was killed by signal 9" in s.log()
    finally:
        s.close()


@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_request_right_after_a_rank_died_gets_503_naming_it(delay_s):
    """The race a load generator hits: a worker dies while the engine idles and a request arrives
    within 50 ms, before the job's monitor has named the dead rank. The step fails first with the
    transport's (Gloo's) message; the request must still get a 503 with Retry-After whose message
    names the rank, and so must the next one."""
    s = Server(model=fixture("llama-kvfew"), extra_args=("--tp", "2"))
    try:
        workers = children(s.proc.pid)
        assert len(workers) == 1
        body = ('{"model": "tiny", "prompt": %s, "max_tokens": 4}' % PROMPT).encode()
        os.kill(workers[0][0], signal.SIGKILL)
        time.sleep(delay_s)
        for attempt in range(2):
            req = urllib.request.Request(s.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=30)
            except Exception as exc:  # the server must answer: say how it ended if it did not
                raise AssertionError(f"attempt {attempt}: {exc!r}; server exit {s.proc.poll()}; "
                                     f"log:\n{s.log()[-4000:]}") from exc
            message = e.value.read().decode()
            assert e.value.code == 503, (attempt, message)
            assert e.value.headers.get("Retry-After"), attempt
            assert "rank 1" in message and "unhealthy" in message, (attempt, message)
        assert health(s.url) == 503
    finally:
        s.close()


def test_two_nodes_on_one_machine(single_process_tokens, tmp_path):
    """--nnodes 2: node 0 hosts rank 0 and HTTP, node 1 (a separate command) hosts rank 1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node_args = ("--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    log1 = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen([kvserve_bin(), "serve", "--model", fixture("llama-kvfew"), *node_args, "--node-rank", "1"],
                             stdout=log1, stderr=subprocess.STDOUT)
    try:
        s = Server(model=fixture("llama-kvfew"), extra_args=(*node_args, "--node-rank", "0"))
        try:
            assert children(s.proc.pid) == [], "one rank per node: node 0 starts no local workers"
            assert greedy(s.url) == single_process_tokens[0]
        finally:
            s.close()
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        log1.close()
