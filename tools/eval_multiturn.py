#!/usr/bin/env python3
"""Multi-turn quality of `prefix_reuse: compressed` against exact recompression (issue 23).

SCBench's multi-turn shared-context setting on the default model: one long context holding several
needles (RULER's multikey facts, tools/ruler_tasks.py), then one question per turn about a different
needle, each turn's prompt the whole chat so far (the model's own answers included, as a chat client
sends it). Every (policy, budget) runs each conversation twice through a real `kvserve serve`:

  exact       every turn is prefilled and compressed anew with that turn's question in the window
              (the prefix cache serves the full-precision prefix);
  compressed  turn 1 is compressed with its question, and later turns continue from what it kept
              (prefix_reuse: compressed), prefilling only their own tokens.

Turn 1 is the same prompt in both modes. Reported per turn: accuracy with 95 % Wilson intervals, the
positions served from caches (cached_tokens) and the median time to first token. Writes
<out>/multiturn.json (every answer) and multiturn.md.

  python3 tools/eval_multiturn.py --kvserve build/kvserve --n 30
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ruler_tasks as rt  # noqa: E402
from eval_quality import wilson  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
HEAD = "Some special magic values are hidden inside the following text. Make sure to memorize them."


def log(msg: str) -> None:
    print(f"[eval_multiturn] {msg}", file=sys.stderr, flush=True)


def question(key: str) -> tuple[str, str]:
    return (f"What is the special magic number for {key} mentioned in the provided text?",
            f"The special magic number for {key} mentioned in the provided text is")


def conversation(maker: rt.TaskMaker, length: int, seed: int, turns: int) -> dict:
    """A context with 4 needles; turn k asks for needle order[k]."""
    rng = random.Random(f"multiturn/{length}/{seed}")
    keys, vals = rt._keys(rng, 4), [rt._digits(rng) for _ in range(4)]
    facts = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
    order = rng.sample(range(4), turns)
    q, prefix = question(keys[order[0]])
    first = maker._wrap("multikey", length, rng, HEAD, facts, q, prefix, [vals[order[0]]], [order[0]])
    later = []
    for i in order[1:]:
        q, prefix = question(keys[i])
        later.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{prefix}")
    return {"seed": seed, "first": first.prompt, "later": later, "answers": [vals[i] for i in order]}


class Server:
    """`kvserve serve` on a free port with the given policies."""

    def __init__(self, a, policies: dict, tmp: pathlib.Path):
        cfg = tmp / "config.yaml"
        lines = [f"model:\n  path: {a.model}\n  served_model_name: m\n  device: cpu",
                 "server:\n  host: 127.0.0.1\n  port: 0\n  threads: 2",
                 f"cache:\n  block_size: 16\n  kv_cache_bytes: {a.kv_cache}", "policies:"]
        for name, params in policies.items():
            lines.append(f"  {name}:" + ("" if params else " {}"))
            lines += [f"    {k}: {v}" for k, v in params.items()]
        cfg.write_text("\n".join(lines) + "\n")
        self.log_path = tmp / "server.log"
        self.proc = subprocess.Popen([a.kvserve, "serve", "--config", str(cfg)], stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.time() + 300
        while time.time() < deadline:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log_path.read_text(errors="replace"))
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        while hasattr(self, "url") and time.time() < deadline and self.proc.poll() is None:
            try:  # listening comes before the model is loaded: wait for /health
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"kvserve serve did not start:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"request failed: {e.code} {e.read()[:2000]!r}\nserver log tail:\n"
                             f"{self.log_path.read_text(errors='replace')[-3000:]}")
        out["seconds"] = time.time() - t0
        return out

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_conversation(srv: Server, tok, conv: dict, policy: str, mode: str, max_tokens: int) -> list[dict]:
    ids = tok.encode(conv["first"], add_special_tokens=False).ids
    im_end = tok.token_to_id("<|im_end|>")
    out = []
    for turn in range(len(conv["answers"])):
        if turn > 0:
            tail = conv["later"][turn - 1]
            glue = ("\n" if out[-1]["ended_with_im_end"] else "<|im_end|>\n") + tail
            ids = ids + tok.encode(glue, add_special_tokens=False).ids
        r = srv.complete({"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "kv_policy": policy,
                          "prefix_reuse": mode, "return_token_ids": True, "stream": False})
        gen = r["choices"][0]["token_ids"]
        text = r["choices"][0]["text"]
        out.append({"turn": turn, "prompt_tokens": len(ids), "text": text,
                    "correct": conv["answers"][turn].lower() in text.lower(),
                    "cached_tokens": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "kept_kv": r["usage"].get("kv_kept_tokens"), "seconds": r["seconds"],
                    "ended_with_im_end": bool(gen) and gen[-1] == im_end})
        ids = ids + gen
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--out", default=str(REPO / "docs" / "eval"))
    ap.add_argument("--policies", default="snapkv,pyramidkv,dynamickv")
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--length", type=int, default=1024, help="turn 1's prompt in tokens")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--n", type=int, default=30, help="conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache", default="2GiB")
    a = ap.parse_args()
    if not pathlib.Path(a.kvserve).exists():
        raise SystemExit(f"--kvserve {a.kvserve}: no such binary (make build)")
    if not 2 <= a.turns <= 4:
        raise SystemExit("--turns: 2 to 4 (the context holds 4 needles)")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(a.model) / "tokenizer.json"))
    maker = rt.TaskMaker(tok)
    convs = [conversation(maker, a.length, a.seed * 100000 + i, a.turns) for i in range(a.n)]
    budgets = [int(b) for b in a.budgets.split(",")]
    policies = {"full": {}}
    cells = []
    for p in a.policies.split(","):
        for b in budgets:
            name = f"{p}_{b}"
            policies[name] = {"method": p, "budget": b}
            cells.append((p, b, name))
    t0 = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server(a, policies, pathlib.Path(tmp))
        try:
            log(f"{a.n} conversations x {a.turns} turns at {a.length} tokens; full, then {len(cells)} cells x 2 modes")
            results["full"] = {"exact": [run_conversation(srv, tok, c, "full", "exact", rt.MAX_TOKENS["multikey"])
                                         for c in convs]}
            for p, b, name in cells:
                results[name] = {}
                for mode in ("compressed", "exact"):
                    results[name][mode] = [run_conversation(srv, tok, c, name, mode, rt.MAX_TOKENS["multikey"])
                                           for c in convs]
                log(f"{name}: done ({time.time() - t0:.0f} s)")
        finally:
            srv.close()
    seconds = time.time() - t0
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiturn.json").write_text(json.dumps({"args": vars(a), "seconds": seconds, "results": results}, indent=1))
    write_report(a, results, cells, seconds, out / "multiturn.md")
    log(f"wrote {out / 'multiturn.md'} ({seconds:.0f} s)")


def write_report(a, results: dict, cells: list, seconds: float, path: pathlib.Path) -> None:
    def acc(runs: list, turn: int) -> str:
        k = sum(r[turn]["correct"] for r in runs)
        lo, hi = wilson(k, len(runs))
        return f"{100 * k / len(runs):.0f} [{100 * lo:.0f}, {100 * hi:.0f}]"

    def later(runs: list) -> tuple[int, int]:
        ks = [r[t]["correct"] for r in runs for t in range(1, a.turns)]
        return sum(ks), len(ks)

    def med(runs: list, turn: int, key: str) -> float:
        return statistics.median(r[turn][key] for r in runs)

    L = ["# Multi-turn quality: `prefix_reuse: compressed` vs exact recompression", "",
         f"`tools/eval_multiturn.py`: {a.n} conversations on `{pathlib.Path(a.model).name}`, turn 1 at "
         f"{a.length} tokens (4 multikey needles in the story filler, one asked for), then {a.turns - 1} more "
         "turns each asking for another needle; every prompt is the whole chat so far. Greedy, "
         f"{rt.MAX_TOKENS['multikey']} tokens per answer; accuracy in % with 95 % Wilson intervals. "
         f"One run, {seconds / 60:.0f} min on this machine.", ""]
    head = "| policy | budget | mode | " + " | ".join(f"turn {t + 1}" for t in range(a.turns)) + \
        " | turns 2+ | cached tokens, turn 2 (median) | TTFT turn 2 (median s) |"
    L += [head, "|" + "---|" * (head.count("|") - 1)]
    full = results["full"]["exact"]
    k, n = later(full)
    L.append("| full | - | exact | " + " | ".join(acc(full, t) for t in range(a.turns)) +
             f" | {100 * k / n:.0f} | {med(full, 1, 'cached_tokens'):.0f} | {med(full, 1, 'seconds'):.2f} |")
    for p, b, name in cells:
        for mode in ("exact", "compressed"):
            runs = results[name][mode]
            k, n = later(runs)
            lo, hi = wilson(k, n)
            L.append(f"| {p} | {b} | {mode} | " + " | ".join(acc(runs, t) for t in range(a.turns)) +
                     f" | {100 * k / n:.0f} [{100 * lo:.0f}, {100 * hi:.0f}] | {med(runs, 1, 'cached_tokens'):.0f} | "
                     f"{med(runs, 1, 'seconds'):.2f} |")
    L += ["", "Turn 1 is the same prompt in both modes. TTFT here is the whole request's wall time with "
          f"{rt.MAX_TOKENS['multikey']} tokens generated (sequential requests), so it bounds the prefill."]
    path.write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
