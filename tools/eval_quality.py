#!/usr/bin/env python3
"""Long-context quality suite: RULER-style tasks (tools/ruler_tasks.py) on a real model, every KV
policy x budget, with kvserve; optionally kvpress's matching presses on the same prompts.

Steps
  1. samples: `--n` per (task, length), generated from `--seed` (no downloads), chat prompts.
  2. full KV on every (task, length); a (task, length) is kept when full KV scores >= --min-full.
  3. every policy x budget (tokens) and ratio on the kept cells: one `kvserve generate` run per
     (policy, budget, task, length) holding all that cell's prompts (one model load, the engine
     batches them); `--jobs` runs go at once, each with --threads / jobs intra-op threads.
  4. --kvpress: SnapKV/PyramidKV/StreamingLLM/Knorm presses in transformers at the ratios, and
     kvserve with semantics=kvpress and the same parameters (kept sets equal by construction):
     accuracy of both and how often the greedy answers are identical.
Writes <out>/quality.json (every answer), quality.md (tables with 95 % Wilson intervals) and plots
(quality_vs_budget.png, quality_heatmap.png). Progress goes to stderr.

  python3 tools/eval_quality.py --kvserve build/kvserve                 # the default grid
  python3 tools/eval_quality.py --kvserve build/kvserve --grid full     # every length/budget/policy
  python3 tools/eval_quality.py --kvserve build/kvserve --device cuda --dtype bfloat16 --jobs 4
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ruler_tasks as rt  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
GRIDS = {
    # Sized for about an hour on 2 idle cores from the rate measured on a loaded machine (11 s per
    # 1K prompt with 5 agents sharing 2 cores): not yet timed idle (docs/eval/quality.md).
    "default": dict(tasks=["niah_number", "niah_word", "multikey", "qa"], lengths=[1024], budgets=[128, 256],
                    ratios=[], policies=["snapkv", "pyramidkv", "dynamickv", "snapkv:head_budgets=adaptive",
                                         "pyramidkv:head_budgets=adaptive"], n=50),
    "full": dict(tasks=list(rt.TASKS), lengths=[1024, 2048, 4096, 8192], budgets=[64, 128, 256, 512], ratios=[0.1, 0.25],
                 policies=["snapkv", "pyramidkv", "dynamickv", "snapkv:head_budgets=adaptive",
                           "pyramidkv:head_budgets=adaptive", "dynamickv:variant=paper",
                           "dynamickv:variant=authors", "streamingllm", "h2o", "knorm", "random"], n=50),
}
# kvpress side by side: kvserve policy + params (semantics=kvpress) and the press that keeps the same set.
KVPRESS = {
    "snapkv": dict(window=64, kernel=5, pooling="avg"),
    "pyramidkv": dict(window=64, kernel=5, pooling="avg", beta=20),
    "streamingllm": dict(sink=4),
    "knorm": dict(skip_layers="none"),
    # AdaKVPress(SnapKVPress): head-wise budgets around kvpress's SnapKV parameters.
    "adakv-snapkv": dict(window=64, kernel=5, pooling="avg", head_budgets="adaptive", alpha=0.2),
}
# The kvserve policy a kvpress entry runs under (its key, unless named here).
KVPRESS_POLICY = {"adakv-snapkv": "snapkv"}


def spec_of(name: str, params: dict) -> str:
    """The kvserve policy spec that keeps what kvpress entry `name` keeps."""
    return f"{KVPRESS_POLICY.get(name, name)}:semantics=kvpress," + ",".join(f"{k}={v}" for k, v in params.items())


# kvserve's observation window per policy when a spec does not set one (the authors' defaults).
DEFAULT_WINDOW = {"snapkv": 8, "pyramidkv": 8, "dynamickv": 8, "h2o": 8}


def window_of(spec: str) -> str:
    """The observation window a policy spec runs with ('-' where the scorer has none)."""
    name, _, params = spec.partition(":")
    for kv in params.split(","):
        if kv.startswith("window="):
            return kv.split("=", 1)[1]
    return str(DEFAULT_WINDOW.get(name, "-"))


def log(msg: str) -> None:
    print(f"[eval_quality] {msg}", file=sys.stderr, flush=True)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def policy_args(spec: str, budget: str | None) -> list[str]:
    """'dynamickv:variant=paper,min_ratio=0.5' -> kvserve flags."""
    if spec == "full":
        return []
    name, _, params = spec.partition(":")
    out = ["--policy", name, "--budget", str(budget)]
    for kv in filter(None, params.split(",")):
        out += ["--policy-param", kv]
    return out


class Runner:
    def __init__(self, a, tmp: pathlib.Path):
        self.a, self.tmp = a, tmp
        self.threads = max(1, a.threads // a.jobs)
        self._n = 0
        self._lock = threading.Lock()

    def generate(self, samples: list, flags: list[str]) -> list[list[int]]:
        with self._lock:
            self._n += 1
            f = self.tmp / f"prompts-{self._n}.json"
        f.write_text(json.dumps([s.ids for s in samples]))
        cmd = [self.a.kvserve, "generate", "--model", self.a.model, "--prompts-file", str(f), "--max-tokens",
               str(samples[0].max_tokens), "--temperature", "0", "--kv-cache", self.a.kv_cache, "--json",
               "--device", self.a.device, *(["--dtype", self.a.dtype] if self.a.dtype else []), *flags]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        results = out["results"] if "results" in out else [out]
        return [r["token_ids"] for r in results]


def make_samples(a, tok) -> dict:
    style, bos = rt.prompt_style(a.model)
    if a.prompt_style != "auto":
        style = a.prompt_style
    log(f"prompts: {style} style{', BOS first' if bos is not None else ''}")
    maker = rt.TaskMaker(tok, style)
    cells = {}
    for task in a.tasks:
        for length in a.lengths:
            ss = [maker.make(task, length, a.seed * 100000 + i) for i in range(a.n)]
            cells[(task, length)] = rt.tokenize(tok, ss, bos)
    return cells


def stop_ids(tok) -> set:
    """The end-of-text ids of SmolLM2 and Gemma 3 that this tokenizer has (dropped from answers)."""
    return {tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<eos>", "<end_of_turn>")} - {None}


def run_grid(a, tok, runner: Runner, cells: dict, configs: list, results: dict, label: str, after_cell=None) -> None:
    """configs: (policy spec, budget or None); fills results[(spec, budget, task, length)];
    after_cell() runs after each (config, cell) lands."""
    jobs = [(spec, b, key) for spec, b in configs for key in cells]
    total = sum(len(cells[k]) for _, _, k in jobs)
    done, t0 = 0, time.time()
    eos = stop_ids(tok)

    def one(job):
        spec, b, key = job
        outs = runner.generate(cells[key], policy_args(spec, b))
        answers = []
        for s, ids in zip(cells[key], outs):
            ids = [t for t in ids if t not in eos]
            text = tok.decode(ids)
            answers.append({"correct": s.correct(text), "text": text, "ids": ids})
        return job, answers

    with cf.ThreadPoolExecutor(a.jobs) as ex:
        for (spec, b, key), answers in ex.map(one, jobs):
            results[(spec, b, *key)] = answers
            done += len(answers)
            el = time.time() - t0
            k = sum(x["correct"] for x in answers)
            log(f"{label}: {spec} budget {b} {key[0]}@{key[1]}: {k}/{len(answers)}   "
                f"[{done}/{total} prompts, {el / 60:.1f} min, eta {el / done * (total - done) / 60:.1f} min]")
            if after_cell:
                after_cell()


def global_layers_only(press):
    """The press, compressing only the layers whose attention is not sliding (Gemma 3's global ones)."""
    base = type(press)

    class GlobalLayersOnly(base):
        def forward_hook(self, module, input, kwargs, output):
            if getattr(module, "is_sliding", False):
                return output
            return super().forward_hook(module, input, kwargs, output)

    press.__class__ = GlobalLayersOnly
    return press


def kvpress_side(a, tok, cells: dict, runner: Runner, results: dict) -> dict:
    """kvpress's presses on the same prompts in transformers; kvserve with semantics=kvpress."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    import kvpress
    import kv_sim

    torch.set_num_threads(max(1, a.threads))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = stop_ids(tok)
    presses = {
        "snapkv": lambda r, p: kvpress.SnapKVPress(compression_ratio=1 - r, window_size=p["window"], kernel_size=p["kernel"]),
        "pyramidkv": lambda r, p: kvpress.PyramidKVPress(compression_ratio=1 - r, window_size=p["window"],
                                                         kernel_size=p["kernel"], beta=p["beta"]),
        "streamingllm": lambda r, p: kvpress.StreamingLLMPress(compression_ratio=1 - r, n_sink=p["sink"]),
        "knorm": lambda r, p: kvpress.KnormPress(compression_ratio=1 - r),
        "adakv-snapkv": lambda r, p: kvpress.AdaKVPress(
            press=kvpress.SnapKVPress(compression_ratio=1 - r, window_size=p["window"], kernel_size=p["kernel"]),
            alpha_safeguard=p["alpha"]),
    }
    if any(t == "sliding_attention" for t in getattr(model.config, "layer_types", None) or []):
        # Gemma 3: kvserve compresses the global layers only (a sliding-window layer's window is its
        # budget), while kvpress's presses on the text-only class compress every layer; each press
        # here leaves the sliding layers alone, so both keep the same sets. PyramidKV's slope runs
        # over the global layers in kvserve and over all layers in kvpress: it has no peer here.
        if "pyramidkv" in a.kvpress_presses:
            raise SystemExit("--kvpress-presses: pyramidkv has no kvpress peer on a model with sliding-window layers")
        presses = {k: (lambda f: lambda r, p: global_layers_only(f(r, p)))(f) for k, f in presses.items()}
    out = {}
    chosen = {k: v for k, v in KVPRESS.items() if k in a.kvpress_presses}
    configs = [(spec_of(name, params), r) for name, params in chosen.items() for r in a.kvpress_ratios]
    run_grid(a, tok, runner, cells, configs, results, "kvserve (semantics=kvpress)")
    t0, done = time.time(), 0
    total = len(chosen) * len(a.kvpress_ratios) * sum(len(v) for v in cells.values())
    for name, params in chosen.items():
        for r in a.kvpress_ratios:
            spec = spec_of(name, params)
            for key, samples in cells.items():
                answers = []
                for s in samples:
                    cache = DynamicCache()
                    with torch.no_grad(), presses[name](r, params)(model):
                        logits = model(torch.tensor([s.ids]), past_key_values=cache, use_cache=True).logits[0, -1]
                    ids = kv_sim.decode(model, cache, logits, None, len(s.ids), s.max_tokens, eos)
                    ids = [t for t in ids if t not in eos]
                    text = tok.decode(ids)
                    answers.append({"correct": s.correct(text), "text": text, "ids": ids})
                    done += 1
                theirs = results[(spec, r, *key)]
                same = sum(x["ids"] == y["ids"] for x, y in zip(answers, theirs))
                out[(name, r, *key)] = {"kvpress": answers, "same": same}
                el = time.time() - t0
                log(f"kvpress {name} ratio {r} {key[0]}@{key[1]}: {sum(x['correct'] for x in answers)}/{len(answers)}, "
                    f"identical to kvserve {same}/{len(answers)}   [{done}/{total}, eta {el / done * (total - done) / 60:.1f} min]")
    return out


def acc(answers: list) -> tuple[int, int]:
    return sum(x["correct"] for x in answers), len(answers)


def fmt(k: int, n: int) -> str:
    lo, hi = wilson(k, n)
    return f"{100 * k / n:.0f} [{100 * lo:.0f}, {100 * hi:.0f}]" if n else "-"


def write_report(a, cells: dict, kept: list, full: dict, results: dict, kvp: dict, seconds: float,
                 partial: str = "") -> None:
    """partial: what a run still in progress has not done yet (its report is rewritten after every
    cell, so a run stopped early keeps what it measured)."""
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = [b for b in a.budgets] + [r for r in a.ratios]
    lines = [
        "# Long-context quality suite (RULER-style tasks, real model)", "",
        *([f"**Partial: {partial}.**", ""] if partial else []),
        f"Written by `tools/eval_quality.py` ({' '.join(sys.argv[1:])}); model `{a.model}`, device {a.device}"
        f"{', dtype ' + a.dtype if a.dtype else ''}; seed {a.seed}; {a.n} samples per (task, length); "
        f"{seconds / 60:.0f} min. Accuracy in % with the 95 % Wilson interval in brackets. Greedy; a sample is "
        "correct when every expected string is in the answer. Budgets are average kept tokens per layer "
        "(window included); numbers below 1 are ratios of the prompt.", "",
        "## Full KV per (task, length) (cells below 60 % are dropped)", "",
        "| task | " + " | ".join(str(x) for x in a.lengths) + " |", "|---|" + "---:|" * len(a.lengths)]
    for task in a.tasks:
        lines.append(f"| {task} | " + " | ".join(fmt(*full[(task, L)]) + ("" if (task, L) in kept else " (dropped)")
                                                for L in a.lengths) + " |")
    lines += ["", "## Accuracy per policy and budget, averaged over the kept (task, length) cells", "",
              "Mean of the per-cell accuracies; the interval is Wilson's on the pooled samples.", "",
              "| policy | window | " + " | ".join(str(b) for b in budgets) + " |", "|---|---:|" + "---:|" * len(budgets)]
    summary = {}
    for spec in a.policies:
        row = []
        for b in budgets:
            per = [acc(results[(spec, b, *key)]) for key in kept if (spec, b, *key) in results]
            if not per:
                row.append("-")
                continue
            mean = sum(k / n for k, n in per) / len(per)
            k, n = sum(k for k, _ in per), sum(n for _, n in per)
            lo, hi = wilson(k, n)
            summary[(spec, b)] = mean
            row.append(f"{100 * mean:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]")
        lines.append(f"| {spec} | {window_of(spec)} | " + " | ".join(row) + " |")
    lines += ["", "## Per task (all kept lengths pooled)", ""]
    for b in budgets:
        lines += [f"### budget {b}", "", "| policy | " + " | ".join(f"{t}" for t in a.tasks) + " |",
                  "|---|" + "---:|" * len(a.tasks)]
        fr = []
        for t in a.tasks:
            ks = [full[key] for key in kept if key[0] == t]
            fr.append(fmt(sum(k for k, _ in ks), sum(n for _, n in ks)) if ks else "-")
        lines.append("| full | " + " | ".join(fr) + " |")
        for spec in a.policies:
            row = []
            for t in a.tasks:
                per = [acc(results[(spec, b, *key)]) for key in kept if key[0] == t and (spec, b, *key) in results]
                row.append(fmt(sum(k for k, _ in per), sum(n for _, n in per)) if per else "-")
            lines.append(f"| {spec} | " + " | ".join(row) + " |")
        lines.append("")
    if kvp:
        lines += ["## kvserve vs kvpress on the same prompts", "",
                  "kvserve runs each policy with `semantics=kvpress` and the press's parameters, so the kept "
                  "sets are equal by construction; `same` is how many greedy answers are token-identical. "
                  "kvpress runs in transformers (fp32, SDPA), kvserve in libtorch.", "",
                  "| press | ratio | task@length | kvpress | kvserve | same |", "|---|---:|---|---:|---:|---:|"]
        for (name, r, task, L), v in kvp.items():
            spec = spec_of(name, KVPRESS[name])
            mine = results[(spec, r, task, L)]
            lines.append(f"| {name} | {r} | {task}@{L} | {fmt(*acc(v['kvpress']))} | {fmt(*acc(mine))} | "
                         f"{v['same']}/{len(mine)} |")
        tot = sum(v["same"] for v in kvp.values())
        n = sum(len(v["kvpress"]) for v in kvp.values())
        lines += ["", f"Identical greedy answers: {tot}/{n} ({100 * tot / max(n, 1):.1f} %).", ""]
    lines += ["![accuracy vs budget](quality_vs_budget.png)", "", "![policy x task](quality_heatmap.png)", ""]
    (out / "quality.md").write_text("\n".join(lines))
    dump = {"args": {k: v for k, v in vars(a).items()}, "kept_cells": [list(k) for k in kept],
            "full": {f"{t}@{L}": v for (t, L), v in full.items()},
            "results": [{"policy": k[0], "budget": k[1], "task": k[2], "length": k[3],
                         "correct": [x["correct"] for x in v], "answers": [x["text"] for x in v]}
                        for k, v in results.items()],
            "kvpress": [{"press": k[0], "ratio": k[1], "task": k[2], "length": k[3], "same": v["same"],
                         "correct": [x["correct"] for x in v["kvpress"]], "answers": [x["text"] for x in v["kvpress"]]}
                        for k, v in kvp.items()]}
    (out / "quality.json").write_text(json.dumps(dump))
    plots(a, kept, results, budgets, out)


def plots(a, kept, results, budgets, out: pathlib.Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots")
        return
    tasks = sorted({k[0] for k in kept}, key=a.tasks.index)
    tok_budgets = [b for b in budgets if isinstance(b, int)]
    if tasks and tok_budgets:
        cols = min(4, len(tasks))
        rows = (len(tasks) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
        for ax, t in zip(axes.flat, tasks):
            for spec in a.policies:
                ys = []
                for b in tok_budgets:
                    per = [acc(results[(spec, b, *key)]) for key in kept if key[0] == t and (spec, b, *key) in results]
                    ys.append(100 * sum(k for k, _ in per) / max(1, sum(n for _, n in per)) if per else float("nan"))
                ax.plot(tok_budgets, ys, marker="o", label=spec)
            ax.set_xscale("log", base=2)
            ax.set_title(t)
            ax.set_xlabel("budget (tokens/layer)")
            ax.set_ylabel("accuracy %")
            ax.set_ylim(-5, 105)
        for ax in list(axes.flat)[len(tasks):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "quality_vs_budget.png", dpi=90)
        plt.close(fig)
    if tasks and budgets and a.policies:
        import numpy as np
        b = 128 if 128 in budgets else budgets[0]
        m = np.full((len(a.policies), len(tasks)), np.nan)
        for i, spec in enumerate(a.policies):
            for j, t in enumerate(tasks):
                per = [acc(results[(spec, b, *key)]) for key in kept if key[0] == t and (spec, b, *key) in results]
                if per:
                    m[i, j] = 100 * sum(k for k, _ in per) / max(1, sum(n for _, n in per))
        fig, ax = plt.subplots(figsize=(1.1 * len(tasks) + 3, 0.5 * len(a.policies) + 1.5))
        im = ax.imshow(m, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
        ax.set_yticks(range(len(a.policies)), a.policies)
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if not np.isnan(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center", color="w" if m[i, j] < 60 else "k", fontsize=8)
        ax.set_title(f"accuracy % at budget {b}")
        fig.colorbar(im)
        fig.tight_layout()
        fig.savefig(out / "quality_heatmap.png", dpi=90)
        plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--prompt-style", choices=["auto", *rt.STYLES], default="auto",
                    help="auto: ChatML for a model whose chat template is ChatML, else a plain completion (base models)")
    ap.add_argument("--out", default=str(REPO / "docs" / "eval"))
    ap.add_argument("--grid", choices=list(GRIDS), default="default", help="defaults for the options below")
    ap.add_argument("--tasks", help=f"comma list of {','.join(rt.TASKS)}")
    ap.add_argument("--lengths", help="comma list of prompt lengths in tokens")
    ap.add_argument("--budgets", help="comma list of budgets in tokens per layer")
    ap.add_argument("--ratios", help="comma list of budget ratios (0 < r < 1)")
    ap.add_argument("--policies", help="comma list; 'name:key=value;...' adds policy parameters (use ';' between them)")
    ap.add_argument("--n", type=int, help="samples per (task, length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-full", type=float, default=0.6, help="keep a (task, length) where full KV scores at least this")
    ap.add_argument("--jobs", type=int, default=1, help="kvserve runs at once")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the jobs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="", help="kvserve compute dtype (float32, bfloat16); default the model's")
    ap.add_argument("--kv-cache", default="4GiB")
    ap.add_argument("--kvpress", action="store_true", help="also run kvpress's presses side by side")
    ap.add_argument("--kvpress-ratios", default="0.1,0.25")
    ap.add_argument("--kvpress-presses", default=",".join(KVPRESS), help="which of the matching presses")
    ap.add_argument("--kvpress-n", type=int, default=0, help="samples per cell for the kvpress part (0: all)")
    a = ap.parse_args()
    g = GRIDS[a.grid]
    a.tasks = a.tasks.split(",") if a.tasks else g["tasks"]
    a.lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else g["lengths"]
    a.budgets = g["budgets"] if a.budgets is None else [int(x) for x in a.budgets.split(",") if x]
    a.ratios = g["ratios"] if a.ratios is None else [float(x) for x in a.ratios.split(",") if x]
    a.policies = g["policies"] if a.policies is None else [p.replace(";", ",") for p in a.policies.split(",") if p]
    a.n = a.n or g["n"]
    a.kvpress_ratios = [float(x) for x in a.kvpress_ratios.split(",")]
    a.kvpress_presses = a.kvpress_presses.split(",")
    for p in a.kvpress_presses:
        if p not in KVPRESS:
            raise SystemExit(f"--kvpress-presses: {p!r} has no matching press (known: {', '.join(KVPRESS)})")
    for t in a.tasks:
        if t not in rt.TASKS:
            raise SystemExit(f"--tasks: unknown task {t!r} (known: {', '.join(rt.TASKS)})")
    if not pathlib.Path(a.kvserve).exists():
        raise SystemExit(f"--kvserve {a.kvserve}: no such binary (make build)")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(a.model) / "tokenizer.json"))
    t0 = time.time()
    cells = make_samples(a, tok)
    log(f"{len(cells)} (task, length) cells x {a.n} samples; policies {a.policies}; budgets {a.budgets} ratios {a.ratios}")
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(a, pathlib.Path(tmp))
        results: dict = {}
        run_grid(a, tok, runner, cells, [("full", None)], results, "full KV")
        full = {key: acc(results[("full", None, *key)]) for key in cells}
        kept = [key for key in cells if full[key][0] >= a.min_full * full[key][1]]
        log(f"kept cells (full >= {a.min_full:.0%}): {kept}")
        kept_cells = {k: cells[k] for k in kept}
        configs = [(p, b) for p in a.policies for b in a.budgets + a.ratios]
        todo = len(configs) * len(kept_cells)

        def progress():
            left = todo - sum(1 for spec, b in configs for key in kept_cells if (spec, b, *key) in results)
            if left:
                write_report(a, cells, kept, full, results, {}, time.time() - t0,
                             partial=f"{left} of {todo} (policy, budget, cell) runs not done when this was written")

        run_grid(a, tok, runner, kept_cells, configs, results, "policies", progress)
        kvp = {}
        if a.kvpress:
            sub = {k: v[: a.kvpress_n or len(v)] for k, v in kept_cells.items()}
            kvp = kvpress_side(a, tok, sub, runner, results)
        write_report(a, cells, kept, full, results, kvp, time.time() - t0)
    log(f"wrote {a.out}/quality.md ({(time.time() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
