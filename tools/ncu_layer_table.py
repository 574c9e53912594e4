#!/usr/bin/env python3
"""One decoder layer's kernels, in launch order, from an Nsight Compute CSV of a decode step.

    ncu --launch-skip N --launch-count M --metrics gpu__time_duration.sum --csv --page raw kvserve bench decode ... > a.csv
    python3 tools/ncu_layer_table.py a.csv [b.csv ...]     # a markdown table per file

The layer is found as the period between launches of the longest kernel (the gate-up GEMM of a
Llama layer); every full period in the capture is aligned by position and the median time per
position is printed, so one slow outlier does not decide a row. ncu serialises kernels, flushes
caches and locks clocks before each one, so the times are upper bounds on what the same kernels
take inside a CUDA graph; use them to rank where a layer's time goes, not as the step time.
"""
import csv
import io
import statistics
import sys


def rows_of(path: str) -> list[tuple[str, str, float]]:
    lines = open(path, errors="replace").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head = table[0]
    name, grid, t = head.index("Kernel Name"), head.index("Grid Size"), head.index("gpu__time_duration.sum")
    unit = table[1][t].strip()
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
    return [(r[name], r[grid], float(r[t].replace(",", "")) * scale) for r in table[2:] if len(r) > t]


def short(name: str) -> str:
    base = name.split("(")[0].replace("void ", "")
    for prefix in ("at::native::", "at::", "kvserve::", "<unnamed>::", "cuda_kernels::", "fused_kernels::"):
        base = base.replace(prefix, "")
    if "elementwise_kernel" in base or "reduce_kernel" in base:  # name the op inside the functor
        for op in ("pow", "Mean", "rsqrt", "add", "neg", "silu", "copy", "Mul", "mul", "ArgMax", "index"):
            if op in name:
                return f"{base.split('<')[0]} ({op.lower()})"
    return base[:70]


def layer_table(path: str) -> str:
    rows = rows_of(path)
    longest = max(rows, key=lambda r: r[2])[0]
    marks = [i for i, r in enumerate(rows) if r[0] == longest]
    periods = [rows[a:b] for a, b in zip(marks, marks[1:])]
    if not periods:
        return f"{path}: fewer than two launches of {short(longest)}; capture more kernels\n"
    n = statistics.mode(len(p) for p in periods)
    periods = [p for p in periods if len(p) == n and [r[0] for r in p] == [r[0] for r in periods[0]]]
    out = [f"{path}: {len(periods)} layer(s) of {n} kernels (from one gate-up GEMM to the next)", "",
           "| # | kernel | grid | µs (median) |", "| ---: | --- | --- | ---: |"]
    total = 0.0
    for k in range(n):
        t = statistics.median(p[k][2] for p in periods)
        total += t
        out.append(f"| {k + 1} | `{short(periods[0][k][0])}` | {periods[0][k][1]} | {t:.1f} |")
    out.append(f"| | **layer** | | **{total:.1f}** |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(layer_table(p))
