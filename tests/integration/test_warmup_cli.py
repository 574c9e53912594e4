"""The engine's warm-up from the command line (`--warmup-tokens`, `model.warmup_tokens`): on by default
only on CUDA, reported apart from the prompts' timings, and without effect on what is generated."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("KVSERVE_BIN", str(ROOT / "build" / "kvserve"))
MODEL = str(ROOT / "models" / "tiny-llama")


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=180)


def generate(*flags: str) -> dict:
    proc = kvserve("generate", "--model", MODEL, "--prompt-ids", "5", "9", "11", "200", "--max-tokens", "6",
                   "--ignore-eos", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_reports_the_warmup_and_answers_as_without():
    cold = generate()  # CPU: auto means none
    assert cold["timings"]["warmup_s"] == 0 and cold["warmup"]["prompts"] == 0
    warm = generate("--warmup-tokens", "96")
    assert warm["warmup"]["prompts"] >= 1 and warm["warmup"]["tokens"] == 96 and warm["warmup"]["decode_steps"] > 0
    assert 0 < warm["timings"]["warmup_s"] <= warm["timings"]["load_s"]
    assert warm["token_ids"] == cold["token_ids"]
    # No CUDA graphs on the CPU: nothing captured, in the warm-up or after it.
    assert warm["warmup"]["graph_captures"] == 0
    assert warm["cuda_graphs"] == {"captures": 0, "capture_s": 0, "captures_after_warmup": 0}


def test_generate_many_prompts_reports_the_warmup():
    prompts_file = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"warmup-prompts-{os.getpid()}.json"
    prompts_file.write_text(json.dumps([[5, 9, 11], [7, 7, 7, 7]]))
    try:
        proc = kvserve("generate", "--model", MODEL, "--prompts-file", str(prompts_file), "--max-tokens", "3", "--json",
                       "--warmup-tokens", "40")
    finally:
        prompts_file.unlink()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["warmup"]["tokens"] == 40 and out["warmup_s"] > 0
    assert out["cuda_graphs"]["captures_after_warmup"] == 0
    assert "warm-up: " in proc.stderr


def test_bad_warmup_tokens_are_refused(tmp_path):
    proc = kvserve("generate", "--model", MODEL, "--prompt-ids", "5", "--warmup-tokens", "-3")
    assert proc.returncode != 0 and "--warmup-tokens" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  warmup_tokens: many\n")
    proc = kvserve("config", "check", str(bad))
    assert proc.returncode != 0
    assert "bad.yaml:2" in proc.stderr and "model.warmup_tokens" in proc.stderr and "integer" in proc.stderr
    for cmd in (["serve"], ["generate"]):
        proc = kvserve(*cmd, "--help")
        assert proc.returncode == 0 and "--warmup-tokens" in proc.stdout, cmd
