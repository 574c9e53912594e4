#!/usr/bin/env python3
"""kvserve benchmarks on bench-125m (fp32, CPU), written to docs/benchmarks.md with a PNG plot.

Part "backend" (issue 2): prefill tokens/s at 512 / 2K / 8K prompt tokens and decode tokens/s at
batch 1 and batch 8, kvserve (`kvserve generate --json`) against transformers on the same
checkpoint in the same run with the same thread count, as ratios.

Part "policies" (issue 3): decode tokens/s at several context lengths (4K and 16K among them),
batch 1 and 8, KV policies full / pyramidkv-128 / knorm-50%, KV bytes per sequence, each decode
figure also as a fraction of the memory-bandwidth floor of DESIGN.md. Uses `kvserve bench decode`,
which fills each sequence's paged KV through the policy's real selector at the size it keeps for
that context (random values: decode cost depends on the kept sizes only) and times real decode
steps. One real long-prefill run per policy cross-checks it.

Part "profile" (issue 15): where a decode step's time goes, from `kvserve bench decode --profile`
(wall time per stage of DecoderModel's decode step) at 16K x 1 and 16K x 8, full and pyramidkv-128.

Part "llamacpp" (issue 15): a current llama.cpp (built from the PyPI source package by
bench/llamacpp_build.sh) on bench-125m converted to GGUF (F32 weights; f16 and f32 KV, flash
attention on), same threads, beside kvserve's bench decode of the same shapes run right next to it:
batch 1 after 16K tokens and 8 sequences after 4K tokens each (llama-batched-bench; the prompt shared
so only one prefill runs, every sequence still reads its own KV per step).

Usage (what `make bench` runs):
  python3 bench/bench_backend.py --kvserve build/kvserve --out docs/benchmarks.md
Options: --parts backend,policies  --threads 2  --quick (smaller sizes, for trying it out)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMACPP_DIR = ROOT / "build-llamacpp"
BANDWIDTH_GBS = 30.0  # DESIGN.md "Performance model": 2-thread AVX2 read bandwidth of these machines
POLICIES = {  # label -> kvserve flags
    "full": [],
    "pyramidkv-128": ["--policy", "pyramidkv", "--budget", "128"],
    "knorm-50%": ["--policy", "knorm", "--budget", "0.5"],
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kvserve = str(pathlib.Path(args.kvserve).resolve())
        self.model = str(pathlib.Path(args.model).resolve())
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        if args.omp_wait_policy != "default":
            self.env["OMP_WAIT_POLICY"] = args.omp_wait_policy
        self.rng = random.Random(1234)
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-bench-"))
        self._hf = None

    # ---- helpers ---------------------------------------------------------------------------
    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 2000) for _ in range(n)]

    def kv_generate(self, prompts: list[list[int]], max_tokens: int, policy: list[str] = (),
                    kv_cache: str = "4GiB", extra: list[str] = ()) -> dict:
        f = self.tmp / "prompts.json"
        f.write_text(json.dumps(prompts))
        cmd = [self.kvserve, "generate", "--model", self.model, "--prompts-file", str(f), "--max-tokens",
               str(max_tokens), "--ignore-eos", "--json", "--kv-cache", kv_cache, *policy, *extra]
        out = subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def kv_bench_decode(self, contexts: list[int], batches: list[int], policy: list[str], steps: int,
                        warmup: int, env: dict | None = None, extra: list[str] = ()) -> list[dict]:
        cmd = [self.kvserve, "bench", "decode", "--model", self.model, "--threads", str(self.args.threads),
               "--steps", str(steps), "--warmup", str(warmup), "--bandwidth-gbs", str(BANDWIDTH_GBS),
               "--context", *map(str, contexts), "--batch", *map(str, batches), *policy, *extra]
        rows = []
        with subprocess.Popen(cmd, env=env or self.env, stdout=subprocess.PIPE, text=True) as p:
            for line in p.stdout:
                if line.strip():
                    rows.append(json.loads(line))
                    r = rows[-1]
                    log(f"  bench decode {r['policy']} ctx={r['context']} B={r['batch']}: "
                        f"{r['decode_tokens_per_s']:.1f} tok/s ({r['step_s_median'] * 1e3:.1f} ms/step, "
                        f"{100 * r['fraction_of_floor']:.0f}% of floor) load {load_avg()}")
        if p.returncode != 0:
            raise SystemExit(f"kvserve bench decode failed ({p.returncode}): {' '.join(cmd)}")
        return rows

    @property
    def hf(self):
        if self._hf is None:
            import torch
            import transformers
            torch.set_num_threads(self.args.threads)
            m = transformers.AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
            self._hf = m.eval()
        return self._hf

    def hf_prefill(self, ids: list[int]) -> float:
        import torch
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.hf(input_ids=x, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    def hf_decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy decode with DynamicCache; returns (decode seconds for new_tokens - 1 steps, tokens)."""
        import torch
        from transformers import DynamicCache
        x = torch.tensor(prompts)
        cache = DynamicCache()
        with torch.inference_mode():
            out = self.hf(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            toks = [tok]
            t0 = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = self.hf(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(tok)
            dt = time.perf_counter() - t0
        return dt, torch.cat(toks, 1).tolist()

    # ---- issue 2 -----------------------------------------------------------------------------
    def part_backend(self) -> dict:
        a = self.args
        res = {"load_before": load_avg(), "prefill": [], "decode": []}
        self.hf  # load outside the timings
        self.hf_prefill(self.prompt(64))  # warm up torch's kernels
        for n in a.prefill_sizes:
            ids = self.prompt(n)
            kv_t, dnn_t, hf_t = [], [], []
            for rep in range(a.repeats):
                r = self.kv_generate([ids], 1)["results"][0]
                kv_t.append(r["timings"]["time_to_first_token_s"])
                r = self.kv_generate([ids], 1, extra=["--cpu-gemm", "onednn"])["results"][0]
                dnn_t.append(r["timings"]["time_to_first_token_s"])
                if n <= a.hf_prefill_max:
                    hf_t.append(self.hf_prefill(ids))
            row = {"tokens": n, "kvserve_s": min(kv_t), "onednn_s": min(dnn_t), "hf_s": min(hf_t) if hf_t else None,
                   "kvserve_all": kv_t, "onednn_all": dnn_t, "hf_all": hf_t, "load": load_avg()}
            log(f"prefill {n}: kvserve {n / row['kvserve_s']:.0f} tok/s (onednn {n / row['onednn_s']:.0f})"
                + (f", transformers {n / row['hf_s']:.0f} tok/s" if hf_t else ", transformers skipped")
                + f"  load {row['load']}")
            res["prefill"].append(row)
        for batch in (1, 8):
            prompts = [self.prompt(a.decode_prompt) for _ in range(batch)]
            steps = a.decode_tokens - 1
            kv_tps, hf_tps, agree = [], [], None
            for rep in range(a.repeats):
                j = self.kv_generate(prompts, a.decode_tokens)
                assert j["max_running"] == batch, f"expected {batch} sequences decoding together, got {j['max_running']}"
                rs = j["results"]
                # All were admitted in one engine step; the last admitted one's decode window is
                # steady-state decode of the whole batch: `steps` steps of `batch` tokens.
                last = max(rs, key=lambda r: r["timings"]["time_to_first_token_s"])
                kv_tps.append(batch * steps / last["timings"]["decode_s"])
                dt, hf_tokens = self.hf_decode(prompts, a.decode_tokens)
                hf_tps.append(batch * steps / dt)
                agree = sum(1 for r, h in zip(rs, hf_tokens) if r["token_ids"][:8] == h[:8])
            row = {"batch": batch, "prompt": a.decode_prompt, "new_tokens": a.decode_tokens,
                   "kvserve_tps": max(kv_tps), "hf_tps": max(hf_tps), "kvserve_all": kv_tps, "hf_all": hf_tps,
                   "first8_agree": agree, "load": load_avg()}
            log(f"decode B={batch}: kvserve {row['kvserve_tps']:.1f} tok/s, transformers {row['hf_tps']:.1f} tok/s"
                f"  load {row['load']}")
            res["decode"].append(row)
        res["load_after"] = load_avg()
        return res

    # ---- issue 3 -----------------------------------------------------------------------------
    def part_policies(self) -> dict:
        a = self.args
        res = {"load_before": load_avg(), "rows": [], "crosscheck": []}
        for label, flags in POLICIES.items():
            for r in self.kv_bench_decode(a.contexts, [1, 8], flags, a.steps, a.warmup):
                r["label"] = label
                r["load"] = load_avg()
                res["rows"].append(r)
        # Cross-check: one real prefill + decode per policy through `kvserve generate` at batch 1.
        n = a.crosscheck_context
        ids = self.prompt(n)
        for label, flags in POLICIES.items():
            j = self.kv_generate([ids], a.crosscheck_tokens, flags)
            r = j["results"][0]
            b = self.kv_bench_decode([n], [1], flags, a.crosscheck_tokens - 1, 0)[0]
            res["crosscheck"].append({"label": label, "context": n, "generate_tps": r["timings"]["decode_tokens_per_s"],
                                      "generate_kept": r["kv_tokens_kept"], "bench_tps": b["decode_tokens_per_s"],
                                      "bench_mean_tps": 1 / b["step_s_mean"], "bench_kept": b["kv_tokens_kept"],
                                      "load": load_avg()})
            log(f"crosscheck {label} ctx={n}: generate {r['timings']['decode_tokens_per_s']:.1f} tok/s "
                f"(kept {r['kv_tokens_kept']}), bench {b['decode_tokens_per_s']:.1f} tok/s (kept {b['kv_tokens_kept']})")
        res["load_after"] = load_avg()
        return res


    # ---- issue 15: where the step's time goes ----------------------------------------------------
    def part_profile(self) -> dict:
        res = {"load_before": load_avg(), "rows": []}
        for label in ("full", "pyramidkv-128"):
            for r in self.kv_bench_decode([16384], [1, 8], POLICIES[label], self.args.steps, self.args.warmup,
                                          extra=["--profile"]):
                r["label"], r["load"] = label, load_avg()
                res["rows"].append(r)
                log(f"profile {label} B={r['batch']}: {r['step_s_mean'] * 1e3:.1f} ms/step mean, "
                    f"{r['profile_ms_per_step']}")
        res["load_after"] = load_avg()
        return res

    # ---- issue 15: llama.cpp side by side ---------------------------------------------------------
    def llamacpp_gguf(self) -> pathlib.Path:
        """Builds llama.cpp once and converts bench-125m to an F32 GGUF with llama.cpp's own converter."""
        subprocess.run(["bash", str(ROOT / "bench" / "llamacpp_build.sh"), str(LLAMACPP_DIR)], check=True)
        gguf = LLAMACPP_DIR / "bench-125m-f32.gguf"
        if not gguf.exists():
            src = LLAMACPP_DIR / "src" / "vendor" / "llama.cpp"
            # The converter fingerprints a BPE tokenizer's pre-tokenizer against the models it knows;
            # bench-125m carries the byte-level fixture tokenizer, which is none of them, and the
            # benchmarks feed token ids, so its pre-tokenizer is declared "default".
            code = ("import sys, runpy; sys.path.insert(0, '.'); import conversion.base as b; "
                    "b.TextModel.get_vocab_base_pre = lambda self, tok: 'default'; "
                    f"sys.argv = ['convert_hf_to_gguf.py', {self.model!r}, '--outtype', 'f32', '--outfile', "
                    f"{str(gguf) + '.tmp'!r}]; runpy.run_path('convert_hf_to_gguf.py', run_name='__main__')")
            subprocess.run([sys.executable, "-c", code], cwd=src, check=True, capture_output=True)
            pathlib.Path(str(gguf) + ".tmp").rename(gguf)
        return gguf

    def part_llamacpp(self) -> dict:
        a = self.args
        gguf = self.llamacpp_gguf()
        bindir = LLAMACPP_DIR / "build" / "bin"
        env = dict(self.env, LD_LIBRARY_PATH=str(bindir))
        res = {"load_before": load_avg(), "single": [], "batched": [], "kvserve": []}
        info = LLAMACPP_DIR / "build" / "common" / "build-info.cpp"
        m = re.search(r'LLAMA_COMMIT = "([^"]+)"', info.read_text()) if info.exists() else None
        res["build"] = m.group(1) if m else "?"
        ctx1, ctxb, batch, tg = a.llamacpp_context, a.llamacpp_batch_context, 8, 32

        def kv(context, batch_, label):
            r = self.kv_bench_decode([context], [batch_], POLICIES[label], a.steps, a.warmup)[0]
            res["kvserve"].append({"label": label, "context": context, "batch": batch_,
                                   "tps": r["decode_tokens_per_s"], "ms": r["step_s_median"] * 1e3, "load": load_avg()})

        def batched_bench(context, batch_, kvt):
            # llama-batched-bench rather than llama-bench for batch 1 too: llama-bench takes no f32 KV.
            cmd = [str(bindir / "llama-batched-bench"), "-m", str(gguf), "-c", str(batch_ * (context + tg + 16)),
                   "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", str(tg), "-npl", str(batch_), "-pps",
                   "-t", str(a.threads), "-fa", "on", "-ctk", kvt, "-ctv", kvt, "--output-format", "jsonl"]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"llama-batched-bench failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
            j = next(json.loads(l) for l in p.stdout.splitlines() if l.startswith("{") and "speed_tg" in l)
            row = {"kv": kvt, "context": context, "batch": batch_, "tps": j["speed_tg"], "load": load_avg()}
            log(f"llama.cpp {kvt} KV, {batch_} x {context}: {j['speed_tg']:.1f} tok/s  load {row['load']}")
            return row

        for kvt in ("f16", "f32"):
            kv(ctx1, 1, "full")
            kv(ctx1, 1, "pyramidkv-128")
            res["single"].append(batched_bench(ctx1, 1, kvt))
        for kvt in ("f16", "f32"):
            kv(ctxb, batch, "full")
            res["batched"].append(batched_bench(ctxb, batch, kvt))
        res["load_after"] = load_avg()
        return res

    # ---- why the OpenMP wait policy matters on a shared 2-core machine ------------------------------
    def part_contention(self) -> dict:
        res = {"load_before": load_avg(), "rows": []}
        for policy in ("active", "passive"):
            env = dict(self.env, OMP_WAIT_POLICY=policy)
            for r in self.kv_bench_decode([1024], [1, 8], [], 12, 2, env=env):
                res["rows"].append({"who": "kvserve bench decode (context 1024)", "policy": policy, "batch": r["batch"],
                                    "min_ms": r["step_s_min"] * 1e3, "median_ms": r["step_s_median"] * 1e3,
                                    "load": load_avg()})
            out = subprocess.run([sys.executable, __file__, "--hf-step-probe", "--model", self.model, "--threads",
                                  str(self.args.threads)], env=env, check=True, capture_output=True, text=True).stdout
            for r in json.loads(out.strip().splitlines()[-1]):
                res["rows"].append({"who": "transformers (context 128)", "policy": policy, **r, "load": load_avg()})
            log(f"contention {policy}: {res['rows'][-4:]}")
        res["load_after"] = load_avg()
        return res


def hf_step_probe(model: str, threads: int) -> None:
    """Child process: transformers decode step times at batch 1 and 8 under this process's OMP_WAIT_POLICY."""
    import torch
    import transformers
    from transformers import DynamicCache
    torch.set_num_threads(threads)
    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rows = []
    for batch in (1, 8):
        x = torch.randint(3, 2000, (batch, 128), generator=torch.Generator().manual_seed(0))
        cache = DynamicCache()
        ts = []
        with torch.inference_mode():
            tok = m(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(14):
                t0 = time.perf_counter()
                tok = m(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
                ts.append(time.perf_counter() - t0)
        ts = sorted(ts[2:])
        rows.append({"batch": batch, "min_ms": ts[0] * 1e3, "median_ms": ts[len(ts) // 2] * 1e3})
    print(json.dumps(rows))


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, batch in zip(axes, (1, 8)):
        for label in POLICIES:
            pts = sorted((r["context"], r["decode_tokens_per_s"]) for r in rows if r["label"] == label and r["batch"] == batch)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_title(f"bench-125m fp32 CPU, batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt_bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def render(args, meta: dict, backend: dict | None, policies: dict | None, png: pathlib.Path | None,
           contention: dict | None = None, profile: dict | None = None, llamacpp: dict | None = None) -> str:
    L = []
    L.append("# kvserve benchmarks\n")
    L.append("Written by `bench/bench_backend.py` (`make bench`); the checkpoint comes from "
             "`tools/make_bench_model.py`. Every figure below is from one run:\n")
    for k in ("date", "commit", "machine", "threads", "versions", "model"):
        L.append(f"- **{k}**: {meta[k]}")
    L.append("")
    L.append("These machines have 2 cores shared with other jobs, so timings are noisy; the load average "
             "(1, 5, 15 min) is given next to every table and row. Each figure is the best of "
             f"{args.repeats} runs (prefill, end-to-end decode) or the median step of a run (`bench decode`), "
             "with kvserve and transformers interleaved so that both see the same load. Both run with "
             f"`OMP_WAIT_POLICY={args.omp_wait_policy}`: with OpenMP's default spin-waiting, a 2-thread run on a "
             "2-core machine that other jobs also use measures mostly the neighbours (see the last section).\n")
    if backend:
        L.append("## Issue 2: prefill and decode against transformers\n")
        L.append(f"fp32 on CPU, {args.threads} threads for both (kvserve: `OMP_NUM_THREADS`; transformers: "
                 "`torch.set_num_threads`), same checkpoint, same process run. kvserve is timed through "
                 "`kvserve generate --json` (prefill = time to first token with `--max-tokens 1`, which also "
                 "includes sampling and the engine's hand-off); transformers through `model(...)` with "
                 "`logits_to_keep=1` (prefill) and a greedy loop over a `DynamicCache` (decode). "
                 f"Load {backend['load_before']} before, {backend['load_after']} after.\n")
        L.append("### Prefill\n")
        L.append("kvserve runs twice per prompt: with the default `cpu_gemm: mkl` (transformers' sgemm, logits "
                 "bitwise equal) and with the opt-in `--cpu-gemm onednn` (configs/README.md).\n")
        L.append("| prompt tokens | kvserve tokens/s (mkl) | kvserve tokens/s (onednn) | transformers tokens/s | "
                 "ratio mkl / transformers | ratio onednn / transformers | load |")
        L.append("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in backend["prefill"]:
            kv = r["tokens"] / r["kvserve_s"]
            dnn = r["tokens"] / r["onednn_s"] if r.get("onednn_s") else None
            dnn_s = f"{dnn:.0f}" if dnn else "—"
            if r["hf_s"]:
                hf = r["tokens"] / r["hf_s"]
                dnn_r = f"**{dnn / hf:.2f}×**" if dnn else "—"
                L.append(f"| {r['tokens']} | {kv:.0f} | {dnn_s} | {hf:.0f} | **{kv / hf:.2f}×** | {dnn_r} | {r['load']} |")
            else:
                L.append(f"| {r['tokens']} | {kv:.0f} | {dnn_s} | not run (too slow here) | — | — | {r['load']} |")
        L.append("")
        L.append("### Decode\n")
        L.append("Prompts of random token ids; greedy with `--ignore-eos`. Batch 8 = 8 prompts in one "
                 "`--prompts-file`, admitted in one engine step and decoded together (`max_running` = 8 checked); "
                 "its figure is the whole batch's tokens/s over the steady-state decode window "
                 "(8 × (new tokens − 1) / `decode_s` of the last-admitted sequence).\n")
        L.append("| batch | prompt | new tokens | kvserve tokens/s | transformers tokens/s | ratio | first 8 tokens equal | load |")
        L.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in backend["decode"]:
            L.append(f"| {r['batch']} | {r['prompt']} | {r['new_tokens']} | {r['kvserve_tps']:.1f} | {r['hf_tps']:.1f} | "
                     f"**{r['kvserve_tps'] / r['hf_tps']:.2f}×** | {r['first8_agree']}/{r['batch']} | {r['load']} |")
        L.append("")
        dec = [r["kvserve_tps"] / r["hf_tps"] for r in backend["decode"]]
        pre = [r["hf_s"] / r["kvserve_s"] for r in backend["prefill"] if r["hf_s"]]
        pre_dnn = [r["hf_s"] / r["onednn_s"] for r in backend["prefill"] if r["hf_s"] and r.get("onednn_s")]
        if pre:
            L.append(f"Goals (issues 2, 15): decode ≥ 1.5× transformers — {'met' if min(dec) >= 1.5 else 'NOT met'} "
                     f"(lowest ratio {min(dec):.2f}×); prefill ≥ 1× — with mkl "
                     f"{'met' if min(pre) >= 1.0 else 'NOT met'} (lowest ratio {min(pre):.2f}×)"
                     + (f", with onednn {'met' if min(pre_dnn) >= 1.0 else 'NOT met'} (lowest ratio {min(pre_dnn):.2f}×)"
                        if pre_dnn else "") + ".\n")
    if policies:
        rows = policies["rows"]
        L.append("## Issue 3: decode with KV compression\n")
        L.append("`kvserve bench decode` (cli/cmd_bench.cpp): for each sequence it fills the engine's paged KV "
                 "memory (`PagedKvMemory`) layer by layer with random q/k/v of *context* tokens, so the policy's "
                 "real selector decides per layer and KV head what is kept and exactly that many entries are "
                 "written into the paged pool; then it times real decode steps of the whole batch through "
                 "`DecoderModel::decode` at positions context + t (greedy argmax fed back). **The KV contents are "
                 "random: decode cost depends only on how many KV entries each (sequence, layer, head) keeps, not "
                 "on their values**, so the step times equal those after a real prefill of that length (see the "
                 "cross-check below); a real prefill of 8 × 16K tokens would take far too long on this machine. "
                 f"{args.steps} timed steps after {args.warmup} warm-up steps; tokens/s = batch / median step time. "
                 f"Threads: {args.threads}. Load {policies['load_before']} before, {policies['load_after']} after.\n")
        L.append(f"Floor = (weight bytes + live KV bytes) / {BANDWIDTH_GBS:.0f} GB/s (DESIGN.md \"Performance "
                 f"model\"); weight bytes = all {fmt_bytes(rows[0]['weight_bytes'])} of fp32 parameters as DESIGN.md "
                 "counts them (a decode step reads only a few rows of the input embedding, so the true floor is "
                 "~20% lower); live KV = the batch's kept KV during the timed steps. \"% of floor\" = floor / "
                 "measured step time (100% = at the bandwidth limit). KV bytes per sequence = `kv_tokens_kept` "
                 f"(summed over layers) × {rows[0]['kv_bytes_per_token_layer']} bytes per token-layer (K and V, "
                 "4 KV heads × 64 × fp32), at the end of the prefill.\n")
        L.append("| context | batch | policy | decode tokens/s | ms / step (median) | best step ms | floor ms | % of floor | KV tokens kept / seq | KV bytes / seq | % of full | load |")
        L.append("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in sorted(rows, key=lambda r: (r["context"], r["batch"], list(POLICIES).index(r["label"]))):
            L.append(f"| {r['context']} | {r['batch']} | {r['label']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['step_s_median'] * 1e3:.1f} | {r['step_s_min'] * 1e3:.1f} | {r['floor_step_s'] * 1e3:.1f} | {100 * r['fraction_of_floor']:.0f}% | "
                     f"{r['kv_tokens_kept']} | {fmt_bytes(r['kv_bytes_per_seq'])} | "
                     f"{100 * r['kv_bytes_per_seq'] / r['kv_bytes_per_seq_full']:.2f}% | {r['load']} |")
        L.append("")
        if png:
            L.append(f"![decode tokens/s vs context length]({png.name})\n")
        top = max(a for a in args.contexts)

        def get(label, batch, ctx=top):
            return next((r for r in rows if r["label"] == label and r["batch"] == batch and r["context"] == ctx), None)
        full8, pyr8 = get("full", 8), get("pyramidkv-128", 8)
        if full8 and pyr8:
            speed = pyr8["decode_tokens_per_s"] / full8["decode_tokens_per_s"]
            share = pyr8["kv_bytes_per_seq"] / pyr8["kv_bytes_per_seq_full"]
            kn = get("knorm-50%", 8)
            L.append(f"Goals (issue 3), at {top} context:\n")
            L.append(f"- decode tokens/s at batch 8, pyramidkv-128 vs full: **{speed:.1f}×** "
                     f"({pyr8['decode_tokens_per_s']:.1f} vs {full8['decode_tokens_per_s']:.1f}) — goal ≥ 5×: "
                     f"**{'met' if speed >= 5 else 'NOT met'}** (best steps: "
                     f"{full8['step_s_min'] / pyr8['step_s_min']:.1f}×). The bandwidth floors alone allow "
                     f"{full8['floor_step_s'] / pyr8['floor_step_s']:.1f}×.")
            L.append(f"- KV bytes per sequence, pyramidkv-128: {fmt_bytes(pyr8['kv_bytes_per_seq'])} of "
                     f"{fmt_bytes(pyr8['kv_bytes_per_seq_full'])} = **{100 * share:.2f}%** of full — goal ≤ 1.5%: "
                     f"**{'met' if share <= 0.015 else 'NOT met'}**." +
                     (f" (knorm-50% keeps {100 * kn['kv_bytes_per_seq'] / kn['kv_bytes_per_seq_full']:.1f}%: layers 0 and 1 "
                      "are not compressed, the paper's default.)" if kn else ""))
            L.append("")
        cc = policies["crosscheck"]
        if cc:
            L.append("### Cross-check against a real prefill\n")
            L.append(f"Batch 1, {cc[0]['context']}-token prompt of random ids: `kvserve generate --json` (real prefill "
                     "through the engine, decode tokens/s from its timings: mean over the run) vs `kvserve bench decode` "
                     "(random fill) at the same context, same number of steps. The kept counts differ only where the "
                     "selection depends on the values (the per-layer budgets are the same).\n")
            L.append("| policy | generate tokens/s | bench decode tokens/s (median / mean) | kept (generate) | kept (bench) | load |")
            L.append("| --- | ---: | ---: | ---: | ---: | --- |")
            for c in cc:
                L.append(f"| {c['label']} | {c['generate_tps']:.1f} | {c['bench_tps']:.1f} / {c['bench_mean_tps']:.1f} | "
                         f"{c['generate_kept']} | {c['bench_kept']} | {c['load']} |")
            L.append("")
    if profile:
        L.append("## Where a decode step's time goes\n")
        L.append("`kvserve bench decode --profile` times each stage of `DecoderModel::decode` with a wall clock (on "
                 "CPU every libtorch op and kernel has finished when it returns, so a stage's wall time is its "
                 "cost); \"other\" is the rest of the mean step (the argmax over the logits, host work). Mean ms "
                 f"per step over {args.steps} steps; context 16384. Load {profile['load_before']} before, "
                 f"{profile['load_after']} after.\n")
        stages = list(profile["rows"][0]["profile_ms_per_step"])
        L.append("| policy | batch | step ms (mean) | " + " | ".join(stages) + " | load |")
        L.append("| --- | ---: | ---: | " + " | ".join("---:" for _ in stages) + " | --- |")
        for r in profile["rows"]:
            mean = r["step_s_mean"] * 1e3
            cells = [f"{r['profile_ms_per_step'][k]:.2f} ({100 * r['profile_ms_per_step'][k] / mean:.0f}%)" for k in stages]
            L.append(f"| {r['label']} | {r['batch']} | {mean:.1f} | " + " | ".join(cells) + f" | {r['load']} |")
        L.append("")
    if llamacpp:
        lc = llamacpp
        L.append("## Side by side with llama.cpp\n")
        L.append(f"llama.cpp build `{lc.get('build', '?')}` (the copy vendored by PyPI's llama-cpp-python 0.3.36, compiled "
                 "here with `GGML_NATIVE=ON` by `bench/llamacpp_build.sh`) on bench-125m converted to GGUF by its own "
                 f"`convert_hf_to_gguf.py` with F32 weights; {args.threads} threads, flash attention on, KV cache f16 or "
                 "f32. `llama-batched-bench -npp <context> -ntg 32 -npl <batch> -pps` (llama-bench takes no f32 KV): "
                 "tokens/s of 32 generated tokens per sequence after a prompt of that many tokens, all sequences "
                 "counted; with `-pps` the prompt is processed once and shared, but each sequence holds and reads "
                 "its own copy of the context's KV. kvserve: "
                 "`bench decode` of the same shape (fp32 KV), run just before each llama.cpp run. "
                 f"Load {lc['load_before']} before, {lc['load_after']} after.\n")
        L.append("| shape | engine | KV cache | tokens/s | load |")
        L.append("| --- | --- | --- | ---: | --- |")
        for r in lc["kvserve"]:
            L.append(f"| {r['batch']} × {r['context']} | kvserve {r['label']} | fp32 | {r['tps']:.1f} | {r['load']} |")
        for r in lc["single"]:
            L.append(f"| 1 × {r['context']} | llama.cpp full | {r['kv']} | {r['tps']:.1f} | {r['load']} |")
        for r in lc["batched"]:
            L.append(f"| {r['batch']} × {r['context']} | llama.cpp full | {r['kv']} | {r['tps']:.1f} | {r['load']} |")
        L.append("")

        def best(label, batch, ctx):
            return max((r["tps"] for r in lc["kvserve"] if r["label"] == label and r["batch"] == batch
                        and r["context"] == ctx), default=None)
        lc1 = max(r["tps"] for r in lc["single"])
        lcb = max(r["tps"] for r in lc["batched"])
        ctx1, ctxb = lc["single"][0]["context"], lc["batched"][0]["context"]
        pyr, full1, full8 = best("pyramidkv-128", 1, ctx1), best("full", 1, ctx1), best("full", 8, ctxb)
        L.append("Against llama.cpp's best KV type in the same run (issue 15's goals):\n")
        L.append(f"- pyramidkv-128 at {ctx1} × 1 vs llama.cpp's full cache: **{pyr / lc1:.1f}×** ({pyr:.1f} vs "
                 f"{lc1:.1f} tokens/s) — goal ≥ 3×: **{'met' if pyr / lc1 >= 3 else 'NOT met'}**. Full vs full: "
                 f"{full1 / lc1:.2f}×.")
        L.append(f"- 8 sequences at {ctxb}, full cache: **{full8 / lcb:.1f}×** ({full8:.1f} vs {lcb:.1f} tokens/s) — "
                 f"goal ≥ 5×: **{'met' if full8 / lcb >= 5 else 'NOT met'}**.\n")
    if contention:
        L.append("## OpenMP spin-waiting on a shared 2-core machine\n")
        L.append(f"Decode step times with {args.threads} threads under `OMP_WAIT_POLICY=active` (what libgomp does by "
                 "default: idle workers spin) and `passive` (they sleep), same binary, same checkpoint, measured in "
                 "this run. When other jobs hold the cores, a spinning worker burns the time slice its partner "
                 "needs and every parallel region waits for a descheduled thread; `perf` on a slow run showed "
                 "~60% of samples inside libgomp. All other tables use "
                 f"`{args.omp_wait_policy}` for both engines. Load {contention['load_before']} before, "
                 f"{contention['load_after']} after.\n")
        L.append("| engine | OMP_WAIT_POLICY | batch | median step ms | best step ms | load |")
        L.append("| --- | --- | ---: | ---: | ---: | --- |")
        for r in contention["rows"]:
            L.append(f"| {r['who']} | {r['policy']} | {r['batch']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['load']} |")
        L.append("")
    L.append("## Reproduce\n")
    L.append("```\nmake bench            # = python3 bench/bench_backend.py --kvserve build/kvserve --out docs/benchmarks.md\n"
             "python3 tools/make_bench_model.py   # the checkpoint alone (.fixtures/bench-125m, git-ignored)\n"
             "build/kvserve bench decode --model .fixtures/bench-125m --context 4096 16384 --batch 1 8 "
             "--threads 2 --policy pyramidkv --budget 128\n```\n")
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--model", default=str(ROOT / ".fixtures" / "bench-125m"))
    ap.add_argument("--parts", default="backend,policies,profile,llamacpp,contention")
    ap.add_argument("--llamacpp-context", type=int, default=16384, help="llama.cpp side by side: batch-1 context")
    ap.add_argument("--llamacpp-batch-context", type=int, default=4096, help="llama.cpp side by side: batch-8 context")
    ap.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active", "default"],
                    help="OMP_WAIT_POLICY for kvserve and transformers (see the contention section of the output)")
    ap.add_argument("--hf-step-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefill-sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--hf-prefill-max", type=int, default=8192, help="skip transformers prefill above this")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=65)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--crosscheck-context", type=int, default=4096)
    ap.add_argument("--crosscheck-tokens", type=int, default=17)
    ap.add_argument("--json-out", help="also write the raw results here")
    ap.add_argument("--quick", action="store_true", help="small sizes, to try the script out")
    args = ap.parse_args()
    if args.hf_step_probe:
        hf_step_probe(args.model, args.threads)
        return
    if args.omp_wait_policy != "default":  # before torch starts its OpenMP pool in this process
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    if args.quick:
        args.prefill_sizes, args.contexts, args.steps, args.decode_tokens = [256], [512, 1024], 4, 9
        args.repeats, args.crosscheck_context, args.crosscheck_tokens = 1, 512, 5
        args.llamacpp_context, args.llamacpp_batch_context = 512, 256
    if not (pathlib.Path(args.model) / "STAMP").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_bench_model.py"), "--out", args.model], check=True)
    parts = set(args.parts.split(","))
    import torch
    import transformers
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": f"`{commit}`" + (" (with uncommitted changes in the working tree)" if dirty else ""),
        "machine": f"{cpu}, {os.cpu_count()} cores, load average at start {load_avg()}",
        "threads": f"{args.threads} (kvserve and transformers), OMP_WAIT_POLICY={args.omp_wait_policy} for both",
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "model": "bench-125m: Llama, 12 layers, hidden 768, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, "
                 "rope_theta 500000, random weights, fp32 (124.7M parameters, 499 MB)",
    }
    t0 = time.time()
    b = Bench(args)
    backend = b.part_backend() if "backend" in parts else None
    log(f"backend part: {time.time() - t0:.0f} s")
    policies = b.part_policies() if "policies" in parts else None
    profile = b.part_profile() if "profile" in parts else None
    llamacpp = b.part_llamacpp() if "llamacpp" in parts else None
    contention = b.part_contention() if "contention" in parts else None
    log(f"total: {time.time() - t0:.0f} s")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = None
    if policies:
        png = out.parent / "decode_vs_context.png"
        plot(policies["rows"], png)
    out.write_text(render(args, meta, backend, policies, png, contention, profile, llamacpp))
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps({"meta": meta, "backend": backend, "policies": policies,
                                                           "profile": profile, "llamacpp": llamacpp,
                                                           "contention": contention}, indent=1))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
