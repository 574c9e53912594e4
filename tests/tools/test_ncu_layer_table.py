"""tools/ncu_layer_table.py on synthetic Nsight Compute CSVs of whole decode steps (the layout of
`ncu --csv --page raw`: ==PROF== lines, a header starting with "ID", a units line, then one row per
kernel). The LM head GEMM is the longest kernel and runs once a step, so it must not mark the layer."""
from __future__ import annotations

import csv
import importlib.util
import io
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_layer_table", ROOT / "tools" / "ncu_layer_table.py")
ncu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu)

# One Llama layer at the fused level, starting at its input norm: (name, grid, µs).
LAYER = [
    ("void kvserve::rms_norm_vec_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 4.0),
    ("nvjet_qkv_gemm", "(4, 24, 1)", 22.0),
    ("void kvserve::rope_qkv_vec_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 4.0),
    ("void kvserve::paged_append_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 5.0),
    ("void kvserve::paged_decode_kernel<__nv_bfloat16, 128>(Args)", "(1, 8, 17)", 12.0),
    ("void kvserve::merge_splits_kernel<__nv_bfloat16>(Args)", "(32, 1, 1)", 8.0),
    ("nvjet_splitk_gemm", "(2, 64, 1)", 16.0),
    ("void cublasLt::splitKreduce_kernel<float>(Args)", "(128, 1, 1)", 4.0),
    ("void kvserve::rms_norm_vec_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 4.0),
    ("nvjet_gate_up_gemm", "(2, 66, 1)", 84.0),
    ("void kvserve::silu_mul_kernel<__nv_bfloat16>(Args)", "(56, 1, 1)", 3.0),
    ("nvjet_splitk_gemm", "(2, 64, 1)", 44.0),
    ("void cublasLt::splitKreduce_kernel<float>(Args)", "(128, 1, 1)", 4.0),
]
EMBED = ("void at::native::index_select_kernel<float>(Args)", "(64, 1, 1)", 3.0)
TAIL = [
    ("void kvserve::rms_norm_vec_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 4.5),  # the final norm
    ("nvjet_lm_head_gemm", "(8, 501, 1)", 300.0),  # longest, once a step
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>(Args)", "(1, 1, 1)", 10.0),
]
LAYERS = 4
LAYER_US = sum(t for _, _, t in LAYER)
OUTSIDE_US = EMBED[2] + sum(t for _, _, t in TAIL)


def step() -> list[tuple[str, str, float]]:
    return [EMBED] + LAYER * LAYERS + TAIL


def write_csv(path: pathlib.Path, rows, unit: str = "nsecond", scale: float = 1e3) -> pathlib.Path:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(["ID", "Process ID", "Process Name", "Kernel Name", "Context", "Stream", "Block Size", "Grid Size",
                "gpu__time_duration.sum"])
    w.writerow(["", "", "", "", "", "", "", "", unit])
    for i, (name, grid, us) in enumerate(rows):
        w.writerow([i, 4242, "kvserve", name, 1, 7, "(128, 1, 1)", grid, f"{us * scale:,.0f}" if scale > 1 else us])
    path.write_text("==PROF== Connected to process 4242 (/tmp/kvserve-build/kvserve)\n"
                    "==PROF== Profiling \"rms_norm_vec_kernel\" - 0: 0%....50%....100% - 1 pass\n"
                    "==PROF== Disconnected from process 4242\n" + buf.getvalue())
    return path


def layer_part(text: str) -> str:
    return text.split("Step summary")[0]


def test_one_step_whose_longest_kernel_runs_once(tmp_path):
    rows = step()
    assert max(rows, key=lambda r: r[2])[0] == "nvjet_lm_head_gemm"  # the old rule would pick it
    text = ncu.layer_table(str(write_csv(tmp_path / "a.csv", rows)))
    head = layer_part(text)
    assert f"{LAYERS - 1} layer(s) of {len(LAYER)} kernels (from one `nvjet_gate_up_gemm` to the next)" in head
    rows_out = [l for l in head.splitlines() if l.startswith("| ") and l.split("|")[1].strip().isdigit()]
    # The period starts at the marker: gate-up, SiLU, down, reduce, then the next layer's norm ...
    order = LAYER[9:] + LAYER[:9]
    assert len(rows_out) == len(LAYER)
    for line, (name, grid, us) in zip(rows_out, order):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert cells[1] == f"`{ncu.short(name)}`" and cells[2] == grid and float(cells[3]) == pytest.approx(us)
    assert f"| | **layer** | | **{LAYER_US:.1f}** |" in head

    summary = text.split("Step summary")[1]
    total = sum(r[2] for r in rows)
    assert f"(1 step(s) captured, {len(rows)} kernels and {LAYERS} layers a step)" in summary
    assert f"kernel time per step: {total:.1f} µs" in summary
    assert f"the layer table x {LAYERS} layers: {LAYER_US * LAYERS:.1f} µs" in summary
    assert f"outside the layer periods: {OUTSIDE_US:.1f} µs in 4 kernels" in summary
    assert "rest (layers off the median, odd periods): 0.0 µs" in summary
    # The outside kernels in step order: the embedding, then the final norm, the LM head and argmax.
    outside = [l for l in summary.splitlines() if l.startswith("| ") and l.split("|")[1].strip().isdigit()]
    assert [c.split("|")[2].strip() for c in outside] == [f"`{ncu.short(n)}`" for n, _, _ in [EMBED] + TAIL]
    assert "`nvjet_lm_head_gemm` | (8, 501, 1) | 300.0 |" in summary
    assert f"| | **outside** | | **{OUTSIDE_US:.1f}** |" in summary


def test_several_steps_take_medians_and_count_per_step(tmp_path):
    rows = step() + step() + step()
    # One slow launch of the QKV GEMM in one layer, and a slow LM head in one step: medians ignore both.
    rows[1 + len(LAYER) + 1] = (rows[1 + len(LAYER) + 1][0], rows[1 + len(LAYER) + 1][1], 500.0)
    lm = len(rows) - 2
    rows[lm] = (rows[lm][0], rows[lm][1], 900.0)
    a = ncu.analyse(rows)
    assert a["steps"] == 3 and a["marks"] == 3 * LAYERS
    assert a["marker"] == ("nvjet_gate_up_gemm", "(2, 66, 1)")
    assert len(a["periods"]) == 3 * (LAYERS - 1) and a["outside_gaps"] == 3 and not a["odd_gaps"]
    assert [r[0] for r in a["outside"]] == [EMBED[0]] + [n for n, _, _ in TAIL]
    assert [r[2] for r in a["outside"]] == [EMBED[2]] + [t for _, _, t in TAIL]
    text = ncu.layer_table(str(write_csv(tmp_path / "b.csv", rows)))
    assert f"| | **layer** | | **{LAYER_US:.1f}** |" in text
    assert f"(3 step(s) captured, {len(step())} kernels and {LAYERS} layers a step)" in text
    total = (sum(r[2] for r in rows)) / 3
    assert f"kernel time per step: {total:.1f} µs" in text
    rest = total - LAYER_US * LAYERS - OUTSIDE_US
    assert f"rest (layers off the median, odd periods): {rest:.1f} µs" in text


def test_steps_can_be_given(tmp_path):
    rows = step() + step()
    a = ncu.analyse(rows, steps=2)
    assert a["steps"] == 2 and len(a["outside"]) == 4
    # Told it is one step, the LM head runs twice in it and marks a "layer" of a whole step: the
    # count of steps is what keeps a once-a-step kernel from marking the layer.
    a = ncu.analyse(rows, steps=1)
    assert a["marker"] == ("nvjet_lm_head_gemm", "(8, 501, 1)") and len(a["pattern"]) == len(step())


def test_a_first_layer_norm_of_its_own_kernel_is_outside(tmp_path):
    rows = step()
    plain = ("void kvserve::rms_norm_kernel<__nv_bfloat16>(Args)", "(1, 1, 1)", 4.0)
    rows[1] = plain  # the first layer's input norm has no residual to add: another kernel
    a = ncu.analyse(rows)
    # The first layer's head then ends before its norm; the last layer's tail takes the final norm
    # (the same kernel as the layer's next norm) to make one whole layer.
    assert [r[0] for r in a["outside"]] == [EMBED[0], plain[0]] + [n for n, _, _ in TAIL[1:]]
    text = ncu.layer_table(str(write_csv(tmp_path / "d.csv", rows)))
    # The final norm's 4.5 µs against the table's 4.0 is the rest.
    assert "rest (layers off the median, odd periods): 0.5 µs" in text


def test_microsecond_units_and_too_short_captures(tmp_path):
    text = ncu.layer_table(str(write_csv(tmp_path / "us.csv", step(), unit="usecond", scale=1)))
    assert f"| | **layer** | | **{LAYER_US:.1f}** |" in text
    text = ncu.layer_table(str(write_csv(tmp_path / "short.csv", [EMBED] + TAIL)))  # nothing runs twice
    assert "no kernel runs twice" in text and "capture more kernels" in text
