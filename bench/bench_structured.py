#!/usr/bin/env python3
"""Structured-output cost: decode throughput of a batch of 8 JSON-schema requests against the same 8
requests unconstrained (A/B interleaved in one run), and the grammar compile time per schema.

Starts `kvserve serve` on the default model (CPU), sends 8 concurrent chat requests of
max_tokens tokens (the schema needs more, so the constrained arm runs as long), and reports
generated tokens per second per arm and their ratio. Compile time per schema: latency of a 1-token
request with a schema the server has not seen, minus the same request again (cached grammar).

Usage: python3 bench/bench_structured.py --kvserve build/kvserve [--rounds 3] [--out docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import sys
import time

from openai import OpenAI

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_http import start_server  # noqa: E402

# At least 200 digits: the constrained arm cannot finish before max_tokens, so both arms decode the
# same number of tokens per request (the unconstrained one with ignore_eos).
SCHEMA = {"type": "object", "properties": {"digits": {"type": "array", "items": {"type": "integer", "minimum": 0,
          "maximum": 9}, "minItems": 200}}, "required": ["digits"]}
PROMPT = "List many random digits as JSON."


def batch(c: OpenAI, constrained: bool, max_tokens: int) -> tuple[int, float]:
    kw = dict(model="bench", temperature=0, max_tokens=max_tokens,
              messages=[{"role": "user", "content": PROMPT}])
    if constrained:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
    else:
        kw["extra_body"] = {"ignore_eos": True}
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: c.chat.completions.create(**kw), range(8)))
    dt = time.perf_counter() - t0
    return sum(r.usage.completion_tokens for r in rs), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=pathlib.Path)
    a = ap.parse_args()
    proc, url = start_server(a.kvserve, a.model, 8)
    try:
        c = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        batch(c, True, 8)  # warm-up (and the schema's compile) outside the timing
        arms = {True: [0, 0.0], False: [0, 0.0]}
        for _ in range(a.rounds):
            for constrained in (False, True):
                n, dt = batch(c, constrained, a.max_tokens)
                arms[constrained][0] += n
                arms[constrained][1] += dt
        free = arms[False][0] / arms[False][1]
        json_tps = arms[True][0] / arms[True][1]
        schemas = json.loads((REPO / "tests" / "integration" / "structured_schemas.json").read_text())
        compile_ms = []
        for i, s in enumerate(schemas):
            rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s["schema"]}}
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                c.chat.completions.create(model="bench", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                          response_format=rf)
                times.append(time.perf_counter() - t0)
            compile_ms.append(max(0.0, times[0] - times[1]) * 1000)
        table = (
            "\n## Structured outputs: JSON-schema decode cost and grammar compile time (bench/bench_structured.py)\n\n"
            f"CPU, default model, batch 8, max_tokens {a.max_tokens}, {a.rounds} interleaved A/B rounds; the "
            "machine was shared with other jobs while this ran.\n\n"
            "| arm | generated tokens | seconds | tokens/s |\n|---|---:|---:|---:|\n"
            f"| unconstrained | {arms[False][0]} | {arms[False][1]:.1f} | {free:.1f} |\n"
            f"| JSON schema | {arms[True][0]} | {arms[True][1]:.1f} | {json_tps:.1f} |\n\n"
            f"Ratio JSON-schema / unconstrained: **{json_tps / free:.3f}**.\n\n"
            f"Grammar compile time over the 30 test schemas (first request minus cached repeat): median "
            f"{statistics.median(compile_ms):.1f} ms, max {max(compile_ms):.1f} ms.\n")
        print(table)
        if a.out:
            with open(a.out, "a") as f:
                f.write(table)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
