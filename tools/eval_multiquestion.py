#!/usr/bin/env python3
"""Many questions per document (issue 32's multi-question task): RULER's multi-key haystack
(tools/ruler_tasks.py: four "special magic number" facts hidden at random depths in `--length` tokens
of filler) is one document, and each of its four keys is asked in a separate chat request to a real
server, under each policy: [user: the haystack, assistant: "I have memorized them.", user: the
question, assistant: the answer prefix] with continue_final_message. The context is the first two
messages, so a policy with `compress: context` (kvzip; knorm/streamingllm so configured) compresses
the haystack once, at the first question, and every later question reads that same compressed cache
(the server's context cache); a query-aware policy (snapkv) compresses each prompt with its question
in it, its best case. Scores whether the number occurs in the answer, with 95 % Wilson intervals,
and prints a markdown table; `--out` also writes every answer as JSON.

`--kvpress` adds rows from transformers on the same documents, questions and token ids
(tools/eval_multiquestion_kvpress.py): full KV ("kvpress full", that harness's reference) and
kvpress's KVzipPress at each `--kvpress-kept` fraction (compression_ratio = 1 - kept), each
document's context compressed once and its questions answered from that cache the way kvpress's
pipeline answers `questions`. `--policies ''` runs the kvpress rows alone (no server).

`--kv-cache-dtype` (alias `--kv-cache-dtypes`; a comma list) runs every policy under each KV cache
storage dtype (float32, float16, bfloat16, int8 = q8_0, int4 = q4_0, q4_1, auto), one server per
dtype (`kvserve serve --kv-cache-dtype`, which sets cache.kv_cache_dtype), and labels the rows
`policy @ dtype`; "of full" is then against `full @` the same dtype. Without it the server keeps the
config's default (auto: the compute dtype) and the rows are the policies' names.
tools/eval_kv_dtype.py builds the memory-equivalent dtype x kept-fraction grid on these functions.

  python3 tools/eval_multiquestion.py --docs 12 --length 1000
  python3 tools/eval_multiquestion.py --docs 12 --length 1000 --policies full,kvzip-0.25,kvzip-0.125 --kvpress
  python3 tools/eval_multiquestion.py --docs 13 --policies full,kvzip-0.25 --kv-cache-dtypes float16,int8,int4
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shlex
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tools"))
import ruler_tasks as rt  # noqa: E402
from kvserve_server import Server  # noqa: E402

# name -> YAML body of the policy (under `policies:`).
POLICIES = {
    "full": "{}",
    "kvzip-0.25": "{method: kvzip, budget: 0.25}",
    "kvzip-0.125": "{method: kvzip, budget: 0.125}",
    # kvzap: the model directory's predictor (<model>/kvzap: the MLP for the default model), and the
    # linear one beside it.
    "kvzap-0.25": "{method: kvzap, budget: 0.25}",
    "kvzap-0.125": "{method: kvzap, budget: 0.125}",
    "kvzap-linear-0.25": "{method: kvzap, budget: 0.25, predictor: models/kvzap-smollm2-135m-instruct/linear}",
    "kvzap-linear-0.125": "{method: kvzap, budget: 0.125, predictor: models/kvzap-smollm2-135m-instruct/linear}",
    "snapkv-0.25": "{method: snapkv, budget: 0.25}",
    "knorm-ctx-0.25": "{method: knorm, budget: 0.25, compress: context}",
    "streamingllm-ctx-0.25": "{method: streamingllm, budget: 0.25, compress: context}",
}
# --policies' default: the policies above (`make eval`'s multi-question rows).
DEFAULT_POLICIES = list(POLICIES)
# Kept fractions 0.125 / 0.25 / 0.5 of kvzip, kvzap (its MLP), snapkv and pyramidkv, for
# tools/eval_kv_dtype.py's memory-equivalent grid (not in the default --policies).
POLICIES.update({
    "kvzip-0.5": "{method: kvzip, budget: 0.5}",
    "kvzap-0.5": "{method: kvzap, budget: 0.5}",
    "snapkv-0.125": "{method: snapkv, budget: 0.125}",
    "snapkv-0.5": "{method: snapkv, budget: 0.5}",
    "pyramidkv-0.125": "{method: pyramidkv, budget: 0.125}",
    "pyramidkv-0.25": "{method: pyramidkv, budget: 0.25}",
    "pyramidkv-0.5": "{method: pyramidkv, budget: 0.5}",
})
# The values `kvserve serve --kv-cache-dtype` takes (cli/kv_cache_dtype_cli.h).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "int8", "int4", "q8_0", "q4_0",
                   "q4_1")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def haystack(tok, length: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """One multi-key sample's haystack text and its (key, number) facts, in insertion order."""
    sample = rt.TaskMaker(tok).make("multikey", length, seed)
    user = sample.prompt.split("<|im_start|>user\n", 1)[1]
    body = user.split("\n\nWhat is the special magic number", 1)[0]
    facts = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", body)
    assert len(facts) == 4, facts
    return body, facts


