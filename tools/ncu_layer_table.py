#!/usr/bin/env python3
"""One decoder layer's kernels, in launch order, and where a decode step's time goes, from an Nsight
Compute CSV of one or more whole decode steps.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --page raw \\
        kvserve bench decode ... --enforce-eager --cuda-profiler-steps 1 > a.csv
    python3 tools/ncu_layer_table.py [--steps N] a.csv [b.csv ...]   # markdown tables per file

The layer is found as the period between launches of a marker kernel: the longest kernel (median
time of one name and grid) that runs at least twice per step. A kernel that runs once per step, such
as the LM head GEMM (the longest one at batch 64), cannot mark a layer. The steps in the capture are
the greatest common divisor of the kernels' counts, because every kernel runs a whole number of times
per step; --steps overrides that guess. The periods with the most common kernel sequence are aligned by
position, and the median time per position is printed, so one slow outlier does not decide a row.

The step summary compares the capture's kernel time per step with the layer table times the layers.
It also lists the kernels outside the layer periods (embedding, final norm, LM head, argmax, ...).
Those are what is left between the last layer and the first one once the layer's own head and tail
are matched off.

ncu serialises kernels, flushes caches and locks clocks before each one. The times are therefore
upper bounds on what the same kernels take inside a CUDA graph. Use them to rank where a step's time
goes, not as the step time.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import math
import statistics
import sys

Row = tuple[str, str, float]  # kernel name, grid size, µs


def rows_of(path: str) -> list[Row]:
    lines = open(path, errors="replace").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head = table[0]
    name, grid, t = head.index("Kernel Name"), head.index("Grid Size"), head.index("gpu__time_duration.sum")
    unit = table[1][t].strip()
    scale = {"ns": 1e-3, "nsecond": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
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


def guess_steps(rows: list[Row]) -> int:
    """Whole steps in the capture: every kernel's count is a multiple of them."""
    return math.gcd(*collections.Counter(r[0] for r in rows).values())


def pick_marker(rows: list[Row], steps: int) -> tuple[str, str] | None:
    """The (name, grid) with the longest median time among those launched at least twice a step."""
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for name, grid, t in rows:
        times[(name, grid)].append(t)
    for need in (2 * steps, 2):  # a wrong guess of the steps falls back to "at least twice"
        cands = {k: statistics.median(v) for k, v in times.items() if len(v) >= need}
        if cands:
            return max(cands, key=cands.get)
    return None


def outside_of(gap: list[Row], pattern: list[str]) -> tuple[list[Row], int]:
    """The kernels of a gap (the run from one step's last layer to the next step's first) that belong
    to no layer: the gap starts with a layer's head (a prefix of the pattern) and ends with a layer's
    tail (a suffix), which together make one layer. Returns them and the head's length. The tail is
    matched first, so a final norm that looks like the layer's next norm counts as outside."""
    n = len(pattern)
    back = 0
    while back < min(n, len(gap)) and gap[-1 - back][0] == pattern[n - 1 - back]:
        back += 1
    fwd = 0
    while fwd < min(n - back, len(gap) - back) and gap[fwd][0] == pattern[fwd]:
        fwd += 1
    return gap[fwd:len(gap) - back], fwd


