#!/usr/bin/env python3
"""Train small, deterministic fixture tokenizers with Hugging Face `tokenizers`.

Each tokenizer is written as a directory holding `tokenizer.json` and `tokenizer_config.json`, the
way a Hugging Face model directory has them, so kvserve's tokenizer can be tested against the
reference on several real-world shapes:

  bytelevel    Llama-3 style: Split(Llama-3 regex) + ByteLevel, ignore_merges, TemplateProcessing bos
  metaspace    Llama-2 style: Prepend("▁") + Replace(" ", "▁") normalizer, byte_fallback BPE, <unk>
  metaspace_pt Mistral style: Metaspace pre-tokenizer (prepend_scheme "first"), byte_fallback BPE
  qwen2        Qwen2 style: NFC, Split(Qwen2 regex) + ByteLevel, merges stored as "a b" strings, no bos

`make_tokenizers(out_dir, seed)` is imported by tools/make_fixture_models.py; keep its signature.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")

_WORDS_EN = ("the of and to in is was for on that with as by at from it an be this which or are "
             "model token cache layer budget attention memory server request stream window policy "
             "quick brown fox jumps over lazy dog hello world language learning kernel tensor "
             "don't it's we're they've I'm you'll she'd Naïve café résumé coöperate").split()
_WORDS_OTHER = ("数据 模型 注意力 缓存 东京 日本語 テスト こんにちは 한국어 안녕하세요 "
                "مرحبا بالعالم اللغة العربية Привет мир данные Γειά σου κόσμε שלום עולם "
                "नमस्ते दुनिया ไทย สวัสดี Straße groß Ärger").split()
_CODE = ["def f(x):\n    return x + 1", "for (int i = 0; i < n; ++i) { s += a[i]; }",
         "if x != None and y >= 3: print(f'{x!r}')", "#include <vector>", "SELECT * FROM t WHERE id = 42;",
         "let v: Vec<u8> = vec![0x1f, 0xff];", "    \tindent\t\t  mixed"]
_EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🤖", "🇯🇵", "✨"]


def training_corpus(seed: int, lines: int = 6000) -> list[str]:
    """Mixed-language text so merges cover English, other scripts, code, digits and whitespace."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou", "ea")]
    # A Zipf-like pool of made-up words gives the trainer enough distinct frequent pairs.
    pool = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(1500)]
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.55:
            words = [rng.choice(_WORDS_EN) if rng.random() < 0.5 else pool[int(rng.paretovariate(0.7)) % len(pool)]
                     for _ in range(rng.randint(3, 14))]
            if rng.random() < 0.3:
                words[0] = words[0].capitalize()
            line = " ".join(words) + rng.choice([".", ",", "!", "?", "", ":"])
        elif kind < 0.75:
            line = rng.choice(" ").join(rng.choice(_WORDS_OTHER) for _ in range(rng.randint(2, 8)))
        elif kind < 0.85:
            line = rng.choice(_CODE)
        elif kind < 0.93:
            line = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 7))) for _ in range(rng.randint(1, 5)))
        else:
            line = " ".join(rng.choice(_WORDS_EN + _EMOJI) for _ in range(rng.randint(2, 6)))
        out.append(line)
    return out


def _write(tok: Tokenizer, out: pathlib.Path, config: dict, string_merges: bool = False) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    if string_merges:
        # Older tokenizer.json files (Llama-2, Qwen2) store merges as "a b"; cover that format too.
        data = json.loads(path.read_text(encoding="utf-8"))
        data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2),
                                               encoding="utf-8")
    return out


def _bytelevel(corpus: list[str], out: pathlib.Path, pattern: str, qwen: bool) -> pathlib.Path:
    tok = Tokenizer(models.BPE(ignore_merges=not qwen))
    if qwen:
        tok.normalizer = normalizers.NFC()
    if qwen:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|reserved_special_token_0|>"]
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2500 if qwen else 3000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials])
    tok.train_from_iterator(corpus, trainer=trainer)
    if qwen:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        # A non-special added token, as chat models sometimes have (e.g. tool-call markers).
        tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
        config = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
                  "pad_token": "<|endoftext|>", "model_max_length": 32768,
                  "chat_template": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
                  "tokenizer_class": "Qwen2Tokenizer"}
    else:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": bos,
                  "eos_token": "<|eot_id|>", "model_max_length": 131072,
                  "chat_template": LLAMA3_CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    return _write(tok, out, config, string_merges=qwen)


def _metaspace(corpus: list[str], out: pathlib.Path, pre_tokenizer: bool) -> pathlib.Path:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    specials = ["<unk>", "<s>", "</s>"]
    # Train words split on ▁ so merges never cross a word boundary, as SentencePiece does.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=2000, min_frequency=2, show_progress=False, limit_alphabet=150,
                                  special_tokens=[AddedToken(s, special=True, normalized=False)
                                                  for s in specials + byte_tokens])
    tok.train_from_iterator(corpus, trainer=trainer)
    if pre_tokenizer:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                     prepend_scheme="first")])
    else:
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = out / "tokenizer.json"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    # Byte-fallback pieces are ordinary vocabulary in Llama-2, not added tokens: text that spells
    # "<0x41>" must be tokenized as text.
    data = json.loads(path.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 4096, "legacy": True,
              "chat_template": LLAMA2_CHAT_TEMPLATE, "tokenizer_class": "LlamaTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2),
                                               encoding="utf-8")
    return out


def make_tokenizers(out_dir: pathlib.Path, seed: int = 0) -> dict[str, pathlib.Path]:
    """Writes the fixture tokenizers under out_dir/<name>/ and returns {name: directory}."""
    out_dir = pathlib.Path(out_dir)
    corpus = training_corpus(seed)
    return {
        "bytelevel": _bytelevel(corpus, out_dir / "bytelevel", LLAMA3_PATTERN, qwen=False),
        "metaspace": _metaspace(corpus, out_dir / "metaspace", pre_tokenizer=False),
        "metaspace_pt": _metaspace(corpus, out_dir / "metaspace_pt", pre_tokenizer=True),
        "qwen2": _bytelevel(corpus, out_dir / "qwen2", QWEN2_PATTERN, qwen=True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=pathlib.Path, help="directory to write the tokenizers into")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, path in make_tokenizers(args.out, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
