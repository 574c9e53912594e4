#!/usr/bin/env python3
"""Serving under load with GuideLLM: kvserve (and optionally llama.cpp's server) at constant arrival rates.

For each row (an engine configuration) the script starts the server on a free 127.0.0.1 port, sends one
warm-up request, then runs GuideLLM (`guidellm run`, offline: synthetic_text data drawn with the model's
own tokenizer from the model directory, streaming /v1/chat/completions) once per arrival rate. A rate
point sends ceil(rate x --seconds) requests at a constant rate and then lets the backlog drain for at
most --drain seconds (GuideLLM's max_requests and max_duration constraints); what is still in flight
then is cancelled and counted as incomplete. Between rates the script waits until the server's
/metrics shows no running or waiting request. Per rate it reports requests completed / errored /
incomplete, the HTTP status codes of the errors (parsed from GuideLLM's error text, and counted in
kvserve's own request log), TTFT and ITL p50/p99 of the completed requests, and output tokens/s; a
request that errors with a 4xx other than 429 is sent once more after the point, alone, to record the
server's answer body. The sustainable rate of a row is the highest rate with no errored and no
incomplete request and a TTFT p99 below --ttft-p99-ms.

Rows (--rows): `full` and a compressing policy (--compress METHOD:BUDGET, written into a temporary YAML
config made from configs/default.yaml), each with chunked prefill explicitly on (`-chunked`) and off
(`-whole`); every kvserve row passes --max-num-batched-tokens explicitly, so the rows mean the same
whatever the server's defaults are. `llamacpp` (opt-in: --llamacpp, or naming it in --rows) is
`python -m llama_cpp.server` on the F32 GGUF, built and started by bench/bench_llamacpp.py's functions
(bench/llamacpp_build.sh compiles llama.cpp first if build-llamacpp/ lacks it: ~10-20 min on 2 cores).

GuideLLM comes from its own virtual environment (`make loadtest` installs the pinned guidellm==0.8.1
into build-guidellm/venv). Never part of `make test`.

Usage: python3 bench/bench_load.py [--rates 0.25 0.5 1 2] [--rows full-chunked,full-whole,...]
                                   [--out docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_llamacpp  # noqa: E402  (llama.cpp build, server start, free port, readiness)

SECTION = "## Serving under load (GuideLLM)"
KVSERVE_MODEL_NAME = "smollm2-135m-instruct"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def load1() -> float:
    return os.getloadavg()[0]


def cpu_busy(seconds: float = 3.0) -> float:
    """Percent of all cores busy over `seconds` (from /proc/stat): with our server idle, other jobs' use."""
    def sample():
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return sum(f), idle
    t1, i1 = sample()
    time.sleep(seconds)
    t2, i2 = sample()
    return 100.0 * (1 - (i2 - i1) / max(1, t2 - t1))


def wait_quiet(args) -> tuple[float, float]:
    """Waits (at most --quiet-wait s) until other jobs use less than --quiet-below % of the cores; returns
    the last measurement and the seconds waited."""
    t0 = time.time()
    busy = cpu_busy()
    while busy >= args.quiet_below and time.time() - t0 < args.quiet_wait:
        log(f"other jobs use {busy:.0f} % of the cores (load {load_avg()}): waiting for < {args.quiet_below:g} %")
        time.sleep(10)
        busy = cpu_busy()
    return busy, time.time() - t0


# ---- servers ---------------------------------------------------------------------------------------

