#!/usr/bin/env python3
"""Make the random-weight fixture checkpoints that kvserve's tests compare against transformers.

Each fixture is a Hugging Face model directory (config.json, safetensors weights, tokenizer files)
written by transformers itself, so the loader is tested on real checkpoint layouts:

  llama-mha      Llama, multi-head attention, byte-level tokenizer
  llama-gqa      Llama, GQA 4:1, linear rope scaling, byte-level tokenizer
  llama3-rope    Llama, GQA 2:1, llama3 rope scaling, 3 layers
  llama-tied     Llama, tied embeddings, Llama-2 style (Prepend/Replace + byte fallback) tokenizer
  qwen2-bias     Qwen2 with q/k/v bias, Qwen2 byte-level tokenizer
  qwen2-tools    qwen2-bias with a Hermes-style tool-calling chat template (<tool_call>)
  mistral        Mistral, GQA, Metaspace tokenizer
  llama-sharded  Llama GQA saved in several shards with model.safetensors.index.json
  llama-bf16     Llama GQA stored in bfloat16 on disk
  llama-kvfew    Llama with 1 KV head (fewer KV heads than TP ranks; for parallel tests)
  qwen3          Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads (16), GQA 2:1, Qwen2 tokenizer
  llama-yarn     Llama, yarn rope scaling (factor 4 over an original context of 64)
  llama-dynamic  Llama, dynamic NTK rope scaling (factor 2 past max_position_embeddings 64)
  llama-longrope Llama, longrope scaling (short/long factors, original context 64, max 256)
  gemma3         Gemma 3 text: 6 layers, local (sliding window 12) and global layers mixed, GQA 2:1,
                 head_dim 32, query_pre_attn_scalar 24, linear rope scaling on the global layers only,
                 tied embeddings, (1 + w) norms with random w

The scaled-rope fixtures have a small original context (64) so that prompts past it stay cheap.

Deterministic by seed. Usage: python3 tools/make_fixture_models.py --out .fixtures
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_fixture_tokenizers import make_tokenizers  # noqa: E402

VERSION = "5"  # bump when the fixtures change so stale folders are remade


# A Hermes-style tool-calling chat template (the format Qwen2.5 and the SmolLM family write): tools
# listed in the system turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool
# results as <tool_response> user turns.
HERMES_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures are within <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Answer a call as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for call in message.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>\n"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _base(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.08, tie_word_embeddings=False)


def specs() -> dict[str, tuple[str, str, dict, dict]]:
    """name -> (architecture, tokenizer, config overrides, save options)."""
    return {
        "llama-mha": ("llama", "bytelevel", {}, {}),
        "llama-gqa": ("llama", "bytelevel", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128,
                                                 rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
        "llama3-rope": ("llama", "bytelevel", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                   rope_theta=500000.0,
                                                   rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                 "original_max_position_embeddings": 64}), {}),
        "llama-tied": ("llama", "metaspace", dict(tie_word_embeddings=True), {}),
        "qwen2-bias": ("qwen2", "qwen2", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False), {}),
        "qwen2-tools": ("qwen2", "qwen2", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False),
                        dict(chat_template=HERMES_TOOLS_TEMPLATE)),
        "mistral": ("mistral", "metaspace_pt", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None), {}),
        "llama-sharded": ("llama", "bytelevel", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3),
                          dict(max_shard_size="150KB")),
        "llama-bf16": ("llama", "bytelevel", dict(num_attention_heads=4, num_key_value_heads=2), dict(dtype=torch.bfloat16)),
        "llama-kvfew": ("llama", "bytelevel", dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3), {}),
        "qwen3": ("qwen3", "qwen2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         use_sliding_window=False), {}),
        "llama-yarn": ("llama", "bytelevel", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 64}), {}),
        "llama-dynamic": ("llama", "bytelevel", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0}), {}),
        # head_dim 16: 8 factors each; factor and attention factor are left for the loaders to derive
        # (256 / 64 = 4, sqrt(1 + ln 4 / ln 64)).
        "llama-longrope": ("llama", "bytelevel", dict(
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 64,
                          "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1],
                          "long_factor": [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 9.5, 14.0]}), {}),
        # A window of 12 (not a multiple of the tests' 16-token blocks) so that 17- and 640-token
        # prompts cross it; two global layers, one in the middle and the last (Gemma's pattern puts
        # one after every five local ones).
        "gemma3": ("gemma3", "bytelevel", dict(
            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=12, tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), {}),
    }


def make_model(out: pathlib.Path, arch: str, tok_dir: pathlib.Path, overrides: dict, save: dict, seed: int) -> None:
    import transformers
    tok_json = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = len(tok_json["model"]["vocab"]) + sum(1 for t in tok_json.get("added_tokens", [])
                                                    if t["content"] not in tok_json["model"]["vocab"])
    cfg_kwargs = _base(vocab)
    cfg_kwargs.update(overrides)
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token"):
        name = tok_cfg.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        ids = [t["id"] for t in tok_json.get("added_tokens", []) if t["content"] == name]
        if ids:
            cfg_kwargs[key + "_id"] = ids[0]
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    if arch == "gemma3":
        cfg_kwargs.pop("rope_theta")  # its rope_parameters name each layer type's base
    config = cls[0](**cfg_kwargs)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # transformers zero-inits biases; random ones test that they are applied
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                # Gemma's norms scale by 1 + w (w starts at 0): the offset is already in the norm.
                offset = 1.0 if "norm" in name and arch != "gemma3" else 0.0
                p.copy_((torch.randn_like(p) * 0.1) + offset)
    save = dict(save)
    template = save.pop("chat_template", None)  # replaces the tokenizer's chat template
    dtype = save.pop("dtype", None)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True, **save)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    if template is not None:
        tok_cfg["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*", help="make only these fixtures")
    ap.add_argument("--default-model", type=pathlib.Path,
                    help="instead: write the small embedded default model (random weights) to this directory")
    args = ap.parse_args()
    if args.default_model:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            toks = make_tokenizers(pathlib.Path(tmp), seed=args.seed)
            if args.default_model.exists():
                shutil.rmtree(args.default_model)
            make_model(args.default_model, "llama", toks["bytelevel"],
                       dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=352, max_position_embeddings=4096, rope_theta=500000.0), {}, args.seed)
        print(f"made {args.default_model}")
        return
    stamp = args.out / "VERSION"
    want = VERSION + ":" + hashlib.sha256(pathlib.Path(__file__).read_bytes() +
                                           (pathlib.Path(__file__).parent / "make_fixture_tokenizers.py").read_bytes()
                                           ).hexdigest()[:16] + f":{args.seed}"
    if stamp.exists() and stamp.read_text() == want and not args.only:
        print(f"fixtures in {args.out} are current")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    toks = make_tokenizers(args.out / "tokenizers", seed=args.seed)
    for i, (name, (arch, tok, overrides, save)) in enumerate(specs().items()):
        if args.only and name not in args.only:
            continue
        out = args.out / name
        if out.exists():
            shutil.rmtree(out)
        make_model(out, arch, toks[tok], dict(overrides), dict(save), args.seed + i)
        print(f"made {out}")
    if not args.only:
        stamp.write_text(want)


if __name__ == "__main__":
    main()
