"""Broken GGUF files get a clear error naming the file and what is wrong (a metadata key, a tensor, a
tokenizer entry), never a crash. Each case is a small valid Llama GGUF (the llama-gqa fixture's
float32 weights under llama.cpp's tensor names, written by the `gguf` Python package) with one
defect; the valid file itself must load and generate, so that every failure below is the defect's.
A head count of 0 once divided by zero (SIGFPE) before any check ran, and a block count far past
the file's tensors could make Gemma 3's layer list without bound."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvserve_testlib import fixtures_dir, run_kvserve

gguf = pytest.importorskip("gguf")

FIXTURE = "llama-gqa"
HF_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def base_metadata() -> dict:
    cfg = json.loads((fixtures_dir() / FIXTURE / "config.json").read_text())
    return {"llama.block_count": cfg["num_hidden_layers"], "llama.context_length": 2048,
            "llama.embedding_length": cfg["hidden_size"], "llama.feed_forward_length": cfg["intermediate_size"],
            "llama.attention.head_count": cfg["num_attention_heads"],
            "llama.attention.head_count_kv": cfg["num_key_value_heads"], "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5}


def tokenizer_metadata() -> dict:
    """A byte-level BPE vocabulary of the fixture's size in the file's own metadata (a lone GGUF)."""
    tokens = ["a", "b", "ab", "<|endoftext|>"] + [f"t{i}" for i in range(2115)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3] + [1] * 2115,
            "tokenizer.ggml.eos_token_id": 3}


def write_gguf(path, metadata: dict, drop=(), tensors=None):
    """The fixture as a GGUF: `metadata` (None drops a key), without the tensors in `drop`, with those
    in `tensors` replaced (GGUF name -> array, any dtype the writer takes)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            (w.add_int32 if -2**31 <= value < 2**31 else w.add_int64)(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for hf, t in load_file(str(fixtures_dir() / FIXTURE / "model.safetensors")).items():
        name = gguf_name(hf)
        if name in drop:
            continue
        t = (tensors or {}).get(name, t.astype(np.float32))
        w.add_tensor(name, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_dir(tmp_path, with_tokenizer: bool):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    if with_tokenizer:
        shutil.copy(fixtures_dir() / FIXTURE / "tokenizer.json", d / "tokenizer.json")
    return d


def generate(path):
    return run_kvserve("generate", "--model", str(path), "--prompt", "ab a b", "--max-tokens", "3", check=False)


def refused_naming(path, case, words):
    """generate on `path` fails cleanly (exit 1, kvserve's error line naming the file) with `words`."""
    proc = generate(path)
    assert proc.returncode == 1, f"{case}: rc={proc.returncode}\n{proc.stderr}"
    err = proc.stderr
    assert "kvserve: error:" in err and path.name in err, err
    for word in words:
        assert word in err, f"{case}: {word!r} not in\n{err}"


def test_the_valid_files_generate(tmp_path):
    beside = write_gguf(model_dir(tmp_path, True) / "m.gguf", base_metadata())
    lone = tmp_path / "lone"
    lone.mkdir()
    alone = write_gguf(lone / "m.gguf", base_metadata() | tokenizer_metadata())
    for path in (beside, alone):
        proc = generate(path)
        assert proc.returncode == 0, proc.stderr


def head_count(n):
    return {"llama.attention.head_count": n}


# (case, metadata changes, tensors dropped, tensors replaced, words the error must contain)
METADATA_CASES = [
    ("no heads", head_count(0), (), None, ["num_attention_heads", "got 0"]),
    ("negative heads", head_count(-1) | {"llama.embedding_length": -2**63}, (), None, ["must be a positive integer"]),
    ("more blocks than tensors", {"llama.block_count": 2**31 - 2}, (), None, ["llama.block_count", "2147483646"]),
    ("a block too many", {"llama.block_count": 3}, (), None, ["blk.2.attn_norm.weight", "missing"]),
    ("negative blocks", {"llama.block_count": -3}, (), None, ["num_hidden_layers", "-3"]),
    ("no embedding length", {"llama.embedding_length": None}, (), None, ["llama.embedding_length", "missing"]),
    ("a string for a length", {"llama.feed_forward_length": "big"}, (), None,
     ["llama.feed_forward_length", "not an integer"]),
    ("a string for a number", {"llama.attention.layer_norm_rms_epsilon": "x"}, (), None,
     ["llama.attention.layer_norm_rms_epsilon", "not a number"]),
    ("KV heads that do not divide", {"llama.attention.head_count_kv": 3}, (), None,
     ["num_key_value_heads (3)"]),
    ("an odd key length", {"llama.attention.key_length": 7}, (), None, ["head_dim"]),
    ("an unknown rope scaling", {"llama.rope.scaling.type": "banana"}, (), None, ["banana"]),
    ("a vocabulary the embedding does not have", {"llama.vocab_size": 5}, (), None,
     ["token_embd.weight", "[2119, 128]", "[5, 128]"]),
    ("a missing tensor", {}, ("blk.1.attn_v.weight",), None, ["blk.1.attn_v.weight", "missing"]),
    ("a tensor of the wrong shape", {}, (), {"blk.1.ffn_up.weight": np.zeros((3, 128), np.float32)},
     ["blk.1.ffn_up.weight", "[3, 128]", "[160, 128]"]),
    ("an integer tensor", {}, (), {"blk.0.attn_norm.weight": np.ones(128, np.int32)},
     ["blk.0.attn_norm.weight", "i32"]),
    ("a float64 tensor", {}, (), {"blk.0.attn_norm.weight": np.ones(128, np.float64)},
     ["blk.0.attn_norm.weight", "f64"]),
]


@pytest.mark.parametrize("case,changes,drop,tensors,words", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_a_broken_model_is_named(tmp_path, case, changes, drop, tensors, words):
    path = write_gguf(model_dir(tmp_path, True) / "bad.gguf", base_metadata() | changes, drop, tensors)
    refused_naming(path, case, words)
    # inspect reads the same file: it reports or refuses it, it does not crash.
    assert run_kvserve("gguf", "inspect", "--model", str(path), check=False).returncode in (0, 1)


TOKENIZER_CASES = [
    ("token types short", {"tokenizer.ggml.token_type": [1, 1]}, ["tokenizer.ggml.token_type", "2 entries"]),
    ("a merge without a space", {"tokenizer.ggml.merges": ["ab"]}, ["tokenizer.ggml.merges[0]", "'ab'"]),
    ("a merge of unknown tokens", {"tokenizer.ggml.merges": ["x y"]}, ["merges[0]", "'x' + 'y'"]),
    ("an end token past the vocabulary", {"tokenizer.ggml.eos_token_id": 99999},
     ["tokenizer.ggml.eos_token_id = 99999"]),
    ("a negative start token", {"tokenizer.ggml.bos_token_id": -5, "tokenizer.ggml.add_bos_token": True},
     ["tokenizer.ggml.bos_token_id = -5"]),
    ("numbers for tokens", {"tokenizer.ggml.tokens": [1, 2, 3]}, ["tokenizer.ggml.tokens", "not an array of strings"]),
    ("a token twice", {"tokenizer.ggml.tokens": ["a", "a"] + [f"t{i}" for i in range(2117)]},
     ["tokenizer.ggml.tokens[1] = 'a' appears twice"]),
    ("no tokens", {"tokenizer.ggml.tokens": [], "tokenizer.ggml.token_type": []}, ["tokenizer.ggml.tokens"]),
]


@pytest.mark.parametrize("case,changes,words", TOKENIZER_CASES, ids=[c[0] for c in TOKENIZER_CASES])
def test_a_broken_tokenizer_in_the_metadata_is_named(tmp_path, case, changes, words):
    path = write_gguf(model_dir(tmp_path, False) / "bad.gguf", base_metadata() | tokenizer_metadata() | changes)
    refused_naming(path, case, words)
