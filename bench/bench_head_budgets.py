#!/usr/bin/env python3
"""Head-wise KV layout A/B: `kvserve bench decode` step times, rounds interleaved (A, B, A, B, ...)
so that machine noise hits every arm alike; medians over rounds and ratios against a baseline.

Arms (each a binary plus `bench decode` flags; every arm sees the same model, context and batch):
- per-layer policies, today's main (`--baseline`, a binary built from the commit before the head-wise
  layout) against the candidate in its default per-layer layout: the cost of the new bookkeeping;
- the candidate's per-layer policy forced onto head-wise blocks (`--kv-layout head`);
- the head-adaptive variant of the same policy and budget (same mean kept tokens per layer), which
  uses head-wise blocks.

Usage: python3 bench/bench_head_budgets.py --baseline /tmp/kvserve-main --candidate build/kvserve \
           [--model .fixtures/bench-125m] [--context 4096] [--batch 4] [--rounds 5] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def bench(binary: str, model: str, context: int, batch: int, steps: int, flags: list[str]) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    out = subprocess.run([binary, "bench", "decode", "--model", model, "--context", str(context), "--batch", str(batch),
                          "--steps", str(steps), "--warmup", "3", "--threads", "2", *flags],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])  # one JSON line per (context, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="kvserve built from main before the head-wise layout")
    ap.add_argument("--candidate", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / ".fixtures" / "bench-125m"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="append the table to this markdown file")
    a = ap.parse_args()
    b = str(a.budget)
    arms = {
        "full (main)": (a.baseline, []),
        "full": (a.candidate, []),
        "full, head blocks": (a.candidate, ["--kv-layout", "head"]),
        f"snapkv-{b} (main)": (a.baseline, ["--policy", "snapkv", "--budget", b]),
        f"snapkv-{b}": (a.candidate, ["--policy", "snapkv", "--budget", b]),
        f"snapkv-{b}, head blocks": (a.candidate, ["--policy", "snapkv", "--budget", b, "--kv-layout", "head"]),
        f"snapkv-{b} adaptive": (a.candidate, ["--policy", "snapkv", "--budget", b, "--policy-param",
                                               "head_budgets=adaptive"]),
        f"pyramidkv-{b} (main)": (a.baseline, ["--policy", "pyramidkv", "--budget", b]),
        f"pyramidkv-{b}": (a.candidate, ["--policy", "pyramidkv", "--budget", b]),
        f"pyramidkv-{b} adaptive": (a.candidate, ["--policy", "pyramidkv", "--budget", b, "--policy-param",
                                                  "head_budgets=adaptive"]),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    info: dict[str, dict] = {}
    load_before = os.getloadavg()
    for r in range(a.rounds):
        for name, (binary, flags) in arms.items():
            row = bench(binary, a.model, a.context, a.batch, a.steps, flags)
            times[name].append(row["step_s_median"] * 1e3)
            info[name] = row
            print(f"round {r + 1}/{a.rounds} {name}: {times[name][-1]:.2f} ms", flush=True)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(name: str, base: str) -> str:
        return f"{med[name] / med[base]:.3f}" if base in med else "-"

    lines = [f"Context {a.context} x batch {a.batch}, {a.steps} timed steps per run after 3 warm-up steps, 2 threads, "
             f"{a.rounds} rounds interleaved; median over rounds of each run's median step. Load "
             f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in load_after)} after.", "",
             "| arm | ms / step | vs main | vs per-layer (same binary) | KV tokens kept per (layer, head): min / mean / max | pool bytes / seq |",
             "|---|---:|---:|---:|---|---:|"]
    for name in arms:
        base_main = name.replace(", head blocks", "").replace(" adaptive", "")
        base_main = base_main if base_main.endswith("(main)") else f"{base_main} (main)"
        per_layer = name.replace(", head blocks", "").replace(" adaptive", "")
        hk = info[name].get("kv_tokens_per_head", {})
        heads = f"{hk['min']} / {hk['mean']:.1f} / {hk['max']}" if hk else "-"
        lines.append(f"| {name} | {med[name]:.2f} | {'-' if name.endswith('(main)') else ratio(name, base_main)} | "
                     f"{'-' if name == per_layer or name.endswith('(main)') else ratio(name, per_layer)} | {heads} | "
                     f"{info[name]['pool_bytes_per_seq']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
