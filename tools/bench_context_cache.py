#!/usr/bin/env python3
"""Compress once, serve many: time to first token of questions about one document under kvzip, on a
real server (the default model, CPU). Per document length: a plain prefill (policy full, a document
the prefix cache has not seen), kvzip's first question (prefill + reconstruction pass + selection:
the cost of compressing), and three more questions that take the compressed document from the
context cache. Prints a markdown table (docs/eval/kvzip-notes.md keeps the figures)."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tools"))
import context_doc  # noqa: E402
from kvserve_server import Server  # noqa: E402


def ttft(url: str, messages: list[dict], policy: str) -> tuple[float, str, int]:
    body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "kv_policy": policy}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, cached = None, "", 0
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    if first is None:
                        first = time.perf_counter() - t0
                    text += c["delta"]["content"]
    return first if first is not None else time.perf_counter() - t0, text, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="1000,4000,7500", help="document tokens (the model reads 8192)")
    ap.add_argument("--budget", default="0.25")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    model = REPO / "models" / "smollm2-135m-instruct"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    yaml = f"""  kvzip:
    budget: {args.budget}
"""
    srv = Server(model=str(model), extra_yaml=yaml, kv_cache_bytes="3GiB")
    rows = []
    try:
        for n in [int(x) for x in args.lengths.split(",")]:
            text, recs = context_doc.document_of_tokens(tok, n, seed=n)
            plain_doc, _ = context_doc.document_of_tokens(tok, n, seed=n + 1)
            qs = context_doc.questions(recs, 4)
            full_t, _, _ = ttft(srv.url, [{"role": "system", "content": plain_doc}, {"role": "user", "content": qs[0][0]}], "full")
            times, cached = [], []
            for q, _ in qs:
                t, _, c = ttft(srv.url, [{"role": "system", "content": text}, {"role": "user", "content": q}], "kvzip")
                times.append(t)
                cached.append(c)
            m = srv.metrics()
            ratio = m["kvserve:kv_cache_blocks_compressed_contexts"] / max(1.0, m["kvserve:compressed_context_full_blocks"])
            hit = statistics.median(times[1:])
            rows.append((n, full_t, times[0], hit, times[0] / full_t, times[0] / hit, cached, ratio))
            print(f"{n}: full {full_t:.2f}s kvzip first {times[0]:.2f}s later {times[1:]} cached {cached} "
                  f"blocks ratio {ratio:.3f}", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    print("| document (tokens) | full TTFT | kvzip 1st question | kvzip questions 2-4 (median) | 1st / full | 1st / later | cached_tokens (q1..q4) | entry blocks / full (all entries) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, f, first, hit, c1, c2, cached, ratio in rows:
        print(f"| {n} | {f:.2f} s | {first:.2f} s | {hit:.3f} s | {c1:.2f}x | {c2:.0f}x | {cached} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
