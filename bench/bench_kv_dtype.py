#!/usr/bin/env python3
"""KV cache dtypes on CPU (fp32, fp16, bf16, int8, int4, ...): `kvserve bench decode` step times,
dtypes interleaved.

For each round and each shape (context x batch, policy) runs the three KV cache dtypes one after
another, so that all three see the same load; prints one JSON line per run (the bench's own
output plus the label and the load average before the run), and optionally llama.cpp's f16-KV
decode of the same shapes (llama-batched-bench, as bench/bench_backend.py runs it). The table in
docs/benchmarks.md ("A 16-bit KV cache on CPU") comes from this script, and so does "Quantized KV
on CPU" (--dtypes float16,int8,int4 --summary: per shape the median step of every dtype as a ratio
to float16's, beside the ratio of the bytes the step reads, weights + live KV).

  python3 bench/bench_kv_dtype.py --kvserve build/kvserve --model .fixtures/bench-125m --rounds 2 \\
      [--llamacpp /work/main/build-llamacpp] > kv_dtype.jsonl
  python3 bench/bench_kv_dtype.py --dtypes float16,int8,int4 --rounds 3 --summary > kv_quant.jsonl
  python3 bench/bench_kv_dtype.py --dtypes float16,int8,int4 --bench-args '--quantization int8' --shapes 4K --summary
"""
import argparse
import json
import os
import pathlib
import statistics
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
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="KV cache dtypes, comma-separated (the first is the baseline)")
    ap.add_argument("--bench-args", default="", help="more `kvserve bench decode` flags, e.g. '--quantization int8'")
    ap.add_argument("--shapes", default="", help="only the shapes whose label contains one of these (comma-separated)")
    ap.add_argument("--summary", action="store_true", help="print a markdown table of ratios to the first dtype (stderr)")
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    shapes = [s for s in SHAPES if not a.shapes or any(k in s[0] for k in a.shapes.split(","))]
    rows = []
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    for rnd in range(a.rounds):
        for label, ctx, batch, extra in shapes:
            for dt in dtypes:
                load = load_avg()
                cmd = [a.kvserve, "bench", "decode", "--model", a.model, "--context", str(ctx), "--batch", str(batch),
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
                       "--kv-cache-dtype", dt, *extra, *a.bench_args.split()]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                row.update(engine="kvserve", label=label, round=rnd, load=load)
                rows.append(row)
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
    if a.summary:
        summarize(rows, dtypes, shapes)


def summarize(rows: list, dtypes: list, shapes: list) -> None:
    """Median step per (shape, dtype) over the rounds, as a ratio to the first dtype's, beside the
    ratio of the bytes a step reads (weights + live KV): a memory-bound step follows the bytes."""
    base = dtypes[0]
    print(f"| shape | KV dtype | step ms (median of rounds) | ratio to {base} | bytes ratio (W + KV) | KV bytes ratio |",
          file=sys.stderr)
    print("| --- | --- | ---: | ---: | ---: | ---: |", file=sys.stderr)
    for label, *_ in shapes:
        med, nbytes, kv = {}, {}, {}
        for dt in dtypes:
            mine = [r for r in rows if r["label"] == label and r["engine"] == "kvserve" and r["kv_cache_dtype"] == dt]
            if not mine:
                continue
            med[dt] = statistics.median(r["step_s_median"] for r in mine)
            nbytes[dt] = mine[0]["weight_bytes"] + mine[0]["live_kv_bytes"]
            kv[dt] = mine[0]["live_kv_bytes"]
        for dt in med:
            print(f"| {label} | {dt} | {med[dt] * 1e3:.1f} | {med[dt] / med[base]:.3f} | {nbytes[dt] / nbytes[base]:.3f} | "
                  f"{kv[dt] / kv[base]:.3f} |", file=sys.stderr)


if __name__ == "__main__":
    main()
