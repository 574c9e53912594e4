#!/usr/bin/env python3
"""Quality per KV cache dtype at equal KV memory: tools/eval_multiquestion.py's many-questions-per-
document task (RULER multi-key haystacks, four questions each over chat, greedy, scored by whether
the number occurs in the answer, 95 % Wilson intervals) on a grid of (policy @ kept fraction, KV
cache storage dtype) cells, one kvserve server per dtype (`kvserve serve --kv-cache-dtype`).

Cells, for each of `--policies` (default kvzip, kvzap, snapkv, pyramidkv):
  equal KV bytes   float16 at 12.5 % kept, int8 (q8_0, 8.5 bits a value) at 25 %, int4 (q4_0,
                   4.5 bits) at 50 %: 16 x 1/8 = 2.0, 8.5 x 1/4 = 2.1, 4.5 x 1/2 = 2.25 bits per
                   cached value of the context;
  equal tokens     the policy at 25 % under float16 and under int8;
and `full` under float16, int8 and int4. KV bytes are nominal: bits per value / 16 x the kept
fraction, relative to the float16 full cache (block padding and a policy's window are not counted).

`--perplexity` also runs `kvserve perplexity --kv-cache-dtype X` with the full policy on held-out
plain-text documents (tools/eval_perplexity.py's "continue" documents, decoded token by token, so
every scored token reads the cache in that dtype) for each of `--ppl-dtypes`.

Prints a markdown table to stdout (progress to stderr); `--out` writes every answer as JSON.

  python3 tools/eval_kv_dtype.py --out docs/eval/kv-dtype.json --perplexity
  python3 tools/eval_kv_dtype.py --docs 1 --cells kvzip-0.25@int8        # smoke test: 4 questions
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import eval_multiquestion as mq  # noqa: E402

# Bits per cached value (ggml block formats and fp8: 32 values share a scale, q4_1 also a minimum).
BITS = {"float32": 32.0, "fp32": 32.0, "float16": 16.0, "fp16": 16.0, "bfloat16": 16.0, "bf16": 16.0,
        "int8": 8.5, "q8_0": 8.5, "int4": 4.5, "q4_0": 4.5, "q4_1": 5.0, "fp8": 8.5, "fp8_e4m3": 8.5}
POLICIES = ("kvzip", "kvzap", "snapkv", "pyramidkv")
# (dtype, kept fraction) at about equal KV bytes, and the equal-token pair.
EQUAL_BYTES = (("float16", 0.125), ("int8", 0.25), ("int4", 0.5))
EQUAL_TOKENS = (("float16", 0.25), ("int8", 0.25))
FULL_DTYPES = ("float16", "int8", "int4")
PPL_DTYPES = ("float32", "float16", "int8", "int4", "q4_1")


def policy_name(policy: str, kept: float) -> str:
    return "full" if policy == "full" else f"{policy}-{kept:g}"


def kept_of(name: str) -> float:
    return 1.0 if name == "full" else float(name.rsplit("-", 1)[1])


def relative_bytes(dtype: str, kept: float) -> float:
    """Nominal KV bytes of a cell against the float16 full cache."""
    return BITS[dtype] / 16.0 * kept


def grid(policies: list[str]) -> list[tuple[str, str]]:
    """(policy name in eval_multiquestion.POLICIES, dtype) cells in table order, without repeats."""
    cells: list[tuple[str, str]] = []
    for p in policies:
        for dtype, kept in EQUAL_BYTES + EQUAL_TOKENS:
            c = (policy_name(p, kept), dtype)
            if c not in cells:
                cells.append(c)
    cells += [("full", d) for d in FULL_DTYPES]
    return cells


def parse_cells(text: str) -> list[tuple[str, str]]:
    cells = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, dtype = item.partition("@")
        if not sep:
            raise ValueError(f"{item!r}: expected policy@dtype, e.g. kvzip-0.25@int8")
        cells.append((name.strip(), dtype.strip()))
    return cells


def run_grid(a: argparse.Namespace, docs: list) -> tuple[dict, dict]:
    """Every cell's rows ({'name @ dtype': rows}) and per-dtype server info, one server per dtype."""
    results, servers = {}, {}
    dtypes = list(dict.fromkeys(d for _, d in a.cells))
    for dtype in dtypes:
        names = [n for n, d in a.cells if d == dtype]
        names.sort(key=lambda n: n != "full")  # full first, as eval_multiquestion's default order
        info: dict = {}
        results.update(mq.run_policies(a.model, docs, names, dtype, info))
        servers[dtype] = info
    return results, servers


