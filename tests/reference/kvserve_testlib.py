"""Shared helpers for the Python reference tests: where the binary and fixtures are, and running it."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kvserve_bin() -> str:
    path = os.environ.get("KVSERVE_BIN", str(ROOT / "build" / "kvserve"))
    if not pathlib.Path(path).exists():
        pytest.skip(f"kvserve binary not built ({path})")
    return path


def fixtures_dir() -> pathlib.Path:
    """The fixture checkpoints; made on demand when the Makefile did not make them."""
    path = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", str(ROOT / ".fixtures")))
    if not (path / "VERSION").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_fixture_models.py"), "--out", str(path)],
                       check=True)
    return path


@functools.cache
def default_model_dir() -> pathlib.Path:
    """The default model (SmolLM2-135M-Instruct), converted by tools/make_smollm2.py if `make model`
    has not made it yet (the tool returns at once when the directory is current)."""
    path = pathlib.Path(os.environ.get("KVSERVE_DEFAULT_MODEL", str(ROOT / "models" / "smollm2-135m-instruct")))
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_smollm2.py"), "--out", str(path)], check=True)
    return path


def run_kvserve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([kvserve_bin(), *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvserve {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids drawn uniformly from the vocabulary, reproducibly."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def write_json(path: pathlib.Path, value) -> pathlib.Path:
    path.write_text(json.dumps(value))
    return path


# Flags of every policy for `forward` / `generate`, with budgets below the test prompts' lengths so
# that every policy compresses.
POLICY_FLAGS = {
    "full": [],
    "snapkv": ["--policy", "snapkv", "--budget", "16", "--policy-param", "window=4"],
    "pyramidkv": ["--policy", "pyramidkv", "--budget", "16", "--policy-param", "window=4"],
    "dynamickv": ["--policy", "dynamickv", "--budget", "16", "--policy-param", "window=4"],
    "streamingllm": ["--policy", "streamingllm", "--budget", "16", "--policy-param", "sink=4"],
    "h2o": ["--policy", "h2o", "--budget", "16"],
    "knorm": ["--policy", "knorm", "--budget", "16"],
    "knorm-decode": ["--policy", "knorm", "--budget", "16", "--policy-param", "decode_budget=24"],
}
