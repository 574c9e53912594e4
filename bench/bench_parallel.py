#!/usr/bin/env python3
"""Tensor x pipeline parallel throughput on CPU (Gloo, real worker processes) against one process.

Runs `kvserve generate --prompts-file` (the engine: continuous batching, decode micro-batches over
the pipeline) for (TP, PP) in (1,1), (2,1), (1,2), (2,2) on bench-125m and prints a markdown table
of decode throughput (generated tokens / wall time of the decode phase) with the ratio to (1,1).

On a machine with few cores the ranks share them (each rank gets cores / ranks threads), so the
table measures the cost of the collectives and the pipeline, not a speed-up: that needs one device
per rank.

    python3 bench/bench_parallel.py --kvserve build/kvserve [--batch 8 --prompt-len 256 --tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def run(kvserve: str, model: str, prompts: pathlib.Path, tokens: int, tp: int, pp: int, policy: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([kvserve, "generate", "--model", model, "--prompts-file", str(prompts), "--max-tokens",
                           str(tokens), "--ignore-eos", "--json", "--tp", str(tp), "--pp", str(pp), *policy],
                          capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"TP={tp} PP={pp} failed:\n{proc.stderr}")
    out = json.loads(proc.stdout)
    results = out["results"]
    generated = sum(r["completion_tokens"] for r in results)
    # decode phase: from the first first-token to the last token (all sequences run together)
    first = min(r["timings"]["time_to_first_token_s"] for r in results)
    last = max(r["timings"]["time_to_first_token_s"] + r["timings"]["decode_s"] for r in results)
    decoded = generated - len(results)
    return {"tp": tp, "pp": pp, "generated": generated, "decode_tok_s": decoded / (last - first),
            "ttft_s": first, "load_s": out["load_s"], "wall_s": wall, "max_running": out["max_running"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--model", default=str(ROOT / ".fixtures" / "bench-125m"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--policy", nargs="*", default=[], help="e.g. --policy --policy pyramidkv --budget 64")
    args = ap.parse_args()
    if not (pathlib.Path(args.model) / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_bench_model.py"), "--out", args.model], check=True)
    vocab = json.loads((pathlib.Path(args.model) / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        prompts = pathlib.Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps([[(97 * i + 13 * j) % (vocab - 10) + 5 for i in range(args.prompt_len)]
                                       for j in range(args.batch)]))
        rows = [run(args.kvserve, args.model, prompts, args.tokens, tp, pp, args.policy) for tp, pp in LAYOUTS]
    base = rows[0]["decode_tok_s"]
    load = os.getloadavg()[0]
    print(f"bench-125m fp32 CPU, {os.cpu_count()} cores (load {load:.1f}), batch {args.batch}, prompt "
          f"{args.prompt_len}, {args.tokens} tokens each, policy {' '.join(args.policy) or 'full'}\n")
    print("| TP x PP | ranks | decode tokens/s | vs 1 process | first token (s) | max running |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tp']} x {r['pp']} | {r['tp'] * r['pp']} | {r['decode_tok_s']:.1f} | "
              f"{r['decode_tok_s'] / base:.2f}x | {r['ttft_s']:.2f} | {r['max_running']} |")


if __name__ == "__main__":
    main()
