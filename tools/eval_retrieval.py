#!/usr/bin/env python3
"""Retrieval accuracy per KV policy x budget over kvserve's OpenAI HTTP API.

Starts `kvserve serve` with one named policy per (policy, budget), builds held-out passkey, needle
and multi-key prompts (tools/retrieval_tasks.py; seeds differ from training), sends greedy
/v1/completions requests concurrently with `kv_policy` set, and scores exact match of the answer
(the completion up to the first '.', stripped). Writes to --out:

  results.csv         one row per (policy, budget, task, length, depth): n, correct, accuracy
  summary.csv         accuracy per (policy, budget, task), averaged over the grid
  tables.md           markdown tables (policy x budget per task; per length; knorm by compression)
  heatmap_<task>_b<budget>.png   depth x length accuracy, one panel per policy (the papers' figure)
  heatmap_<task>_knorm.png       the same for knorm at each compression
  accuracy_vs_budget.png         mean accuracy per task against budget, one line per policy
  run.json            the exact arguments, model, commit and timings

  python3 tools/eval_retrieval.py --kvserve build/kvserve --out docs/eval
  python3 tools/eval_retrieval.py --policies full snapkv --budgets 64 --lengths 512 --depths 0.5 --n 4 --out /tmp/e
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import retrieval_tasks as rt  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
ALL_POLICIES = ["full", "snapkv", "pyramidkv", "dynamickv", "streamingllm", "h2o", "knorm"]
TASKS = ["passkey", "needle", "multikey"]
EVAL_SEED = 7_000_000  # held out: training uses seed*1000+step streams from 20261122


class Server:
    def __init__(self, kvserve: str, model: str, policies: dict, kv_cache: str, max_num_seqs: int, log_dir: pathlib.Path):
        lines = []
        for name, params in policies.items():
            body = ", ".join(f"{k}: {v}" for k, v in params.items())
            lines.append(f"  {name}: {{{body}}}")
        cfg = log_dir / "eval_config.yaml"
        cfg.write_text(f"""model:
  path: {model}
  served_model_name: eval
  device: cpu
  dtype: float32
server:
  host: 127.0.0.1
  port: 0
  max_body_bytes: 4MiB
  request_timeout_s: 3600
  threads: 4
cache:
  block_size: 16
  kv_cache_bytes: {kv_cache}
scheduler:
  max_num_seqs: {max_num_seqs}
  max_num_batched_tokens: 4096
  max_waiting: 4096
policies:
{chr(10).join(lines)}
default_policy: full
""")
        self.log_path = log_dir / "server.log"
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen([kvserve, "serve", "--config", str(cfg), "--quiet"], stdout=self.log_file,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while True:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log_path.read_text(errors="replace"))
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                break
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kvserve serve failed:\n" + self.log_path.read_text(errors="replace"))
            time.sleep(0.05)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kvserve never became healthy:\n" + self.log_path.read_text(errors="replace"))
            time.sleep(0.1)

    def complete(self, prompt: str, policy: str, max_tokens: int) -> dict:
        body = json.dumps({"model": "eval", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "kv_policy": policy}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def policy_table(policies: list, budgets: list, knorm_compressions: list, window: int | None,
                 extra: dict | None = None) -> dict:
    """YAML policy name -> (label, method, budget label, params); `extra` goes into every compressing policy."""
    out = {}
    for p in policies:
        if p == "full":
            out["full"] = ("full", "full", "-", {})
            continue
        for b in budgets:
            params = {"method": p, "budget": b, **(extra or {})}
            if window is not None and p in ("snapkv", "pyramidkv", "dynamickv", "h2o"):
                params["window"] = window
            out[f"{p}-{b}"] = (p, p, str(b), params)
        if p == "knorm":
            for c in knorm_compressions:
                ratio = round(1 - c / 100, 4)
                out[f"knorm-c{c}"] = ("knorm", "knorm", f"{c}%", {"method": "knorm", "budget": ratio, **(extra or {})})
    return out


def build_samples(model_dir: str, tasks: list, lengths: list, depths: list, n: int, seed: int,
                  n_keys: int, max_tokens: int) -> list:
    """Prompts of about `length - max_tokens` tokens, so prompt + generation fit in `length`."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    b = rt.Builder(tok, tok.token_to_id("<|begin_of_text|>"))
    out = []
    for ti, task in enumerate(tasks):
        for length in lengths:
            for depth in depths:
                for i in range(n):
                    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{i}")
                    text, ids, answer, ans_ids, meta = rt.build(
                        b, rng, task, length - max_tokens, depth=depth, passkey_digits=5, n_keys=n_keys)
                    out.append({"task": task, "length": length, "depth": depth, "i": i, "prompt": text,
                                "prompt_tokens": len(ids), "answer": answer.strip()})
    return out