MAX_TOKENS = 16


def messages_of(body: str, key: str) -> list[dict]:
    """The chat of one question: the context (haystack, acknowledgement), the question, the answer prefix."""
    return [{"role": "user", "content": body}, {"role": "assistant", "content": "I have memorized them."},
            {"role": "user", "content": f"What is the special magic number for {key} mentioned in the provided text?"},
            {"role": "assistant", "content": f"The special magic number for {key} mentioned in the provided text is"}]


def ask(url: str, body: str, key: str, policy: str) -> tuple[str, float, int]:
    import urllib.request
    messages = messages_of(body, key)
    req_body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "continue_final_message": True, "add_generation_prompt": False,
                           "kv_policy": policy}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", req_body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1200) as r:
        out = json.loads(r.read())
    return (out["choices"][0]["message"]["content"], time.perf_counter() - t0,
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


def label(name: str, kv_cache_dtype: str | None) -> str:
    """A result row's name: the policy's, with ` @ dtype` when the run sets the KV cache dtype."""
    return name if kv_cache_dtype is None else f"{name} @ {kv_cache_dtype}"


def kv_blocks_total(srv: Server) -> float | None:
    """The server's KV pool size in blocks (a fixed kv_cache_bytes holds more blocks of a smaller dtype)."""
    try:
        return srv.metrics().get("kvserve:kv_cache_blocks_total")
    except Exception:  # noqa: BLE001 -- informational only
        return None


def run_policies(model: str, docs: list, names: list[str], kv_cache_dtype: str | None = None,
                 info: dict | None = None, serve_args: tuple[str, ...] = ()) -> dict[str, list[dict]]:
    """One kvserve server (the policies `names` of POLICIES; with `kv_cache_dtype`, that KV cache
    storage dtype, else the config's default) asking every document's questions under each policy in
    turn. Returns {label(name, kv_cache_dtype): one row per question}; progress goes to stderr.
    `info`, when given, gets the run's seconds and the pool's kv_cache_blocks_total."""
    results = {}
    t_srv = time.perf_counter()
    yaml = "".join(f"  {n}: {POLICIES[n]}\n" for n in names if n != "full")
    extra_args = serve_args + (() if kv_cache_dtype is None else ("--kv-cache-dtype", kv_cache_dtype))
    srv = Server(model=model, extra_yaml=yaml, kv_cache_bytes="2GiB", extra_args=extra_args)
    try:
        if info is not None:
            info["kv_cache_blocks_total"] = kv_blocks_total(srv)
        for name in names:
            rows = []
            for d, (body, facts) in enumerate(docs):
                for i, (key, answer) in enumerate(facts):
                    text, secs, cached = ask(srv.url, body, key, name)
                    rows.append({"doc": d, "question": i, "answer": answer, "text": text, "correct": answer in text,
                                 "seconds": secs, "cached_tokens": cached})
            results[label(name, kv_cache_dtype)] = rows
            k = sum(r["correct"] for r in rows)
            print(f"{label(name, kv_cache_dtype)}: {k}/{len(rows)}", file=sys.stderr, flush=True)
    finally:
        srv.stop()
        secs = time.perf_counter() - t_srv
        if info is not None:
            info["seconds"] = secs
        where = "" if kv_cache_dtype is None else f" (kv_cache_dtype {kv_cache_dtype})"
        print(f"kvserve rows{where}: {secs:.0f} s", file=sys.stderr, flush=True)
    return results


def full_of(name: str) -> str:
    """The full-KV row `name` is compared with: the same harness's, under the same KV dtype."""
    if name.startswith("kvpress"):
        return "kvpress full"
    return label("full", name.split(" @ ", 1)[1] if " @ " in name else None)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--length", type=int, default=1000, help="document tokens")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help=f"kvserve policies, comma list ('' for none); known: {', '.join(POLICIES)}")
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"),
                    help="model directory, or a .gguf file (its directory's tokenizer.json makes the documents)")
    ap.add_argument("--serve-args", default="", help="more `kvserve serve` flags for the kvserve rows, e.g. "
                                                     "'--quantization int8'")
    ap.add_argument("--out", default="")
    ap.add_argument("--kvpress", action="store_true",
                    help="also run transformers full KV and kvpress's KVzipPress on the same prompts")
    ap.add_argument("--kvpress-kept", default="0.25,0.125",
                    help="KVzipPress kept fractions, comma list (compression_ratio = 1 - kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for the kvpress rows (0: torch's default)")
    ap.add_argument("--kv-cache-dtype", "--kv-cache-dtypes", dest="kv_cache_dtypes", default=None,
                    help="KV cache storage dtype(s) of the kvserve rows, comma list (one server each; rows "
                         "labelled 'policy @ dtype'): " + ", ".join(KV_CACHE_DTYPES) +
                         ". Default: not set (the config's default, auto)")
    a = ap.parse_args(argv)
    a.policies = [n for n in a.policies.split(",") if n]
    for n in a.policies:
        if n not in POLICIES:
            ap.error(f"--policies: unknown policy {n!r} (known: {', '.join(POLICIES)})")
    a.kvpress_kept = [float(x) for x in a.kvpress_kept.split(",") if x]
    if any(not 0 < r <= 1 for r in a.kvpress_kept):
        ap.error("--kvpress-kept: fractions must be in (0, 1]")
    if not a.policies and not a.kvpress:
        ap.error("nothing to run: no --policies and no --kvpress")
    if a.kv_cache_dtypes is not None:
        a.kv_cache_dtypes = [x.strip() for x in a.kv_cache_dtypes.split(",") if x.strip()]
        if not a.kv_cache_dtypes:
            ap.error("--kv-cache-dtype: empty list")
        for x in a.kv_cache_dtypes:
            if x not in KV_CACHE_DTYPES:
                ap.error(f"--kv-cache-dtype: unknown dtype {x!r} (known: {', '.join(KV_CACHE_DTYPES)})")
        if len(set(a.kv_cache_dtypes)) != len(a.kv_cache_dtypes):
            ap.error("--kv-cache-dtype: a dtype is listed twice")
    return a


