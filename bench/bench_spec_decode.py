#!/usr/bin/env python3
"""Speculative decoding (prompt lookup, or self-drafting with --spec) against plain decoding, one
`kvserve generate` binary, rounds interleaved (plain, speculative, plain, ...) so that machine noise
hits both alike.

Workloads (paragraphs of the repository's docs and of ../shared/papers as passages):
- copy:    the passage, then "Repeat the text above word for word:" and its first words: the model
           copies, prompt lookup drafts what it copies;
- nocopy:  an open question with nothing to copy from (the prompt shares few n-grams with the answer);
- long:    a document of --long-tokens tokens (passages in a rotated order per prompt), then a request
           to continue it; every sequence makes all its tokens (ignore_eos), for self-drafting at long
           context.
- shared:  one document of --long-tokens tokens, then a different passage per prompt and a request
           to continue (ignore_eos): a batch shares the document's blocks through the prefix cache,
           so it is admitted after one long prefill and decodes together.
- quote:   the same documents, then a request to repeat a paragraph from the document's middle, named
           by its first words (ignore_eos): what to copy lies far from the recent window, where a
           draft view chosen by a policy (--spec with draft_policy) can reach and sinks + window cannot.
For each row the runner's own clock gives a draft step's cost c and a verify step's cost v as
multiples of a plain step (generate --json: draft_s / draft_steps, verify_s / verify_steps), and the
ratio they predict, MAL / (draft steps per verify * c + v), beside the measured one.
At batch 1 each prompt runs alone (decode tokens/s over the prompts); at batch B the prompts run
together (`--prompts-file`). Runs are greedy unless --temperature (seeded sampling; then sampled
self-drafts, draft_sampling "sample", differ from plain tokens by design); the tokens of both
modes are compared.

Usage: python3 bench/bench_spec_decode.py [--model models/smollm2-135m-instruct] [--prompts 8]
           [--batches 1,8] [--exactness 200] [--out docs/benchmarks-speculative.md]
           [--spec '{"method": "self", "num_speculative_tokens": 4}'] [--workloads long --long-tokens 7600]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
IGNORE_EOS = False
TEMPERATURE = 0.0
EXTRA_ARGS: list[str] = []  # --kv-cache-dtype for both modes
QUESTIONS = ["Write a short story about a dragon who learns to bake bread.",
             "List five ideas for a birthday party for a ten-year-old.",
             "Explain why the sky is blue to a child.",
             "What are the benefits of learning a second language?",
             "Describe your perfect weekend in the mountains.",
             "Give three tips for writing a good cover letter.",
             "Why do cats purr? Answer in a few sentences.",
             "Plan a three-day trip to Rome for a family."]


def passages(n: int) -> list[str]:
    out = []
    files = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"] + sorted((REPO.parent / "shared" / "papers").glob("*.txt"))
    for f in files:
        for p in re.split(r"\n\s*\n", f.read_text(errors="replace")):
            p = " ".join(p.split())
            if 200 <= len(p) <= 700 and not p.startswith(("|", "#", "```", "-", "*", ">")):
                out.append(p)
    assert len(out) >= n, f"only {len(out)} passages"
    return out[:n]


def copy_prompt(p: str) -> str:
    return f"{p}\n\nRepeat the text above word for word:\n{' '.join(p.split()[:4])}"


def long_prompts(model: str, n: int, tokens: int) -> list[str]:
    """n documents of about `tokens` tokens (counted with the model's tokenizer), each its own order."""
    from tokenizers import Tokenizer
    m = pathlib.Path(model)
    tok = Tokenizer.from_file(str((m if m.is_dir() else m.parent) / "tokenizer.json"))  # a GGUF: the one beside it
    ps = passages(40)
    out = []
    for i in range(n):
        order = ps[i % len(ps):] + ps[:i % len(ps)]
        doc, k = [], 0
        while True:
            nxt = order[k % len(order)]
            if len(tok.encode("\n\n".join(doc + [nxt])).ids) > tokens - 16:
                break
            doc.append(nxt)
            k += 1
        out.append("\n\n".join(doc) + "\n\nContinue the text above:")
    return out


def shared_prompts(model: str, n: int, tokens: int) -> list[str]:
    """One document of about `tokens` tokens, then a different passage per prompt and a request to
    continue: a batch's sequences share the document's blocks through the prefix cache, so the batch
    is admitted after one long prefill and all of it decodes together (distinct long prompts are
    prefilled one after another while the first ones already decode, and the KV pool may not hold
    them all)."""
    doc = long_prompts(model, 1, tokens - 400)[0].removesuffix("\n\nContinue the text above:")
    return [f"{doc}\n\n{p}\n\nContinue the text above:" for p in passages(40)[-n:]]


def quote_prompts(model: str, n: int, tokens: int) -> list[str]:
    """long_prompts' documents, each asking to repeat word for word a paragraph from its middle, named
    by its first words: the answer is far from the recent window (a view of sinks and window misses
    it; a policy that reads the question's attention finds it)."""
    out = []
    for doc in long_prompts(model, n, tokens - 64):
        paras = doc.removesuffix("\n\nContinue the text above:").split("\n\n")
        words = paras[len(paras) // 2].split()
        out.append("\n\n".join(paras) + f"\n\nRepeat word for word the paragraph above that begins with "
                   f"\"{' '.join(words[:8])}\":\n{' '.join(words[:4])}")
    return out


def run(binary: str, model: str, prompts: list[str], max_tokens: int, spec: bool) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [binary, "generate", "--model", model, "--prompts-file", f.name, "--max-tokens", str(max_tokens),
           "--temperature", str(TEMPERATURE), "--json"]
    if TEMPERATURE > 0:
        cmd += ["--seed", "1"]
    if spec:
        cmd += ["--speculative-config", json.dumps(SPEC)]
    if IGNORE_EOS:
        cmd += ["--ignore-eos"]
    cmd += EXTRA_ARGS
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    os.unlink(f.name)
    return json.loads(out.stdout)


def decode_rate(results: list[dict]) -> float:
    """Generated tokens after the first per second of decode, over results that ran together."""
    first = max(r["timings"]["time_to_first_token_s"] for r in results)
    end = max(r["timings"]["time_to_first_token_s"] + r["timings"]["decode_s"] for r in results)
    toks = sum(r["completion_tokens"] for r in results) - len(results)
    return toks / (end - first) if end > first else 0.0


def measure(binary, model, prompts, batch, max_tokens, rounds, batch1_prompts=0):
    """Per mode: median tokens/s over rounds, the last round's token ids and speculation report.
    batch1_prompts > 0: batch 1 runs only that many of the prompts (a long prefill each)."""
    rates = {False: [], True: []}
    steps = {False: [], True: []}  # plain: seconds a step; speculative: (draft s/step, verify s/step, drafts/verify)
    ids, spec_report = {}, None
    for _ in range(rounds):
        for spec in (False, True):
            if batch == 1:
                toks = secs = 0.0
                got = []
                drafts = draft_tokens = accepted = 0
                cost = [0.0, 0, 0.0, 0]
                for p in prompts[:batch1_prompts or len(prompts)]:
                    j = run(binary, model, [p], max_tokens, spec)
                    r = j["results"][0]
                    got.append(r["token_ids"])
                    toks += r["completion_tokens"] - 1
                    secs += r["timings"]["decode_s"]
                    s = j["speculative"]
                    drafts, draft_tokens, accepted = drafts + s["drafts"], draft_tokens + s["draft_tokens"], accepted + s["accepted_tokens"]
                    cost = [cost[0] + s["draft_s"], cost[1] + s["draft_steps"], cost[2] + s["verify_s"], cost[3] + s["verify_steps"]]
                rates[spec].append(toks / secs)
                steps[spec].append(secs / toks if not spec else cost)
                rep = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted}
            else:
                j = run(binary, model, prompts[:batch], max_tokens, spec)
                got = [r["token_ids"] for r in j["results"]]
                rates[spec].append(decode_rate(j["results"]))
                s = j["speculative"]
                if spec:
                    steps[spec].append([s["draft_s"], s["draft_steps"], s["verify_s"], s["verify_steps"]])
                else:  # every sequence decodes every step while the longest runs
                    rs = j["results"]
                    steps[spec].append(batch / decode_rate(rs) if decode_rate(rs) else 0.0)
                rep = {k: s[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
            ids[spec] = got
            if spec:
                spec_report = rep
    same = sum(a == b for a, b in zip(ids[False], ids[True]))
    t = statistics.median(steps[False])
    d_s, d_n, v_s, v_n = (sum(x[i] for x in steps[True]) for i in range(4))
    cv = (d_s / d_n / t if d_n else 0.0, v_s / v_n / t if v_n else 0.0, d_n / v_n if v_n else 0.0)
    return statistics.median(rates[False]), statistics.median(rates[True]), spec_report, same, len(ids[False]), cv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exactness", type=int, default=0, help="greedy prompts compared at batch 16 (0: skip)")
    ap.add_argument("--out", default="")
    ap.add_argument("--spec", default="", help="the --speculative-config JSON (default: prompt lookup, 5 drafts)")
    ap.add_argument("--workloads", default="copy,nocopy", help="copy, nocopy, long, quote, shared")
    ap.add_argument("--long-tokens", type=int, default=7600)
    ap.add_argument("--batch1-prompts", type=int, default=0,
                    help="> 0: batch 1 runs only the first N prompts (long contexts: each prefill costs minutes)")
    ap.add_argument("--kv-cache-dtype", default="", help="passed to generate in both modes")
    ap.add_argument("--kv-cache", default="", help="KV pool size passed to generate (default 1 GiB: a batch of long "
                                                   "prompts beyond it runs a few at a time)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded sampling (acceptance of sampled vs argmax self-drafts, draft_sampling)")
    a = ap.parse_args()
    global SPEC, IGNORE_EOS, TEMPERATURE, EXTRA_ARGS
    TEMPERATURE = a.temperature
    EXTRA_ARGS = (["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else []) + \
                 (["--kv-cache", a.kv_cache] if a.kv_cache else [])
    if a.spec:
        SPEC = json.loads(a.spec)
    lines = [f"Config: `{json.dumps(SPEC)}`, "
             f"{'greedy' if not a.temperature else f'temperature {a.temperature}, seed 1'}, {a.max_tokens} new tokens, {a.rounds} interleaved rounds "
             f"(median), model `{pathlib.Path(a.model).name}`"
             f"{f', KV cache {a.kv_cache_dtype}' if a.kv_cache_dtype else ''}"
             f"{f', a {a.kv_cache} KV pool' if a.kv_cache else ''}"
             f"{f', batch 1 over the first {a.batch1_prompts} prompts' if a.batch1_prompts else ''}.", "",
             "| workload | batch | plain tok/s | speculative tok/s | ratio | drafts | draft tokens | accepted | "
             "acceptance | mean accepted length | identical outputs | draft step c | verify step v | "
             "draft steps per verify | predicted ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    wanted = a.workloads.split(",")
    work = {"copy": lambda: [copy_prompt(p) for p in passages(a.prompts)],
            "nocopy": lambda: (QUESTIONS * (a.prompts // len(QUESTIONS) + 1))[:a.prompts],
            "long": lambda: long_prompts(a.model, a.prompts, a.long_tokens),
            "quote": lambda: quote_prompts(a.model, a.prompts, a.long_tokens),
            "shared": lambda: shared_prompts(a.model, a.prompts, a.long_tokens)}
    for name in wanted:
        prompts = work[name]()
        IGNORE_EOS = name in ("long", "quote", "shared")
        for batch in [int(b) for b in a.batches.split(",")]:
            plain, spec, rep, same, n, (c, v, per) = measure(a.binary, a.model, prompts, batch, a.max_tokens, a.rounds,
                                                               a.batch1_prompts)
            acc = rep["accepted_tokens"] / rep["draft_tokens"] if rep["draft_tokens"] else 0.0
            mal = 1 + rep["accepted_tokens"] / rep["drafts"] if rep["drafts"] else 0.0
            pred = mal / (per * c + v) if v else 0.0
            lines.append(f"| {name} | {batch} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f} | {rep['drafts']} | "
                         f"{rep['draft_tokens']} | {rep['accepted_tokens']} | {acc:.2f} | {mal:.2f} | {same}/{n} | "
                         f"{c:.2f} | {v:.2f} | {per:.2f} | {pred:.2f} |")
            print(lines[-1], flush=True)
    if a.exactness:
        ps = [copy_prompt(p) for p in passages(a.exactness // 2)] + \
             [f"Question {i}: {q}" for i, q in enumerate((QUESTIONS * (a.exactness // len(QUESTIONS) + 1))[:a.exactness - a.exactness // 2])]
        same = total = 0
        diffs = []
        for i in range(0, len(ps), 16):
            chunk = ps[i:i + 16]
            x = [r["token_ids"] for r in run(a.binary, a.model, chunk, 64, False)["results"]]
            y = [r["token_ids"] for r in run(a.binary, a.model, chunk, 64, True)["results"]]
            for k, (u, v) in enumerate(zip(x, y)):
                total += 1
                if u == v:
                    same += 1
                else:
                    at = next((t for t, (p, q) in enumerate(zip(u, v)) if p != q), min(len(u), len(v)))
                    diffs.append((i + k, at))
        lines += ["", f"Exactness: {same}/{total} greedy outputs (64 tokens, batches of 16) token-identical "
                      f"with and without speculation; first differing token of the others (prompt, index): {diffs}."]
        print(lines[-1], flush=True)
    if a.out:
        pathlib.Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
