#!/usr/bin/env python3
"""Which KV heads keep the needle: per-(layer, KV head) evidence for head-wise budgets.

For RULER-style needle prompts (tools/ruler_tasks.py, the same samples as tools/eval_quality.py for
the same --seed), runs `kvserve forward --dump-kept` under each policy and reports, per layer:
- how many KV heads keep every token of the asked-for fact (the needle), on average;
- the tokens each head keeps (min / mean / max);
- for the heads that keep the needle under the first policy (the "retrieval heads" of that prompt),
  how many tokens the other policies give them and whether they still keep it.
The question is why a head-adaptive allocation (AdaKV) answers fewer prompts than uniform heads at
the same layer budget: do the heads that carry the needle get fewer tokens, or do the joint top-k
scores pick other tokens inside those heads?

  python3 tools/head_starvation.py --kvserve build/kvserve --budget 128 --n 20
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import ruler_tasks as rt  # noqa: E402


def dump_kept(a, ids: list, spec: str, tmp: pathlib.Path) -> dict:
    name, _, params = spec.partition(":")
    ids_f, out_f, kept_f = tmp / "ids.json", tmp / "logits.safetensors", tmp / "kept.json"
    ids_f.write_text(json.dumps(ids))
    cmd = [a.kvserve, "forward", "--model", a.model, "--input-ids", str(ids_f), "--output", str(out_f),
           "--dump-kept", str(kept_f), "--policy", name, "--budget", str(a.budget)]
    for kv in filter(None, params.split(";")):
        cmd += ["--policy-param", kv]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(kept_f.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default=str(REPO / "build" / "kvserve"))
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--task", default="niah_number")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--policies", default="snapkv,snapkv:head_budgets=adaptive",
                    help="comma list; 'name:key=value;...' adds parameters; the first is the reference")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the per-sample figures here")
    a = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(pathlib.Path(a.model) / "tokenizer.json"))
    maker = rt.TaskMaker(tok)
    samples = rt.tokenize(tok, [maker.make(a.task, a.length, a.seed * 100000 + i) for i in range(a.n)])
    policies = a.policies.split(",")
    ref = policies[0]
    # stats[policy][layer] = lists over (sample, head)
    per = {p: {} for p in policies}
    retrieval = {p: {} for p in policies}  # layer -> [(kept tokens, keeps needle)] of the ref's needle heads
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        for si, s in enumerate(samples):
            needle = set(rt.needle_token_positions(tok, s))
            dumps = {p: dump_kept(a, s.ids, p, tmp) for p in policies}
            row = {"sample": si, "needle_tokens": len(needle)}
            ref_layers = dumps[ref]["layers"]
            for p in policies:
                kept_heads = 0
                for li, layer in enumerate(dumps[p]["layers"]):
                    st = per[p].setdefault(li, {"keeps": [], "sizes": [], "share": []})
                    for hi, kept in enumerate(layer["kept"]):
                        ks = set(kept)
                        keeps = needle <= ks
                        st["keeps"].append(keeps)
                        st["share"].append(len(needle & ks) / max(1, len(needle)))
                        st["sizes"].append(len(kept))
                        kept_heads += keeps
                        if needle <= set(ref_layers[li]["kept"][hi]):
                            retrieval[p].setdefault(li, []).append((len(kept), keeps))
                row[p] = kept_heads
            rows.append(row)
            print(f"[head_starvation] sample {si}: heads keeping the needle " +
                  ", ".join(f"{p} {row[p]}" for p in policies), file=sys.stderr)
    layers = sorted(per[ref])
    heads = len(samples[0].ids) and len(per[ref][0]["keeps"]) // len(samples)
    print(f"# Which KV heads keep the needle: {a.task} @ {a.length}, budget {a.budget}, {len(samples)} samples, "
          f"{len(layers)} layers x {heads} KV heads\n")
    print("Per layer: the share of needle tokens a head keeps (mean over heads and samples); mean KV heads (of "
          "%d) that keep every needle token; tokens per head min / mean / max; for the heads that keep the "
          "needle under `%s`: their mean tokens and the share that still keep it.\n" % (heads, ref))
    hdr = "| layer | " + " | ".join(f"{p}: needle share | {p}: heads keeping | {p}: tokens/head" for p in policies)
    hdr += " | " + " | ".join(f"{p}: on {ref}'s needle heads" for p in policies[1:]) + " |"
    print(hdr)
    print("|" + "---|" * (1 + 3 * len(policies) + len(policies) - 1))
    totals = {p: 0.0 for p in policies}
    shares = {p: 0.0 for p in policies}
    for li in layers:
        cells = []
        for p in policies:
            st = per[p][li]
            k = sum(st["keeps"]) / len(samples)
            totals[p] += k
            sz = st["sizes"]
            share = sum(st["share"]) / len(st["share"])
            shares[p] += share / len(layers)
            cells += [f"{share:.2f}", f"{k:.2f}", f"{min(sz)} / {sum(sz) / len(sz):.0f} / {max(sz)}"]
        for p in policies[1:]:
            r = retrieval[p].get(li, [])
            cells.append(f"{sum(t for t, _ in r) / len(r):.0f} tok, {100 * sum(k for _, k in r) / len(r):.0f} % keep"
                         if r else "-")
        print(f"| {li} | " + " | ".join(cells) + " |")
    print("\nHeads keeping the needle, summed over layers (mean per sample): " +
          ", ".join(f"{p} {totals[p]:.1f}" for p in policies))
    print("Share of needle tokens kept, mean over every (layer, head): " +
          ", ".join(f"{p} {shares[p]:.3f}" for p in policies))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
