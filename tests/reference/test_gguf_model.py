"""kvserve serving a GGUF file as it ships, against peers no one here wrote: the gguf Python
package's dequantize (every tensor, bit for bit), transformers' float32 conversion of the same file
(prefill logits, bit for bit: prompts of more than 32 tokens run the dequantized weights through
the float GEMM), and clear errors for broken files."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvserve_testlib import ROOT, default_model_dir, random_ids, run_kvserve, write_json

gguf = pytest.importorskip("gguf")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf():
    path = default_model_dir() / GGUF_NAME
    assert path.exists(), f"{path} missing: tools/make_smollm2.py copies it beside the float32 weights"
    return path


def test_every_tensor_dequantizes_as_the_gguf_package_does(tmp_path):
    path = default_gguf()
    out = tmp_path / "deq.safetensors"
    run_kvserve("gguf", "dequantize", "--model", str(path), "--out", str(out))
    ours = load_file(str(out))
    reader = gguf.GGUFReader(str(path))
    assert set(ours) == {t.name for t in reader.tensors}
    types = set()
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        got = ours[t.name]
        assert got.shape == tuple(reversed([int(n) for n in t.shape])), t.name
        np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=t.name)
        types.add(t.tensor_type.name)
    assert types == {"Q4_1", "Q8_0", "F32"}


def test_inspect_names_the_architecture_and_types():
    info = json.loads(run_kvserve("gguf", "inspect", "--model", str(default_gguf()), "--json").stdout)
    assert info["architecture"] == "llama" and info["served_as"] == "LlamaForCausalLM"
    assert info["config"]["num_hidden_layers"] == 30 and info["config"]["tie_word_embeddings"] is True
    assert set(info["bytes_by_type"]) == {"q4_1", "q8_0", "f32"}
    # The config read from the metadata is the one transformers wrote for the float32 conversion.
    hf = json.loads((default_model_dir() / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id"):
        assert info["config"][key] == hf[key], key


def forward_logits(tmp_path, model, ids, *flags, name="out"):
    out = tmp_path / f"{name}.safetensors"
    run_kvserve("forward", "--model", str(model), "--input-ids", str(write_json(tmp_path / "ids.json", ids)),
                "--output", str(out), *flags)
    return load_file(str(out))["logits"]


def test_prefill_logits_equal_the_float32_conversion_bit_for_bit(tmp_path):
    # llama.cpp's converter stores Llama's q/k rows interleaved per head; kvserve reorders them as
    # transformers' GGUF loader does, so the dequantized weights are the float32 checkpoint's.
    # A GGUF's KV cache is float16 by default (as llama.cpp's): float32 here, as the directory's.
    ids = random_ids(40, 49152, 11)
    from_gguf = forward_logits(tmp_path, default_gguf(), ids, "--kv-cache-dtype", "float32", name="gguf")
    from_f32 = forward_logits(tmp_path, default_model_dir(), ids, name="f32")
    np.testing.assert_array_equal(from_gguf, from_f32)
    # The default float16 cache rounds the prompt's K/V once: the logits move in their last digits.
    half = forward_logits(tmp_path, default_gguf(), ids, name="gguf16")
    assert 0 < np.abs(half - from_f32).max() < 0.1 and (half.argmax(-1) == from_f32.argmax(-1)).mean() > 0.9


def generate(model, *flags, n=24):
    proc = run_kvserve("generate", "--model", str(model), "--prompt", "The capital of France is", "--max-tokens", str(n),
                       "--json", *flags)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_decode_runs_on_the_blocks_and_reports_them():
    q = generate(default_gguf())
    f = generate(default_model_dir())
    assert q["weights"]["format"] == "q4_1+q8_0" and f["weights"]["format"] == "float32"
    # llama.cpp's default KV cache for a GGUF (f16); the float32 directory keeps its compute dtype.
    assert q["kv_cache_dtype"] == "float16" and f["kv_cache_dtype"] == "float32"
    assert generate(default_gguf(), "--kv-cache-dtype", "float32", n=1)["kv_cache_dtype"] == "float32"
    # 5 bits a weight (and an 8-bit embedding) against 32.
    assert q["weights"]["bytes"] * 4 < f["weights"]["bytes"]
    # The first token comes from the prefill's logits, which equal the float32 model's.
    assert q["token_ids"][0] == f["token_ids"][0]
    assert q["completion_tokens"] == 24 and q["text"].strip()


def perplexity(tmp_path, model, ids, *flags) -> float:
    """Teacher-forced perplexity decoded token by token: every step runs the quantized kernels."""
    proc = run_kvserve("perplexity", "--model", str(model), "--input-ids", str(write_json(tmp_path / "ppl.json", ids)),
                       "--prefill", "16", *flags)
    return json.loads(proc.stdout.strip().splitlines()[-1])["perplexity"]


def test_quantized_decode_keeps_the_perplexity(tmp_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    ids = tok.encode((ROOT / "README.md").read_text()[:3000]).ids[:300]
    f32 = perplexity(tmp_path, default_model_dir(), ids)
    # The shipped Q4_1 blocks differ from the float32 conversion only by the 8-bit activations.
    assert perplexity(tmp_path, default_gguf(), ids) / f32 < 1.01
    for quant, fmt, bound in (("int8", "q8_0", 1.03), ("int4", "q4_0+q8_0", 1.4)):
        assert generate(default_model_dir(), "--quantization", quant, n=4)["weights"]["format"] == fmt
        assert perplexity(tmp_path, default_model_dir(), ids, "--quantization", quant) / f32 < bound, quant


def test_a_k_quant_whose_blocks_do_not_fit_falls_back_as_llama_quantize_does(tmp_path):
    """The default model's rows of 576 values are not whole 256-value super-blocks: `--quantization
    q4_k` makes those weights Q5_0 (llama-quantize's fallback, what llama.cpp's Q4_K_M files of such
    models hold) and the MLP's down projection (rows of 1536) Q4_K, and says so at load; prompts
    decoded together (the K-quant tiles) equal each decoded alone (vec_dot), and the perplexity
    stays near float32's (+7 % on 200 tokens of this README, 2026-12-02)."""
    def q4_k(*args):
        proc = run_kvserve("generate", "--model", str(default_model_dir()), "--quantization", "q4_k", "--json", *args)
        return proc, json.loads(proc.stdout.strip().splitlines()[-1])

    proc, out = q4_k("--prompt", "The capital of France is", "--max-tokens", "4")
    assert out["weights"]["format"] == "q5_0+q4_K+q8_0"
    assert "90 linear weights" in proc.stderr and "are q5_0 (llama-quantize's fallback)" in proc.stderr, proc.stderr
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def add(a, b):"]
    batch = q4_k("--prompts-file", str(write_json(tmp_path / "p.json", prompts)), "--max-tokens", "12")[1]["results"]
    for p, got in zip(prompts, batch):
        assert got["token_ids"] == q4_k("--prompt", p, "--max-tokens", "12")[1]["token_ids"], p
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    ids = tok.encode((ROOT / "README.md").read_text()[:3000]).ids[:200]
    f32 = perplexity(tmp_path, default_model_dir(), ids)
    assert perplexity(tmp_path, default_model_dir(), ids, "--quantization", "q4_k") / f32 < 1.15


def error_of(*args) -> str:
    proc = run_kvserve(*args, check=False)
    assert proc.returncode == 1, f"expected a clean failure, got rc={proc.returncode}\n{proc.stderr}"
    assert "kvserve: error:" in proc.stderr
    return proc.stderr


def test_truncated_gguf_is_named(tmp_path):
    bad = tmp_path / "cut.gguf"
    data = default_gguf().read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    err = error_of("generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2")
    assert "cut.gguf" in err


def test_an_unserved_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    err = error_of("gguf", "inspect", "--model", str(path))
    assert "mamba" in err and "not served" in err


def test_quantization_of_a_gguf_is_refused(tmp_path):
    err = error_of("generate", "--model", str(default_gguf()), "--quantization", "int8", "--prompt", "hi")
    assert "GGUF" in err and "quantization" in err


def lone_gguf(tmp_path):
    """The default model's GGUF alone in a directory: no tokenizer.json, no config.json beside it."""
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / GGUF_NAME).symlink_to(default_gguf())
    return lone / GGUF_NAME


def test_a_lone_gguf_tokenizes_as_the_tokenizers_library(tmp_path):
    """The tokenizer built from the file's metadata against the `tokenizers` library running the
    tokenizer.json the conversion wrote (itself checked against llama.cpp's vocabulary): every line of
    the tokenizer corpus, special tokens and newlines included, and the detokenized text."""
    tokenizers = pytest.importorskip("tokenizers")
    from test_tokenizer_vs_hf import make_lines, make_multiline_texts
    hf = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    texts = make_lines(n=400) + make_multiline_texts(n=100) + ["<|im_start|>user\nhi 12345<|im_end|>\n", "", " "]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in texts))
    got = [json.loads(line) for line in run_kvserve("tokenize", "--model", str(lone_gguf(tmp_path)), "--text-file",
                                                     str(src), "--json-input").stdout.splitlines()]
    want = [e.ids for e in hf.encode_batch(texts)]
    assert len(got) == len(want)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {texts[bad[0]]!r}: {got[bad[0]]} vs {want[bad[0]]}"


def test_a_lone_gguf_generates_as_it_does_beside_its_tokenizer(tmp_path):
    """Tokenizer, EOS and chat template from the metadata: the same greedy chat answer as the file
    served from the model directory (tokenizer.json and tokenizer_config.json beside it)."""
    args = ("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12", "--json")
    lone = json.loads(run_kvserve(*args, "--model", str(lone_gguf(tmp_path))).stdout)
    beside = json.loads(run_kvserve(*args, "--model", str(default_gguf())).stdout)
    assert lone["token_ids"] == beside["token_ids"] and lone["text"] == beside["text"]
    assert lone["prompt_tokens"] == beside["prompt_tokens"]


def test_a_lone_gguf_serves_chat_with_its_own_template(tmp_path):
    """Served alone, the file's chat template (tokenizer.chat_template) renders the chat: the prompt
    counts and greedy answer equal the same chat served from the model directory, and
    /tokenizer_info shows the template of the directory's tokenizer_config.json."""
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from kvserve_server import Server, raw
    body = json.dumps({"model": "tiny", "max_tokens": 10, "temperature": 0,
                       "messages": [{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": "Name a large city in Japan."}]})
    answers = []
    for model in (lone_gguf(tmp_path), default_gguf()):
        srv = Server(model=str(model))
        try:
            status, _, data = raw(srv, "POST", "/v1/chat/completions", body)
            assert status == 200, data
            r = json.loads(data)
            answers.append((r["usage"]["prompt_tokens"], r["choices"][0]["message"]["content"]))
            status, _, data = raw(srv, "GET", "/tokenizer_info")
            assert status == 200, data
            template = json.loads(data)["chat_template"]
        finally:
            srv.close()
        want = json.loads((default_model_dir() / "tokenizer_config.json").read_text())["chat_template"]
        assert template == want
    assert answers[0] == answers[1]


def write_sentencepiece_gguf(path, tokens, types, scores, add_space_prefix=False):
    """A GGUF whose tokenizer metadata is a SentencePiece vocabulary ("llama"), as Gemma's files carry."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([float(x) for x in scores])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_lone_sentencepiece_gguf_tokenizes_as_the_tokenizers_library(tmp_path):
    """A SentencePiece vocabulary (scored pieces, 256 byte pieces, control and user-defined tokens)
    built into a tokenizer from the file's metadata, against the `tokenizers` library running the
    tokenizer.json that tools/make_gemma3.py writes from the same file: texts with words the pieces
    cover, pieces tied in score, text only the byte pieces cover, control tokens and runs of newlines."""
    tokenizers = pytest.importorskip("tokenizers")
    import random
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import make_gemma3
    rng = random.Random(4)
    words = ["the", "cat", "sat", "on", "mat", "naïve", "日本", "ab", "abc", "cab", "tha", "hello", "12", "x"]
    pieces = set()
    for wd in words:
        for i in range(len(wd)):
            for j in range(i + 1, len(wd) + 1):
                pieces.add(wd[i:j])
                pieces.add("\u2581" + wd[i:j])
    pieces.add("\u2581")
    pieces = sorted(pieces)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + \
        ["<start_of_turn>", "<end_of_turn>", "\n\n", "\n\n\n"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces) + [3, 3, 4, 4]
    # Scores from a few values, so that merges tie and the order among ties decides.
    scores = [0.0] * 260 + [-float(rng.choice([1, 2, 3, 5, 8])) - len(p) for p in pieces] + [0.0] * 4
    lone = tmp_path / "lone"
    lone.mkdir()
    write_sentencepiece_gguf(lone / "sp.gguf", tokens, types, scores)
    make_gemma3.write_tokenizer(lone / "sp.gguf", tmp_path)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 12))) for _ in range(200)]
    texts += ["".join(rng.choice(words) for _ in range(rng.randrange(1, 6))) for _ in range(100)]
    texts += ["<start_of_turn>user\nthe cat\n\n\nsat<end_of_turn>\n", "", " ", "  x  ", "Zebra ünï 🙂 cab",
              "the\tcat\r\n", "QQQ the"]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in texts))
    got = [json.loads(line) for line in run_kvserve("tokenize", "--model", str(lone / "sp.gguf"), "--text-file",
                                                     str(src), "--json-input").stdout.splitlines()]
    want = [e.ids for e in hf.encode_batch(texts)]
    assert len(got) == len(want)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {texts[bad[0]]!r}: {got[bad[0]]} vs {want[bad[0]]}"
    assert any(4 <= t < 260 for ids in got for t in ids)  # the byte pieces were used
    # Decoding gives the text back (byte pieces fused into UTF-8, the space marker a space).
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps(g[1:]) + "\n" for g in got[:50]))
    back = [json.loads(line) for line in run_kvserve("detokenize", "--model", str(lone / "sp.gguf"), "--ids-file",
                                                      str(ids)).stdout.splitlines()]
    assert back == [hf.decode(g[1:]) for g in got[:50]] == texts[:50]
    # A space prefix (SentencePiece's add_dummy_prefix) is not built: refused naming the key.
    write_sentencepiece_gguf(lone / "prefix.gguf", tokens, types, scores, add_space_prefix=True)
    err = error_of("tokenize", "--model", str(lone / "prefix.gguf"), "--text-file", str(src), "--json-input")
    assert "tokenizer.ggml.add_space_prefix" in err and "--tokenizer" in err


@pytest.mark.skipif(not (ROOT / "models" / "gemma-3-270m" / ".kvserve-model").is_file(),
                    reason="models/gemma-3-270m not made (make model-gemma3)")
def test_a_lone_gemma3_gguf_tokenizes_and_generates_as_beside_its_tokenizer(tmp_path):
    """Gemma 3's Q4_K_M file alone (262,144 SentencePiece pieces): the tokenizer corpus tokenizes as
    the `tokenizers` library runs the tokenizer.json `make model-gemma3` lays beside the file, and a
    greedy chat answer (Gemma's chat template from the metadata) equals the one served beside it."""
    tokenizers = pytest.importorskip("tokenizers")
    from test_tokenizer_vs_hf import make_lines, make_multiline_texts
    beside = ROOT / "models" / "gemma-3-270m" / "gemma-3-270m-q4_k_m.gguf"
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / beside.name).symlink_to(beside)
    hf = tokenizers.Tokenizer.from_file(str(beside.parent / "tokenizer.json"))
    texts = make_lines(n=300) + make_multiline_texts(n=60) + ["<start_of_turn>user\nhi 12345<end_of_turn>\n", "",
                                                              " ", "  x\n\n\n y\t\tz 日本語 🙂"]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in texts))
    got = [json.loads(line) for line in run_kvserve("tokenize", "--model", str(lone / beside.name), "--text-file",
                                                     str(src), "--json-input").stdout.splitlines()]
    want = [e.ids for e in hf.encode_batch(texts)]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(texts)} differ; first: {texts[bad[0]]!r}: {got[bad[0]]} vs {want[bad[0]]}"
    args = ("generate", "--prompt", "Name a large city in Japan.", "--max-tokens", "8", "--json")
    a = json.loads(run_kvserve(*args, "--model", str(lone / beside.name)).stdout)
    b = json.loads(run_kvserve(*args, "--model", str(beside)).stdout)
    assert a["token_ids"] == b["token_ids"] and a["prompt_tokens"] == b["prompt_tokens"]


def test_a_gguf_tokenizer_kvserve_does_not_build_is_named(tmp_path):
    """A pre-tokenizer not checked against a reference (here Qwen2's name) is refused naming the key
    and the way out (--tokenizer), not guessed."""
    path = tmp_path / "qwen-like.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tmp_path / "t.txt").write_text("ab\n")
    err = error_of("tokenize", "--model", str(path), "--text-file", str(tmp_path / "t.txt"))
    assert "tokenizer.ggml.pre" in err and "qwen2" in err and "--tokenizer" in err


def test_plan_counts_quantized_weight_bytes():
    """`kvserve plan --dtype q4_1` (the default GGUF's format), `q8_0`, `q6_k` and `int8` (a GPU's int8
    groups of 128 with a float32 scale): the weights' bytes at the bits per weight of their CUDA form
    (gguf_cuda_forms.h: int4 with a bfloat16 scale and zero per 32, int8 codes with a float32 scale
    per 32 or 16), scales included, and the KV cache takes the rest of the memory in bfloat16 (the
    compute dtype of quantized weights on a GPU); q5_k's offsets per 32 add a bit."""
    cfg = str(default_model_dir() / "config.json")

    def plan(dtype):
        return json.loads(run_kvserve("plan", "--model-config", cfg, "--gpu-memory", "1GiB", "--context", "4096",
                                      "--dtype", dtype, "--json").stdout)
    bf16, q41, q80, q6k, i8 = plan("bfloat16"), plan("q4_1"), plan("q8_0"), plan("q6_k"), plan("int8")
    params = bf16["stages"][0]["weight_params_per_gpu"]
    assert q41["weight_bits"] == 5.0 and q80["weight_bits"] == 9.0 and q6k["weight_bits"] == 10.0
    assert bf16["weight_bits"] == 16.0 and i8["weight_bits"] == 8.25
    assert q41["stages"][0]["weight_bytes_per_gpu"] == -(-params * 5 // 8)
    assert q80["stages"][0]["weight_bytes_per_gpu"] == -(-params * 9 // 8)
    assert q6k["stages"][0]["weight_bytes_per_gpu"] == -(-params * 10 // 8)
    assert i8["stages"][0]["weight_bytes_per_gpu"] == -(-params * 33 // 32)
    q5k = plan("q5_k")
    assert q5k["weight_bits"] == 10.0 and q5k["stages"][0]["weight_bytes_per_gpu"] == -(-params * 10 // 8)
    for p in (q41, q80, q6k, q5k, i8):
        assert p["stages"][0]["kv_bytes_per_token"] == bf16["stages"][0]["kv_bytes_per_token"]
        assert p["policies"][0]["max_seqs"] > bf16["policies"][0]["max_seqs"]


GEMMA3 = ROOT / "models" / "gemma-3-270m"


@pytest.mark.skipif(not (GEMMA3 / ".kvserve-model").is_file(), reason=f"{GEMMA3} not made (make model-gemma3)")
def test_gemma3_q4_k_m_prefill_equals_its_float32_conversion(tmp_path):
    # A Q4_K_M file mixes q4_K, q5_0, q6_K and q8_0 tensors; Gemma's norms are stored as 1 + w.
    path = GEMMA3 / "gemma-3-270m-q4_k_m.gguf"
    info = json.loads(run_kvserve("gguf", "inspect", "--model", str(path), "--json").stdout)
    assert {"q4_K", "q6_K", "q8_0"} <= set(info["bytes_by_type"])
    ids = [2] + random_ids(39, 262144, 3)
    np.testing.assert_array_equal(forward_logits(tmp_path, path, ids, "--kv-cache-dtype", "float32", name="gguf"),
                                  forward_logits(tmp_path, GEMMA3, ids, name="f32"))
    r = generate(path, n=8)
    assert r["completion_tokens"] == 8 and "q4_K" in r["weights"]["format"]


def test_tensor_parallel_shards_of_the_blocks_equal_one_process(tmp_path):
    # TP 3: q/k/v and gate/up split by rows, o_proj and down_proj by whole blocks of columns (192
    # and 512 values), the vocabulary by rows; only the partial sums' order differs from one process.
    # A float32 cache: float16 would round a K value that the order moved across a half-way point.
    ids = random_ids(40, 49152, 21)
    one = forward_logits(tmp_path, default_gguf(), ids, "--kv-cache-dtype", "float32", name="tp1")
    three = forward_logits(tmp_path, default_gguf(), ids, "--tp", "3", "--kv-cache-dtype", "float32", name="tp3")
    np.testing.assert_allclose(three, one, atol=1e-3, rtol=0)
    assert (three.argmax(-1) == one.argmax(-1)).all()


def test_pipeline_stages_of_the_blocks_equal_one_process(tmp_path):
    # PP 2: each stage loads its own layers' blocks from the file (the embedding on the first, the
    # tied LM head on the last); a stage boundary changes no arithmetic, so the logits are equal.
    ids = random_ids(40, 49152, 22)
    one = forward_logits(tmp_path, default_gguf(), ids, name="one")
    two = forward_logits(tmp_path, default_gguf(), ids, "--pp", "2", name="pp2")
    np.testing.assert_array_equal(two, one)
    # TP 3 x PP 2 (six processes) serves the tokens TP 3 alone does: the stages split no block.
    args = ("generate", "--model", str(default_gguf()), "--prompt", "The capital of France is", "--max-tokens", "12",
            "--ignore-eos", "--json")
    tp3 = json.loads(run_kvserve(*args, "--tp", "3").stdout)
    six = json.loads(run_kvserve(*args, "--tp", "3", "--pp", "2").stdout)
    assert six["token_ids"] == tp3["token_ids"]
