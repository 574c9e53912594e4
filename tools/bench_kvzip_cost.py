#!/usr/bin/env python3
"""What kvzip's reconstruction and kvzap's predictor cost (issue 32): time to first token of one
passkey prompt under each policy against a plain prefill of the same prompt (policy full), at each
length, and the decode step after it. Runs are interleaved per length (full, kvzip, kvzap, snapkv,
full) in fresh `kvserve generate` processes, so load drifts hit both sides;
the ratio is the figure to read on a shared machine.

  python3 tools/bench_kvzip_cost.py --lengths 1024 4096 8000 --repeats 1 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import retrieval_tasks as rt  # noqa: E402


def prompt_ids(model: str, length: int, seed: int) -> list[int]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(model) / "tokenizer.json"))
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    builder = rt.Builder(tok, cfg.get("bos_token_id") or 0)
    _, ids, _, _, _ = rt.build(builder, random.Random(seed), "passkey", length)
    return ids


def run(kvserve: str, model: str, ids: list[int], policy: list[str], new_tokens: int, threads: int) -> dict:
    cmd = [kvserve, "generate", "--model", model, "--prompt-ids", *map(str, ids), "--max-tokens", str(new_tokens),
           "--ignore-eos", "--json", "--max-num-batched-tokens", str(len(ids) + 8), *policy]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed: {p.stderr[-500:]}")
    out = json.loads(p.stdout)
    return {**out["timings"], "completion_tokens": out["completion_tokens"], "wall_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--budget", default="0.25")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=33, help="tokens generated (the decode step is over the last 32)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (0: unset)")
    ap.add_argument("--json-out")
    ap.add_argument("--policies", default="kvzip,kvzap,snapkv",
                    help="compressing policies measured against full, comma list (kvzip, kvzap, kvzap-linear, snapkv)")
    ap.add_argument("--kvzap-linear", default=str(REPO / "models" / "kvzap-smollm2-135m-instruct" / "linear"),
                    help="the predictor of the kvzap-linear row (kvzap's is the model directory's)")
    a = ap.parse_args()
    known = {
        "kvzip": ["--policy", "kvzip", "--budget", a.budget],
        "kvzap": ["--policy", "kvzap", "--budget", a.budget],
        "kvzap-linear": ["--policy", "kvzap", "--budget", a.budget, "--policy-param", f"predictor={a.kvzap_linear}"],
        "snapkv": ["--policy", "snapkv", "--budget", a.budget],
    }
    names = [n for n in a.policies.split(",") if n]
    for n in names:
        if n not in known:
            ap.error(f"--policies: unknown {n!r} (known: {', '.join(known)})")
    policies = {"full": [], **{n: known[n] for n in names}}
    rows, raw = [], []
    for n in a.lengths:
        ids = prompt_ids(a.model, n, seed=n)
        got: dict[str, list[dict]] = {k: [] for k in policies}
        for _ in range(a.repeats):
            for name in ["full", *names, "full"]:
                r = run(a.kvserve, a.model, ids, policies[name], a.new_tokens, a.threads)
                got[name].append(r)
                raw.append({"length": len(ids), "policy": name, **{k: r.get(k) for k in (
                    "time_to_first_token_s", "decode_s", "completion_tokens", "wall_s")}})
                print(f"{len(ids)} {name}: ttft {r['time_to_first_token_s']:.2f} s, decode {r.get('decode_s', 0):.2f} s",
                      file=sys.stderr, flush=True)

        def ttft(name):
            return statistics.median(r["time_to_first_token_s"] for r in got[name])

        def step_ms(name):
            return statistics.median(1e3 * r["decode_s"] / max(1, r["completion_tokens"] - 1) for r in got[name])

        rows.append((len(ids), {k: ttft(k) for k in policies}, {k: step_ms(k) for k in policies}))
    print("| prompt tokens | plain prefill (full) | " + " | ".join(f"{k} prefill (/ full)" for k in names)
          + " | decode ms/token: full | " + " | ".join(names) + " |")
    print("| ---: " * (2 + 2 * len(names) + 1) + "|")
    for n, tf, dm in rows:
        cells = [f"{tf[k]:.2f} s (**{tf[k] / tf['full']:.2f}x**)" for k in names]
        print(f"| {n} | {tf['full']:.2f} s | " + " | ".join(cells) + f" | {dm['full']:.1f} | "
              + " | ".join(f"{dm[k]:.1f}" for k in names) + " |")
    if a.json_out:
        pathlib.Path(a.json_out).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
