#!/usr/bin/env python3
"""Engine A/B benchmark: two kvserve binaries (a baseline and a candidate), measured in the same run,
rounds interleaved (A, B, A, B, ...) so that machine noise hits both alike; reports medians and the
candidate/baseline ratio.

Two measurements go through the whole engine (scheduler, runner, output processing):
- `kvserve generate`: a batch of prompts decoded together; ms per decode step;
- HTTP: streaming completions from N concurrent `openai` clients against `kvserve serve`
  (bench_http.py's loop); requests/s, tokens/s and inter-token latency.

Usage: python3 bench/bench_engine_ab.py --baseline /tmp/kvserve-before --candidate build/kvserve \
           [--rounds 3] [--out docs/benchmarks-engine-ab.md]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_http  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def generate_step_ms(binary: str, model: str, batch: int, prompt_words: int, max_tokens: int) -> tuple[float, float]:
    """(ms per decode step, generated tokens/s over the decode) for one batch run."""
    words = ("The grass is green. The sky is blue. The sun is yellow. Here we go. " * 200).split()
    prompts = [" ".join(words[i:i + prompt_words]) for i in range(batch)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    out = subprocess.run([binary, "generate", "--model", model, "--prompts-file", f.name, "--max-tokens",
                          str(max_tokens), "--temperature", "0", "--ignore-eos", "--json"],
                         capture_output=True, text=True, check=True)
    os.unlink(f.name)
    results = json.loads(out.stdout)["results"]
    # All prompts are admitted in the first step and finish in the same last step: the decode phase
    # runs from the last first token (after every prefill) to the last token.
    first = max(r["timings"]["time_to_first_token_s"] for r in results)
    end = max(r["timings"]["time_to_first_token_s"] + r["timings"]["decode_s"] for r in results)
    steps = max(r["completion_tokens"] for r in results) - 1
    return (end - first) / steps * 1e3, sum(r["completion_tokens"] - 1 for r in results) / (end - first)


def http_level(binary: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    proc, url = bench_http.start_server(binary, model, max_seqs=64)
    try:
        return bench_http.run_level(url, clients, seconds, "The quick brown fox jumps over the lazy dog. " * 8, max_tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--candidate", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-retriever"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args()

    runs: dict[str, dict[str, list[float]]] = {"baseline": {}, "candidate": {}}
    loads = []
    for r in range(args.rounds):
        for name, binary in (("baseline", args.baseline), ("candidate", args.candidate)):
            loads.append(os.getloadavg()[0])
            step_ms, tok_s = generate_step_ms(binary, args.model, args.batch, args.prompt_words, args.max_tokens)
            h = http_level(binary, args.model, args.clients, args.seconds, args.max_tokens)
            m = runs[name]
            for k, v in (("step_ms", step_ms), ("gen_tok_s", tok_s), ("http_rps", h["rps"]),
                         ("http_tok_s", h["tok_s"]), ("itl50", h["itl50"] * 1e3), ("ttft50", h["ttft50"] * 1e3)):
                m.setdefault(k, []).append(v)
            print(f"round {r + 1} {name}: step {step_ms:.2f} ms, generate {tok_s:.1f} tok/s, "
                  f"http {h['rps']:.2f} req/s {h['tok_s']:.1f} tok/s ITL p50 {h['itl50'] * 1e3:.2f} ms", flush=True)

    rows = [("`generate` batch of %d: ms per decode step" % args.batch, "step_ms", True),
            ("`generate`: tokens/s", "gen_tok_s", False),
            ("HTTP, %d streaming clients: requests/s" % args.clients, "http_rps", False),
            ("HTTP: tokens/s", "http_tok_s", False),
            ("HTTP: ITL p50 (ms)", "itl50", True),
            ("HTTP: TTFT p50 (ms)", "ttft50", True)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    lines = [f"Engine A/B on `{pathlib.Path(args.model).name}` (candidate commit {commit}, {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} cores, load average {min(loads):.1f}-{max(loads):.1f} during the run; "
             f"{args.rounds} interleaved rounds, medians; {args.batch} prompts of {args.prompt_words} words x "
             f"{args.max_tokens} tokens; HTTP {args.seconds:.0f} s per round):", "",
             "| measure | baseline | candidate | candidate / baseline | better is |",
             "| --- | ---: | ---: | ---: | --- |"]
    for label, key, lower in rows:
        a, b = statistics.median(runs["baseline"][key]), statistics.median(runs["candidate"][key])
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.3f} | {'lower' if lower else 'higher'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
