#!/usr/bin/env python3
"""Quality per weight format (issue 48): the default model served as float32 (the GGUF dequantized by
tools/make_smollm2.py), as the Q4_1 GGUF it ships (`--model ...Q4_1.gguf`: ggml's blocks and dot
products) and quantized at load (`--quantization int8` = ggml Q8_0), side by side on
- tools/eval_multiquestion.py's many-questions-per-document task (RULER multi-key haystacks, four
  questions each over chat, greedy; 95 % Wilson intervals) under `--policies` (default full and
  kvzip at 25 %), one server per format;
- perplexity with the full cache (`kvserve perplexity`, tools/eval_perplexity.py's held-out
  "continue" documents, the same token ids for every format).
Every format runs with its default KV cache, as it is served: float32 for the float32 directory and
--quantization, float16 for the GGUF (kvserve's default for a GGUF file on the CPU, as llama.cpp's).

Prints a markdown table to stdout (progress to stderr); `--out` writes every answer as JSON.

  python3 tools/eval_quantized_weights.py --out docs/eval/quantized-weights.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import eval_kv_dtype as kd  # noqa: E402
import eval_multiquestion as mq  # noqa: E402

MODEL = REPO / "models" / "smollm2-135m-instruct"
# (label, model path, extra kvserve flags)
FORMATS = [("float32", MODEL, ()),
           ("Q4_1 GGUF", MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf", ()),
           ("int8 (Q8_0 at load)", MODEL, ("--quantization", "int8"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=13, help="documents (4 questions each; 13 -> 52 per cell)")
    ap.add_argument("--length", type=int, default=1000, help="document tokens")
    ap.add_argument("--policies", default="full,kvzip-0.25")
    ap.add_argument("--ppl-docs", type=int, default=4)
    ap.add_argument("--ppl-length", type=int, default=1024)
    ap.add_argument("--kvserve", default=os.environ.get("KVSERVE_BIN", str(REPO / "build" / "kvserve")))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ["KVSERVE_BIN"] = a.kvserve
    names = [n for n in a.policies.split(",") if n]
    for n in names:
        if n not in mq.POLICIES:
            ap.error(f"--policies: unknown policy {n!r}")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    docs = [mq.haystack(tok, a.length, 1000 + d) for d in range(a.docs)]
    answers: dict = {}
    ppl: dict = {}
    with tempfile.TemporaryDirectory(prefix="weights-ppl-") as tmp:
        ids = pathlib.Path(tmp) / "ids.json"
        ids.write_text(json.dumps(kd.perplexity_docs(str(MODEL), a.ppl_docs, a.ppl_length, 8_000_000)))
        for label, model, flags in FORMATS:
            rows = mq.run_policies(str(model), docs, names, serve_args=tuple(flags))
            answers[label] = rows
            cmd = [a.kvserve, "perplexity", "--model", str(model), "--input-ids", str(ids), *flags]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
            ppl[label] = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"{label}: perplexity {ppl[label]['perplexity']:.4f}", file=sys.stderr, flush=True)
    print(f"| weights | perplexity ({a.ppl_docs} x {a.ppl_length} tokens, full KV) | "
          + " | ".join(f"{n}: correct of {a.docs * 4} [95 % interval]" for n in names) + " |")
    print("| --- | ---: | " + " | ".join("---" for _ in names) + " |")
    for label, _, _ in FORMATS:
        cells = []
        for n in names:
            rows = answers[label][n]
            k = sum(r["correct"] for r in rows)
            lo, hi = mq.wilson(k, len(rows))
            cells.append(f"{k}/{len(rows)} [{lo:.0%}, {hi:.0%}]")
        print(f"| {label} | {ppl[label]['perplexity']:.2f} | " + " | ".join(cells) + " |")
    base = answers[FORMATS[0][0]]
    for label, _, _ in FORMATS[1:]:
        for n in names:
            same = sum(x["text"].strip() == y["text"].strip() for x, y in zip(base[n], answers[label][n]))
            print(f"{label} vs float32, {n}: identical answer text {same}/{len(base[n])}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"answers": answers, "perplexity": ppl}, indent=1))


if __name__ == "__main__":
    main()