class KvserveServer:
    def __init__(self, args, row: str, tmp: pathlib.Path, cfg: pathlib.Path, policy: str, chunked: bool) -> None:
        self.name, self.kind, self.model_name = row, "kvserve", KVSERVE_MODEL_NAME
        self.log_path = tmp / f"server-{row}.log"
        self.cmd = [str(pathlib.Path(args.kvserve).resolve()), "serve", "--config", str(cfg), "--model", str(args.model),
                    "--port", "0", "--default-policy", policy,
                    "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill",
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens)] + list(args.serve_arg or [])
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="passive")

    def binary(self) -> dict:
        """Which build/kvserve this row ran: its mtime and /version (a binary relinked during the run
        shows up as rows with different mtimes)."""
        b = pathlib.Path(self.cmd[0])
        info = {"mtime": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(b.stat().st_mtime))}
        try:
            with urllib.request.urlopen(self.url + "/version", timeout=5) as r:
                info["version"] = json.loads(r.read()).get("version")
        except Exception:  # noqa: BLE001
            pass
        return info

    def start(self) -> str:
        for attempt in range(3):  # the binary may be relinked under us: retry a failed start
            self.logf = open(self.log_path, "w+")
            self.proc = subprocess.Popen(self.cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
            try:
                self.url = bench_llamacpp.wait_ready(self.proc, self.log_path, r"listening on http://127\.0\.0\.1:(\d+)")
                return self.url
            except SystemExit as e:
                log(f"{self.name}: start failed (attempt {attempt + 1}): {str(e)[-400:]}")
                self.stop()
                time.sleep(5)
        raise SystemExit(f"{self.name}: kvserve did not start: {shlex.join(self.cmd)}")

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def statuses_since(self, offset: int) -> dict[str, int]:
        """HTTP statuses of POSTs in kvserve's request log since offset."""
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            text = f.read()
        return dict(collections.Counter(re.findall(r'"POST /v1/chat/completions" (\d{3})', text)))

    def notes_since(self, offset: int) -> list[str]:
        """The server's other log lines since offset (warnings, ignored request fields), deduplicated."""
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            lines = f.read().splitlines()
        skip = re.compile(r'"(GET|POST) /|chatcmpl-|cmpl-')
        return list(dict.fromkeys(l for l in lines if l.strip() and not skip.search(l)))[:10]

    def wait_idle(self, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
                    text = r.read().decode()
                running = re.search(r"^kvserve:num_requests_running\S* (\S+)", text, re.M)
                waiting = re.search(r"^kvserve:num_requests_waiting\S* (\S+)", text, re.M)
                if running and waiting and float(running.group(1)) == 0 and float(waiting.group(1)) == 0:
                    return
            except Exception:
                pass
            time.sleep(1)
        log(f"{self.name}: still busy after {timeout:.0f} s, going on")

    def stop(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        bench_llamacpp.stop_process(self.proc, self.logf)
        self.proc = None


class LlamacppServer:
    """llama-cpp-python's server on the F32 GGUF, started by bench_llamacpp.Bench.start_llamacpp."""

    def __init__(self, args, row: str) -> None:
        self.name, self.kind, self.model_name = row, "llamacpp", "bench"
        ns = argparse.Namespace(kvserve=args.kvserve, llamacpp_dir=args.llamacpp_dir, threads=args.threads)
        self.bench = bench_llamacpp.Bench(ns)

    def start(self) -> str:
        self.proc, self.url, self.logf = self.bench.start_llamacpp(self.bench.ggufs["F32"])
        return self.url

    def log_offset(self) -> int:
        return 0

    def statuses_since(self, offset: int) -> dict[str, int]:
        return {}

    def binary(self) -> dict:
        return {}

    def notes_since(self, offset: int) -> list[str]:
        return []

    def wait_idle(self, timeout: float = 180) -> None:
        time.sleep(2)  # one request at a time; a cancelled client's request ends with its connection

    def stop(self) -> None:
        bench_llamacpp.stop_process(self.proc, self.logf)


def warm_up(server, output_tokens: int) -> None:
    """One short chat request: the first one pays for page faults and kernel set-up."""
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": output_tokens, "temperature": 0}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def probe_fields(url: str, request_args: str) -> dict:
    """Sends one of GuideLLM's completed requests again, alone, and returns the fields it carries, the
    status and what the server says it ignored (kvserve names unknown fields in X-KV-Ignored-Fields)."""
    body = (json.loads(request_args).get("body") or {})
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = {"fields": sorted(body), "stream_options": body.get("stream_options")}
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            out.update(status=r.status, ignored=r.headers.get("X-KV-Ignored-Fields"))
    except urllib.error.HTTPError as e:
        out.update(status=e.code, ignored=e.headers.get("X-KV-Ignored-Fields"), body=e.read(2000).decode(errors="replace"))
    except Exception as e:  # noqa: BLE001
        out.update(status=None, body=repr(e)[:300])
    return out


def replay(url: str, request_args: str) -> dict:
    """Sends one of GuideLLM's requests again, alone, and returns the status and the body."""
    args = json.loads(request_args)
    body = args.get("body") or {}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return {"status": r.status, "body": r.read(2000).decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read(2000).decode(errors="replace")}
    except Exception as e:  # noqa: BLE001
        return {"status": None, "body": repr(e)[:500]}


# ---- GuideLLM --------------------------------------------------------------------------------------

def guidellm_command(args, server, rate: float, out: pathlib.Path) -> list[str]:
    backend = {"kind": "openai_http", "target": server.url, "model": server.model_name,
               "request_format": "/v1/chat/completions", "stream": True}
    if server.kind == "llamacpp":
        # llama_cpp.server reads max_tokens, not max_completion_tokens, and has no ignore_eos: ban EOS
        # (<|im_end|>, id 2) as bench_llamacpp.py does, so both engines write output_tokens tokens.
        backend["extras"] = {"body": {"max_tokens": args.output_tokens, "logit_bias": {"2": -100.0}}}
        # GuideLLM checks a backend with GET /health first; llama_cpp.server has no such route (the
        # script has waited for its /v1/models already).
        backend["validate_backend"] = False
    requests = max(1, math.ceil(rate * args.seconds))
    return [str(args.guidellm), "run",
            "--backend", json.dumps(backend, separators=(",", ":")),
            "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": str(args.model)}, separators=(",", ":")),
            "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                                  "output_tokens": args.output_tokens}, separators=(",", ":")),
            "--profile", json.dumps({"kind": "constant", "rate": [rate]}, separators=(",", ":")),
            "--constraint", json.dumps({"kind": "max_requests", "count": requests}, separators=(",", ":")),
            "--constraint", json.dumps({"kind": "max_duration", "seconds": args.seconds + args.drain},
                                       separators=(",", ":")),
            "--output", json.dumps({"kind": "json", "path": str(out)}, separators=(",", ":")),
            "--disable-console-interactive"]


def status_of(error: str | None) -> str:
    """'429', '503', ... from httpx's HTTPStatusError text, else the exception's name."""
    if not error:
        return "unknown"
    m = re.search(r"'(\d{3}) [^']*' for url", error)
    if m:
        return m.group(1)
    m = re.match(r"\s*(\w+)\(", error)
    return m.group(1) if m else error[:60]


def summarize(path: pathlib.Path) -> dict:
    d = json.loads(path.read_text())
    b = d["benchmarks"][0]
    m, reqs = b["metrics"], b["requests"]
    ok, bad, inc = reqs.get("successful") or [], reqs.get("errored") or [], reqs.get("incomplete") or []

    def pct(metric: str, p: str) -> float | None:
        s = m[metric]["successful"]
        return s["percentiles"][p] if s and s.get("count") else None
    errors = collections.Counter(status_of((r.get("info") or {}).get("error")) for r in bad)
    return {"completed": len(ok), "errored": len(bad), "incomplete": len(inc),
            "error_codes": dict(errors),
            "error_samples": sorted({(r.get("info") or {}).get("error") or "" for r in bad})[:3],
            "ttft_p50": pct("time_to_first_token_ms", "p50"), "ttft_p99": pct("time_to_first_token_ms", "p99"),
            "itl_p50": pct("inter_token_latency_ms", "p50"), "itl_p99": pct("inter_token_latency_ms", "p99"),
            # GuideLLM's "Server Throughput, Output Tokens Per Sec" (all requests over the benchmark's time)
            "out_tok_s": m["output_tokens_per_second"]["total"]["mean"],
            "completed_tokens": sum(r.get("output_tokens") or 0 for r in ok),
            "duration_s": b["duration"], "concurrency_mean": m["request_concurrency"]["successful"]["mean"],
            "guidellm_version": d["metadata"]["guidellm_version"],
            "_ok_args": next((r.get("request_args") for r in ok if r.get("request_args")), None),
            "_errored_args": [(status_of((r.get("info") or {}).get("error")), r.get("request_args")) for r in bad]}


def cpu_since(ru0) -> float:
    """CPU seconds (user + system) of the children reaped since ru0: here, GuideLLM and its worker."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)


def run_point(args, server, rate: float, runs: pathlib.Path) -> dict:
    out = runs / f"{server.name}-rate{rate:g}.json"
    cmd = guidellm_command(args, server, rate, out)
    env = dict(os.environ, **OFFLINE, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    busy, waited = wait_quiet(args)
    offset = server.log_offset()
    before = load_avg()
    t0 = time.time()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(runs / f"{server.name}-rate{rate:g}.log", "w") as logf:
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=runs, start_new_session=True)
        try:
            rc = p.wait(timeout=args.seconds + args.drain + 300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
    row = {"row": server.name, "rate": rate, "requests_sent": max(1, math.ceil(rate * args.seconds)),
           "load_before": before, "load_after": load_avg(),
           "busy_before": busy, "waited_s": waited, "wall_s": time.time() - t0, "guidellm_rc": rc,
           "guidellm_cpu_s": cpu_since(ru0),
           "command": shlex.join(cmd)}
    if not out.exists():
        tail = (runs / f"{server.name}-rate{rate:g}.log").read_text(errors="replace")[-2000:]
        row.update(failed=f"guidellm exited {rc} without output:\n{tail}")
        log(f"{server.name} @ {rate:g}/s: {row['failed']}")
        return row
    row.update(summarize(out))
    row["server_statuses"] = server.statuses_since(offset)
    row["server_notes"] = server.notes_since(offset)
    errored_args = row.pop("_errored_args")
    ok_args = row.pop("_ok_args")
    if ok_args and server.kind == "kvserve" and not getattr(server, "probed", None):
        server.wait_idle()
        server.probed = probe_fields(server.url, ok_args)
        row["probe"] = server.probed
    # A 4xx other than 429 is the server refusing what GuideLLM sent: record what it answered.
    refused = [(s, a) for s, a in errored_args if s.startswith("4") and s != "429" and a]
    if refused:
        server.wait_idle()
        row["refused"] = [dict(replay(server.url, a), guidellm_status=s) for s, a in refused[:1]]
    log(f"{server.name} @ {rate:g}/s: {row['completed']} ok, {row['errored']} errored {row['error_codes']}, "
        f"{row['incomplete']} incomplete; TTFT p50/p99 {fmt(row['ttft_p50'])}/{fmt(row['ttft_p99'])} ms, "
        f"ITL p50/p99 {fmt(row['itl_p50'], 1)}/{fmt(row['itl_p99'], 1)} ms, {row['out_tok_s']:.1f} out tok/s, "
        f"server statuses {row['server_statuses']}, load {row['load_after']}, {row['wall_s']:.0f} s")
    return row


# ---- rows, report ----------------------------------------------------------------------------------

def make_config(args, tmp: pathlib.Path) -> tuple[pathlib.Path, str]:
    """A minimal config: the model, a local port, `full` and the compressing policy at the requested
    budget (its other parameters as configs/default.yaml sets them); every other key keeps the server's
    default, so the file stays valid whatever else configs/default.yaml gains meanwhile."""
    import yaml
    method, budget = args.compress.split(":")
    name = f"{method}{budget}"
    try:
        entry = dict((yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()).get("policies") or {})
                     .get(method) or {})
    except Exception:  # noqa: BLE001
        entry = {}
    entry.update(method=method, budget=int(budget))
    cfg = {"model": {"path": str(args.model), "served_model_name": KVSERVE_MODEL_NAME},
           "server": {"host": "127.0.0.1", "port": 0},
           "policies": {"full": {}, name: entry}, "default_policy": "full"}
    path = tmp / "bench_load.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path, name


def describe_row(row: str, args) -> str:
    if row == "llamacpp":
        return "llama.cpp server, F32 GGUF"
    policy, mode = row.rsplit("-", 1)
    budget = args.compress.split(":")[1]
    pol = "full KV" if policy == "full" else f"{policy.rstrip('0123456789')} budget {budget}"
    return f"kvserve {pol}, chunked prefill {'on' if mode == 'chunked' else 'off'}"


def fmt(x, nd: int = 0) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def sustainable(points: list[dict], bound_ms: float) -> str:
    good = [p["rate"] for p in points if "failed" not in p and p["errored"] == 0 and p["incomplete"] == 0
            and p["ttft_p99"] is not None and p["ttft_p99"] < bound_ms]
    if not good:
        return f"below {min(p['rate'] for p in points):g} req/s"
    best = max(good)
    lower_bad = [p["rate"] for p in points if p["rate"] < best and p["rate"] not in good]
    return f"{best:g} req/s" + (f" (but not at {', '.join(f'{r:g}' for r in lower_bad)})" if lower_bad else "")


def sched_defaults(kvserve: str) -> str:
    """The scheduler flags of this binary that the rows leave at their defaults: `serve --help`'s words and
    the value configs/default.yaml documents."""
    try:
        text = subprocess.run([kvserve, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001
        return ""
    try:
        import yaml
        sched = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()).get("scheduler") or {}
    except Exception:  # noqa: BLE001
        sched = {}
    lines, found = text.splitlines(), []
    for flag in ("--long-prefill-token-threshold", "--max-queue-time-s", "--max-waiting", "--max-num-seqs"):
        for i, line in enumerate(lines):
            m = re.match(r"\s*" + re.escape(flag) + r"(?:\s+[A-Z]+\S*)?\s*(.*)$", line)
            if m:
                desc = m.group(1).strip() or (lines[i + 1].strip() if i + 1 < len(lines) else "")
                key = flag[2:].replace("-", "_")
                found.append(f"`{flag}`" + (f" = {sched[key]}" if key in sched else "") + f" ({desc})")
                break
    return ", ".join(found)


def dirty_files() -> list[str]:
    """Tracked C++/CMake files with uncommitted changes (the binary may be built from them, not the commit)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                         cwd=ROOT).stdout
    files = [l[3:] for l in out.splitlines() if l.strip()]
    return [f for f in files if f.endswith((".cpp", ".h", ".cu", ".cuh", ".hpp", "CMakeLists.txt"))]


