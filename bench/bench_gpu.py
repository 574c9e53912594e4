#!/usr/bin/env python3
"""kvserve on one GPU (issue 13, item 6): bench checkpoints of the Llama-3.2-1B and Llama-3.1-8B
shapes, measured in one run and written to docs/benchmarks-gpu.md.

What one run does, in this order (the issue's acceptance rows first, so that a run cut short by
its time budget still has them):

1. probe: GPU name, memory, torch/transformers versions, and the HBM bandwidth measured here
   (a big device-to-device copy with torch: bytes read + written / time);
2. the checkpoints: random bf16 weights made with transformers (on the GPU when there is one),
   saved as safetensors with the byte-level fixture tokenizer beside them (kvserve generate loads
   a tokenizer; prompts are token ids, so its small vocabulary does not matter), in a cache folder
   outside the repository (default /tmp/kvserve-bench-models), reused when their STAMP matches;
3. `kvserve bench decode --device cuda` for full / pyramidkv-128 / snapkv-1024 at contexts
   1K-32K x batch 1-64; cells whose KV does not fit in GPU memory are skipped with a note (the KV
   is estimated first), a failed cell is recorded in the table, never fatal;
4. end to end on the largest shape: `kvserve generate --device cuda` for 8 prompts x 8K tokens
   (full and pyramidkv-128: decode ms/step and time to first token), `kvserve bench decode` of
   the same shape beside it, and transformers' `generate` (eager PyTorch, its default sdpa
   attention, no compile) on the same checkpoint with the same batch as the baseline.

Floor = (weight bytes read per step + live KV bytes) / measured bandwidth. Weight bytes read per
step = every parameter except the input embedding of an untied model (a step reads only `batch`
rows of it); live KV bytes = what `kvserve bench decode` reports as the batch's kept KV during
the timed steps (`live_kv_bytes`: the policy's kept tokens, per layer, plus the decoded ones).

Usage (on a GPU machine; tools/gpu_check.sh bench runs it against the build of `run`):
  python3 bench/bench_gpu.py --kvserve /tmp/kvserve-build/kvserve            # writes docs/benchmarks-gpu.md
  python3 bench/bench_gpu.py --kvserve ... --quick                           # a small subset
  python3 bench/bench_gpu.py --kvserve build/kvserve --device cpu --shapes tiny   # smoke test of the logic, no GPU
                                                                                 # (writes /tmp/benchmarks-gpu-cpu.md)
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
GiB = 1 << 30

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {  # name -> (description, LlamaConfig kwargs)
    "8b": ("Llama-3.1-8B shape", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0), tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02)),
    "1b": ("Llama-3.2-1B shape", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02)),
    # For trying the script's logic on a machine without a GPU; its figures mean nothing.
    "tiny": ("tiny Llama (smoke test)", dict(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02)),
}
POLICIES = {  # label -> kvserve flags
    "full": [],
    "pyramidkv-128": ["--policy", "pyramidkv", "--budget", "128"],
    "snapkv-1024": ["--policy", "snapkv", "--budget", "1024"],
}
DEFAULTS = {  # per device: the matrix and the end-to-end run
    "cuda": dict(contexts=[1024, 4096, 16384, 32768], batches=[1, 8, 16, 64], steps=16, warmup=4,
                 gen_prompts=8, gen_prompt_tokens=8192, gen_new_tokens=128, shapes="8b,1b", budget_s=480),
    "cpu": dict(contexts=[256, 1024], batches=[1, 4], steps=4, warmup=1,
                gen_prompts=2, gen_prompt_tokens=512, gen_new_tokens=8, shapes="tiny", budget_s=900),
}
QUICK = dict(contexts=[1024, 32768], batches=[1, 8, 64], steps=8, warmup=2, gen_prompts=8, gen_prompt_tokens=8192,
             gen_new_tokens=32, shapes="8b", budget_s=300)


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def graph_note(graphs: dict | None) -> str:
    """The CUDA graph captures a generate run made after its warm-up: each held up the steps of every
    running request (a context growing past a graph's split hint is captured again)."""
    if not graphs:
        return ""
    return (f"; {graphs.get('captures_after_warmup', 0)} graph captures after the warm-up "
            f"({graphs.get('capture_s', 0.0):.2f} s of captures in all)")


def fmt_bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def fmt_ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def weight_bytes(c: dict, elem: int) -> tuple[int, int]:
    """(all parameters as `kvserve bench decode` counts them, bytes one decode step reads)."""
    Hd, D, H, KV = c["hidden_size"], head_dim(c), c["num_attention_heads"], c["num_key_value_heads"]
    per_layer = Hd * (H + 2 * KV) * D + H * D * Hd + 3 * Hd * c["intermediate_size"] + 2 * Hd
    embed = c["vocab_size"] * Hd
    body = c["num_hidden_layers"] * per_layer + Hd
    tied = c.get("tie_word_embeddings", False)
    return (body + embed * (1 if tied else 2)) * elem, (body + embed) * elem


def kv_token_layer_bytes(c: dict, elem: int) -> int:
    return 2 * c["num_key_value_heads"] * head_dim(c) * elem


# ---------------------------------------------------------------------------------------------
# Children: each runs in its own process, so the bench process never holds GPU memory while
# kvserve runs, and a crash or hang is one failed step under a timeout.
# ---------------------------------------------------------------------------------------------
def child_probe(device: str) -> dict:
    import torch
    import transformers
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "python": sys.version.split()[0]}
    if device.startswith("cuda"):
        dev = torch.device(device)
        p = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        out.update(name=p.name, sms=p.multi_processor_count, mem_total=total, mem_free=free,
                   cuda=torch.version.cuda, driver=_nvidia_smi("driver_version"))
        n = 4 * GiB  # bytes per buffer: far beyond L2
        src = torch.empty(n // 2, dtype=torch.bfloat16, device=dev).fill_(1.0)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        reps, times = 10, []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        times.sort()
        out.update(copy_bytes=n, copy_s_median=times[reps // 2], copy_s_min=times[0],
                   bandwidth_gbs=2 * n / times[reps // 2] / 1e9)
    else:
        import platform
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                   platform.machine())
        avail = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemAvailable"))
        out.update(name=f"{cpu} ({os.cpu_count()} cores)", mem_total=avail, mem_free=avail)
        n = 256 << 20
        src = torch.ones(n // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        times.sort()
        out.update(copy_bytes=n, copy_s_median=times[2], copy_s_min=times[0], bandwidth_gbs=2 * n / times[2] / 1e9)
    return out


def _nvidia_smi(field: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def stamp_of(shape: str, seed: int) -> str:
    return json.dumps({"shape": shape, "config": SHAPES[shape][1], "seed": seed, "dtype": "bfloat16", "v": 1},
                      sort_keys=True)


def child_make_model(shape: str, out: str, device: str, seed: int) -> dict:
    """Random bf16 weights of that shape, made on `device`, saved as safetensors + the fixture tokenizer."""
    import torch
    import transformers
    out = pathlib.Path(out)
    t0 = time.time()
    if out.exists():
        shutil.rmtree(out)
    tmp = out.parent / (out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    torch.manual_seed(seed)
    kw = json.loads(json.dumps(SHAPES[shape][1]))  # a copy: transformers edits rope_scaling in place
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:  # transformers 5
        kw["rope_parameters"] = dict(kw.pop("rope_scaling"), rope_theta=kw.pop("rope_theta"))
    config = transformers.LlamaConfig(**kw)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # random (not unit) norm weights, as tools/make_bench_model.py does
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    t_init = time.time() - t0
    model = model.to("cpu")
    model.save_pretrained(tmp, safe_serialization=True)
    sys.path.insert(0, str(ROOT / "tools"))
    from make_bench_model import tokenizer_dir  # noqa: E402  (the byte-level fixture tokenizer)
    tok = tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, tmp / f)
    (tmp / "STAMP").write_text(stamp_of(shape, seed))
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "init_s": t_init, "total_s": time.time() - t0}


def child_hf(model_dir: str, device: str, dtype: str, prompts_file: str, new_tokens: int) -> dict:
    """transformers' generate (eager PyTorch, default attention) on the batch: TTFT and per-step times."""
    import torch
    import transformers
    t0 = time.time()
    dt = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, device_map=device).eval()
    load_s = time.time() - t0
    prompts = json.loads(pathlib.Path(prompts_file).read_text())
    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    class Clock(transformers.StoppingCriteria):  # called once per generated token, after it is chosen
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores, **kw):
            sync()
            self.t.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run(x, n):
        clock = Clock()
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, stopping_criteria=[clock])
        sync()
        return start, clock.t, out

    run(ids[:1, :128], 4)  # warm-up: cuBLAS handles, kernels
    start, t, out = run(ids, new_tokens)
    steps = [b - a for a, b in zip(t, t[1:])]
    s = sorted(steps)
    res = {"load_s": load_s, "batch": ids.shape[0], "prompt_tokens": ids.shape[1], "new_tokens": new_tokens,
           "generated": int(out.shape[1] - ids.shape[1]), "ttft_s": t[0] - start,
           "step_s_mean": sum(steps) / len(steps) if steps else None,
           "step_s_median": s[len(s) // 2] if s else None, "attn": getattr(model.config, "_attn_implementation", "?")}
    if device.startswith("cuda"):
        res["max_memory"] = torch.cuda.max_memory_allocated()
    return res


def run_child(kind: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} failed ({p.returncode}): {p.stderr.strip()[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, probe: dict) -> None:
        self.args = args
        self.probe = probe
        self.kvserve = str(pathlib.Path(args.kvserve).resolve())
        self.bw = args.bandwidth_gbs or probe["bandwidth_gbs"]
        self.t_start = time.time()
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-bench-gpu-"))
        self.rng = random.Random(1234)
        self.cells: list[dict] = []  # every bench decode cell: measured, failed or skipped
        self.e2e: dict | None = None
        self.models: dict[str, dict] = {}
        # On a shared CPU, OpenMP's spin-waiting measures the neighbours (docs/benchmarks.md).
        self.env = dict(os.environ) if args.device.startswith("cuda") else dict(os.environ, OMP_WAIT_POLICY="passive")

    def left(self) -> float:
        return self.args.budget_s - (time.time() - self.t_start)

    # ---- checkpoints -----------------------------------------------------------------------------
    def model(self, shape: str) -> str | None:
        d = pathlib.Path(self.args.models) / f"bench-{shape}"
        if shape in self.models:
            return self.models[shape].get("dir")
        info = {"shape": shape}
        stamp = d / "STAMP"
        if stamp.exists() and stamp.read_text() == stamp_of(shape, self.args.seed):
            info.update(dir=str(d), made="reused")
            log(f"checkpoint {d}: reused")
        else:
            log(f"checkpoint {d}: making ({SHAPES[shape][0]}, random bf16 on {self.args.device})")
            try:
                r = run_child("make-model", [shape, str(d), self.args.device, str(self.args.seed)],
                              timeout=max(60.0, min(self.args.make_timeout, self.left() + 120)))
                info.update(dir=str(d), made=f"made in {r['total_s']:.0f} s ({r['params'] / 1e6:,.1f}M parameters)")
                log(f"  {info['made']}")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                info["error"] = str(e)[-500:]
                log(f"  FAILED: {info['error']}")
        self.models[shape] = info
        return info.get("dir")

    # ---- memory estimate ---------------------------------------------------------------------------
    def kv_tokens_per_seq(self, c: dict, label: str, ctx: int) -> int:
        L, extra = c["num_hidden_layers"], self.args.steps + self.args.warmup + 2
        keep = {"full": ctx, "pyramidkv-128": min(ctx, 128), "snapkv-1024": min(ctx, 1024)}[label]
        return L * (keep + extra)

    def need_bytes(self, shape: str, label: str, ctx: int, batch: int) -> int:
        """GPU memory a bench decode cell needs: weights, the KV pool, the attention's transient
        copies of one layer's KV (the gather path reads K and V into dense tensors, ~3x a layer's
        KV), the fill's random q/k/v and 2 GiB for the CUDA context, cuBLAS and the allocator."""
        c = SHAPES[shape][1]
        elem = 2 if self.args.dtype in ("bfloat16", "float16") else 4
        kv_seq = self.kv_tokens_per_seq(c, label, ctx) * kv_token_layer_bytes(c, elem)
        kv = batch * kv_seq
        transient = 3 * kv // c["num_hidden_layers"]
        fill = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * ctx * head_dim(c) * elem * 2
        logits = batch * c["vocab_size"] * 4 * 2
        return weight_bytes(c, elem)[0] + kv + transient + fill + logits + 2 * GiB

    def fits(self, shape: str, label: str, ctx: int, batch: int) -> tuple[bool, int]:
        need = self.need_bytes(shape, label, ctx, batch)
        return need <= self.args.mem_fraction * self.probe["mem_free"], need

    # ---- kvserve bench decode ------------------------------------------------------------------------
    def bench_cmd(self, model: str, label: str, contexts: list[int], batches: list[int], steps: int, warmup: int):
        return [self.kvserve, "bench", "decode", "--model", model, "--device", self.args.device, "--dtype",
                self.args.dtype, "--steps", str(steps), "--warmup", str(warmup), "--bandwidth-gbs",
                f"{self.bw:.3f}", "--context", *map(str, contexts), "--batch", *map(str, batches),
                *POLICIES[label], *(["--threads", str(self.args.threads)] if self.args.threads else []),
                *(["--enforce-eager"] if self.args.enforce_eager else [])]

    def add_cell(self, shape: str, label: str, ctx: int, batch: int, status: str, row: dict | None = None,
                 note: str = "", group: str = "matrix") -> dict:
        old = self.cell(shape, label, ctx, batch)
        if old is not None and old["status"] == "ok":
            return old  # a cell measured once keeps that figure
        c = SHAPES[shape][1]
        elem = 2 if self.args.dtype in ("bfloat16", "float16") else 4
        w_all, w_read = weight_bytes(c, elem)
        cell = {"shape": shape, "policy": label, "context": ctx, "batch": batch, "status": status, "note": note,
                "group": group, "weight_bytes_read": w_read, "weight_bytes_all": w_all, "bandwidth_gbs": self.bw}
        if row:
            live = row["live_kv_bytes"]
            floor = (w_read + live) / (self.bw * 1e9)
            cell.update(row=row, step_ms=row["step_s_median"] * 1e3, step_min_ms=row["step_s_min"] * 1e3,
                        tokens_per_s=batch / row["step_s_median"], floor_ms=floor * 1e3,
                        weights_floor_ms=w_read / (self.bw * 1e9) * 1e3, frac=floor / row["step_s_median"],
                        live_kv_bytes=live, kv_per_layer=row["kv_tokens_kept"] / c["num_hidden_layers"])
        self.cells = [x for x in self.cells if not (x["shape"] == shape and x["policy"] == label and
                                                    x["context"] == ctx and x["batch"] == batch)]
        self.cells.append(cell)
        return cell

    def cell(self, shape, label, ctx, batch) -> dict | None:
        return next((x for x in self.cells if x["shape"] == shape and x["policy"] == label and x["context"] == ctx
                     and x["batch"] == batch), None)

    def have(self, shape, label, ctx, batch) -> bool:
        return self.cell(shape, label, ctx, batch) is not None

    def run_cells(self, shape: str, label: str, want: list[tuple[int, int]], group: str = "matrix",
                  steps: int | None = None, warmup: int | None = None) -> None:
        """Runs the cells (context, batch) of one shape and policy with as few kvserve processes as the
        memory check allows; a failed cell is recorded and the cells that need at least its memory are
        skipped, the others run again in a fresh process."""
        a = self.args
        steps, warmup = steps or a.steps, a.warmup if warmup is None else warmup
        if self.left() <= 0 and shape not in self.models:  # no time left to make its checkpoint
            for ctx, b in want:
                if not self.have(shape, label, ctx, b):
                    self.add_cell(shape, label, ctx, b, "skipped", note="time budget spent", group=group)
            return
        model = self.model(shape)
        todo = []
        for ctx, b in sorted(set(want)):
            if model is None:
                if not self.have(shape, label, ctx, b):
                    self.add_cell(shape, label, ctx, b, "failed", note="no checkpoint", group=group)
                continue
            x = self.cell(shape, label, ctx, b)
            if x is not None and x["status"] != "ok":
                continue
            if x is not None:  # measured already: kept, but it may round out a process's rectangle
                todo.append((ctx, b))
                continue
            ok, need = self.fits(shape, label, ctx, b)
            if not ok:
                self.add_cell(shape, label, ctx, b, "skipped", group=group,
                              note=f"does not fit: needs ~{need / GiB:.0f} GiB of "
                                   f"{a.mem_fraction * self.probe['mem_free'] / GiB:.0f} GiB usable")
                continue
            todo.append((ctx, b))
        tries = 0
        while todo:
            tries += 1
            if self.left() <= 0:
                for ctx, b in todo:
                    if not self.have(shape, label, ctx, b):
                        self.add_cell(shape, label, ctx, b, "skipped", note="time budget spent", group=group)
                return
            # Group contexts that run the same batches into one process (one model load); cells
            # measured before are measured again (and the first figure kept) when that saves a process.
            by_ctx: dict[int, list[int]] = {}
            for ctx, b in todo:
                by_ctx.setdefault(ctx, []).append(b)
            groups: list[tuple[list[int], list[int]]] = []
            for ctx in sorted(by_ctx):
                bs = sorted(by_ctx[ctx])
                if groups and groups[-1][1] == bs:
                    groups[-1][0].append(ctx)
                else:
                    groups.append(([ctx], bs))
            failed_at = None
            for ctxs, bs in groups:
                if all(self.have(shape, label, c, b) for c in ctxs for b in bs):
                    continue
                if self.left() <= 0:
                    break
                order = [(c, b) for c in ctxs for b in bs]
                timeout = min(a.cmd_timeout + a.cell_timeout * len(order), max(30.0, self.left() + 30))
                cmd = self.bench_cmd(model, label, ctxs, bs, steps, warmup)
                log(f"[{time.time() - self.t_start:5.0f}s] bench decode {shape} {label} context {ctxs} batch {bs}")
                got, err = self.stream(cmd, timeout, shape, label, order, group)
                if err is not None:
                    c0, b0 = order[got]
                    self.add_cell(shape, label, c0, b0, "failed", note=err, group=group)
                    failed_at = (c0, b0)
                    rest = order[got + 1:]
                    for c, b in rest:
                        if c >= c0 and b >= b0:
                            self.add_cell(shape, label, c, b, "skipped", group=group,
                                          note=f"needs at least the memory of {fmt_ctx(c0)} x {b0}, which failed")
                    break
            todo = [(c, b) for c, b in todo if not self.have(shape, label, c, b)]
            if failed_at is None:  # every group ran, or the budget stopped them
                for c, b in todo:
                    self.add_cell(shape, label, c, b, "skipped", note="time budget spent", group=group)
                return
            if tries >= 3 and todo:
                for c, b in todo:
                    self.add_cell(shape, label, c, b, "skipped", note="not run: 3 failed processes before it",
                                  group=group)
                return

    def stream(self, cmd, timeout, shape, label, order, group) -> tuple[int, str | None]:
        """Runs one bench decode process, recording each JSON line as it comes; returns (cells
        done, error of the next cell or None)."""
        got = 0
        errf = self.tmp / "stderr.txt"
        with open(errf, "w") as ef:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=ef, text=True, env=self.env)
            deadline = time.time() + timeout
            import selectors
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            buf = ""
            timed_out = False
            while True:
                if time.time() > deadline:
                    p.kill()
                    timed_out = True
                    break
                if not sel.select(timeout=1.0):
                    if p.poll() is not None:
                        break
                    continue
                chunk = os.read(p.stdout.fileno(), 65536).decode()
                if not chunk:
                    break
                buf += chunk
                while "\n" in buf:
                    line, buf = buf.split("\n", 1)
                    if not line.strip().startswith("{"):
                        continue
                    r = json.loads(line)
                    ctx, b = order[got]
                    assert (r["context"], r["batch"]) == (ctx, b), (r["context"], r["batch"], ctx, b)
                    got += 1
                    old = self.cell(shape, label, ctx, b)
                    if old is not None and old["status"] == "ok":
                        continue  # measured earlier in the run: that figure stays
                    cell = self.add_cell(shape, label, ctx, b, "ok", row=r, group=group)
                    log(f"  {shape} {label} {fmt_ctx(ctx)} x {b}: {cell['step_ms']:.2f} ms/step, floor "
                        f"{cell['floor_ms']:.2f} ms ({100 * cell['frac']:.0f}%), {cell['tokens_per_s']:.0f} tok/s")
            p.wait()
            sel.close()
        if got == len(order):
            return got, None
        tail = errf.read_text().strip().splitlines()
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit {p.returncode}"
        msg = (tail[-1] if tail else "")[:300]
        log(f"  FAILED at {order[got]}: {why}: {msg}")
        return got, f"{why}: {msg}" if msg else why

    # ---- the plan ---------------------------------------------------------------------------------------
    def acceptance_cells(self, shape: str) -> dict[str, tuple[str, int, int]]:
        a = self.args
        lo, hi = min(a.contexts), max(a.contexts)
        mid = 8 if 8 in a.batches else sorted(a.batches)[min(1, len(a.batches) - 1)]
        return {"full_lo_1": ("full", lo, 1), "full_hi_mid": ("full", hi, mid),
                "pyr_hi_1": ("pyramidkv-128", hi, 1), "pyr_hi_max": ("pyramidkv-128", hi, max(a.batches))}

    def run_all(self, checkpoint=lambda: None) -> None:
        """`checkpoint` is called after each step: the output file is rewritten then, so a run
        stopped from outside (the device's 10-minute limit) leaves what it had measured."""
        a = self.args
        shapes = a.shapes
        top = shapes[0]  # the acceptance rows and the end-to-end part use the first (largest) shape
        acc = self.acceptance_cells(top)
        log(f"== acceptance cells on {top}")
        # One process per policy: the rectangle around its acceptance cells (the extra cells are
        # matrix cells anyway).
        by_policy: dict[str, tuple[set, set]] = {}
        for label, ctx, b in acc.values():
            cs, bs = by_policy.setdefault(label, (set(), set()))
            cs.add(ctx)
            bs.add(b)
        for label, (cs, bs) in by_policy.items():
            self.run_cells(top, label, [(c, b) for c in cs for b in bs], group="acceptance")
            checkpoint()
        log(f"== end to end on {top}")
        self.e2e = self.end_to_end(top)
        checkpoint()
        for shape in shapes:
            log(f"== matrix on {shape}")
            for label in POLICIES:
                self.run_cells(shape, label, [(c, b) for c in a.contexts for b in a.batches])
                checkpoint()

    # ---- end to end: generate vs bench decode vs transformers -------------------------------------------
    def end_to_end(self, shape: str) -> dict:
        a = self.args
        res = {"shape": shape, "prompts": a.gen_prompts, "prompt_tokens": a.gen_prompt_tokens,
               "new_tokens": a.gen_new_tokens, "kvserve": {}, "bench": {}, "hf": None}
        model = self.model(shape)
        if model is None:
            res["error"] = "no checkpoint"
            return res
        c = SHAPES[shape][1]
        elem = 2 if a.dtype in ("bfloat16", "float16") else 4
        prompts = [[self.rng.randrange(3, min(2000, c["vocab_size"])) for _ in range(a.gen_prompt_tokens)]
                   for _ in range(a.gen_prompts)]
        pf = self.tmp / "prompts.json"
        pf.write_text(json.dumps(prompts))
        per_seq = (a.gen_prompt_tokens + a.gen_new_tokens + 64) * c["num_hidden_layers"] * kv_token_layer_bytes(c, elem)
        kv_cache = int(per_seq * a.gen_prompts * 1.25) + (64 << 20)
        mid_ctx = a.gen_prompt_tokens + a.gen_new_tokens // 2
        for label in ("full", "pyramidkv-128"):
            if self.left() <= 0:
                res["kvserve"][label] = {"error": "time budget spent"}
                continue
            cmd = [self.kvserve, "generate", "--model", model, "--device", a.device, "--dtype", a.dtype,
                   "--prompts-file", str(pf), "--max-tokens", str(a.gen_new_tokens), "--ignore-eos", "--json",
                   "--kv-cache", f"{kv_cache // (1 << 20)}MiB", *POLICIES[label],
                   *(["--enforce-eager"] if a.enforce_eager else [])]
            log(f"[{time.time() - self.t_start:5.0f}s] generate {shape} {label}: {a.gen_prompts} x "
                f"{a.gen_prompt_tokens} tokens, {a.gen_new_tokens} new")
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                                   timeout=min(a.gen_timeout, max(30.0, self.left() + 30)))
                if p.returncode != 0:
                    raise RuntimeError(f"exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1][:300]}")
                j = json.loads(p.stdout.strip().splitlines()[-1])
                rs = j["results"]
                ttfts = [r["timings"]["time_to_first_token_s"] for r in rs]
                last = max(rs, key=lambda r: r["timings"]["time_to_first_token_s"])
                n = last["completion_tokens"]
                g = {"load_s": j["load_s"], "warmup_s": j.get("warmup_s", 0.0), "warmup": j.get("warmup"),
                     "max_running": j["max_running"], "ttft_first_s": min(ttfts),
                     "ttft_last_s": max(ttfts), "step_s": last["timings"]["decode_s"] / max(1, n - 1),
                     "completion_tokens": n, "kv_tokens_kept": last["kv_tokens_kept"],
                     "kv_tokens_full": last["kv_tokens_full"], "cuda_graphs": j.get("cuda_graphs")}
                res["kvserve"][label] = g
                log(f"  step {g['step_s'] * 1e3:.2f} ms, TTFT first {g['ttft_first_s']:.2f} s / all "
                    f"{g['ttft_last_s']:.2f} s, max_running {g['max_running']}")
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                res["kvserve"][label] = {"error": str(e)[-300:]}
                log(f"  FAILED: {e}")
            # bench decode of the same shape: batch = prompts, context = the middle of the generation
            self.run_cells(shape, label, [(mid_ctx, a.gen_prompts)], group="e2e")
            cell = next((x for x in self.cells if x["shape"] == shape and x["policy"] == label
                         and x["context"] == mid_ctx and x["batch"] == a.gen_prompts), None)
            res["bench"][label] = cell
        if self.left() <= 0:
            res["hf"] = {"error": "time budget spent"}
            return res
        log(f"[{time.time() - self.t_start:5.0f}s] transformers generate {shape}: {a.gen_prompts} x "
            f"{a.gen_prompt_tokens} tokens, {a.gen_new_tokens} new")
        try:
            res["hf"] = run_child("hf", [model, a.device, a.dtype, str(pf), str(a.gen_new_tokens)],
                                  timeout=min(a.hf_timeout, max(30.0, self.left() + 30)), env=self.env)
            h = res["hf"]
            log(f"  step {h['step_s_mean'] * 1e3:.2f} ms (mean), TTFT {h['ttft_s']:.2f} s, load {h['load_s']:.0f} s")
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            res["hf"] = {"error": str(e)[-300:]}
            log(f"  FAILED: {e}")
        return res


# ---------------------------------------------------------------------------------------------
def render(args, meta: dict, b: Bench) -> str:
    L = []
    gpu = args.device.startswith("cuda")
    bw = b.bw
    L.append("# kvserve on one GPU\n" if gpu else "# kvserve GPU benchmark script: CPU smoke test\n")
    if not gpu:
        L.append("**Not GPU figures.** `bench/bench_gpu.py --device cpu --shapes tiny` run on a CPU to try the "
                 "script's logic: a tiny random model, fp32, small contexts. Nothing here says anything about "
                 "GPU performance.\n")
    L.append("Written by `bench/bench_gpu.py` from one run (checkpoints with random bf16 weights, made by the "
             "script with transformers and never committed):\n")
    for k in ("date", "commit", "device", "versions", "bandwidth", "models", "run"):
        L.append(f"- **{k}**: {meta[k]}")
    L.append("")
    L.append(f"Floor = (weight bytes read per step + live KV bytes) / {bw:.0f} GB/s (the bandwidth measured above). "
             "Weight bytes read per step: every parameter but the input embedding of an untied model (a step reads "
             "`batch` rows of it); live KV bytes: `live_kv_bytes` of `kvserve bench decode`, the batch's kept KV "
             "(what the policy keeps per layer, plus the decoded tokens) averaged over the timed steps. "
             "\"% of floor\" = floor / median step (100% = at the bandwidth limit). Weights-only floor = weight "
             "bytes read per step / bandwidth.\n")

    def cell(shape, label, ctx, batch):
        return next((x for x in b.cells if x["shape"] == shape and x["policy"] == label and x["context"] == ctx
                     and x["batch"] == batch), None)

    def why(x):
        return "not in this run" if x is None else f"{x['status']}: {x['note']}"

    top = args.shapes[0]
    acc = b.acceptance_cells(top)
    name = SHAPES[top][0]
    L.append(f"## Acceptance rows (issue 13), {name}\n")
    L.append("| row | measured | goal | result |")
    L.append("| --- | --- | --- | --- |")
    for key in ("full_lo_1", "full_hi_mid"):
        label, ctx, bb = acc[key]
        x = cell(top, label, ctx, bb)
        if x and x["status"] == "ok":
            L.append(f"| {label} {fmt_ctx(ctx)} × {bb}: % of floor | {x['step_ms']:.2f} ms/step, floor "
                     f"{x['floor_ms']:.2f} ms = **{100 * x['frac']:.0f}%** | ≥ 75% | "
                     f"**{'met' if x['frac'] >= 0.75 else 'NOT met'}** |")
        else:
            L.append(f"| {label} {fmt_ctx(ctx)} × {bb}: % of floor | {why(x)} | ≥ 75% | — |")
    for key in ("pyr_hi_1", "pyr_hi_max"):
        label, ctx, bb = acc[key]
        x = cell(top, label, ctx, bb)
        if x and x["status"] == "ok":
            r = x["step_ms"] / x["weights_floor_ms"]
            L.append(f"| {label} {fmt_ctx(ctx)} × {bb}: step / weights-only floor | {x['step_ms']:.2f} / "
                     f"{x['weights_floor_ms']:.2f} ms = **{r:.2f}×** | ≤ 1.25× | **{'met' if r <= 1.25 else 'NOT met'}** |")
        else:
            L.append(f"| {label} {fmt_ctx(ctx)} × {bb}: step / weights-only floor | {why(x)} | ≤ 1.25× | — |")
    label, hi, bmax = acc["pyr_hi_max"]
    x = cell(top, label, hi, bmax)
    fulls = [f for f in b.cells if f["shape"] == top and f["policy"] == "full" and f["context"] == hi
             and f["status"] == "ok"]
    if x and x["status"] == "ok" and fulls:
        best = max(fulls, key=lambda f: f["tokens_per_s"])
        largest = max(f["batch"] for f in fulls)
        L.append(f"| pyramidkv-128 {fmt_ctx(hi)} × {bmax} tokens/s vs full's best at {fmt_ctx(hi)} in the same device "
                 f"memory (full fits batch ≤ {largest} here) | {x['tokens_per_s']:.0f} vs {best['tokens_per_s']:.0f} "
                 f"(full × {best['batch']}) = **{x['tokens_per_s'] / best['tokens_per_s']:.1f}×** | — | "
                 f"KV {fmt_bytes(x['live_kv_bytes'])} vs {fmt_bytes(best['live_kv_bytes'])} |")
    else:
        L.append(f"| pyramidkv-128 {fmt_ctx(hi)} × {bmax} tokens/s vs full's best at {fmt_ctx(hi)} | "
                 f"{why(x) if not (x and x['status'] == 'ok') else 'no full cell at that context ran'} | — | — |")
    e = b.e2e or {}
    hf = e.get("hf") or {}
    for label in ("full", "pyramidkv-128"):
        g, bc = e.get("kvserve", {}).get(label), e.get("bench", {}).get(label)
        what = f"generate step / bench decode step, {label}, {e.get('prompts')} × {fmt_ctx(e.get('prompt_tokens', 0))}"
        if g and "error" not in g and bc and bc["status"] == "ok":
            L.append(f"| {what} | {g['step_s'] * 1e3:.2f} / {bc['step_ms']:.2f} ms = **{g['step_s'] * 1e3 / bc['step_ms']:.2f}×** "
                     "| — | |")
        else:
            L.append(f"| {what} | {(g or {}).get('error') or (why(bc) if bc else 'not run')} | — | — |")
    g = e.get("kvserve", {}).get("full")
    if g and "error" not in g and hf and "error" not in hf:
        r = g['ttft_last_s'] / hf['ttft_s']
        L.append(f"| time to first token, full, {e['prompts']} × {fmt_ctx(e['prompt_tokens'])}: kvserve (all "
                 f"{e['prompts']} prompts) / transformers | {g['ttft_last_s']:.2f} s / {hf['ttft_s']:.2f} s = "
                 f"**{r:.2f}×** | ≤ 1× (issue 34) | **{'met' if r <= 1.0 else 'NOT met'}** |")
        L.append(f"| decode step, full, kvserve generate vs transformers | {g['step_s'] * 1e3:.2f} vs "
                 f"{hf['step_s_mean'] * 1e3:.2f} ms = **{hf['step_s_mean'] / g['step_s']:.2f}× faster** | — | |")
    else:
        L.append(f"| time to first token vs transformers | "
                 f"{(g or {}).get('error') or hf.get('error') or 'not run'} | — | — |")
    L.append("")

    # end to end
    L.append(f"## End to end on the {name}: `kvserve generate` vs `bench decode` vs transformers\n")
    if e:
        L.append(f"{e['prompts']} prompts of {e['prompt_tokens']} random token ids, {e['new_tokens']} new tokens each, "
                 "greedy, `--ignore-eos`. kvserve: `kvserve generate --prompts-file` in a fresh process; its TTFT "
                 "counts from the prompts' submission, after the engine's start-up warm-up (`model.warmup_tokens`, "
                 "on CUDA by default: one prefill step of the token budget and a few decode steps, which `load` "
                 "includes, as transformers' warm-up generate is left out of its TTFT); the engine prefills at most "
                 "8192 prompt tokens a "
                 "step, so the prompts are admitted one after another: TTFT is given for the first prompt and for the "
                 "last (= all prompts have their first token). Decode step = `decode_s` / (tokens − 1) of the "
                 "last-admitted sequence: steady decode of the whole batch, except its last few steps, where the "
                 "sequences admitted earlier have already finished. `bench decode` at the same batch, context "
                 f"{e['prompt_tokens'] + e['new_tokens'] // 2} (the middle of the generation). transformers: "
                 f"`generate` on the same checkpoint and batch (eager PyTorch, attention `{hf.get('attn', '?')}`, "
                 "DynamicCache, no compile), after a small warm-up generate; one forward prefills the whole batch; "
                 "TTFT and step times from a stopping criterion that synchronises and reads the clock after every "
                 "token.\n")
        L.append("| engine | policy | decode ms / step | tokens/s | TTFT first prompt (s) | TTFT all prompts (s) | KV kept / seq | note |")
        L.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for label in ("full", "pyramidkv-128"):
            g = e["kvserve"].get(label)
            if g and "error" not in g:
                L.append(f"| kvserve generate | {label} | {g['step_s'] * 1e3:.2f} | {e['prompts'] / g['step_s']:.0f} | "
                         f"{g['ttft_first_s']:.2f} | {g['ttft_last_s']:.2f} | {g['kv_tokens_kept']} of {g['kv_tokens_full']} "
                         f"| max_running {g['max_running']}, load {g['load_s']:.1f} s (warm-up "
                         f"{g.get('warmup_s', 0.0):.2f} s){graph_note(g.get('cuda_graphs'))} |")
            else:
                L.append(f"| kvserve generate | {label} | — | — | — | — | — | {(g or {}).get('error', 'not run')} |")
            bc = e["bench"].get(label)
            if bc and bc["status"] == "ok":
                L.append(f"| kvserve bench decode | {label} | {bc['step_ms']:.2f} | {bc['tokens_per_s']:.0f} | — | — | "
                         f"{bc['row']['kv_tokens_kept']} of {bc['row']['kv_tokens_full']} | context {bc['context']}, "
                         f"floor {bc['floor_ms']:.2f} ms ({100 * bc['frac']:.0f}%) |")
            else:
                L.append(f"| kvserve bench decode | {label} | — | — | — | — | — | {why(bc)} |")
        if hf and "error" not in hf:
            L.append(f"| transformers generate | full | {hf['step_s_mean'] * 1e3:.2f} | {e['prompts'] / hf['step_s_mean']:.0f} "
                     f"| — | {hf['ttft_s']:.2f} | full | median step {hf['step_s_median'] * 1e3:.2f} ms, load "
                     f"{hf['load_s']:.0f} s" + (f", peak {fmt_bytes(hf['max_memory'])}" if hf.get("max_memory") else "")
                     + " |")
        else:
            L.append(f"| transformers generate | full | — | — | — | — | — | {hf.get('error', 'not run')} |")
        L.append("")

    # the matrix
    for shape in args.shapes:
        c = SHAPES[shape][1]
        rows = [x for x in b.cells if x["shape"] == shape and x["group"] != "e2e"]
        if not rows:
            continue
        w_all, w_read = rows[0]["weight_bytes_all"], rows[0]["weight_bytes_read"]
        L.append(f"## `kvserve bench decode`, {SHAPES[shape][0]}\n")
        L.append(f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
                 f"{c['num_key_value_heads']} KV heads, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, "
                 f"{'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, {args.dtype}: "
                 f"{fmt_bytes(w_all)} of weights, {fmt_bytes(w_read)} read per step (weights-only floor "
                 f"{w_read / (bw * 1e9) * 1e3:.2f} ms). {args.steps} timed steps after {args.warmup} warm-up steps, "
                 "median step. Checkpoint: " + b.models.get(shape, {}).get("made", b.models.get(shape, {}).get("error", "?"))
                 + ".\n")
        L.append("| context | batch | policy | ms / step | best step ms | floor ms | % of floor | tokens/s | KV tokens / layer (mean) | live KV | note |")
        L.append("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for x in sorted(rows, key=lambda r: (r["context"], r["batch"], list(POLICIES).index(r["policy"]))):
            if x["status"] == "ok":
                L.append(f"| {x['context']} | {x['batch']} | {x['policy']} | {x['step_ms']:.2f} | {x['step_min_ms']:.2f} | "
                         f"{x['floor_ms']:.2f} | {100 * x['frac']:.0f}% | {x['tokens_per_s']:.0f} | "
                         f"{x['kv_per_layer']:.0f} | {fmt_bytes(x['live_kv_bytes'])} | |")
            else:
                L.append(f"| {x['context']} | {x['batch']} | {x['policy']} | — | — | — | — | — | — | — | "
                         f"{x['status']}: {x['note']} |")
        L.append("")
    L.append("## Reproduce\n")
    L.append("```\n# on a GPU machine with no network: tools/gpu_check.sh fetch (here), then there\n"
             "tools/gpu_check.sh run     # build + CUDA tests\ntools/gpu_check.sh bench   # this file\n"
             "# or, with a kvserve built against a CUDA torch:\n"
             f"python3 bench/bench_gpu.py --kvserve build/kvserve {'--quick ' if args.quick else ''}"
             f"{'' if gpu else '--device cpu --shapes tiny '}--out {args.out if not gpu else 'docs/benchmarks-gpu.md'}\n```\n")
    return "\n".join(L)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "probe":
            r = child_probe(rest[0])
        elif kind == "make-model":
            r = child_make_model(rest[0], rest[1], rest[2], int(rest[3]))
        elif kind == "hf":
            r = child_hf(rest[0], rest[1], rest[2], rest[3], int(rest[4]))
        else:
            raise SystemExit(f"unknown child {kind}")
        print(json.dumps(r))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=str(ROOT / "build" / "kvserve"))
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (smoke test with --shapes tiny)")
    ap.add_argument("--dtype", help="kvserve/transformers compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--shapes", help="comma-separated, first = where the acceptance rows and the end-to-end run go "
                                     "(default 8b,1b on cuda, tiny on cpu)")
    ap.add_argument("--models", default="/tmp/kvserve-bench-models", help="checkpoint cache (outside the repository)")
    ap.add_argument("--out", help="default docs/benchmarks-gpu.md on cuda, /tmp/benchmarks-gpu-cpu.md on cpu")
    ap.add_argument("--json-out", help="also write the raw results here")
    ap.add_argument("--quick", action="store_true", help="a small subset: 8B only, contexts 1K and 32K, batch 1/8/64")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--gen-prompts", type=int)
    ap.add_argument("--gen-prompt-tokens", type=int)
    ap.add_argument("--gen-new-tokens", type=int)
    ap.add_argument("--budget-s", type=float, help="no new step starts after this many seconds (default 480 on cuda)")
    ap.add_argument("--bandwidth-gbs", type=float, help="use this instead of the measured bandwidth")
    ap.add_argument("--mem-fraction", type=float, default=0.92, help="share of free device memory a cell may plan for")
    ap.add_argument("--threads", type=int, default=0, help="kvserve --threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="kvserve decodes without CUDA graphs (the A/B against a default run; shown in the run line)")
    ap.add_argument("--cmd-timeout", type=float, default=90, help="seconds per bench decode process, plus --cell-timeout per cell")
    ap.add_argument("--cell-timeout", type=float, default=20)
    ap.add_argument("--gen-timeout", type=float, default=180)
    ap.add_argument("--hf-timeout", type=float, default=240)
    ap.add_argument("--make-timeout", type=float, default=420)
    args = ap.parse_args()
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    preset = dict(DEFAULTS[dev])
    if args.quick:
        preset.update(QUICK if dev == "cuda" else {})
    for k, v in preset.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s} (have {', '.join(SHAPES)})")
    args.dtype = args.dtype or ("bfloat16" if dev == "cuda" else "float32")
    args.out = args.out or (str(ROOT / "docs" / "benchmarks-gpu.md") if dev == "cuda" else "/tmp/benchmarks-gpu-cpu.md")
    if dev == "cpu" and pathlib.Path(args.out).resolve().is_relative_to(ROOT / "docs"):
        raise SystemExit("--device cpu writes no figures into docs/: give --out outside it")
    if not pathlib.Path(args.kvserve).exists():
        raise SystemExit(f"no kvserve binary at {args.kvserve} (--kvserve)")
    pathlib.Path(args.models).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    t0 = time.time()
    log(f"probe {args.device} ...")
    probe = run_child("probe", [args.device], timeout=300)
    log(f"  {probe.get('name')}: {probe['bandwidth_gbs']:.0f} GB/s device copy (read + write), "
        f"{probe['mem_free'] / GiB:.1f} GiB free; torch {probe['torch']}")
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?"
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
    except OSError:  # no git there
        commit, dirty = os.environ.get("KVSERVE_COMMIT", "?"), ""
    b = Bench(args, probe)
    b.t_start = t0  # the budget counts from the start, the probe included
    dev_line = probe.get("name", "?")
    if dev == "cuda":
        dev_line += (f", {probe['mem_total'] / GiB:.1f} GiB ({probe['mem_free'] / GiB:.1f} free at start), "
                     f"{probe.get('sms')} SMs, driver {probe.get('driver')}, CUDA {probe.get('cuda')}")
    else:
        dev_line += f", {probe['mem_total'] / GiB:.1f} GiB available"
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(final: bool) -> None:
        total = time.time() - t0
        meta = {
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "commit": f"`{commit}`" + (" (with uncommitted changes)" if dirty else ""),
            "device": dev_line,
            "versions": f"torch {probe['torch']}, transformers {probe['transformers']}, Python {probe['python']}",
            "bandwidth": (f"{probe['bandwidth_gbs']:.0f} GB/s measured: torch copy of {fmt_bytes(probe['copy_bytes'])} "
                          f"device to device, (bytes read + written) / median of 10 copies "
                          f"({probe['copy_s_median'] * 1e3:.2f} ms)" if dev == "cuda" else
                          f"{probe['bandwidth_gbs']:.1f} GB/s (a torch copy of {fmt_bytes(probe['copy_bytes'])} in host memory)")
                         + (f"; the floors use {b.bw:.0f} GB/s (--bandwidth-gbs)" if args.bandwidth_gbs else ""),
            "models": "; ".join(f"{SHAPES[s][0]}: " + b.models.get(s, {}).get("made", b.models.get(s, {}).get("error", "not made"))
                                for s in args.shapes) + f" (cache `{args.models}`)",
            "run": f"`{' '.join([pathlib.Path(sys.argv[0]).name] + sys.argv[1:])}`, "
                   + (f"{total:.0f} s in all" if final else f"**unfinished**: written after {total:.0f} s, the run "
                      "went on (or was stopped) after that")
                   + (f", time budget {args.budget_s:.0f} s" if args.budget_s else ""),
        }
        out.write_text(render(args, meta, b))
        if args.json_out:
            pathlib.Path(args.json_out).write_text(json.dumps({"meta": meta, "probe": probe, "cells": b.cells,
                                                               "e2e": b.e2e, "models": b.models}, indent=1, default=str))

    b.run_all(checkpoint=lambda: write(False))
    log(f"total: {time.time() - t0:.0f} s")
    write(True)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
