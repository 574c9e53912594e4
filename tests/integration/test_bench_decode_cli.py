"""`kvserve bench decode` on CPU: the host planning time it reports (host_plan_s_median) and the
--cuda-profiler-steps flag's errors (the range itself only opens on CUDA; tools/gpu_check.sh profile
and tests/reference/test_cuda_vs_reference.py use it there)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("KVSERVE_BIN", str(ROOT / "build" / "kvserve"))
MODEL = str(ROOT / "models" / "tiny-llama")


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, "bench", "decode", "--model", MODEL, *args], capture_output=True, text=True,
                          timeout=120)


def test_reports_the_host_planning_time_of_each_cell():
    proc = bench("--context", "40", "70", "--batch", "1", "2", "--steps", "3", "--warmup", "1",
                 "--policy", "pyramidkv", "--budget", "16")
    assert proc.returncode == 0, proc.stderr
    cells = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(cells) == 4
    for c in cells:
        # The planning runs inside each timed step, so its median cannot exceed the step's.
        assert 0 < c["host_plan_s_median"] <= c["step_s_median"], c
        assert "cuda_profiler_steps" not in c


def test_profiler_steps_need_a_cuda_device():
    proc = bench("--context", "40", "--steps", "2", "--cuda-profiler-steps", "1")
    assert proc.returncode != 0
    assert "--cuda-profiler-steps" in proc.stderr and "CUDA device" in proc.stderr


def test_profiler_steps_must_be_timed_steps():
    proc = bench("--context", "40", "--steps", "2", "--device", "cuda", "--cuda-profiler-steps", "3")
    assert proc.returncode != 0
    assert "--cuda-profiler-steps 3" in proc.stderr and "--steps" in proc.stderr


def test_profiler_steps_default_to_off_and_reject_negatives():
    assert "--cuda-profiler-steps" in bench("--help").stdout
    proc = bench("--context", "40", "--steps", "2", "--cuda-profiler-steps", "-1")
    assert proc.returncode != 0 and "--cuda-profiler-steps" in proc.stderr