def machine() -> str:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0) / 2**20
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM (shared with other jobs)"


def render(meta: dict, points: list[dict]) -> str:
    a = meta["args"]
    L = [SECTION, "",
         f"Written by `bench/bench_load.py` (`make loadtest`) on {meta['date']}: kvserve commit `{meta['commit']}`, "
         f"GuideLLM {meta['guidellm_version']} (PyPI, in `build-guidellm/venv`), {meta['machine']}. "
         f"1-min load average {meta['load_before']} before, {meta['load_after']} after "
         f"(1/5/15 min: {meta['load_before_all']} before, {meta['load_after_all']} after); "
         f"the whole run took {meta['wall_min']:.1f} min.", "",
         "```sh", meta["command"], "```", ""]
    bins = meta.get("binaries", {})
    if bins:
        by = collections.defaultdict(list)
        for r, b in bins.items():
            if b:
                by[(b.get("mtime"), b.get("version"))].append(r)
        dirty = [f for f in meta.get("dirty", []) if f.endswith((".cpp", ".h", ".cu", ".cuh", ".hpp", "CMakeLists.txt"))]
        L += ["`build/kvserve` as each row found it"
              + (f" (built from the work tree, which had {len(dirty)} C++/CMake files changed against the commit: "
                 "another change was in progress)" if dirty else "") + ": "
              + "; ".join(f"{', '.join(rs)}: version {v or '?'}, linked {m}" for (m, v), rs in by.items())
              + (". **The binary was relinked during the run, so the rows did not all run the same server.**"
                 if len(by) > 1 else "."), ""]
    L += [
         f"GuideLLM runs offline on this machine beside the server (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, "
         f"HF_DATASETS_OFFLINE=1, one worker process): `synthetic_text` prompts of {a['prompt_tokens']} tokens "
         f"(counted by the model's own tokenizer; the server counts ~30 more for the chat template) and "
         f"{a['output_tokens']} output tokens (`ignore_eos`), streamed `/v1/chat/completions`, a `constant` "
         f"arrival rate. Each rate point sends ceil(rate × {a['seconds']:g}) requests and then allows "
         f"{a['drain']:g} s for the backlog to drain (`max_requests` + `max_duration`): a request still in flight "
         f"then is cancelled and counted *incomplete*. kvserve: `kvserve serve --config` (a temporary YAML: the model, `full` and "
         f"the compressing policy at the budget below, every other key at the server's default) `--default-policy P --enable-chunked-prefill` or "
         f"`--no-enable-chunked-prefill`, `--max-num-batched-tokens {a['max_num_batched_tokens']}` (a prompt longer "
         f"than that is prefilled in chunks with chunked prefill on, whole in one step with it off), "
         f"{a['threads']} threads, OMP_WAIT_POLICY=passive, prefix caching at its default (on; the synthetic prompts "
         f"share only the chat template's first tokens)"
         + (f"; left at this binary's defaults: {meta['sched_defaults']}" if meta.get("sched_defaults") else "")
         + f". TTFT and ITL: p50/p99 over the completed requests "
         f"(ITL over their tokens; where requests are incomplete these are the survivors' figures and "
         f"flatter the point); output tokens/s: GuideLLM's server throughput over the point's duration; "
         f"error codes: from GuideLLM's error text (`HTTPStatusError ... '429 ...'`), and in brackets the statuses "
         f"in kvserve's own request log; others' CPU before: the share of both cores busy during the 3 s before the "
         f"point with our server idle (other jobs on this shared machine; the script waits up to "
         f"{a['quiet_wait']:g} s for it to drop below {a['quiet_below']:g} %). **Sustainable rate**: the highest rate with no errored and no incomplete "
         f"request and TTFT p99 < {a['ttft_p99_ms']:g} ms. GuideLLM and the server share the 2 cores: GuideLLM "
         f"(its start included) used {guidellm_cpu(points)} per point, so these rates are the machine's, "
         f"not the engine's alone.", "",
         "| row | rate (req/s) | sent | completed | errored | incomplete | error codes | TTFT p50 (ms) | TTFT p99 (ms) "
         "| ITL p50 (ms) | ITL p99 (ms) | output tok/s | load (1 min) | others' CPU before |",
         "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    rows = list(dict.fromkeys(p["row"] for p in points))
    for r in rows:
        for p in (q for q in points if q["row"] == r):
            if "failed" in p:
                L.append(f"| {describe_row(r, argparse.Namespace(**a))} | {p['rate']:g} | {p['requests_sent']} | "
                         f"guidellm failed (rc {p['guidellm_rc']}) | | | | | | | | | {p['load_after'].split()[0]} | |")
                continue
            codes = ", ".join(f"{k} ×{v}" for k, v in sorted(p["error_codes"].items())) or "–"
            srv = {k: v for k, v in p.get("server_statuses", {}).items() if k != "200"}
            if srv:
                codes += " [" + ", ".join(f"{k} ×{v}" for k, v in sorted(srv.items())) + "]"
            L.append(f"| {describe_row(r, argparse.Namespace(**a))} | {p['rate']:g} | {p['requests_sent']} | "
                     f"{p['completed']} | {p['errored']} | {p['incomplete']} | {codes} | {fmt(p['ttft_p50'])} | "
                     f"{fmt(p['ttft_p99'])} | {fmt(p['itl_p50'], 1)} | {fmt(p['itl_p99'], 1)} | "
                     f"{p['out_tok_s']:.1f} | {p['load_before'].split()[0]} → {p['load_after'].split()[0]} | "
                     f"{p.get('busy_before', float('nan')):.0f} % |")
    busy = sorted(p["busy_before"] for p in points if p.get("busy_before") is not None)
    if busy and busy[len(busy) // 2] >= 50:
        L += ["", f"**Other jobs kept the cores busy: before the median point they used {busy[len(busy) // 2]:.0f} % "
                  f"of both cores with our server idle. These figures are those of a contended machine, not "
                  f"kvserve's capacity; rerun on a quiet one.**"]
    L += ["", f"Sustainable rate (no errors, nothing incomplete, TTFT p99 < {a['ttft_p99_ms']:g} ms):", ""]
    for r in rows:
        L.append(f"- {describe_row(r, argparse.Namespace(**a))}: "
                 f"**{sustainable([p for p in points if p['row'] == r], a['ttft_p99_ms'])}**")
    notes = list(dict.fromkeys(n for p in points for n in p.get("server_notes", [])))
    if notes:
        L += ["", "kvserve's log lines during the points other than requests (first 10):", ""]
        L += [f"- `{n[:300]}`" for n in notes[:10]]
    if "llamacpp" not in rows:
        L += ["", "llama.cpp's server (llama-cpp-python's `llama_cpp.server` on the F32 GGUF, built by "
                  "`bench/llamacpp_build.sh`) is an opt-in row (`--llamacpp`), not in this run."]
    probes = [(p["row"], p["probe"]) for p in points if p.get("probe")]
    if probes:
        r, x = probes[0]
        L += ["", f"What GuideLLM sends: `{'`, `'.join(x['fields'])}` with `stream_options` "
                  f"`{json.dumps(x['stream_options'])}`; one of its requests sent again alone ({r}) got {x['status']}, "
                  + (f"and kvserve named as ignored: `{x['ignored']}`." if x.get("ignored")
                     else "and no `X-KV-Ignored-Fields` header: kvserve used every field.")]
    refused = [(p["row"], p["rate"], x) for p in points for x in p.get("refused", [])]
    if refused:
        L += ["", "Requests the server refused (4xx other than 429), sent again alone after the point:", ""]
        for r, rate, x in refused:
            L.append(f"- {r} @ {rate:g}/s: GuideLLM saw {x['guidellm_status']}; replayed: {x['status']} "
                     f"`{x['body'][:300]}`")
    samples = sorted({s for p in points for s in p.get("error_samples", []) if s})
    if samples:
        L += ["", "GuideLLM's error texts (first of each kind):", ""]
        seen = set()
        for s in samples:
            k = status_of(s)
            if k not in seen:
                seen.add(k)
                L.append(f"- `{s[:300]}`")
    L += ["", "One rate point's GuideLLM command, as run (the target's port changes per run):", "", "```sh",
          meta["example_guidellm"], "```", ""]
    return "\n".join(L)


def guidellm_cpu(points: list[dict]) -> str:
    xs = [(p["guidellm_cpu_s"], p["wall_s"]) for p in points if p.get("guidellm_cpu_s") is not None]
    if not xs:
        return "an unmeasured share"
    c, w = [x[0] for x in xs], [x[1] for x in xs]

    def span(v: list[float]) -> str:
        return f"{min(v):.0f}" if round(min(v)) == round(max(v)) else f"{min(v):.0f}-{max(v):.0f}"
    return f"{span(c)} CPU-seconds ({span(w)} s of wall time each)"


def write_section(doc: pathlib.Path, text: str) -> None:
    """Replaces the section (up to the next '## ' heading) or appends it; the rest of the file stays."""
    old = doc.read_text() if doc.exists() else ""
    start = old.find("\n" + SECTION + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        nxt = old.find("\n## ", start + 1 + len(SECTION))
        rest = old[nxt:] if nxt >= 0 else "\n"
        new = old[:start + 1] + text.rstrip("\n") + "\n" + rest
    doc.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--guidellm", default=str(ROOT / "build-guidellm" / "venv" / "bin" / "guidellm"))
    ap.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "smollm2-135m-instruct")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1, 2], help="constant arrival rates, req/s")
    ap.add_argument("--rows", default=None,
                    help="comma-separated: full-chunked, full-whole, <compress>-chunked, <compress>-whole, llamacpp "
                         "(default: the four kvserve rows, plus llamacpp with --llamacpp)")
    ap.add_argument("--compress", default="pyramidkv:64", help="compressing policy METHOD:BUDGET (tokens per layer)")
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's server as a row (builds it if needed)")
    ap.add_argument("--llamacpp-dir", default=str(ROOT / "build-llamacpp"))
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=40, help="arrival window per rate: ceil(rate x seconds) requests")
    ap.add_argument("--drain", type=float, default=20, help="seconds after the window before in-flight requests "
                                                            "are cancelled (incomplete)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--serve-arg", action="append", metavar="ARG",
                    help="one more argument for every `kvserve serve`, e.g. --serve-arg=--long-prefill-token-threshold=0")
    ap.add_argument("--ttft-p99-ms", type=float, default=2000, help="TTFT p99 bound of the sustainable rate")
    ap.add_argument("--quiet-below", type=float, default=40,
                    help="before each rate point, wait until other jobs use less than this %% of the cores")
    ap.add_argument("--quiet-wait", type=float, default=120, help="... but at most this many seconds")
    ap.add_argument("--runs-dir", type=pathlib.Path, default=ROOT / "build-guidellm" / "runs")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file whose section is written (docs/benchmarks.md)")
    ap.add_argument("--render", type=pathlib.Path, help="only re-render the section from a run's summary JSON")
    args = ap.parse_args()
    if args.render:
        run = json.loads(args.render.read_text())
        text = render(run["meta"], run["points"])
        print(text)
        if args.out:
            write_section(args.out, text)
        return

    args.model = args.model.resolve()
    method = args.compress.split(":")[0]
    name = f"{method}{args.compress.split(':')[1]}"
    rows = (args.rows.split(",") if args.rows else
            ["full-chunked", "full-whole", f"{name}-chunked", f"{name}-whole"] + (["llamacpp"] if args.llamacpp else []))
    rows = [r.replace(method + "-", name + "-") if r.startswith(method + "-") else r for r in rows]
    if not pathlib.Path(args.guidellm).exists():
        raise SystemExit(f"{args.guidellm} not found: `make loadtest` installs guidellm==0.8.1 into build-guidellm/venv")
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    if "llamacpp" in rows and not (pathlib.Path(args.llamacpp_dir) / "smollm2-f32.gguf").exists():
        subprocess.run(["bash", str(ROOT / "bench" / "llamacpp_build.sh"), args.llamacpp_dir], check=True)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = (args.runs_dir / stamp).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-load-"))
    cfg, compress_name = make_config(args, tmp)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "guidellm_version": version.split()[-1] if version else "?", "machine": machine(),
            "load_before": f"{load1():.2f}", "load_before_all": load_avg(),
            "command": shlex.join(["python3", "bench/bench_load.py"] + sys.argv[1:]),
            "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
            "runs_dir": str(runs), "dirty": dirty_files(), "sched_defaults": sched_defaults(args.kvserve)}
    log(f"bench_load: rows {rows}, rates {args.rates}, guidellm {meta['guidellm_version']}, output in {runs}, "
        f"load {load_avg()}")
    t0 = time.time()
    points: list[dict] = []
    for row in rows:
        if row == "llamacpp":
            server = LlamacppServer(args, row)
        else:
            policy, mode = row.rsplit("-", 1)
            if policy not in ("full", compress_name) or mode not in ("chunked", "whole"):
                raise SystemExit(f"unknown row {row!r}")
            server = KvserveServer(args, row, runs, cfg, policy, mode == "chunked")
        server.start()
        meta.setdefault("binaries", {})[row] = server.binary()
        try:
            warm_up(server, args.output_tokens)
            for rate in args.rates:
                server.wait_idle()
                points.append(run_point(args, server, rate, runs))
                meta["example_guidellm"] = points[-1]["command"]
                (runs / "summary.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
        finally:
            server.stop()
    meta.update(load_after=f"{load1():.2f}", load_after_all=load_avg(), wall_min=(time.time() - t0) / 60)
    (runs / "summary.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    text = render(meta, points)
    print(text)
    if args.out:
        write_section(args.out, text)
        log(f"wrote the section '{SECTION}' of {args.out}; raw results in {runs}")


if __name__ == "__main__":
    main()
