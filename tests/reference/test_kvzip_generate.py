"""`kvserve generate --policy kvzip` end to end on the embedded tiny-retriever: a passkey in a
~1,500-token haystack is answered from a cache holding 25 % of the prompt's KV entries, chosen by
reconstruction scores (docs/eval/kvzip-notes.md). The same prompt under the other allocators that
take kvzip's scores (uniform per-head budgets, PyramidKV) also runs and compresses."""
from __future__ import annotations

import json
import random
import sys

import pytest

from kvserve_testlib import ROOT, run_kvserve

MODEL = ROOT / "models" / "tiny-retriever"


def passkey_prompt(seed: int, length: int = 1500):
    sys.path.insert(0, str(ROOT / "tools"))
    import retrieval_tasks as rt
    from tokenizers import Tokenizer
    builder = rt.Builder(Tokenizer.from_file(str(MODEL / "tokenizer.json")), 0)
    text, _, answer, _, _ = rt.build(builder, random.Random(seed), "passkey", length, depth=0.4, passkey_digits=5)
    return text, answer


def generate(text: str, *policy: str) -> dict:
    proc = run_kvserve("generate", "--model", str(MODEL), "--prompt", text, "--max-tokens", "8", "--json", *policy)
    return json.loads(proc.stdout)


@pytest.mark.parametrize("seed", [31337, 7])
def test_kvzip_answers_passkey_at_quarter_kept(seed):
    text, answer = passkey_prompt(seed)
    full = generate(text, "--policy", "full")
    assert full["text"].startswith(answer), (full["text"], answer)
    out = generate(text, "--policy", "kvzip", "--budget", "0.25")
    assert out["text"].startswith(answer), (out["text"], answer)
    kept, whole = out["kv_tokens_kept"], out["kv_tokens_full"]
    assert kept <= 0.26 * whole, f"kept {kept} of {whole} KV tokens"
    heads = out["kv_tokens_per_head"]
    assert heads["min"] < heads["max"], "one global top-k keeps different counts per (layer, head)"


@pytest.mark.parametrize("params", [["--policy-param", "allocator=uniform", "--policy-param", "head_budgets=uniform"],
                                    ["--policy-param", "allocator=pyramid", "--policy-param", "head_budgets=uniform"],
                                    ["--policy-param", "allocator=dynamic"]])
def test_kvzip_scores_under_other_allocators(params):
    text, answer = passkey_prompt(31337)
    out = generate(text, "--policy", "kvzip", "--budget", "0.25", *params)
    assert out["kv_tokens_kept"] < 0.3 * out["kv_tokens_full"]
    assert out["text"].startswith(answer), (params, out["text"], answer)