def accuracy(rows: list) -> float:
    return sum(r["correct"] for r in rows) / max(1, len(rows))


def score(text: str, answer: str) -> bool:
    return text.split(".")[0].strip() == answer


def git_commit() -> str:
    try:
        c = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "tools", "models"],
                               capture_output=True, text=True).stdout.strip()
        return c + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def heatmaps(rows: list, out: pathlib.Path, table: dict, lengths: list, depths: list):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    acc = {}
    for r in rows:
        acc[(r["policy"], r["task"], r["length"], r["depth"])] = r["accuracy"]
    tasks = sorted({r["task"] for r in rows}, key=TASKS.index)
    budgets = sorted({v[2] for v in table.values() if v[2] not in ("-",) and not v[2].endswith("%")}, key=int)
    groups = [(f"b{b}", [k for k, v in table.items() if v[2] == b or k == "full"]) for b in budgets]
    knorm = [k for k, v in table.items() if v[2].endswith("%")]
    if knorm:
        groups.append(("knorm", (["full"] if "full" in table else []) + knorm))
    if not budgets and "full" in table and not knorm:
        groups.append(("full", ["full"]))
    files = []
    for task in tasks:
        for gname, names in groups:
            if not names:
                continue
            fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names) + 1, 2.9), squeeze=False)
            for ax, name in zip(axes[0], names):
                m = np.array([[acc.get((name, task, L, d), np.nan) for L in lengths] for d in depths])
                im = ax.imshow(m, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
                for yi in range(len(depths)):
                    for xi in range(len(lengths)):
                        if not np.isnan(m[yi, xi]):
                            ax.text(xi, yi, f"{m[yi, xi]:.1f}".lstrip("0") if m[yi, xi] < 1 else "1",
                                    ha="center", va="center", fontsize=6)
                ax.set_xticks(range(len(lengths)))
                ax.set_xticklabels([str(L) for L in lengths], rotation=90, fontsize=7)
                ax.set_yticks(range(len(depths)))
                ax.set_yticklabels([f"{int(d * 100)}%" for d in depths], fontsize=7)
                ax.set_title(name, fontsize=8)
                ax.set_xlabel("context length", fontsize=7)
                if ax is axes[0][0]:
                    ax.set_ylabel("depth", fontsize=7)
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
            fig.suptitle(f"{task}: exact-match accuracy ({gname})", fontsize=9, y=1.04)
            f = out / f"heatmap_{task}_{gname}.png"
            fig.savefig(f, dpi=110, bbox_inches="tight")
            plt.close(fig)
            files.append(f.name)
    return files


def budget_plot(summary: list, out: pathlib.Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = sorted({s["task"] for s in summary}, key=TASKS.index)
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        full = [s["accuracy"] for s in summary if s["task"] == task and s["policy"] == "full"]
        pols = sorted({s["method"] for s in summary if s["method"] != "full"}, key=ALL_POLICIES.index)
        for p in pols:
            pts = sorted((int(s["budget"]), s["accuracy"]) for s in summary
                         if s["task"] == task and s["method"] == p and s["budget"].isdigit())
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        if full:
            ax.axhline(full[0], color="k", ls="--", lw=1, label="full")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens per layer)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(task)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_budget.png", dpi=110)
    plt.close(fig)
    return "accuracy_vs_budget.png"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=os.environ.get("KVSERVE_BIN", str(REPO / "build" / "kvserve")))
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-retriever"))
    ap.add_argument("--policies", nargs="+", default=ALL_POLICIES)
    ap.add_argument("--budgets", nargs="*", type=int, default=[32, 64, 128])
    ap.add_argument("--knorm-compressions", nargs="*", type=int, default=[10, 30, 50, 70, 90],
                    help="knorm also at these compression percentages (budget ratio 1 - c/100)")
    ap.add_argument("--window", type=int, default=None, help="override the observation window of window policies")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="extra policy parameter for every compressing policy, as YAML (e.g. skip_layers=[0,1,2])")
    ap.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    ap.add_argument("--lengths", nargs="+", type=int, default=None,
                    help="prompt lengths in tokens (default: 1/8, 1/4, 1/2, 3/4 and all of the model's max length)")
    ap.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--n", type=int, default=2, help="samples per (task, length, depth) cell")
    ap.add_argument("--n-keys", type=int, default=4, help="key-value pairs in a multikey prompt")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--workers", type=int, default=16, help="concurrent requests")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-cache", default="1GiB")
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "eval")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    if args.lengths is None:
        max_len = json.loads((pathlib.Path(args.model) / "config.json").read_text())["max_position_embeddings"]
        args.lengths = [max_len // 8, max_len // 4, max_len // 2, max_len * 3 // 4, max_len]
    extra = {}
    for kv in args.param:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--param {kv!r}: expected KEY=VALUE")
        extra[key] = value
    table = policy_table(args.policies, args.budgets, args.knorm_compressions if "knorm" in args.policies else [],
                         args.window, extra)
    samples = build_samples(args.model, args.tasks, args.lengths, args.depths, args.n, args.seed, args.n_keys,
                            args.max_tokens)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvserve-eval-") as tmp:
        server = Server(args.kvserve, args.model, {k: v[3] for k, v in table.items()}, args.kv_cache,
                        min(args.workers, 64), pathlib.Path(tmp))
        results = []
        try:
            timings = {}
            for name in table:
                t1 = time.time()
                with cf.ThreadPoolExecutor(args.workers) as ex:
                    outs = list(ex.map(lambda s: server.complete(s["prompt"], name, args.max_tokens), samples))
                timings[name] = round(time.time() - t1, 1)
                for s, o in zip(samples, outs):
                    text = o["choices"][0]["text"]
                    usage = o.get("usage", {})
                    if usage.get("prompt_tokens") not in (None, s["prompt_tokens"]):
                        raise RuntimeError(f"prompt tokenized to {usage['prompt_tokens']} tokens by the server, "
                                           f"{s['prompt_tokens']} here")
                    results.append({"policy": name, "task": s["task"], "length": s["length"], "depth": s["depth"],
                                    "i": s["i"], "answer": s["answer"], "output": text,
                                    "correct": score(text, s["answer"])})
                acc = accuracy(results[-len(samples):])
                print(f"{name}: {acc:.3f} ({timings[name]}s)", flush=True)
        finally:
            server.stop()
    wall = time.time() - t0

    # Aggregate.
    cells = {}
    for r in results:
        key = (r["policy"], r["task"], r["length"], r["depth"])
        c = cells.setdefault(key, [0, 0])
        c[0] += 1
        c[1] += int(r["correct"])
    rows = [{"policy": k[0], "method": table[k[0]][1], "budget": table[k[0]][2], "task": k[1], "length": k[2],
             "depth": k[3], "n": v[0], "correct": v[1], "accuracy": round(v[1] / v[0], 4)} for k, v in cells.items()]
    with open(args.out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    summary = []
    for name, (label, method, budget, params) in table.items():
        for task in args.tasks:
            rs = [r for r in results if r["policy"] == name and r["task"] == task]
            summary.append({"policy": name, "method": method, "budget": budget, "task": task, "n": len(rs),
                            "accuracy": round(accuracy(rs), 4)})
    with open(args.out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0].keys()))
        w.writeheader()
        w.writerows(summary)
    with open(args.out / "samples.jsonl", "w") as f:
        for r in results:
            if not r["correct"] or r["policy"] == "full":
                f.write(json.dumps({k: r[k] for k in ("policy", "task", "length", "depth", "i", "answer", "output")})
                        + "\n")

    # Markdown tables.
    md = []
    acc = {(s["policy"], s["task"]): s["accuracy"] for s in summary}
    methods = [p for p in args.policies if p != "full"]
    budgets = [str(b) for b in args.budgets]
    md.append(f"Model `{args.model}`, commit `{git_commit()}`, {args.n} samples per cell, lengths "
              f"{args.lengths}, depths {args.depths}, {len(samples)} prompts per policy, seed {args.seed}.\n")
    for task in args.tasks:
        md.append(f"### {task}: accuracy by policy x budget (tokens per layer)\n")
        md.append("| policy | " + " | ".join(budgets) + " |")
        md.append("| --- |" + " --- |" * len(budgets))
        if "full" in table:
            md.append("| full | " + " | ".join(f"{acc[('full', task)]:.2f}" for _ in budgets) + " |")
        for p in methods:
            md.append(f"| {p} | " + " | ".join(f"{acc.get((f'{p}-{b}', task), float('nan')):.2f}" for b in budgets)
                      + " |")
        md.append("")
    knorm = [k for k, v in table.items() if v[2].endswith("%")]
    if knorm:
        md.append("### knorm by compression (fraction of the prompt's KV dropped per compressed layer)\n")
        md.append("| task | " + " | ".join(table[k][2] for k in knorm) + " |")
        md.append("| --- |" + " --- |" * len(knorm))
        for task in args.tasks:
            md.append(f"| {task} | " + " | ".join(f"{acc[(k, task)]:.2f}" for k in knorm) + " |")
        md.append("")
    if "full" in table and len(table) > 1:
        # How often a policy's greedy output is exactly the full cache's: a fidelity proxy that still
        # says something when accuracy is at the floor for every policy.
        full_out = {(r["task"], r["length"], r["depth"], r["i"]): r["output"] for r in results if r["policy"] == "full"}
        md.append("### agreement with the full cache (identical greedy output), all tasks\n")
        md.append("| policy | all lengths | " + " | ".join(f"{L}" for L in args.lengths) + " |")
        md.append("| --- | --- |" + " --- |" * len(args.lengths))
        for name in table:
            if name == "full":
                continue
            rs = [r for r in results if r["policy"] == name]
            def agree(sel):
                return sum(full_out[(r["task"], r["length"], r["depth"], r["i"])] == r["output"] for r in sel) / max(1, len(sel))
            md.append(f"| {name} | {agree(rs):.2f} | " + " | ".join(
                f"{agree([r for r in rs if r['length'] == L]):.2f}" for L in args.lengths) + " |")
        md.append("")
    if "needle" in args.tasks:
        # The first answer token comes from the prefill, where every policy still sees the whole prompt
        # (as in the papers' implementations); compression only acts on the tokens after it. A
        # one-token word answer is therefore right under any policy (up to the '.' after it), while a
        # number (one token per digit) needs the cache: the split separates the two.
        md.append("### needle by answer type: numbers (one token per digit) vs words (one token, then the '.' "
                  "that ends the answer)\n")
        md.append("| policy | numbers | words |")
        md.append("| --- | --- | --- |")
        for name in table:
            rs = [r for r in results if r["policy"] == name and r["task"] == "needle"]
            num = [r for r in rs if r["answer"].isdigit()]
            word = [r for r in rs if not r["answer"].isdigit()]
            md.append(f"| {name} | {accuracy(num):.2f} ({len(num)}) | {accuracy(word):.2f} ({len(word)}) |")
        md.append("")
    multi = [t for t in ("passkey", "multikey") if t in args.tasks]
    if multi and any(d >= 0.99 for d in args.depths) and any(d < 0.99 for d in args.depths):
        # At depth 100 % the fact sits just before the question, inside any recent window: split it
        # off so that StreamingLLM's recent window does not pass for retrieval.
        md.append(f"### {' + '.join(multi)} by fact position: depth < 100 % vs 100 %\n")
        md.append("| policy | depth < 100 % | depth 100 % |")
        md.append("| --- | --- | --- |")
        for name in table:
            rs = [r for r in results if r["policy"] == name and r["task"] in multi]
            inner = [r for r in rs if r["depth"] < 0.99]
            end = [r for r in rs if r["depth"] >= 0.99]
            md.append(f"| {name} | {accuracy(inner):.2f} | {accuracy(end):.2f} |")
        md.append("")
    md.append("### accuracy by context length (all tasks and depths)\n")
    md.append("| policy | " + " | ".join(str(L) for L in args.lengths) + " |")
    md.append("| --- |" + " --- |" * len(args.lengths))
    for name in table:
        vals = []
        for L in args.lengths:
            rs = [r for r in results if r["policy"] == name and r["length"] == L]
            vals.append(f"{accuracy(rs):.2f}")
        md.append(f"| {name} | " + " | ".join(vals) + " |")
    md.append("")
    (args.out / "tables.md").write_text("\n".join(md))
    files = []
    if not args.no_plots:
        files = heatmaps(rows, args.out, table, args.lengths, args.depths) + [budget_plot(summary, args.out)]
    (args.out / "run.json").write_text(json.dumps({
        "argv": sys.argv[1:], "model": args.model, "commit": git_commit(), "wall_s": round(wall, 1),
        "prompts_per_policy": len(samples), "seconds_per_policy": timings, "files": files,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=1) + "\n")
    print("\n".join(md))
    print(f"wrote {args.out} in {wall:.0f}s")


if __name__ == "__main__":
    main()
