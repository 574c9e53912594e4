#!/usr/bin/env python3
"""fp32 vs fp16 vs bf16 KV cache on CPU: `kvserve bench decode` step times, dtypes interleaved.

For each round and each shape (context x batch, policy) runs the three KV cache dtypes one after
another, so that all three see the same load; prints one JSON line per run (the bench's own
output plus the label and the load average before the run), and optionally llama.cpp's f16-KV
decode of the same shapes (llama-batched-bench, as bench/bench_backend.py runs it). The table in
docs/benchmarks.md ("A 16-bit KV cache on CPU") comes from this script.

  python3 bench/bench_kv_dtype.py --kvserve build/kvserve --model .fixtures/bench-125m --rounds 2 \\
      [--llamacpp /work/main/build-llamacpp] > kv_dtype.jsonl
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

SHAPES = [  # (label, context, batch, extra bench flags)
    ("4K x 8 full", 4096, 8, []),
    ("16K x 1 full", 16384, 1, []),
    ("16K x 8 pyramidkv-128", 16384, 8, ["--policy", "pyramidkv", "--budget", "128"]),
]
DTYPES = ["float32", "float16", "bfloat16"]


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", default="build/kvserve")
    ap.add_argument("--model", default=".fixtures/bench-125m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", help="llama.cpp build dir with build/bin/llama-batched-bench and bench-125m-f32.gguf")
    a = ap.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    for rnd in range(a.rounds):
        for label, ctx, batch, extra in SHAPES:
            for dt in DTYPES:
                load = load_avg()
                cmd = [a.kvserve, "bench", "decode", "--model", a.model, "--context", str(ctx), "--batch", str(batch),
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
                       "--kv-cache-dtype", dt, *extra]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                row.update(engine="kvserve", label=label, round=rnd, load=load)
                print(json.dumps(row), flush=True)
            if a.llamacpp and "full" in label:
                base = pathlib.Path(a.llamacpp)
                bindir = base / "build" / "bin"
                tg = 32
                load = load_avg()
                cmd = [str(bindir / "llama-batched-bench"), "-m", str(base / "bench-125m-f32.gguf"),
                       "-c", str(batch * (ctx + tg + 16)), "-b", "2048", "-ub", "512", "-npp", str(ctx), "-ntg", str(tg),
                       "-npl", str(batch), "-pps", "-t", str(a.threads), "-fa", "on", "-ctk", "f16", "-ctv", "f16",
                       "--output-format", "jsonl"]
                p = subprocess.run(cmd, env=dict(env, LD_LIBRARY_PATH=str(bindir)), capture_output=True, text=True)
                if p.returncode != 0:
                    sys.exit(f"llama-batched-bench failed: {p.stderr[-2000:]}")
                j = next(json.loads(l) for l in p.stdout.splitlines() if l.startswith("{") and "speed_tg" in l)
                print(json.dumps({"engine": "llama.cpp", "label": label, "round": rnd, "kv_cache_dtype": "f16",
                                  "decode_tokens_per_s": j["speed_tg"], "step_s_median": batch / j["speed_tg"],
                                  "load": load}), flush=True)


if __name__ == "__main__":
    main()