def analyse(rows: list[Row], steps: int | None = None) -> dict:
    steps = steps or guess_steps(rows)
    marker = pick_marker(rows, steps)
    if marker is None:
        return {"steps": steps, "marker": None}
    marks = [i for i, r in enumerate(rows) if (r[0], r[1]) == marker]
    segments = [rows[a:b] for a, b in zip(marks, marks[1:])]  # not empty: the marker runs twice
    pattern = list(collections.Counter(tuple(r[0] for r in s) for s in segments).most_common(1)[0][0])
    periods = [s for s in segments if [r[0] for r in s] == pattern]
    # The gaps: segments that are no layer period, and the wrap-around from the last marker through
    # the capture's end and start to the first marker (the capture holds whole steps).
    wrap = rows[marks[-1]:] + rows[:marks[0]]
    gaps = [s for s in segments if [r[0] for r in s] != pattern] + [wrap]
    # The outside kernels in step order: the wrap-around's split between its end-of-step and
    # start-of-step parts sets the order; the gaps that hold the same kernels are aligned to it.
    ref, split = outside_of(wrap, pattern)
    ref_names = [r[0] for r in ref]
    # The wrap-around's end-of-capture kernels among the outside ones (they run last in a step).
    k = min(max(len(rows) - marks[-1] - split, 0), len(ref))
    gap_outside = [outside_of(g, pattern)[0] for g in gaps]
    same = [o for o in gap_outside if [r[0] for r in o] == ref_names]
    outside = [(ref[i][0], ref[i][1], statistics.median(o[i][2] for o in same)) for i in range(len(ref))]
    outside = outside[k:] + outside[:k]
    odd = [o for o in gap_outside if [r[0] for r in o] != ref_names]
    return {"steps": steps, "marker": marker, "pattern": pattern, "periods": periods, "marks": len(marks),
            "outside": outside, "outside_gaps": len(same), "odd_gaps": odd,
            "total_us": sum(r[2] for r in rows), "kernels": len(rows)}


def layer_table(path: str, steps: int | None = None) -> str:
    rows = rows_of(path)
    a = analyse(rows, steps)
    if a["marker"] is None:
        return f"{path}: no kernel runs twice, so no layer period; capture more kernels\n"
    periods, n = a["periods"], len(a["pattern"])
    mark = short(a["marker"][0])
    out = [f"{path}: {len(periods)} layer(s) of {n} kernels (from one `{mark}` to the next)", "",
           "| # | kernel | grid | µs (median) |", "| ---: | --- | --- | ---: |"]
    layer = 0.0
    for k in range(n):
        t = statistics.median(p[k][2] for p in periods)
        layer += t
        out.append(f"| {k + 1} | `{short(periods[0][k][0])}` | {periods[0][k][1]} | {t:.1f} |")
    out.append(f"| | **layer** | | **{layer:.1f}** |")
    out += ["", step_summary(a, layer)]
    return "\n".join(out) + "\n"


def step_summary(a: dict, layer: float) -> str:
    s = a["steps"]
    layers = a["marks"] / s
    per_step = a["total_us"] / s
    outside = sum(r[2] for r in a["outside"])
    in_layers = layer * layers
    out = [f"Step summary ({s} step(s) captured, {a['kernels'] / s:g} kernels and {layers:g} layers a step):", "",
           f"- kernel time per step: {per_step:.1f} µs",
           f"- the layer table x {layers:g} layers: {in_layers:.1f} µs ({100 * in_layers / per_step:.1f} %)",
           f"- outside the layer periods: {outside:.1f} µs in {len(a['outside'])} kernels "
           f"({100 * outside / per_step:.1f} %; median over {a['outside_gaps']} step boundary(ies))",
           f"- rest (layers off the median, odd periods): {per_step - in_layers - outside:.1f} µs"]
    if a["odd_gaps"]:
        odd = sum(r[2] for g in a["odd_gaps"] for r in g)
        out.append(f"- {len(a['odd_gaps'])} odd period(s) left {sum(len(g) for g in a['odd_gaps'])} kernels "
                   f"({odd:.1f} µs in all) outside the layer pattern")
    out += ["", "| # | kernel outside the layers | grid | µs |", "| ---: | --- | --- | ---: |"]
    out += [f"| {i + 1} | `{short(name)}` | {grid} | {t:.1f} |" for i, (name, grid, t) in enumerate(a["outside"])]
    out.append(f"| | **outside** | | **{outside:.1f}** |")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu --csv --page raw output with gpu__time_duration.sum")
    ap.add_argument("--steps", type=int, help="whole decode steps in each capture (default: guessed from the counts)")
    args = ap.parse_args()
    rc = 0
    for p in args.csv:
        try:
            print(layer_table(p, args.steps))
        except (OSError, StopIteration, ValueError) as e:  # a failed ncu run leaves no table: say so, go on
            print(f"{p}: no kernel table ({type(e).__name__}: {e})\n")
            rc = 1
    sys.exit(rc)
