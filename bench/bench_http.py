#!/usr/bin/env python3
"""HTTP serving benchmark: requests/s, TTFT and inter-token latency (p50/p99) at 1, 8 and 32
concurrent streaming clients against a real `kvserve serve` on the default model.

Starts the server on a free 127.0.0.1 port, drives it with the official `openai` client (one thread
per client, each issuing streaming completions back to back for a fixed time), prints a markdown
table and optionally appends it to a file.

Usage: python3 bench/bench_http.py --kvserve build/kvserve [--seconds 20] [--out docs/benchmarks-http.md]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request

from openai import OpenAI

REPO = pathlib.Path(__file__).resolve().parents[1]


def start_server(binary: str, model: str, max_seqs: int) -> tuple[subprocess.Popen, str]:
    tmp = tempfile.mkdtemp(prefix="kvserve-bench-")
    cfg = pathlib.Path(tmp) / "config.yaml"
    cfg.write_text(f"model: {{path: {model}, served_model_name: bench}}\n"
                   f"server: {{host: 127.0.0.1, port: 0}}\n"
                   f"scheduler: {{max_num_seqs: {max_seqs}}}\n")
    log = open(pathlib.Path(tmp) / "server.log", "w+")
    proc = subprocess.Popen([binary, "serve", "--config", str(cfg)], stderr=log, stdout=log)
    deadline = time.time() + 120
    while time.time() < deadline:
        log.seek(0)
        m = re.search(r"127\.0\.0\.1:(\d+)", log.read())
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except Exception:
                pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not become healthy")


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def stream_clients(url: str, clients: int, seconds: float, request) -> dict:
    """`clients` threads issue `request(client, i)` (a streaming completion; i counts requests) back to
    back for `seconds`; TTFT and inter-token latency from the text chunks, tokens from the usage chunk
    when the server sends one."""
    ttft, itl, done, tokens = [], [], [0], [0]
    lock = threading.Lock()
    stop_at = time.time() + seconds
    counter = iter(range(1 << 30))

    def worker():
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while time.time() < stop_at:
            with lock:
                i = next(counter)
            t0 = time.perf_counter()
            last, first, n, usage = None, None, 0, None
            local_itl = []
            for chunk in request(client, i):
                if getattr(chunk, "usage", None):
                    usage = chunk.usage.completion_tokens
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    local_itl.append(now - last)
                last = now
                n += 1
            with lock:
                if first is not None:
                    ttft.append(first)
                itl.extend(local_itl)
                done[0] += 1
                tokens[0] += usage if usage else n

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return dict(clients=clients, requests=done[0], wall=wall, rps=done[0] / wall, tok_s=tokens[0] / wall,
                ttft50=pct(ttft, 50), ttft99=pct(ttft, 99), itl50=pct(itl, 50), itl99=pct(itl, 99))


def run_level(url: str, clients: int, seconds: float, prompt: str, max_tokens: int) -> dict:
    def request(client, i: int):
        return client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})

    return stream_clients(url, clients, seconds, request)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    proc, url = start_server(args.kvserve, args.model, max_seqs=64)
    try:
        rows = [run_level(url, int(c), args.seconds, prompt, args.max_tokens) for c in args.levels.split(",")]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    load = os.getloadavg()[0]
    lines = [f"HTTP streaming on `{pathlib.Path(args.model).name}` (commit {commit}, {time.strftime('%Y-%m-%d')}, "
             f"load average {load:.1f} on {os.cpu_count()} cores; prompt ~{len(prompt.split())} words, "
             f"{args.max_tokens} tokens per request, {args.seconds:.0f} s per level):", "",
             "| clients | requests | requests/s | tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['rps']:.2f} | {r['tok_s']:.1f} | {r['ttft50']*1e3:.1f} | "
                     f"{r['ttft99']*1e3:.1f} | {r['itl50']*1e3:.2f} | {r['itl99']*1e3:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
