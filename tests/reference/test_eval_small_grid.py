"""The retrieval evaluation on the embedded default model (models/tiny-retriever), small enough for
`make test`: `full` keeps passkey/needle accuracy on held-out prompts at the trained length, and a tiny
policy x budget grid writes its tables, CSVs and heatmaps (to a temporary directory, not docs/).
The full grid is `make eval` (tools/eval_retrieval.py, tools/eval_perplexity.py -> docs/eval/)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from kvserve_testlib import ROOT, kvserve_bin, run_kvserve

MODEL = ROOT / "models" / "tiny-retriever"
EVAL = ROOT / "tools" / "eval_retrieval.py"

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="models/tiny-retriever not present")


def _eval(out, *args: str) -> list[dict]:
    cmd = [sys.executable, str(EVAL), "--kvserve", kvserve_bin(), "--model", str(MODEL), "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_full_retrieves_at_trained_length(tmp_path):
    # 40 held-out prompts per task at the trained length (max_position_embeddings), 8 depths x 5 samples.
    trained = json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
    rows = _eval(tmp_path, "--policies", "full", "--tasks", "passkey", "needle", "--lengths", str(trained),
                 "--depths", "0", "0.14", "0.28", "0.43", "0.57", "0.71", "0.86", "1", "--n", "5",
                 "--seed", "424242", "--no-plots")
    acc = {r["task"]: float(r["accuracy"]) for r in rows}
    assert acc["passkey"] >= 0.99, acc
    assert acc["needle"] >= 0.95, acc


def test_small_grid_writes_tables_and_heatmaps(tmp_path):
    rows = _eval(tmp_path, "--policies", "full", "snapkv", "streamingllm", "knorm", "--budgets", "64",
                 "--knorm-compressions", "50", "--lengths", "256", "512", "--depths", "0.2", "0.8", "--n", "1")
    names = {(r["policy"], r["task"]) for r in rows}
    for p in ("full", "snapkv-64", "streamingllm-64", "knorm-64", "knorm-c50"):
        for t in ("passkey", "needle", "multikey"):
            assert (p, t) in names
    for f in ("results.csv", "summary.csv", "tables.md", "run.json", "accuracy_vs_budget.png",
              "heatmap_passkey_b64.png", "heatmap_needle_knorm.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    md = (tmp_path / "tables.md").read_text()
    assert "| snapkv |" in md and "### needle" in md
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["prompts_per_policy"] == 2 * 2 * 3
    for r in rows:
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and int(r["n"]) == 4


def test_kvserve_tokenizer_matches_training_segments():
    """The eval builds prompts by concatenating segment ids; kvserve must tokenize the text the same."""
    sys.path.insert(0, str(ROOT / "tools"))
    import random

    import retrieval_tasks as rt
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    b = rt.Builder(tok, tok.token_to_id("<|begin_of_text|>"))
    rng = random.Random(99)
    texts, ids = [], []
    for i in range(12):
        task = ("passkey", "needle", "multikey", "continue")[i % 4]
        t, x, _, _, _ = rt.build(b, rng, task, rng.choice([100, 700]), chat=(i % 3 == 0))
        texts.append(t)
        ids.append(x)
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        f = pathlib.Path(d) / "in.txt"
        f.write_text("\n".join(json.dumps(t) for t in texts) + "\n")
        out = run_kvserve("tokenize", "--model", str(MODEL), "--text-file", str(f), "--json-input").stdout
    got = [json.loads(line) for line in out.splitlines()]
    assert got == ids
