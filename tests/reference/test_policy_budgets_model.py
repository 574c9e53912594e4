"""`kvserve policy budgets --model`: the per-layer budgets a prompt gets (DynamicKV's depend on its
scores) equal those `kvserve forward --dump-kept` reports for the same prompt, for every variant."""
from __future__ import annotations

import json

import pytest

from kvserve_testlib import fixtures_dir, run_kvserve, write_json

PROMPT = [(11 * i + 5) % 1800 + 7 for i in range(57)]


@pytest.mark.parametrize("params", [[], ["variant=paper"], ["variant=authors", "m=2"], ["min_ratio=0.5"]])
def test_budgets_for_a_prompt_equal_the_forward_dump(tmp_path, params):
    model = str(fixtures_dir() / "llama-gqa")
    ids = write_json(tmp_path / "ids.json", PROMPT)
    flags = [x for p in params for x in ("--param", p)]
    got = json.loads(run_kvserve("policy", "budgets", "--policy", "dynamickv", "--budget", "16", "--model", model,
                                 "--input-ids", str(ids), *flags).stdout)
    dump = tmp_path / "kept.json"
    run_kvserve("forward", "--model", model, "--input-ids", str(ids), "--output", str(tmp_path / "l.safetensors"),
                "--dump-kept", str(dump), "--policy", "dynamickv", "--budget", "16",
                *[x for p in params for x in ("--policy-param", p)])
    want = json.loads(dump.read_text())
    assert got["budgets"] == want["budgets"]
    assert got["prompt_len"] == len(PROMPT) and got["total"] == sum(want["budgets"])
    assert any(b < len(PROMPT) for b in got["budgets"])


def test_budgets_model_needs_one_prompt(tmp_path):
    model = str(fixtures_dir() / "llama-gqa")
    bad = run_kvserve("policy", "budgets", "--policy", "dynamickv", "--model", model, check=False)
    assert bad.returncode != 0 and "exactly one of --prompt" in bad.stderr
    bad = run_kvserve("policy", "budgets", "--policy", "dynamickv", check=False)
    assert bad.returncode != 0 and "--prompt-len and --layers" in bad.stderr
