#!/usr/bin/env python3
"""Prefix caching on the real workloads: time to first token with `cache.enable_prefix_caching`
off and on, per KV policy, and whether the greedy tokens are the same.

(a) doc-QA: one long document (--doc tokens) and --questions different questions after it, sent one
    after the other. With the cache on, the first question is a miss and the others hit the cached
    document; with it off, every question is a miss (--miss-questions of them are run: their cost is
    the same).
(b) multi-turn: --conversations chats of --turns turns behind one shared system prompt
    (--system tokens); each turn adds a --user-token message and the model's greedy reply
    (--reply tokens, its token ids as the server returns them) and the next turn sends the whole
    conversation again. Besides cache off and on, a third setting runs it with
    `prefix_reuse: compressed` (each turn continues the previous turn's compressed KV; lossy, so
    its tokens are compared with the exact runs' but not expected equal).

(c) tier (not in the defaults): the host-RAM tier (cache.prefix_cache_bytes). Both servers cache,
    in a pool with room for about one request (--tier-pool); one adds a tier (--tier-bytes). A
    document and its first question, then per further question an unrelated prompt as long as
    the document (which needs the pool: the document's cached blocks move to the tier, or are
    dropped without one) and the question: without a tier it is a miss, with one a hit from host
    memory.
(d) partial (not in the defaults): prompts that share only the first --partial-shared tokens of a
    cached document (the rest is new), against misses of the same length, with the cache on.

Prompts are token ids (deterministic pseudo-random text from the vocabulary), sent to
/v1/completions with streaming; TTFT is the client's time to the first streamed token. Each policy
gets its own document and system prompt, so that its first request is a miss whatever ran before.
One server per (workload, cache setting), the settings interleaved per workload, both on the same
(shared, loaded) machine. Prints a markdown table and writes --json.

Usage: python3 bench/bench_prefix_cache.py --kvserve build/kvserve [--model models/smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import random
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]

POLICIES = {
    "full": "{}",
    "snapkv": "{budget: 512, window: 32}",
    "pyramidkv": "{budget: 512, window: 8}",
    "dynamickv": "{budget: 512, window: 8}",
    "streamingllm": "{budget: 512, sink: 4}",
    "h2o": "{budget: 512, window: 8}",
    "knorm": "{budget: 512}",
}


def start_server(binary: str, model: str, caching: bool, policies: list[str], pool: str = "3GiB",
                 tier: str = "0", device: str = "cpu", dtype: str = "float32") -> tuple[subprocess.Popen, str]:
    tmp = tempfile.mkdtemp(prefix="kvserve-prefix-")
    cfg = pathlib.Path(tmp) / "config.yaml"
    pol = "".join(f"  {p}: {POLICIES[p]}\n" for p in policies if p != "full")
    cfg.write_text(f"model: {{path: {model}, served_model_name: bench, device: {device}, dtype: {dtype}}}\n"
                   f"server: {{host: 127.0.0.1, port: 0, request_timeout_s: 3600}}\n"
                   f"cache: {{kv_cache_bytes: {pool}, enable_prefix_caching: {'true' if caching else 'false'}, "
                   f"prefix_cache_bytes: {tier}}}\n"
                   f"scheduler: {{max_num_seqs: 8, max_num_batched_tokens: 8192}}\n"
                   f"policies:\n{pol or '  {}'}\n")
    log_path = pathlib.Path(tmp) / "server.log"
    log = open(log_path, "w+")
    proc = subprocess.Popen([binary, "serve", "--config", str(cfg), "--quiet"], stderr=log, stdout=log)
    deadline = time.time() + 300
    while time.time() < deadline:
        log.seek(0)
        m = re.search(r"127\.0\.0\.1:(\d+)", log.read())
        if m:
            url = f"127.0.0.1:{m.group(1)}"
            try:
                with urllib.request.urlopen(f"http://{url}/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except Exception:
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server did not become healthy; log {log_path}")


def complete(url: str, prompt: list[int], policy: str, max_tokens: int,
             reuse: str = "exact") -> tuple[float, str, int, list[int]]:
    """One streaming greedy completion: (TTFT seconds, generated text, cached prompt tokens, generated ids)."""
    conn = http.client.HTTPConnection(url, timeout=3600)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "kv_policy": policy, "prefix_reuse": reuse,
                       "return_token_ids": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, text, cached, ids = None, "", 0, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        for c in chunk.get("choices") or []:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += c.get("text") or ""
            ids += c.get("token_ids") or []
    conn.close()
    return ttft, text, cached, ids


def words(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(200, vocab) for _ in range(n)]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_host_stores_total",
                 "prefix_cache_host_loads_total"):
        m = re.search(rf"kvserve:{name}\{{[^}}]*\}} ([0-9.e+]+)", text)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def doc_qa(url: str, policy: str, args, vocab: int, n_questions: int) -> dict:
    rng = random.Random(f"doc-{policy}")
    doc = words(rng, args.doc, vocab)
    runs = []
    for q in range(n_questions):
        question = words(random.Random(f"q-{q}"), args.question, vocab)
        ttft, text, cached, _ = complete(url, doc + question, policy, args.max_tokens)
        runs.append({"ttft": ttft, "text": text, "cached": cached})
    return {"runs": runs}


def tier_qa(url: str, policy: str, args, vocab: int) -> dict:
    """The host tier: a document and its first question, then for each further question an
    unrelated prompt as long as the document first (it needs the pool, so the document's cached
    blocks move to the tier, or are dropped without one), then the question."""
    rng = random.Random(f"tier-{policy}")
    doc = words(rng, args.doc, vocab)
    runs = []
    for q in range(args.tier_questions + 1):
        if q:
            complete(url, words(random.Random(f"flush-{policy}-{q}"), args.doc + args.question, vocab), policy, 1)
        question = words(random.Random(f"q-{q}"), args.question, vocab)
        ttft, text, cached, _ = complete(url, doc + question, policy, args.max_tokens)
        runs.append({"ttft": ttft, "text": text, "cached": cached})
    return {"runs": runs}


def partial_qa(url: str, policy: str, args, vocab: int) -> dict:
    """A partial hit: after a document is cached, prompts as long as document + question whose first
    --partial-shared tokens are the document's and the rest new, against misses of the same length."""
    doc = words(random.Random(f"partial-{policy}"), args.doc, vocab)
    complete(url, doc + words(random.Random("q-0"), args.question, vocab), policy, 1)
    runs, misses = [], []
    for q in range(args.partial_questions):
        rest = words(random.Random(f"rest-{policy}-{q}"), args.doc - args.partial_shared + args.question, vocab)
        ttft, text, cached, _ = complete(url, doc[:args.partial_shared] + rest, policy, args.max_tokens)
        runs.append({"ttft": ttft, "text": text, "cached": cached})
        fresh = words(random.Random(f"miss-{policy}-{q}"), args.doc + args.question, vocab)
        ttft, text, cached, _ = complete(url, fresh, policy, args.max_tokens)
        misses.append({"ttft": ttft, "text": text, "cached": cached})
    return {"runs": runs, "misses": misses}


