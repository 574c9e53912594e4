"""`kvserve serve` on one CUDA device (skipped without one), over HTTP with the official openai
client: streamed chat, per-request KV policies, and greedy output identical to a CPU server; a
completion's `kv_context` compressed once by kvzip on the GPU and reused, with a CPU server's tokens
(the embedded model, and the Gemma 3 fixture, whose local layers decode through the windowed kernel)."""
from __future__ import annotations

import os
import pathlib

import openai
import pytest

from kvserve_server import Server

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "models" / "tiny-retriever")
TEXT = ("Read the following text and answer the question at the end. Boris painted the old bridge near Lima. "
        "In the morning, the baker from Lima walked to the tower. Julia keeps the lamp in the attic. "
        "Boris and Julia shared some bread by the tower. The rain lasted for 12 days in Lima. "
        "Where does Julia keep the lamp?")
PROMPT = TEXT + " Julia keeps the lamp in the"


def completions(url: str) -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    out = {}
    for policy in ("full", "snapkv", "pyramidkv"):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"kv_policy": policy})
        out[policy] = r.choices[0].text
    return out


def test_cuda_server_matches_cpu_server():
    cuda = Server(model=MODEL, extra_args=("--device", "cuda"))
    try:
        got = completions(cuda.url)
        c = openai.OpenAI(base_url=cuda.url + "/v1", api_key="unused")
        stream = c.chat.completions.create(model="tiny", stream=True, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": TEXT}])
        chat = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    finally:
        assert cuda.stop() == 0, cuda.log()[-3000:]
    cpu = Server(model=MODEL)
    try:
        want = completions(cpu.url)
    finally:
        cpu.stop()
    assert got == want
    assert got["full"].strip().startswith("attic"), got
    assert "attic" in chat, chat


CONTEXT = " ".join(f"Record {i}: the {w} is kept in box {i * 7 % 31}." for i, w in
                   enumerate(["lamp", "coin", "map", "key", "rope", "ink", "bell", "dice"] * 3))


def context_answers(url: str) -> list[tuple[str, int]]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = []
    for q in ("Where is the lamp?", "Where is the bell?", "Where is the coin?"):
        r = c.completions.create(model="tiny", prompt=f"\nQuestion: {q}\nAnswer:", max_tokens=8, temperature=0,
                                 extra_body={"kv_policy": "kvzip", "kv_context": CONTEXT})
        out.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
    return out


@pytest.mark.parametrize("model", ["tiny-retriever", "gemma3"])
def test_cuda_compressed_context_matches_cpu(model):
    if model == "gemma3":
        path = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", pathlib.Path(MODEL).parents[1] / ".fixtures")) / "gemma3"
        if not (path / "config.json").exists():
            pytest.skip("no gemma3 fixture (make fixtures)")
        yaml = "  kvzip:\n    budget: 24\n"
    else:
        path, yaml = pathlib.Path(MODEL), "  kvzip:\n    budget: 0.25\n"
    got = {}
    for dev in ("cuda", "cpu"):
        srv = Server(model=str(path), extra_yaml=yaml, extra_args=("--device", dev, "--dtype", "float32"))
        try:
            got[dev] = context_answers(srv.url)
            assert srv.metrics()["kvserve:compressed_contexts"] >= 1
        finally:
            assert srv.stop() == 0, srv.log()[-3000:]
    assert got["cuda"] == got["cpu"]
    cached = [c for _, c in got["cuda"]]
    assert cached[0] == 0 and cached[1] == cached[2] > 100, cached


SPEC = {
    "ngram": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
             '"auto_disable": false}',
    "self": '{"method": "self", "num_speculative_tokens": 3, "draft_sink_tokens": 16, "draft_window_tokens": 32, '
            '"draft_min_context_tokens": 0, "auto_disable": false}',
    "self-snapkv": '{"method": "self", "num_speculative_tokens": 3, "draft_sink_tokens": 16, '
                   '"draft_window_tokens": 32, "draft_min_context_tokens": 0, "draft_policy": "snapkv", '
                   '"draft_budget": 48, "auto_disable": false}',
}


@pytest.mark.parametrize("method", list(SPEC))
def test_speculative_decoding_on_cuda_changes_no_token(method):
    # Speculation on the GPU: drafts as further rows of their sequences in one eager step (plain steps
    # replay graphs), the verify through the multi-row decode path, rejected rows truncated. Greedy fp32:
    # every token must be plain decoding's on the same device, and some drafts must be accepted.
    import json
    import subprocess
    from kvserve_server import kvserve_bin
    args = [kvserve_bin(), "generate", "--model", MODEL, "--device", "cuda", "--dtype", "float32", "--prompt",
            TEXT + " " + CONTEXT + " Record 3: the", "--max-tokens", "32", "--ignore-eos", "--json"]
    spec = subprocess.run(args + ["--speculative-config", SPEC[method]], capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr[-3000:]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    j, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert j["token_ids"] == p["token_ids"], (j["text"], p["text"])
    s = j["speculative"]
    assert s["drafts"] > 0 and s["accepted_tokens"] > 0, s


def fixture_logits(tmp_path, name: str, *args: str):
    """kvserve forward's logits (float32) on llama-gqa for 40 fixed token ids, with `args`."""
    import json
    import subprocess
    import numpy as np
    from safetensors.numpy import load_file
    from kvserve_server import kvserve_bin
    fixture = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", pathlib.Path(MODEL).parents[1] / ".fixtures")) / "llama-gqa"
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([(i * 37 + 11) % 2000 for i in range(40)]))
    out = tmp_path / f"{name}.safetensors"
    subprocess.run([kvserve_bin(), "forward", "--model", str(fixture), *args, "--input-ids", str(ids), "--output", str(out)],
                   check=True, timeout=300)
    return load_file(str(out))["logits"].astype(np.float32)


def generate_on_cuda(*args: str) -> dict:
    """generate --json on the GPU (bfloat16, 8 tokens of PROMPT) with `args`: its summary line."""
    import json
    import subprocess
    from kvserve_server import kvserve_bin
    gen = subprocess.run([kvserve_bin(), "generate", "--model", MODEL, "--device", "cuda", "--dtype", "bfloat16", *args,
                          "--prompt", PROMPT, "--max-tokens", "8", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(gen.stdout.strip().splitlines()[-1])


def test_fp8_weights_on_cuda_track_the_cpu_reference(tmp_path):
    # --quantization fp8: e4m3 weights, per-token e4m3 activations, at::_scaled_mm on the GPU (whose
    # row-wise scaled products are written in bfloat16) against libtorch's CPU _scaled_mm (float32).
    import numpy as np
    a, b = (fixture_logits(tmp_path, dev, "--device", dev, "--dtype", "float32", "--quantization", "fp8")
            for dev in ("cuda", "cpu"))
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
    j = generate_on_cuda("--quantization", "fp8")
    assert j["weights"]["format"].startswith("float8_e4m3fn") and j["completion_tokens"] == 8


def test_int4_weights_on_cuda_track_the_dense_model(tmp_path):
    # --quantization int4 on a GPU: 4-bit groups with bfloat16 scales and zeros, libtorch's tinygemm
    # (bfloat16 activations), against the same checkpoint's dense bfloat16 logits on the GPU. The
    # LM head stays dense; every other linear layer of llama-gqa tiles (rows % 8, columns % 32).
    import subprocess
    import numpy as np
    from kvserve_server import kvserve_bin
    gpu = ("--device", "cuda", "--dtype", "bfloat16")
    a = fixture_logits(tmp_path, "int4", *gpu, "--quantization", "int4")
    b = fixture_logits(tmp_path, "dense", *gpu)
    assert np.abs(a - b).max() <= 0.25 * np.abs(b).max()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75
    j = generate_on_cuda("--quantization", "int4")
    assert j["weights"]["format"].startswith("int4_g") and j["completion_tokens"] == 8
    # ggml block types stay CPU products: refused on the GPU, naming what to use there.
    bad = subprocess.run([kvserve_bin(), "generate", "--model", MODEL, "--device", "cuda", "--quantization", "q8_0",
                          "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "fp8" in bad.stderr and "int8" in bad.stderr and "int4" in bad.stderr, bad.stderr


def test_int8_weights_on_cuda_track_the_dense_model(tmp_path, monkeypatch):
    # --quantization int8 on a GPU: int8 codes with a float32 scale per group of columns. A 40-token
    # forward expands the weights for one GEMM (more than 16 rows); with KVSERVE_INT8_DENSE_ROWS=0 every
    # product runs kvserve's few-row kernel instead (five passes of 8 rows): the two must agree to fp32
    # sums, and both track the dense float32 model as 8-bit rounding allows. generate decodes on the kernel.
    import numpy as np
    gpu = ("--device", "cuda", "--dtype", "float32")
    expanded = fixture_logits(tmp_path, "int8", *gpu, "--quantization", "int8")
    monkeypatch.setenv("KVSERVE_INT8_DENSE_ROWS", "0")
    kernel = fixture_logits(tmp_path, "int8-kernel", *gpu, "--quantization", "int8")
    monkeypatch.delenv("KVSERVE_INT8_DENSE_ROWS")
    dense = fixture_logits(tmp_path, "dense", *gpu)
    assert np.abs(kernel - expanded).max() <= 1e-3 * np.abs(expanded).max()
    assert np.abs(expanded - dense).max() <= 0.05 * np.abs(dense).max()
    assert (expanded.argmax(-1) == dense.argmax(-1)).mean() >= 0.9
    j = generate_on_cuda("--quantization", "int8")
    assert j["weights"]["format"].startswith("int8_g") and j["completion_tokens"] == 8


def test_gguf_blocks_keep_their_integers_on_cuda(tmp_path):
    # The default model's Q4_1 GGUF on a GPU (backend/quantization/gguf_cuda_forms.h): its Q8_0
    # embedding (tied to the LM head) stays int8 codes with their fp16 scales widened (Int8Weight,
    # groups of 32, the LM head's product on kvserve's kernel); its Q4_1 layers become tinygemm's int4
    # groups of 32 (the nibbles, bfloat16 scale and zero, bfloat16 activations). The float32 directory
    # is that file's dequantization: the GPU's logits track it as bfloat16 rounding allows.
    import json
    import subprocess
    import numpy as np
    from safetensors.numpy import load_file
    from kvserve_server import kvserve_bin
    d = pathlib.Path(MODEL).parents[0] / "smollm2-135m-instruct"
    gguf = d / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not made (make model)")
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([(i * 37 + 11) % 49152 for i in range(12)]))
    logits = {}
    for name, model in (("gguf", gguf), ("f32", d)):
        out = tmp_path / f"{name}.safetensors"
        subprocess.run([kvserve_bin(), "forward", "--model", str(model), "--device", "cuda", "--dtype", "float32",
                        "--input-ids", str(ids), "--output", str(out)], check=True, timeout=300)
        logits[name] = load_file(str(out))["logits"].astype(np.float32)
    assert np.abs(logits["gguf"] - logits["f32"]).max() <= 0.1 * np.abs(logits["f32"]).max()
    assert (logits["gguf"].argmax(-1) == logits["f32"].argmax(-1)).mean() >= 0.75
    gen = subprocess.run([kvserve_bin(), "generate", "--model", str(gguf), "--device", "cuda", "--dtype", "bfloat16",
                          "--prompt", PROMPT, "--max-tokens", "8", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    j = json.loads(gen.stdout.strip().splitlines()[-1])
    fmt = j["weights"]["format"]
    assert "int8_g32" in fmt and "int4_g32" in fmt and j["completion_tokens"] == 8, j["weights"]
    # Nothing of the file is widened to bfloat16.
    assert "dequantized" not in gen.stderr, gen.stderr[-2000:]


@pytest.mark.parametrize("kv", ["int8", "int4", "q4_1"])
def test_quantized_kv_on_cuda_matches_the_cpu_pool(kv):
    # A quantized pool on the GPU: rows encoded on the device (the host's bytes), decode steps through
    # the quantized kernel, prefill and compression through the device decode. Greedy fp32 tokens must be
    # a CPU pool's of the same format, under full KV and a compressing policy.
    import json
    import subprocess
    from kvserve_server import kvserve_bin
    for policy in ("full", "snapkv"):
        got = {}
        for dev in ("cuda", "cpu"):
            out = subprocess.run([kvserve_bin(), "generate", "--model", MODEL, "--device", dev, "--dtype", "float32",
                                  "--kv-cache-dtype", kv, "--policy", policy, "--prompt", TEXT + " " + CONTEXT,
                                  "--max-tokens", "24", "--ignore-eos", "--json"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            got[dev] = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["cuda"]["token_ids"] == got["cpu"]["token_ids"], (kv, policy, got["cuda"]["text"], got["cpu"]["text"])
        assert got["cuda"]["kv_cache_dtype"] == got["cpu"]["kv_cache_dtype"], got["cuda"]
