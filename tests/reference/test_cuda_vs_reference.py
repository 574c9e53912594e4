"""kvserve on one CUDA device (skipped without one): the same answers as transformers on that device
and as kvserve on CPU.

- fp32 forward logits against transformers on CUDA (TF32 off on both sides) and bf16 against
  transformers in bf16 (rounding differs, so the check is argmax agreement and a mean-error bound);
- every policy's budgets and kept positions per (layer, KV head) identical to the CPU run (the
  fixtures have random weights, so no two scores tie);
- greedy generation on the embedded model identical to CPU, and the passkey answered;
- decode through CUDA graphs (the default on CUDA) generating what --enforce-eager generates, and
  `bench decode` replaying graphs unless --enforce-eager;
- the fused elementwise kernels (on by default; KVSERVE_FUSED_OPS=0 turns them off) under the same logits, graph and layout tests;
- the head-wise layout (a block table and a length per KV head) decoding through the CUDA kernels
  and graphs as it decodes on CPU, with head-adaptive SnapKV leaving the heads different lengths;
- Gemma 3 (sliding-window layers beside global ones): prefill logits against transformers, and greedy
  decoding through the windowed CUDA kernel (graphs and eager) as on CPU, uncompressed and with the
  global layers compressed;
- kvzip's reconstruction scoring keeping the same positions on CUDA as on CPU.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvserve_testlib import POLICY_FLAGS, ROOT, fixtures_dir, random_ids, run_kvserve, write_json

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FIXTURES = ["llama-gqa", "llama3-rope", "qwen2-bias", "mistral", "llama-tied", "gemma3", "qwen3"]
# `forward` runs no decode steps, so the decode-eviction variant would repeat knorm.
POLICIES = {k: v for k, v in POLICY_FLAGS.items() if k != "knorm-decode"}
POLICIES["snapkv-adaptive"] = [*POLICY_FLAGS["snapkv"], "--policy-param", "head_budgets=adaptive"]
POLICIES["kvzip"] = ["--policy", "kvzip", "--budget", "16", "--policy-param", "chunk_size=16"]


def kv_forward(tmp: pathlib.Path, model: str, ids: list[int], *args: str, tag: str = "x"):
    out, dump = tmp / f"logits-{tag}.safetensors", tmp / f"kept-{tag}.json"
    run_kvserve("forward", "--model", model, "--input-ids", str(write_json(tmp / f"ids-{tag}.json", ids)),
                "--output", str(out), "--dump-kept", str(dump), *args)
    return load_file(str(out))["logits"].float(), json.loads(dump.read_text())


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(params=["0", "1", "2"], ids=["torch-ops", "fused-ops", "fused-vec"])
def fused(request, monkeypatch):
    """Runs a test with the fused elementwise kernels off (torch op chains), on (KVSERVE_FUSED_OPS=1)
    and in their vectorized variants (2, the default, with the K/V append's)."""
    monkeypatch.setenv("KVSERVE_FUSED_OPS", request.param)
    return request.param


@pytest.mark.parametrize("name", FIXTURES)
def test_fp32_logits_match_transformers_on_cuda(name, tmp_path, fused):
    path = fixtures_dir() / name
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    for n in (1, 17, 640):
        ids = random_ids(n, hf.config.vocab_size, seed=n)
        got, _ = kv_forward(tmp_path, str(path), ids, "--device", "cuda", "--dtype", "float32", tag=str(n))
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-3, f"{name}: {n} tokens: max abs logit diff {diff}"


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_bf16_logits_track_transformers_bf16_on_cuda(name, tmp_path, fused):
    path = fixtures_dir() / name
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ids = random_ids(300, hf.config.vocab_size, seed=5)
    got, _ = kv_forward(tmp_path, str(path), ids, "--device", "cuda", "--dtype", "bfloat16")
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    mean_err = (got - ref).abs().mean().item() / ref.abs().mean().item()
    assert agree >= 0.95 and mean_err <= 0.05, f"{name}: argmax agreement {agree:.3f}, relative mean error {mean_err:.4f}"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_policy_keeps_the_same_positions_on_cuda_as_on_cpu(policy, tmp_path):
    path = str(fixtures_dir() / "llama-gqa")
    ids = [(7 * i + 3) % 1900 + 5 for i in range(57)]
    cpu_logits, cpu_kept = kv_forward(tmp_path, path, ids, *POLICIES[policy], tag="cpu")
    gpu_logits, gpu_kept = kv_forward(tmp_path, path, ids, "--device", "cuda", "--dtype", "float32",
                                      *POLICIES[policy], tag="cuda")
    assert (gpu_logits - cpu_logits).abs().max().item() <= 1e-3
    assert gpu_kept == cpu_kept


def test_embedded_model_generates_the_same_on_cuda_and_retrieves():
    import random
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import retrieval_tasks as rt
    from tokenizers import Tokenizer
    model = ROOT / "models" / "tiny-retriever"
    builder = rt.Builder(Tokenizer.from_file(str(model / "tokenizer.json")), 0)
    text, _, answer, _, _ = rt.build(builder, random.Random(31337), "passkey", 1500, depth=0.3, passkey_digits=5)
    outs = {}
    for dev in ("cpu", "cuda"):
        proc = run_kvserve("generate", "--model", str(model), "--prompt", text, "--max-tokens", "8", "--json",
                           "--device", dev, "--dtype", "float32", "--policy", "snapkv", "--budget", "256")
        outs[dev] = json.loads(proc.stdout)
    assert outs["cuda"]["token_ids"] == outs["cpu"]["token_ids"]
    assert outs["cuda"]["text"].startswith(answer), (outs["cuda"]["text"], answer)


def test_cuda_graphs_generate_what_eager_decode_generates(tmp_path, fused):
    model = ROOT / "models" / "tiny-llama"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    # Five prompts (bucket 8: three padding rows), of lengths that cross block and split boundaries.
    prompts = [random_ids(n, vocab, seed) for seed, n in enumerate([5, 40, 200, 33, 900])]
    path = write_json(tmp_path / "prompts.json", prompts)
    outs = {}
    for mode in ("graphs", "eager"):
        flags = ["--enforce-eager"] if mode == "eager" else []
        proc = run_kvserve("generate", "--model", str(model), "--prompts-file", str(path), "--max-tokens", "24",
                           "--ignore-eos", "--json", "--device", "cuda", "--dtype", "float32", *flags)
        out = json.loads(proc.stdout)
        outs[mode] = [r["token_ids"] for r in out["results"]]
        graphs = out["cuda_graphs"]
        if mode == "eager":
            assert graphs["captures"] == 0
        else:  # the warm-up's buckets and hints, then whatever the prompts' steps needed
            assert graphs["captures"] >= 1 and graphs["capture_s"] > 0
            assert graphs["captures"] == out["warmup"]["graph_captures"] + graphs["captures_after_warmup"]
    assert outs["graphs"] == outs["eager"]


def test_bench_decode_replays_graphs_unless_enforce_eager():
    model = ROOT / "models" / "tiny-llama"
    args = ["bench", "decode", "--model", str(model), "--device", "cuda", "--context", "300", "--batch", "3",
            "--steps", "6", "--warmup", "2", "--block-size", "16"]
    graphs = json.loads(run_kvserve(*args).stdout.strip().splitlines()[-1])
    eager = json.loads(run_kvserve(*args, "--enforce-eager").stdout.strip().splitlines()[-1])
    assert graphs["cuda_graphs"] is True and graphs["cuda_graph_stats"]["replays"] == 8
    assert graphs["cuda_graph_stats"]["eager"] == 0
    assert eager["cuda_graphs"] is False
    for got in (graphs, eager):  # the host planning, timed apart on both paths
        assert 0 < got["host_plan_s_median"] <= got["step_s_median"], got
    # Without a profiler attached the range is a no-op that must not disturb the steps.
    ranged = json.loads(run_kvserve(*args, "--cuda-profiler-steps", "2").stdout.strip().splitlines()[-1])
    assert ranged["cuda_profiler_steps"] == 2 and ranged["cuda_graph_stats"]["replays"] == 8


def test_head_layout_decodes_on_cuda_as_on_cpu(tmp_path, fused):
    model = ROOT / "models" / "tiny-retriever"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = [random_ids(n, vocab, seed) for seed, n in enumerate([40, 300, 700, 129, 1000])]
    path = write_json(tmp_path / "prompts.json", prompts)
    flags = ["--kv-layout", "head", "--policy", "snapkv", "--budget", "64", "--policy-param", "head_budgets=adaptive",
             "--max-tokens", "16", "--ignore-eos", "--json", "--dtype", "float32"]
    outs = {}
    for mode, extra in (("cpu", ["--device", "cpu"]), ("graphs", ["--device", "cuda"]),
                        ("eager", ["--device", "cuda", "--enforce-eager"])):
        got = json.loads(run_kvserve("generate", "--model", str(model), "--prompts-file", str(path), *flags,
                                     *extra).stdout)
        outs[mode] = [r["token_ids"] for r in got["results"]]
        heads = [r["kv_tokens_per_head"] for r in got["results"]]
        assert any(h["min"] < h["max"] for h in heads), (mode, heads)
    assert outs["graphs"] == outs["eager"]
    assert outs["graphs"] == outs["cpu"]


@pytest.mark.parametrize("policy,prefix", [("full", "on"), ("full", "off"), ("snapkv", "on")])
def test_gemma3_decodes_on_cuda_as_on_cpu(policy, prefix, tmp_path):
    """The gemma3 fixture's local layers (window 12, blocks of 16) decode through the windowed CUDA
    kernel: prompts shorter than, equal to and far past the window, 24 tokens each, so every row's
    window start moves across block boundaries while it decodes. With prefix caching on, a local
    layer holds its whole prompt (the kernel starts at the window's block); off, it keeps a ring."""
    path = fixtures_dir() / "gemma3"
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = [random_ids(n, vocab, seed) for seed, n in enumerate([5, 12, 13, 40, 300])]
    prompts_file = write_json(tmp_path / "prompts.json", prompts)
    flags = ["--max-tokens", "24", "--ignore-eos", "--json", "--dtype", "float32", *POLICY_FLAGS[policy]]
    if prefix == "off":
        flags.append("--no-enable-prefix-caching")
    outs = {}
    for mode, extra in (("cpu", ["--device", "cpu"]), ("graphs", ["--device", "cuda"]),
                        ("eager", ["--device", "cuda", "--enforce-eager"])):
        got = json.loads(run_kvserve("generate", "--model", str(path), "--prompts-file", str(prompts_file), *flags,
                                     *extra).stdout)
        outs[mode] = [r["token_ids"] for r in got["results"]]
    assert outs["graphs"] == outs["eager"]
    assert outs["graphs"] == outs["cpu"]
