#!/usr/bin/env python3
"""Chunked prefill A/B: one long prompt arrives while short requests decode; what the running
requests' inter-token latency and the long request's time to first token are with and without
`scheduler.enable_chunked_prefill`.

Per configuration it starts `kvserve serve` on the default model, starts `--short` streaming
completions (short prompts, ignore_eos), waits until each has
streamed a few tokens, then sends the long prompt (random token ids, streaming, one new token). The
inter-token gaps of the short requests are measured from the long request's submission to its first
token (the window a prefill can stall them); TTFT is the long request's. The short requests are
cancelled a second after that. Configurations are run
interleaved, `--rounds` times each, so that both see the same machine load.

With `--config FILE` the server runs that file as it is (e.g. configs/default.yaml: the default
scheduler) and only chunked prefill is switched on or off by flag; `--longs N` sends N long prompts at
once. Each row then also reports the running streams' worst gap against their median gap over the
whole measurement (from before the long prompts arrive until a second after they all started).

Usage: python3 bench/bench_chunked_prefill.py --kvserve build/kvserve [--long 8000] [--budget 512]
       python3 bench/bench_chunked_prefill.py --config configs/default.yaml --short 2 --longs 2 --long 3000
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import random
import re
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]


def start_server(binary: str, model: str, budget: int, chunked: bool, config: str | None = None,
                 server_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    tmp = tempfile.mkdtemp(prefix="kvserve-chunked-")
    cfg = pathlib.Path(tmp) / "config.yaml"
    cfg.write_text(f"model: {{path: {model}, served_model_name: bench}}\n"
                   f"server: {{host: 127.0.0.1, port: 0}}\n"
                   f"cache: {{kv_cache_bytes: 2GiB}}\n"
                   f"scheduler: {{max_num_seqs: 8, max_num_batched_tokens: {budget}, "
                   f"enable_chunked_prefill: {'true' if chunked else 'false'}}}\n")
    log_path = pathlib.Path(tmp) / "server.log"
    log = open(log_path, "w+")
    args = [binary, "serve", "--config", str(cfg), "--quiet"]
    if config:  # the file as it is, on a free port, with chunked prefill set by flag
        args = [binary, "serve", "--config", config, "--port", "0", "--served-model-name", "bench", "--quiet",
                "--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill", *server_args]
    proc = subprocess.Popen(args, stderr=log, stdout=log, cwd=REPO)
    deadline = time.time() + 180
    while time.time() < deadline:
        log.seek(0)
        m = re.search(r"127\.0\.0\.1:(\d+)", log.read())
        if m:
            url = f"127.0.0.1:{m.group(1)}"
            try:
                with urllib.request.urlopen(f"http://{url}/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url, str(log_path)
            except Exception:
                pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server did not become healthy; log {log_path}")


def stream(url: str, prompt: list[int], max_tokens: int, times: list[float], started: threading.Event | None = None,
           stop: threading.Event | None = None, after: int = 3) -> None:
    """One streaming completion; appends the arrival time of every token chunk to `times`. Closes
    the connection (the server cancels the request) once `stop` is set."""
    conn = http.client.HTTPConnection(url, timeout=600)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
            times.append(time.perf_counter())
            if started is not None and len(times) == after:
                started.set()
        if stop is not None and stop.is_set():
            break
    conn.close()


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def run_once(binary: str, model: str, vocab: int, args, chunked: bool) -> dict:
    proc, url, log = start_server(binary, model, args.budget, chunked, args.config, tuple(args.server_arg))
    try:
        rng = random.Random(7)
        shorts = [[rng.randrange(vocab) for _ in range(args.short_prompt)] for _ in range(args.short)]
        longs = [[rng.randrange(vocab) for _ in range(args.long)] for _ in range(args.longs)]
        times: list[list[float]] = [[] for _ in shorts]
        ready = [threading.Event() for _ in shorts]
        stop = threading.Event()
        threads = [threading.Thread(target=stream, args=(url, p, 4000, times[i], ready[i], stop))
                   for i, p in enumerate(shorts)]
        for t in threads:
            t.start()
        for e in ready:
            e.wait(120)
        time.sleep(1.0)  # the streams' plain decode steps before the long prompts
        long_times: list[list[float]] = [[] for _ in longs]
        t_submit = time.perf_counter()
        senders = [threading.Thread(target=stream, args=(url, p, 1, long_times[i])) for i, p in enumerate(longs)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        t_first = max(ts[0] for ts in long_times)
        time.sleep(1.0)  # a few decode steps after the prefill
        stop.set()
        for t in threads:
            t.join()
        gaps = []
        for ts in times:
            # Gaps that overlap the long requests' wait: from their submission to the last first token.
            gaps += [b - a for a, b in zip(ts, ts[1:]) if b > t_submit and a < t_first]
        before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < t_submit]
        whole = [b - a for ts in times for a, b in zip(ts[2:], ts[3:])]  # every gap after the third token
        return {"ttft": t_first - t_submit, "ttfts": [ts[0] - t_submit for ts in long_times],
                "itl_max": max(gaps), "itl_p50": statistics.median(gaps),
                "itl_before_p50": statistics.median(before) if before else float("nan"), "gaps": len(gaps),
                "worst_over_median": max(whole) / statistics.median(whole), "load": os.getloadavg()}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--long", type=int, default=8000, help="long prompt tokens")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--short-prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--longs", type=int, default=1, help="long prompts sent at once")
    ap.add_argument("--config", help="serve this config file as it is (chunked prefill set by flag)")
    ap.add_argument("--server-arg", action="append", default=[], help="more `serve` flags (with --config)")
    ap.add_argument("--only", choices=["on", "off"], help="one configuration only")
    args = ap.parse_args()
    vocab = json.loads((pathlib.Path(args.model) / "config.json").read_text())["vocab_size"]
    results: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for chunked in [c for c in order if args.only is None or c == (args.only == "on")]:
            res = run_once(args.kvserve, args.model, vocab, args, chunked)
            results[chunked].append(res)
            print(f"round {r} chunked={chunked}: TTFT {res['ttft']:.2f} s "
                  f"({', '.join(f'{t:.2f}' for t in res['ttfts'])}), ITL max {res['itl_max'] * 1e3:.0f} ms, "
                  f"p50 {res['itl_p50'] * 1e3:.1f} ms (before the long prompt {res['itl_before_p50'] * 1e3:.1f} ms), "
                  f"worst/median {res['worst_over_median']:.1f}, "
                  f"{res['gaps']} gaps, load {' '.join(f'{x:.2f}' for x in res['load'])}", flush=True)
    print()
    print("| chunked prefill | long prompts' TTFT s | decode ITL max ms | decode ITL p50 ms | ITL p50 before ms | "
          "worst gap / median gap | load (1/5/15 min) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for chunked in (False, True):
        for res in results[chunked]:
            print(f"| {'on' if chunked else 'off'} | {', '.join(f'{t:.2f}' for t in res['ttfts'])} | "
                  f"{res['itl_max'] * 1e3:.0f} | {res['itl_p50'] * 1e3:.1f} | {res['itl_before_p50'] * 1e3:.1f} | "
                  f"{res['worst_over_median']:.1f} | {' '.join(f'{x:.2f}' for x in res['load'])} |")


if __name__ == "__main__":
    main()