def paired(x: list[dict], y: list[dict]) -> str:
    both = sum(p["correct"] and q["correct"] for p, q in zip(x, y))
    agree = sum(p["correct"] == q["correct"] for p, q in zip(x, y))
    same = sum(p["text"].strip() == q["text"].strip() for p, q in zip(x, y))
    return f"both correct {both}/{len(x)}, same verdict {agree}/{len(x)}, identical answer text {same}/{len(x)}"


def table(a: argparse.Namespace, results: dict) -> list[str]:
    n_q = len(a.docs_list) * 4
    lines = [f"| cell | dtype | kept | KV bytes (of float16 full) | correct ({len(a.docs_list)} documents x 4 questions, "
             f"{a.length} tokens) | 95 % interval | by question 1..4 |",
             "| --- | --- | ---: | ---: | --- | --- | --- |"]
    for name, dtype in a.cells:
        rows = results[mq.label(name, dtype)]
        k, n = sum(r["correct"] for r in rows), len(rows)
        assert n == n_q, (name, dtype, n)
        lo, hi = mq.wilson(k, n)
        per_q = "/".join(str(sum(r["correct"] for r in rows if r["question"] == i)) for i in range(4))
        kept = kept_of(name)
        lines.append(f"| {mq.label(name, dtype)} | {dtype} | {kept:.1%} | {relative_bytes(dtype, kept):.3f} | "
                     f"{k}/{n} ({k / n:.0%}) | [{lo:.0%}, {hi:.0%}] | {per_q} |")
    return lines


def comparisons(a: argparse.Namespace, results: dict) -> list[str]:
    """Per-question agreement of the cells that differ only in dtype (equal tokens) with float16's."""
    out = []
    names = list(dict.fromkeys(n for n, _ in a.cells))
    for name in names:
        ref = results.get(mq.label(name, "float16"))
        if ref is None:
            continue
        for dtype in dict.fromkeys(d for n, d in a.cells if n == name and d != "float16"):
            out.append(f"- {mq.label(name, dtype)} vs {mq.label(name, 'float16')}: "
                       f"{paired(results[mq.label(name, dtype)], ref)}")
    return out


def perplexity_docs(model: str, n: int, length: int, seed: int) -> list[list[int]]:
    """tools/eval_perplexity.py's held-out "continue" documents, tokenized for `model` (its BOS from
    config.json where the tokenizer has no <|begin_of_text|>)."""
    import eval_perplexity as ep
    docs = ep.docs(model, n, length, seed)
    if any(d[0] is None for d in docs):
        cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
        bos = cfg.get("bos_token_id")
        if not isinstance(bos, int):
            raise SystemExit(f"{model}: no <|begin_of_text|> token and no integer bos_token_id in config.json")
        docs = [[bos if t is None else t for t in d] for d in docs]
    return docs


