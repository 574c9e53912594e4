#!/usr/bin/env python3
"""Per-layer evidence for DynamicKV on the default model, and its variants' accuracy, in transformers
(tools/kv_sim.py re-does kvserve's selection in PyTorch). Writes JSON with per-layer rows and
per-variant correct counts; docs/eval/dynamickv.md is written from it.

  python3 tools/dynamickv_study.py --model models/smollm2-135m-instruct --n 8 --out /tmp/dyn.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kv_sim  # noqa: E402
import ruler_tasks as rt  # noqa: E402

VARIANTS = {
    "paper": {},
    "authors": {"per_query_head": True, "final": False, "authors_trailing": True},
    "norm_layer": {"norm": "layer"},
    "norm_head": {"norm": "head"},
    "norm_max": {"norm": "max"},
    "min50": {"min_frac": 0.5},
    "norm_head_min50": {"norm": "head", "min_frac": 0.5},
    "prior50": {"prior": "pyramid", "alpha": 0.5},
    "norm_head_prior50": {"norm": "head", "prior": "pyramid", "alpha": 0.5},
    "maxpool": {"pooling": "max"},
    "min75": {"min_frac": 0.75},
    "norm_kth": {"norm": "kth"},
    "norm_kth_min50": {"norm": "kth", "min_frac": 0.5},
    "uniform50": {"prior": "uniform", "alpha": 0.5},
    "kth50": {"norm": "kth", "rank": 0.5},
    "kth25": {"norm": "kth", "rank": 0.25},
    "kth50_authors": {"norm": "kth", "rank": 0.5, "per_query_head": True, "final": False, "authors_trailing": True},
    "kth50_maxpool": {"norm": "kth", "rank": 0.5, "pooling": "max"},
    "kth50_min50": {"norm": "kth", "rank": 0.5, "min_frac": 0.5},
}


def report(path: str, keys: list) -> str:
    """Markdown: per-layer kept tokens / attention mass kept / needle tokens kept, and accuracies."""
    d = json.loads(pathlib.Path(path).read_text())
    L = d["layers"]
    keys = [k for k in keys if k in L]
    out = ["| layer | " + " | ".join(keys) + " |", "|---:|" + "---|" * len(keys)]
    for i in range(len(L[keys[0]])):
        out.append(f"| {i} | " + " | ".join("%.0f / %.2f / %.2f" % tuple(L[k][i]) for k in keys) + " |")
    out.append("| sum | " + " | ".join("%.0f" % sum(r[0] for r in L[k]) for k in keys) + " |")
    out += ["", "| config | " + " | ".join(next(iter(d["cells"].values())).keys()) + " | all |",
            "|---|" + "---:|" * (len(next(iter(d["cells"].values()))) + 1)]
    for k, c in d["cells"].items():
        tot = sum(v[0] for v in c.values()), sum(v[1] for v in c.values())
        out.append(f"| {k} | " + " | ".join(f"{v[0]}/{v[1]}" for v in c.values()) + f" | {tot[0]}/{tot[1]} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2], sys.argv[3].split(",")))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--tasks", default="niah_number,multikey,qa")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8, help="samples per task")
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/dynamickv_study.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    tok = Tokenizer.from_file(str(pathlib.Path(a.model) / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = {tok.token_to_id("<|im_end|>"), 2}
    maker = rt.TaskMaker(tok)
    budgets = [int(b) for b in a.budgets.split(",")]
    variants = a.variants.split(",")
    cells = {}
    layers = {}
    t0 = time.time()
    samples = [maker.make(task, a.length, s) for task in a.tasks.split(",") for s in range(a.n)]
    rt.tokenize(tok, samples)
    for si, smp in enumerate(samples):
        t = len(smp.ids)
        needle = rt.needle_token_positions(tok, smp)
        cap, cache, first = kv_sim.prefill(model, smp.ids, 8)
        runs = [("full", None, None)] + [(p, b, None) for b in budgets for p in ("snapkv", "pyramidkv")] + \
            [("dynamickv", b, v) for b in budgets for v in variants]
        for pol, b, v in runs:
            key = pol if pol == "full" else f"{pol}{'/' + v if v else ''}@{b}"
            if pol == "full":
                kept = None
            else:
                kept, _ = kv_sim.select(pol, cap, t, b, VARIANTS.get(v, {}))
            out = kv_sim.decode(model, cache, first, kept, t, smp.max_tokens, eos)
            ok = smp.correct(tok.decode(out))
            c = cells.setdefault(key, {}).setdefault(smp.task, [0, 0])
            c[0] += ok
            c[1] += 1
            if kept is not None and (pol != "dynamickv" or v in ("paper", "authors", "norm_kth", "prior50", "min50", "kth50", "kth25")):
                ev = kv_sim.evidence(cap, kept, needle, t, 8)
                acc = layers.setdefault(key, [[0.0, 0.0, 0.0] for _ in ev])
                for i, (n, m, nd) in enumerate(ev):
                    acc[i][0] += n / len(samples)
                    acc[i][1] += m / len(samples)
                    acc[i][2] += nd / len(samples)
        done = si + 1
        el = time.time() - t0
        print(f"[study] {done}/{len(samples)} samples, {el:.0f} s, eta {el / done * (len(samples) - done):.0f} s",
              file=sys.stderr, flush=True)
        pathlib.Path(a.out).write_text(json.dumps({"args": vars(a), "cells": cells, "layers": layers}, indent=1))
    for k, d in cells.items():
        tot = sum(v[0] for v in d.values()), sum(v[1] for v in d.values())
        print(f"{k:40s} {tot[0]:3d}/{tot[1]:3d}  " + " ".join(f"{tk}={v[0]}/{v[1]}" for tk, v in d.items()))


if __name__ == "__main__":
    main()