def main() -> None:
    a = parse_args()
    from tokenizers import Tokenizer
    model = pathlib.Path(a.model)
    tok = Tokenizer.from_file(str((model.parent if model.is_file() else model) / "tokenizer.json"))
    names = a.policies
    a.questions = 4
    docs = [haystack(tok, a.length, 1000 + d) for d in range(a.docs)]
    results = {}
    t_start = time.perf_counter()
    if a.kvpress:
        import eval_multiquestion_kvpress as kvp
        results.update(kvp.run(a.model, docs, messages_of, a.kvpress_kept, MAX_TOKENS, a.threads,
                               log=lambda m: print(m, file=sys.stderr, flush=True)))
        print(f"kvpress rows: {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)
    if names:
        for dtype in (a.kv_cache_dtypes or [None]):
            results.update(run_policies(a.model, docs, names, dtype, serve_args=tuple(shlex.split(a.serve_args))))
    # "of full": against the same harness's full KV (kvserve's "full", transformers' "kvpress full"),
    # under the same KV cache dtype ("x @ int8" against "full @ int8").
    fulls = {f: sum(r["correct"] for r in results.get(f, [])) or None for f in {full_of(n) for n in results}}
    print(f"| policy | correct ({a.docs} documents x {a.questions} questions, {a.length} tokens) | 95 % interval | "
          "of full | by question 1..k | median time, question 1 / later |")
    print("| --- | --- | --- | --- | --- | --- |")
    order = [n for n in results if not n.startswith("kvpress")] + [n for n in results if n.startswith("kvpress")]
    for name in order:
        rows = results[name]
        k, n = sum(r["correct"] for r in rows), len(rows)
        lo, hi = wilson(k, n)
        per_q = "/".join(str(sum(r["correct"] for r in rows if r["question"] == i)) for i in range(a.questions))
        first = statistics.median(r["seconds"] for r in rows if r["question"] == 0)
        later = statistics.median(r["seconds"] for r in rows if r["question"] > 0) if a.questions > 1 else float("nan")
        full = fulls[full_of(name)]
        rel = f"{k / full:.0%}" if full else "-"
        print(f"| {name} | {k}/{n} ({k / n:.0%}) | [{lo:.0%}, {hi:.0%}] | {rel} | {per_q} | {first:.2f} s / {later:.2f} s |")
    # Per question, kvserve's row against the kvpress row of the same budget.
    pairs = [(label(mine, dtype), theirs) for dtype in (a.kv_cache_dtypes or [None])
             for mine, theirs in [("full", "kvpress full")] +
             [(f"kvzip-{r:g}", f"kvpress KVzipPress {r:g}") for r in a.kvpress_kept]]
    for mine, theirs in pairs:
        if mine in results and theirs in results:
            x, y = results[mine], results[theirs]
            both = sum(p["correct"] and q["correct"] for p, q in zip(x, y))
            agree = sum(p["correct"] == q["correct"] for p, q in zip(x, y))
            same = sum(p["text"].strip() == q["text"].strip() for p, q in zip(x, y))
            print(f"{mine} vs {theirs}: both correct {both}/{len(x)}, same verdict {agree}/{len(x)}, "
                  f"identical answer text {same}/{len(x)}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
