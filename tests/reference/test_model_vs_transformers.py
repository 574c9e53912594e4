"""kvserve's forward pass and greedy generation against Hugging Face transformers on every fixture."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvserve_testlib import default_model_dir, fixtures_dir, random_ids, run_kvserve, write_json

# Scaled RoPE whose original context (64 positions) the longer prompts pass: yarn extends it
# statically, dynamic NTK and longrope change their frequencies with the sequence length.
SCALED_ROPE = ["llama-yarn", "llama-dynamic", "llama-longrope"]
FIXTURES = ["llama-mha", "llama-gqa", "llama3-rope", "llama-tied", "qwen2-bias", "mistral", "llama-sharded",
            "llama-bf16", "llama-kvfew", "qwen3", "gemma3", *SCALED_ROPE]


def hf_model(name: str):
    # bf16 fixtures are compared in fp32 compute, as kvserve runs them on CPU.
    return transformers.AutoModelForCausalLM.from_pretrained(fixtures_dir() / name, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", FIXTURES)
def test_forward_logits_match(name, tmp_path):
    model = hf_model(name)
    # Increasing lengths: transformers' dynamic NTK keeps the frequencies of its longest forward so far.
    for n in (1, 17, 100, 640) if name in SCALED_ROPE else (1, 17, 640):
        ids = random_ids(n, model.config.vocab_size, seed=n)
        out = tmp_path / f"logits-{n}.safetensors"
        run_kvserve("forward", "--model", str(fixtures_dir() / name), "--input-ids",
                    str(write_json(tmp_path / f"ids-{n}.json", ids)), "--output", str(out))
        got = load_file(out)["logits"]
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].float()
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: prompt of {n} tokens: max abs logit diff {diff}"


GREEDY_CASES = [(name, 24) for name in FIXTURES if name not in SCALED_ROPE] + \
    [(name, n) for name in SCALED_ROPE for n in (50, 80)]


# The scaled-rope prompts start below the original context and decode past it (50 + 32 > 64), or
# start past it: transformers' generate rotates each new token with the frequencies of its own
# length, the cached keys keep theirs, and so does kvserve (backend/model/rope.h).
@pytest.mark.parametrize("name,prompt_len", GREEDY_CASES)
def test_greedy_generation_matches(name, prompt_len):
    model = hf_model(name)
    ids = random_ids(prompt_len, model.config.vocab_size, seed=7)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=0)[0, len(ids):].tolist()
    out = run_kvserve("generate", "--model", str(fixtures_dir() / name), "--prompt-ids", *map(str, ids),
                      "--max-tokens", "32", "--ignore-eos", "--json")
    got = json.loads(out.stdout)["token_ids"]
    assert got == ref


def test_batched_decode_equals_each_alone(tmp_path):
    """Four sequences of different lengths decoded together give the tokens each gives alone."""
    name = "llama-gqa"
    vocab = hf_model(name).config.vocab_size
    prompts = [random_ids(n, vocab, seed=100 + n) for n in (3, 40, 17, 90)]
    spec = write_json(tmp_path / "batch.json", prompts)
    together = json.loads(run_kvserve("generate", "--model", str(fixtures_dir() / name), "--prompts-file",
                                      str(spec), "--max-tokens", "24", "--ignore-eos", "--json").stdout)
    assert together["max_running"] == 4, "the four sequences were not decoded in one batch"
    for i, p in enumerate(prompts):
        alone = json.loads(run_kvserve("generate", "--model", str(fixtures_dir() / name), "--prompt-ids", *map(str, p),
                                       "--max-tokens", "24", "--ignore-eos", "--json").stdout)
        assert together["results"][i]["token_ids"] == alone["token_ids"], f"sequence {i} differs when batched"


def test_perplexity_full_cache_matches_transformers(tmp_path):
    """`kvserve perplexity` (a prefilled head, then the true tokens decoded one at a time through the
    paged cache) scores every next token as transformers does over the whole document."""
    name = "llama-gqa"
    model = hf_model(name)
    docs = [random_ids(90, model.config.vocab_size, seed=11), random_ids(57, model.config.vocab_size, seed=12)]
    ids = write_json(tmp_path / "docs.json", docs)
    proc = run_kvserve("perplexity", "--model", str(fixtures_dir() / name), "--input-ids", str(ids), "--prefill", "16")
    out = json.loads(proc.stdout)
    assert out["scored"] == sum(len(d) - 1 for d in docs)
    for doc, got in zip(docs, out["documents"]):
        x = torch.tensor([doc])
        with torch.no_grad():
            logits = model(x).logits[0, :-1].float()
        ref = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        assert got["scored"] == len(doc) - 1
        assert abs(got["nll"] - ref) <= 1e-5 * abs(ref), (got["nll"], ref)


@pytest.mark.parametrize("policy", ["kvzip", "kvzap"])
def test_perplexity_runs_the_context_compressing_policies(tmp_path, policy):
    """`kvserve perplexity --policy kvzip|kvzap` (they once exhausted its pool): the prompt's KV is
    compressed to about the budget and every token is scored."""
    if not (default_model_dir() / "kvzap" / "config.json").exists():
        pytest.skip("the default model is not made (make model)")
    docs = [random_ids(199, 49152, seed=21)]
    ids = write_json(tmp_path / "docs.json", docs)
    out = json.loads(run_kvserve("perplexity", "--model", str(default_model_dir()), "--input-ids", str(ids),
                                 "--prefill", "150", "--policy", policy, "--budget", "0.5").stdout)
    assert out["scored"] == 198 and out["policy"] == policy
    assert 0 < out["mean_visible_fraction"] < 0.9, out["mean_visible_fraction"]
