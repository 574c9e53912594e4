"""`model.enforce_eager` / `--enforce-eager` on CPU (CUDA graphs only exist on CUDA; the CUDA side is
tests/reference/test_cuda_vs_reference.py): the YAML key is validated, the flag is accepted by
serve, generate and bench decode, and a CPU model never uses graphs."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("KVSERVE_BIN", str(ROOT / "build" / "kvserve"))
MODEL = str(ROOT / "models" / "tiny-llama")


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120)


def test_yaml_enforce_eager_must_be_a_boolean(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  enforce_eager: yes\n")
    proc = kvserve("config", "check", str(bad))
    assert proc.returncode != 0
    assert "bad.yaml:2" in proc.stderr and "model.enforce_eager" in proc.stderr and "true or false" in proc.stderr
    good = tmp_path / "good.yaml"
    good.write_text("model:\n  enforce_eager: true\n")
    proc = kvserve("config", "check", str(good))
    assert proc.returncode == 0, proc.stderr
    assert "enforce_eager" in proc.stdout


def test_every_command_takes_the_flag():
    for cmd in (["serve"], ["generate"], ["bench", "decode"]):
        proc = kvserve(*cmd, "--help")
        assert proc.returncode == 0 and "--enforce-eager" in proc.stdout, cmd


def test_bench_decode_on_cpu_never_uses_graphs():
    for flags in ([], ["--enforce-eager"]):
        proc = kvserve("bench", "decode", "--model", MODEL, "--context", "40", "--steps", "2", "--warmup", "1", *flags)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1])["cuda_graphs"] is False


def test_generate_with_the_flag_matches_without_on_cpu():
    outs = []
    for flags in ([], ["--enforce-eager"]):
        proc = kvserve("generate", "--model", MODEL, "--prompt-ids", "1", "2", "3", "--max-tokens", "5", "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout)["token_ids"])
    assert outs[0] == outs[1]
