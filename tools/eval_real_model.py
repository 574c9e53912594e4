#!/usr/bin/env python3
"""KV compression on a real language model: SmolLM2-135M-Instruct (the default model), with kvserve.

Three measurements, each a `kvserve` CLI run per (policy, kept fraction or budget):

  prefill   perplexity of a continuation after a compressed prefix: each document's first
            --prefix tokens are prefilled through the policy (budget = kept fraction of the
            prefix), the next tokens are decoded teacher-forced on that cache and scored
            (`kvserve perplexity --prefill N --per-token`, only the continuation counts).
  decode    perplexity under decode-time eviction (the key-L2-norm paper's figure 3): whole
            documents decoded token by token, the cache held at decode_budget = fraction x length
            (knorm: largest key norms out; streamingllm: oldest non-sink tokens out; the other
            policies need attention scores, which decoding does not compute).
  passkey   a five-digit pass key hidden at a depth in filler text, asked for in a chat turn,
            greedy (`kvserve generate`): first with the full cache at several lengths, then every
            policy x budget at the lengths where the full cache succeeds.

Text: licence texts that every Debian system ships (/usr/share/common-licenses). They are common
on the web, so the model has likely seen them: perplexities are low and the context matters less
than for unseen text; the comparison between policies is what this measures.

Writes real_model.json, real_model.md and real_*.png to --out.
  python3 tools/eval_real_model.py --kvserve build/kvserve --out docs/eval
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
LICENSES = pathlib.Path("/usr/share/common-licenses")
DOCS = ["GPL-3", "MPL-2.0"]
PREFILL_POLICIES = ["snapkv", "pyramidkv", "dynamickv", "streamingllm", "h2o", "knorm"]
DECODE_POLICIES = ["knorm", "streamingllm"]
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
PASSKEY_Q = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
             "remember it; I will ask you about it.\n\n{haystack}\n\nWhat is the pass key?")


def log(msg: str) -> None:
    print(f"[eval_real_model] {msg}", file=sys.stderr, flush=True)


class Kv:
    def __init__(self, binary: str, model: str, tmp: pathlib.Path):
        self.binary, self.model, self.tmp = binary, model, tmp

    def run(self, *args: str) -> dict:
        cmd = [self.binary, *args]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def perplexity(self, docs: list[list[int]], prefill: int, policy: list[str]) -> dict:
        f = self.tmp / "docs.json"
        f.write_text(json.dumps(docs))
        return self.run("perplexity", "--model", self.model, "--input-ids", str(f), "--prefill", str(prefill),
                        "--per-token", *policy)

    def generate(self, prompts: list[list[int]], max_tokens: int, policy: list[str]) -> dict:
        f = self.tmp / "prompts.json"
        f.write_text(json.dumps(prompts))
        return self.run("generate", "--model", self.model, "--prompts-file", str(f), "--max-tokens", str(max_tokens),
                        "--temperature", "0", "--kv-cache", "4GiB", "--json", *policy)


def policy_flags(policy: str, budget: str) -> list[str]:
    return [] if policy == "full" else ["--policy", policy, "--budget", budget]


def continuation_ppl(result: dict, prefix: int) -> float:
    """Perplexity over the tokens decoded after the prefix (the prefill's own targets excluded)."""
    nll = [x for d in result["documents"] for x in d["nll_per_token"][prefix:]]
    return math.exp(sum(nll) / len(nll))


def part_prefill(kv: Kv, docs: list[list[int]], prefix: int, fractions: list[float],
                 policies: list[str]) -> list[dict]:
    rows = []
    full = kv.perplexity(docs, prefix, [])
    rows.append({"policy": "full", "fraction": 1.0, "perplexity": continuation_ppl(full, prefix)})
    log(f"prefill full: {rows[-1]['perplexity']:.3f}")
    for policy in policies:
        for f in fractions:
            r = kv.perplexity(docs, prefix, policy_flags(policy, str(f)))
            kept = sum(sum(d["final_cached"]) for d in r["documents"]) / (len(docs) * len(r["documents"][0]["final_cached"]))
            rows.append({"policy": policy, "fraction": f, "perplexity": continuation_ppl(r, prefix),
                         "mean_cached_at_end": kept})
            log(f"prefill {policy} {f}: {rows[-1]['perplexity']:.3f} (cached at end {kept:.0f})")
    return rows


def part_decode(kv: Kv, docs: list[list[int]], fractions: list[float], chunk: int) -> list[dict]:
    length = len(docs[0])
    # Full-cache reference: one prefill scores every token exactly as decoding would.
    full = kv.perplexity(docs, length, [])
    rows = [{"policy": "full", "fraction": 1.0, "perplexity": full["perplexity"], "visible": 1.0}]
    log(f"decode full: {full['perplexity']:.3f}")
    for policy in DECODE_POLICIES:
        for f in fractions:
            budget = max(int(round(f * length)), 4 + chunk + 1)
            flags = ["--policy", policy, "--policy-param", f"decode_budget={budget}",
                     "--policy-param", f"decode_evict_chunk={chunk}"]
            if policy == "knorm":
                flags += ["--budget", "0.999"]  # prefill is one token: nothing to compress there
            r = kv.perplexity(docs, 1, flags)
            rows.append({"policy": policy, "fraction": f, "perplexity": r["perplexity"],
                         "visible": r["mean_visible_fraction"]})
            log(f"decode {policy} {f}: {r['perplexity']:.3f} (visible {r['mean_visible_fraction']:.2f})")
    return rows


def passkey_prompts(tok, length: int, depths: list[float], n: int, seed: int) -> list[tuple[list[int], str, float]]:
    """(prompt ids, key, depth): about `length` tokens each, the key sentence at `depth` of the filler."""
    rng = random.Random(seed + length)
    filler_tokens = len(tok(FILLER)["input_ids"])
    out = []
    for depth in depths:
        for _ in range(n):
            key = str(rng.randint(10000, 99999))
            needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
            reps = max(1, (length - 80) // filler_tokens)
            cut = int(round(depth * reps))
            haystack = FILLER * cut + needle + FILLER * (reps - cut)
            msgs = [{"role": "user", "content": PASSKEY_Q.format(haystack=haystack.strip())}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            out.append((ids, key, depth))
    return out


def part_passkey(kv: Kv, tok, lengths: list[int], depths: list[float], n: int, budgets: list[int],
                 threshold: float, policy_lengths: int, seed: int) -> dict:
    res = {"full": [], "policies": []}
    good = []
    cache = {}
    for length in lengths:
        samples = passkey_prompts(tok, length, depths, n, seed)
        cache[length] = samples
        r = kv.generate([s[0] for s in samples], 12, [])
        ok = [s[1] in x["text"] for s, x in zip(samples, r["results"])]
        acc = sum(ok) / len(ok)
        tokens = sum(len(s[0]) for s in samples) / len(samples)
        by_depth = {d: sum(o for o, s in zip(ok, samples) if s[2] == d) / sum(1 for s in samples if s[2] == d)
                    for d in depths}
        res["full"].append({"length": length, "prompt_tokens": tokens, "accuracy": acc, "n": len(ok),
                            "by_depth": by_depth, "answers": [x["text"] for x in r["results"][:3]]})
        log(f"passkey full {length}: {acc:.2f} ({tokens:.0f} tokens)")
        if acc >= threshold:
            good.append(length)
    # The longest lengths the full cache handles: where compression has the most to remove.
    good = good[-policy_lengths:] if policy_lengths > 0 else []
    res["lengths_evaluated"] = good
    for length in good:
        samples = cache[length]
        for policy in PREFILL_POLICIES:
            for b in budgets:
                r = kv.generate([s[0] for s in samples], 12, policy_flags(policy, str(b)))
                ok = [s[1] in x["text"] for s, x in zip(samples, r["results"])]
                by_depth = {d: sum(o for o, s in zip(ok, samples) if s[2] == d) / sum(1 for s in samples if s[2] == d)
                            for d in depths}
                res["policies"].append({"length": length, "policy": policy, "budget": b,
                                        "accuracy": sum(ok) / len(ok), "by_depth": by_depth})
                log(f"passkey {policy} b={b} len={length}: {sum(ok) / len(ok):.2f}")
    return res


def plots(res: dict, out: pathlib.Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    made = []
    for part, xlabel in (("prefill", "kept fraction of the prefix (prefill compression)"),
                         ("decode", "KV kept during decoding (decode_budget / length)")):
        rows = res.get(part)
        if not rows:
            continue
        full = next(r["perplexity"] for r in rows if r["policy"] == "full")
        fig, ax = plt.subplots(figsize=(5.6, 3.8))
        for policy in sorted({r["policy"] for r in rows} - {"full"}):
            pts = sorted((r["fraction"], r["perplexity"]) for r in rows if r["policy"] == policy)
            ax.plot([p for p, _ in pts], [q for _, q in pts], marker="o", label=policy)
        ax.axhline(full, color="k", ls="--", lw=1, label="full cache")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.invert_xaxis()
        ax.legend(fontsize=8)
        ax.set_title(f"SmolLM2-135M-Instruct, {part}", fontsize=9)
        fig.tight_layout()
        name = f"real_perplexity_{part}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    pk = res.get("passkey")
    if pk and pk["policies"]:
        fig, axes = plt.subplots(1, len(pk["lengths_evaluated"]), figsize=(5.2 * len(pk["lengths_evaluated"]), 3.8),
                                 squeeze=False)
        for ax, length in zip(axes[0], pk["lengths_evaluated"]):
            full = next(r["accuracy"] for r in pk["full"] if r["length"] == length)
            for policy in PREFILL_POLICIES:
                pts = sorted((r["budget"], r["accuracy"]) for r in pk["policies"]
                             if r["policy"] == policy and r["length"] == length)
                ax.plot([p for p, _ in pts], [q for _, q in pts], marker="o", label=policy)
            ax.axhline(full, color="k", ls="--", lw=1, label="full cache")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tokens per layer)")
            ax.set_ylabel("pass key accuracy")
            ax.set_title(f"SmolLM2-135M-Instruct, ~{length} tokens", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "real_passkey_vs_budget.png", dpi=110)
        plt.close(fig)
        made.append("real_passkey_vs_budget.png")
    return made


def render(meta: dict, res: dict, pngs: list[str]) -> str:
    L = ["# KV compression on a real model: SmolLM2-135M-Instruct", "",
         f"`tools/eval_real_model.py`, commit {meta['commit']}, {meta['date']}, {meta['seconds']:.0f} s on "
         f"{meta['cores']} cores (load average {meta['load']}). Arguments: `{meta['argv']}`.", ""]
    if res.get("prefill"):
        rows = res["prefill"]
        fr = sorted({r["fraction"] for r in rows if r["policy"] != "full"}, reverse=True)
        full = next(r["perplexity"] for r in rows if r["policy"] == "full")
        L += ["## Perplexity after a compressed prefix", "",
              f"{meta['docs']} documents ({', '.join(meta['doc_names'])}), {meta['prefix']}-token prefix prefilled "
              f"through the policy (budget = kept fraction of the prefix; window policies keep an 8-token window), "
              f"then {meta['continuation']} tokens decoded teacher-forced on that cache and scored. "
              f"Full cache: **{full:.3f}**.", "",
              "| policy | " + " | ".join(f"{f:g}" for f in fr) + " |", "| --- |" + " --- |" * len(fr)]
        for p in PREFILL_POLICIES:
            cells = [next((f"{r['perplexity']:.3f}" for r in rows if r["policy"] == p and r["fraction"] == f), "–")
                     for f in fr]
            L.append(f"| {p} | " + " | ".join(cells) + " |")
        L.append("")
    if res.get("decode"):
        rows = res["decode"]
        fr = sorted({r["fraction"] for r in rows if r["policy"] != "full"}, reverse=True)
        full = next(r["perplexity"] for r in rows if r["policy"] == "full")
        L += ["## Perplexity under decode-time eviction", "",
              f"The same documents cut to {meta['decode_length']} tokens, decoded token by token from the first; "
              f"decode_budget = fraction × {meta['decode_length']}, evicting {meta['chunk']} tokens at a time. "
              f"Full cache: **{full:.3f}**. Cells: perplexity (mean visible fraction).", "",
              "| policy | " + " | ".join(f"{f:g}" for f in fr) + " |", "| --- |" + " --- |" * len(fr)]
        for p in DECODE_POLICIES:
            cells = [next((f"{r['perplexity']:.3f} ({r['visible']:.2f})" for r in rows
                           if r["policy"] == p and r["fraction"] == f), "–") for f in fr]
            L.append(f"| {p} | " + " | ".join(cells) + " |")
        L.append("")
    pk = res.get("passkey")
    if pk:
        L += ["## Pass key retrieval", "",
              f"Five-digit key at depths {meta['depths']} of filler text, {meta['n']} samples per depth, asked in a "
              "chat turn, greedy, 12 tokens; correct if the key appears in the answer.", "",
              "Full cache first:", "",
              "| length (target) | prompt tokens | accuracy | by depth | first answers |", "| --- | --- | --- | --- | --- |"]
        for r in pk["full"]:
            ans = "; ".join(a.replace("|", "\\|").replace("\n", " ") for a in r["answers"])
            depth = ", ".join(f"{float(d):g}: {v:.2f}" for d, v in r.get("by_depth", {}).items())
            L.append(f"| {r['length']} | {r['prompt_tokens']:.0f} | {r['accuracy']:.2f} | {depth} | {ans} |")
        L += ["", f"Policies at the longest length where the full cache reaches {meta['threshold']:.0%}: "
              f"{pk['lengths_evaluated'] or 'none'}.", ""]
        for length in pk["lengths_evaluated"]:
            budgets = sorted({r["budget"] for r in pk["policies"] if r["length"] == length})
            L += [f"~{length} tokens:", "", "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |",
                  "| --- |" + " --- |" * len(budgets)]
            for p in PREFILL_POLICIES:
                cells = [next((f"{r['accuracy']:.2f}" for r in pk["policies"]
                               if r["policy"] == p and r["length"] == length and r["budget"] == b), "–") for b in budgets]
                L.append(f"| {p} | " + " | ".join(cells) + " |")
            L.append("")
    for png in pngs:
        L.append(f"![{png}]({png})")
    L.append("")
    return "\n".join(L)


def combine(dirs: list[pathlib.Path], out: pathlib.Path) -> None:
    """Parts run as separate processes (to use more than one core of a busy machine) -> one report."""
    res, meta = {}, None
    for d in dirs:
        run = json.loads((d / "real_model.json").read_text())
        for part, value in run["results"].items():
            if part in res and isinstance(value, list):
                # The same part split by policy: one full-cache row is enough (the runs are deterministic).
                res[part] += [r for r in value if r["policy"] != "full"]
            else:
                res[part] = value
        if meta is None:
            meta = dict(run["meta"])
        else:
            for k, v in run["meta"].items():
                if k in ("argv", "seconds", "load", "date"):
                    meta[k] = f"{meta[k]}; {v}" if k != "seconds" else max(meta[k], v)
                elif k not in meta or k in ("depths", "n", "threshold"):
                    meta[k] = v
    out.mkdir(parents=True, exist_ok=True)
    pngs = plots(res, out)
    (out / "real_model.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    (out / "real_model.md").write_text(render(meta, res, pngs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=os.environ.get("KVSERVE_BIN", str(REPO / "build" / "kvserve")))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--parts", default="prefill,decode,passkey")
    ap.add_argument("--docs", nargs="+", default=DOCS, help="files under /usr/share/common-licenses")
    ap.add_argument("--prefill-policies", nargs="+", default=PREFILL_POLICIES, choices=PREFILL_POLICIES)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    ap.add_argument("--decode-length", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=16, help="decode_evict_chunk")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    ap.add_argument("--n", type=int, default=3, help="pass key samples per depth")
    ap.add_argument("--budgets", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--threshold", type=float, default=0.6, help="full-cache accuracy a length needs")
    ap.add_argument("--policy-lengths", type=int, default=1,
                    help="evaluate the policies at this many of the longest lengths that pass --threshold")
    ap.add_argument("--seed", type=int, default=9_000_000)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "eval")
    ap.add_argument("--combine", type=pathlib.Path, nargs="+",
                    help="instead: merge the real_model.json of runs of separate parts into --out")
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out)
        return
    import transformers
    subprocess.run([sys.executable, str(REPO / "tools" / "make_smollm2.py"), "--out", args.model], check=True)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    t0 = time.time()
    need = args.prefix + args.continuation
    docs = []
    for name in args.docs:
        ids = tok((LICENSES / name).read_text())["input_ids"]
        if len(ids) < need:
            raise SystemExit(f"{LICENSES / name}: {len(ids)} tokens, --prefix + --continuation need {need}")
        docs.append(ids[:need])
    args.out.mkdir(parents=True, exist_ok=True)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        kv = Kv(args.kvserve, args.model, pathlib.Path(tmp))
        parts = args.parts.split(",")
        if "prefill" in parts:
            res["prefill"] = part_prefill(kv, docs, args.prefix, args.fractions, args.prefill_policies)
        if "decode" in parts:
            res["decode"] = part_decode(kv, [d[:args.decode_length] for d in docs], args.fractions, args.chunk)
        if "passkey" in parts:
            res["passkey"] = part_passkey(kv, tok, args.lengths, args.depths, args.n, args.budgets, args.threshold,
                                          args.policy_lengths, args.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    meta = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": time.time() - t0,
            "cores": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "argv": " ".join(sys.argv[1:]), "docs": len(docs), "doc_names": args.docs, "prefix": args.prefix,
            "continuation": args.continuation, "decode_length": args.decode_length, "chunk": args.chunk,
            "depths": args.depths, "n": args.n, "threshold": args.threshold}
    pngs = plots(res, args.out)
    (args.out / "real_model.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    text = render(meta, res, pngs)
    (args.out / "real_model.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