def multi_turn(url: str, policy: str, args, vocab: int, reuse: str) -> dict:
    system = words(random.Random(f"sys-{policy}"), args.system, vocab)
    runs = []
    for c in range(args.conversations):
        rng = random.Random(f"conv-{c}")
        history = list(system)
        for t in range(args.turns):
            history += words(rng, args.user, vocab)
            ttft, text, cached, ids = complete(url, history, policy, args.reply, reuse)
            runs.append({"ttft": ttft, "text": text, "cached": cached, "prompt": len(history)})
            history += ids  # the reply, as the next turn sends it
    return {"runs": runs}


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default="doc,chat")
    ap.add_argument("--doc", type=int, default=8000)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--miss-questions", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--compressed", type=int, default=1, help="chat: also run prefix_reuse: compressed (1/0)")
    ap.add_argument("--tier-questions", type=int, default=3, help="tier: questions after an unrelated prompt each")
    ap.add_argument("--tier-pool", default="600MiB", help="tier: kv_cache_bytes, room for about one 8K request")
    ap.add_argument("--tier-bytes", default="1GiB", help="tier: cache.prefix_cache_bytes")
    ap.add_argument("--partial-shared", type=int, default=2500, help="partial: leading document tokens a prompt shares")
    ap.add_argument("--partial-questions", type=int, default=2, help="partial: partial hits (and as many misses)")
    ap.add_argument("--device", default="cpu", help="model.device: cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default="float32", help="model.dtype (bfloat16 for the GPU rows)")
    ap.add_argument("--pool", default="3GiB", help="kv_cache_bytes of the doc, chat and partial servers")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    policies = args.policies.split(",")
    vocab = json.loads((pathlib.Path(args.model) / "config.json").read_text())["vocab_size"]
    tok = pathlib.Path(args.model) / "tokenizer.json"
    if tok.exists():  # the bench checkpoints carry a small fixture tokenizer: ids past it are refused
        vocab = min(vocab, len(json.loads(tok.read_text())["model"]["vocab"]))
    load = os.getloadavg()
    results: dict = {"args": vars(args), "loadavg_start": load, "doc": {}, "chat": {}, "tier": {}, "partial": {}}
    for workload in args.workloads.split(","):
        settings = [("off", False, "exact"), ("on", True, "exact")]
        if workload == "chat" and args.compressed:
            settings.append(("compressed", True, "compressed"))
        if workload == "tier":  # both with the cache, in a pool that holds one request: without and with a tier
            settings = [("pool", True, "0"), ("host", True, args.tier_bytes)]
        if workload == "partial":  # the cache on; its misses are the baseline
            settings = [("on", True, "exact")]
        for setting, caching, reuse in settings:
            if workload == "tier":
                proc, url = start_server(args.kvserve, args.model, caching, policies, args.tier_pool, reuse,
                                         args.device, args.dtype)
            else:
                proc, url = start_server(args.kvserve, args.model, caching, policies, args.pool, "0", args.device,
                                         args.dtype)
            try:
                for policy in policies:
                    if workload == "tier":
                        r = tier_qa(url, policy, args, vocab)
                    elif workload == "partial":
                        r = partial_qa(url, policy, args, vocab)
                    elif workload == "doc":
                        r = doc_qa(url, policy, args, vocab, args.questions if caching else args.miss_questions)
                    else:
                        r = multi_turn(url, policy, args, vocab, reuse)
                    results[workload].setdefault(policy, {})[setting] = r
                    print(f"{workload} {policy} {setting}: TTFT p50 {p50([x['ttft'] for x in r['runs']]):.3f} s", flush=True)
                results[workload]["metrics_" + setting] = metrics(url)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    results["loadavg_end"] = os.getloadavg()

    print(f"\nload average at start {load[0]:.1f}, at end {results['loadavg_end'][0]:.1f} (shared machine)\n")
    if "doc" in results and any(p in results["doc"] for p in policies):
        print("| policy | miss TTFT (cache off, p50) | first question (cache on, miss) | hit TTFT p50 | miss / hit | "
              "hit rate (tokens) | same tokens |")
        print("|---|---|---|---|---|---|---|")
        for p in policies:
            r = results["doc"].get(p)
            if not r:
                continue
            off, on = r["off"]["runs"], r["on"]["runs"]
            miss, hits = p50([x["ttft"] for x in off]), [x["ttft"] for x in on[1:]]
            same = sum(a["text"] == b["text"] for a, b in zip(off, on))
            rate = sum(x["cached"] for x in on) / max(1, len(on) * (args.doc + args.question))
            print(f"| {p} | {miss:.3f} s | {on[0]['ttft']:.3f} s | {p50(hits):.3f} s | {miss / p50(hits):.1f}x | "
                  f"{100 * rate:.0f} % | {same}/{len(off)} |")
    if "chat" in results and any(p in results["chat"] for p in policies):
        print("\n| policy | TTFT p50 off | TTFT p50 on | off / on | hit rate (tokens) | same tokens | "
              "TTFT p50 compressed | off / compressed | hit rate compressed | same tokens as off, compressed |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for p in policies:
            r = results["chat"].get(p)
            if not r:
                continue
            off, on = r["off"]["runs"], r["on"]["runs"]
            a, b = p50([x["ttft"] for x in off]), p50([x["ttft"] for x in on])
            same = sum(x["text"] == y["text"] for x, y in zip(off, on))
            rate = sum(x["cached"] for x in on) / max(1, sum(x["prompt"] for x in on))
            line = f"| {p} | {a:.3f} s | {b:.3f} s | {a / b:.1f}x | {100 * rate:.0f} % | {same}/{len(off)} |"
            if "compressed" in r:
                cp = r["compressed"]["runs"]
                c = p50([x["ttft"] for x in cp])
                crate = sum(x["cached"] for x in cp) / max(1, sum(x["prompt"] for x in cp))
                csame = sum(x["text"] == y["text"] for x, y in zip(off, cp))
                line += f" {c:.3f} s | {a / c:.1f}x | {100 * crate:.0f} % | {csame}/{len(off)} |"
            else:
                line += " - | - | - | - |"
            print(line)
    if results["tier"]:
        print("\n| policy | question after an unrelated prompt, pool only (p50) | cached tokens | same, host tier (p50) | "
              "cached tokens | pool only / host tier | same tokens |")
        print("|---|---|---|---|---|---|---|")
        for p in policies:
            r = results["tier"].get(p)
            if not r:
                continue
            pool, host = r["pool"]["runs"][1:], r["host"]["runs"][1:]
            a, b = p50([x["ttft"] for x in pool]), p50([x["ttft"] for x in host])
            same = sum(x["text"] == y["text"] for x, y in zip(r["pool"]["runs"], r["host"]["runs"]))
            print(f"| {p} | {a:.3f} s | {p50([x['cached'] for x in pool]):.0f} | {b:.3f} s | "
                  f"{p50([x['cached'] for x in host]):.0f} | {a / b:.1f}x | {same}/{len(r['pool']['runs'])} |")
        # With (a) in the same run: what a hit from the tier costs over a hit from the pool, the
        # copy-in of the document's blocks, per layer.
        layers = json.loads((pathlib.Path(args.model) / "config.json").read_text())["num_hidden_layers"]
        for p in policies:
            r, d = results["tier"].get(p), results["doc"].get(p)
            if r and d and "on" in d:
                tier_hit = p50([x["ttft"] for x in r["host"]["runs"][1:]])
                pool_hit = p50([x["ttft"] for x in d["on"]["runs"][1:]])
                print(f"{p}: hit from the tier {tier_hit:.3f} s, from the pool {pool_hit:.3f} s: copy-in "
                      f"{1000 * (tier_hit - pool_hit):.1f} ms, {1000 * (tier_hit - pool_hit) / layers:.2f} ms per layer")
        m = results["tier"].get("metrics_host", {})
        print(f"\nhost tier: {m.get('prefix_cache_host_stores_total', 0):.0f} entries moved out, "
              f"{m.get('prefix_cache_host_loads_total', 0):.0f} brought back")
    if results["partial"]:
        print(f"\n| policy | miss, {args.doc + args.question} tokens (p50) | partial hit (p50) | cached tokens | "
              "miss / partial hit |")
        print("|---|---|---|---|---|")
        for p in policies:
            r = results["partial"].get(p, {}).get("on")
            if not r:
                continue
            a, b = p50([x["ttft"] for x in r["misses"]]), p50([x["ttft"] for x in r["runs"]])
            print(f"| {p} | {a:.3f} s | {b:.3f} s | {p50([x['cached'] for x in r['runs']]):.0f} | {a / b:.2f}x |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
