#!/usr/bin/env python3
"""Perplexity against the kept KV fraction under decode-time eviction (the key-L2-norm paper's
language-modelling check, its figure 3), with `kvserve perplexity`.

Held-out plain-text documents (tools/retrieval_tasks.py "continue" task, another seed than
training) are decoded token by token, teacher-forced, through kvserve's paged KV memory; a policy
with decode_budget = round(fraction x length) evicts as the cache grows (knorm drops the largest
key norms, streamingllm the oldest non-sink tokens; h2o is not offered: decode computes no attention
scores). Writes perplexity.csv, perplexity.md and
perplexity_vs_kept.png to --out.

  python3 tools/eval_perplexity.py --kvserve build/kvserve --out docs/eval
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import retrieval_tasks as rt  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]

# label -> (policy, extra params)
VARIANTS = {
    "knorm": ("knorm", {}),                                   # the paper's default: layers 0 and 1 kept whole
    "knorm-all-layers": ("knorm", {"skip_layers": "none"}),  # every layer evicts
    "streamingllm": ("streamingllm", {}),                     # sink 4 + most recent
}


def docs(model_dir: str, n: int, length: int, seed: int) -> list:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    b = rt.Builder(tok, tok.token_to_id("<|begin_of_text|>"))
    rng = random.Random(seed)
    return [rt.build(b, rng, "continue", length)[1] for _ in range(n)]


def run(kvserve: str, model: str, ids_file: str, policy: str, params: dict) -> dict:
    cmd = [kvserve, "perplexity", "--model", model, "--input-ids", ids_file]
    if policy != "full":
        cmd += ["--policy", policy]
        for k, v in params.items():
            cmd += ["--policy-param", f"{k}={v}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=os.environ.get("KVSERVE_BIN", str(REPO / "build" / "kvserve")))
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-retriever"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.75, 0.5, 0.3, 0.2, 0.1])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=16, help="decode_evict_chunk")
    ap.add_argument("--seed", type=int, default=8_000_000)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "eval")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.json")
        pathlib.Path(ids_file).write_text(json.dumps(docs(args.model, args.docs, args.length, args.seed)))
        full = run(args.kvserve, args.model, ids_file, "full", {})
        rows.append({"variant": "full", "fraction": 1.0, "decode_budget": 0, "visible": 1.0,
                     "perplexity": round(full["perplexity"], 4), "mean_nll": round(full["mean_nll"], 5)})
        print(f"full: ppl {full['perplexity']:.3f}", flush=True)
        for v in args.variants:
            policy, extra = VARIANTS[v]
            for f in args.fractions:
                budget = max(int(round(f * args.length)), 4 + args.chunk + 1)
                params = {"decode_budget": budget, "decode_evict_chunk": args.chunk, **extra}
                if policy == "knorm":
                    params["budget"] = 0.999  # prefill is one token: nothing to compress there
                r = run(args.kvserve, args.model, ids_file, policy, params)
                rows.append({"variant": v, "fraction": f, "decode_budget": budget,
                             "visible": round(r["mean_visible_fraction"], 4),
                             "perplexity": round(r["perplexity"], 4), "mean_nll": round(r["mean_nll"], 5)})
                print(f"{v} f={f}: ppl {r['perplexity']:.3f} visible {r['mean_visible_fraction']:.3f}", flush=True)
    with open(args.out / "perplexity.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    md = [f"{args.docs} held-out documents of {args.length} tokens (seed {args.seed}), teacher-forced token by "
          f"token through the paged KV cache; decode_budget = fraction x {args.length}, evicting "
          f"{args.chunk} tokens at a time. `visible` = mean over steps and layers of cached / context tokens.\n",
          f"Full cache: perplexity **{full['perplexity']:.3f}**.\n",
          "| variant | " + " | ".join(f"{f:g}" for f in args.fractions) + " |",
          "| --- |" + " --- |" * len(args.fractions)]
    for v in args.variants:
        cells = []
        for f in args.fractions:
            r = next(x for x in rows if x["variant"] == v and x["fraction"] == f)
            cells.append(f"{r['perplexity']:.3f} ({r['visible']:.2f})")
        md.append(f"| {v} | " + " | ".join(cells) + " |")
    md.append("\nCells: perplexity (visible fraction).")
    (args.out / "perplexity.md").write_text("\n".join(md) + "\n")
    if not args.no_plots:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        for v in args.variants:
            pts = sorted((x["fraction"], x["perplexity"]) for x in rows if x["variant"] == v)
            ax.plot([p for p, _ in pts], [q for _, q in pts], marker="o", label=v)
        ax.axhline(full["perplexity"], color="k", ls="--", lw=1, label="full cache")
        ax.set_xlabel("KV kept during decoding (decode_budget / length)")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.invert_xaxis()
        ax.legend(fontsize=8)
        ax.set_title(f"tiny-retriever, {args.docs} x {args.length}-token documents", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.out / "perplexity_vs_kept.png", dpi=110)
        plt.close(fig)
    print("\n".join(md))
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
