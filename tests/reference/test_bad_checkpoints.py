"""Broken checkpoints give one clear error naming the file (and tensor), never a crash."""
from __future__ import annotations

import json
import shutil
import struct

import pytest

from kvserve_testlib import fixtures_dir, run_kvserve, write_json


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(fixtures_dir() / "llama-gqa", dst)
    return dst


def forward_error(model, tmp_path) -> str:
    proc = run_kvserve("forward", "--model", str(model), "--input-ids", str(write_json(tmp_path / "ids.json", [1, 2, 3])),
                       "--output", str(tmp_path / "out.safetensors"), check=False)
    assert proc.returncode == 1, f"expected a clean failure, got rc={proc.returncode}\n{proc.stderr}"
    assert "kvserve: error:" in proc.stderr
    return proc.stderr


def test_truncated_safetensors(model_copy, tmp_path):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = forward_error(model_copy, tmp_path)
    assert "model.safetensors" in err and "tensor '" in err


def test_header_length_past_end(model_copy, tmp_path):
    f = model_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    f.write_bytes(bytes(data))
    err = forward_error(model_copy, tmp_path)
    assert "model.safetensors" in err and "header length" in err


def test_shape_contradicts_config(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model_copy / "config.json").write_text(json.dumps(cfg))
    err = forward_error(model_copy, tmp_path)
    assert "mlp.gate_proj.weight" in err and "config.json implies" in err


def test_missing_tensor(model_copy, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    err = forward_error(model_copy, tmp_path)
    assert "model.layers.1.self_attn.v_proj.weight" in err and "missing" in err


def test_unknown_architecture(model_copy, tmp_path):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    err = forward_error(model_copy, tmp_path)
    assert "config.json" in err and "FalconForCausalLM" in err


def test_malformed_config(model_copy, tmp_path):
    (model_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    err = forward_error(model_copy, tmp_path)
    assert "config.json" in err and "malformed JSON" in err


def test_missing_shard(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(fixtures_dir() / "llama-sharded", dst)
    (dst / "model-00002-of-00006.safetensors").unlink()
    err = forward_error(dst, tmp_path)
    assert "model-00002-of-00006.safetensors" in err


@pytest.mark.parametrize("body", ["[1, 2, 1e400]", "[1, 2,", '{"ids": 3}'])
@pytest.mark.parametrize("command", ["forward", "generate"])
def test_bad_input_id_files_name_the_file(command, body, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(body)
    flag = "--input-ids" if command == "forward" else "--prompts-file"
    args = [command, "--model", str(fixtures_dir() / "llama-gqa"), flag, str(ids)]
    if command == "forward":
        args += ["--output", str(tmp_path / "out.safetensors")]
    proc = run_kvserve(*args, check=False)
    assert proc.returncode == 1, f"expected a clean failure, got rc={proc.returncode}\n{proc.stderr}"
    assert "kvserve: error:" in proc.stderr and "ids.json" in proc.stderr, proc.stderr
