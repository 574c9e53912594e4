#!/usr/bin/env python3
"""Write the bench-125m checkpoint that every benchmark in docs/benchmarks.md uses.

bench-125m (DESIGN.md "Performance model"): Llama, 12 layers, hidden 768, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000, rope_theta 500000, untied embeddings, random weights, fp32
(~125M parameters, ~500 MB). Made with transformers itself; the byte-level fixture tokenizer is
copied beside it so kvserve can load the directory (benchmarks pass token ids, so the tokenizer's
smaller vocabulary does not matter; ids it does not know detokenize to nothing).

The weights are never committed: write them into a git-ignored folder (default .fixtures/bench-125m).
Idempotent: a folder whose STAMP matches this script's settings is left alone.

Usage: python3 tools/make_bench_model.py [--out .fixtures/bench-125m] [--seed 1234]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=32768,
              rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.02, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)


def tokenizer_dir() -> pathlib.Path:
    """The byte-level fixture tokenizer; made on the fly when .fixtures has not been built."""
    d = ROOT / ".fixtures" / "tokenizers" / "bytelevel"
    if (d / "tokenizer.json").exists():
        return d
    sys.path.insert(0, str(ROOT / "tools"))
    from make_fixture_tokenizers import make_tokenizers  # noqa: E402
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-tok-"))
    return make_tokenizers(tmp, seed=1234)["bytelevel"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / ".fixtures" / "bench-125m")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    stamp = args.out / "STAMP"
    want = json.dumps({"config": CONFIG, "seed": args.seed, "v": 1}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == want:
        print(f"{args.out} is current")
        return
    import transformers
    if args.out.exists():
        shutil.rmtree(args.out)
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(config).eval().to(torch.float32)
    with torch.no_grad():  # random (not unit) norm weights, as the fixtures do
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    model.save_pretrained(args.out, safe_serialization=True)
    tok = tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, args.out / f)
    n = sum(p.numel() for p in model.parameters())
    stamp.write_text(want)
    print(f"made {args.out}: {n / 1e6:.1f}M parameters, {n * 4 / 1e6:.0f} MB fp32")


if __name__ == "__main__":
    main()