def run_perplexity(a: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-dtype-ppl-") as tmp:
        ids = pathlib.Path(tmp) / "ids.json"
        ids.write_text(json.dumps(perplexity_docs(a.model, a.ppl_docs, a.ppl_length, a.ppl_seed)))
        for dtype in a.ppl_dtypes:
            cmd = [a.kvserve, "perplexity", "--model", a.model, "--input-ids", str(ids), "--kv-cache-dtype", dtype]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append({"dtype": dtype, "bits": BITS[dtype], "perplexity": r["perplexity"], "mean_nll": r["mean_nll"],
                         "scored": r["scored"], "seconds": time.perf_counter() - t0,
                         "command": shlex.join(cmd).replace(str(ids), "IDS.json")})
            print(f"perplexity @ {dtype}: {r['perplexity']:.4f} ({r['scored']} tokens, "
                  f"{rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def perplexity_table(a: argparse.Namespace, rows: list[dict]) -> list[str]:
    ref = next((r for r in rows if r["dtype"] in ("float32", "fp32")), rows[0])
    lines = [f"| KV cache dtype | bits per value | perplexity ({a.ppl_docs} documents x {a.ppl_length} tokens, full "
             f"cache) | vs {ref['dtype']} | mean NLL difference |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['bits']:g} | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / ref['perplexity'] - 1:+.2%} | {r['mean_nll'] - ref['mean_nll']:+.5f} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=13, help="documents (4 questions each; 13 -> 52 per cell)")
    ap.add_argument("--length", type=int, default=1000, help="document tokens")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies of the grid, comma list")
    ap.add_argument("--cells", default=None,
                    help="instead of the grid: cells policy@dtype, comma list (e.g. kvzip-0.25@int8,full@int8; "
                         "'' for none, with --perplexity)")
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--kvserve", default=os.environ.get("KVSERVE_BIN", str(REPO / "build" / "kvserve")),
                    help="kvserve binary (also used by the servers, through KVSERVE_BIN)")
    ap.add_argument("--out", default="", help="JSON file: every answer, the cells' scores, the perplexities")
    ap.add_argument("--perplexity", action="store_true", help="also the full cache's perplexity per --ppl-dtypes")
    ap.add_argument("--ppl-dtypes", default=",".join(PPL_DTYPES))
    ap.add_argument("--ppl-docs", type=int, default=4)
    ap.add_argument("--ppl-length", type=int, default=1024)
    ap.add_argument("--ppl-seed", type=int, default=8_000_000, help="tools/eval_perplexity.py's default seed")
    a = ap.parse_args(argv)
    a.policies = [p for p in (x.strip() for x in a.policies.split(",")) if p]
    try:
        a.cells = grid(a.policies) if a.cells is None else parse_cells(a.cells)
    except ValueError as e:
        ap.error(f"--cells: {e}")
    for name, dtype in a.cells:
        if name not in mq.POLICIES:
            ap.error(f"unknown policy {name!r} (tools/eval_multiquestion.py POLICIES: {', '.join(mq.POLICIES)})")
        if dtype not in BITS:
            ap.error(f"unknown KV cache dtype {dtype!r} (known: {', '.join(BITS)})")
        try:
            kept_of(name)
        except ValueError:
            ap.error(f"{name!r}: no kept fraction in the name (expected policy-FRACTION)")
    if len(set(a.cells)) != len(a.cells):
        ap.error("a cell is listed twice")
    a.ppl_dtypes = [d for d in (x.strip() for x in a.ppl_dtypes.split(",")) if d]
    for d in a.ppl_dtypes:
        if d not in BITS:
            ap.error(f"--ppl-dtypes: unknown dtype {d!r}")
    if not a.cells and not a.perplexity:
        ap.error("nothing to run: no cells and no --perplexity")
    if not pathlib.Path(a.kvserve).exists():
        ap.error(f"--kvserve {a.kvserve}: no such binary (make build)")
    return a


def main() -> None:
    a = parse_args()
    os.environ["KVSERVE_BIN"] = a.kvserve  # tests/integration/kvserve_server.py's Server starts this binary
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    out: dict = {"command": shlex.join([sys.executable, *sys.argv]), "started_utc": started.isoformat(timespec="seconds"),
                 "model": a.model, "task": {"documents": a.docs, "questions_per_document": 4, "length": a.length,
                                            "max_tokens": mq.MAX_TOKENS, "seeds": [1000 + d for d in range(a.docs)]},
                 "cells": [], "servers": {}, "perplexity": []}
    lines: list[str] = []
    a.docs_list = []
    if a.cells:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(pathlib.Path(a.model) / "tokenizer.json"))
        a.docs_list = [mq.haystack(tok, a.length, 1000 + d) for d in range(a.docs)]
        results, out["servers"] = run_grid(a, a.docs_list)
        for name, dtype in a.cells:
            rows = results[mq.label(name, dtype)]
            k, n = sum(r["correct"] for r in rows), len(rows)
            lo, hi = mq.wilson(k, n)
            out["cells"].append({"cell": mq.label(name, dtype), "policy": name, "yaml": mq.POLICIES[name],
                                 "dtype": dtype, "kept": kept_of(name),
                                 "kv_bytes_of_float16_full": relative_bytes(dtype, kept_of(name)),
                                 "correct": k, "total": n, "wilson95": [lo, hi], "rows": rows})
        lines += table(a, results)
        comp = comparisons(a, results)
        if comp:
            lines += ["", "Per question, against the same policy and kept fraction under float16:", ""] + comp
        blocks = {d: i.get("kv_cache_blocks_total") for d, i in out["servers"].items()}
        lines += ["", "KV pool of each server (kv_cache_bytes 2GiB): " +
                  ", ".join(f"{d} {b:.0f} blocks" if b is not None else f"{d} ?" for d, b in blocks.items())]
        known = [b for b in blocks.values() if b is not None]
        if len(set(known)) < len(known):
            lines.append("WARNING: two dtypes gave the same pool size: did --kv-cache-dtype take effect?")
    if a.perplexity:
        out["perplexity"] = run_perplexity(a)
        lines += [""] + perplexity_table(a, out["perplexity"])
    out["seconds"] = time.perf_counter() - t0
    print("\n".join(lines).lstrip("\n"))
    print(f"done in {out['seconds']:.0f} s", file=sys.stderr)
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
