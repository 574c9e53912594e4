#!/usr/bin/env python3
"""Train KVzap predictors (arXiv 2601.07891, kvpress's KVzapPress) for SmolLM2-135M-Instruct on CPU.

KVzap replaces KVzip's costly "repeat the context" pass with a tiny per-layer model that reads the
hidden state entering a layer's attention (the input_layernorm output, what kvpress hands a
self_attn forward hook as kwargs["hidden_states"]) and predicts the log KVzip+ score of every KV
head at that position. This tool follows kvpress's kvzap/train.py recipe with local data:

 1. Texts, --min-tokens..--max-tokens tokens each. A quarter (1 - --package-fraction) is sampled
    from the model itself (chat seed prompts over 43 topics x 10 formats: essays, stories, code,
    fact lists, dialogue, instructions, tables, letters; temperature/top-p sampling with a mild
    repetition penalty, end-of-turn suppressed until --min-tokens); the rest are excerpts of text
    shipped with the installed Python, alternating stdlib sources and site-packages prose
    (METADATA long descriptions, READMEs, docs). Generation is the expensive part on CPU, hence
    the 3:1 split. Everything is seeded; the package excerpts depend on what is installed (the
    chosen files are recorded in training.json). No network, no hub data, no evaluation prompts.
 2. Targets. Each text goes through KVzip's repeat prompt built with the chat template:
        user: <text>\\n\\nRepeat the previous context exactly.   assistant: <text>
    token ranges [sp, ep) (original) and [sr, er) (repeat) come from the tokenizer's offsets. One
    forward pass; a forward hook on every layer's self_attn computes
        KVzip+ score[h, i, j] = A[h, i, j] / ||h_i|| * ||W_o^(h) v_j||
    (A: softmax attention, h_i: the layer's attention input at query i, W_o^(h): the o_proj
    columns of query head h, v_j: value of key j for h's KV head), takes the max over queries
    i in [sr, er) and over the query heads of each KV head, and the log. --target kvzip drops the
    two norms (plain max attention). X = attention input at the original positions, y = the log
    scores [positions, KV heads]; --positions positions per text are sampled (same for all layers).
    With --attn sdpa (default) the model runs with SDPA and the hook recomputes the needed
    attention rows (queries [sr, er), keys [0, er)) from q/k with RoPE, exactly what the eager
    kernel's softmax gives but cheaper; --attn eager uses the eager kernel's returned weights.
 3. Models, per layer: a linear map (closed-form ridge, --alpha, float64 solve, intercept not
    penalised, like sklearn's Ridge) and an MLP Linear(hidden, --hidden-dim) -> GELU ->
    Linear(--hidden-dim, KV heads) trained like kvpress (all layers at once, AdamW, MSE, cosine
    LR, gradient clipping 1.0). ~10% of the texts (--test-fraction) are held out.
 4. Metrics on the held-out texts: per-layer R^2 (averaged over KV heads) and Spearman rank
    correlation (per head over positions, averaged), and the share of the true top 25% / 12.5%
    entries (global over layers, heads, positions) that the prediction's top 25% / 12.5% recovers.
 5. Output in kvpress's format, loadable with
    kvpress.presses.kvzap_press.KVzapModel.from_pretrained(dir):
        OUT/linear/  OUT/mlp/   (config.json + model.safetensors, float32)
        OUT/training.json        settings, data provenance, timings, metrics
    Each saved model is loaded back and checked to predict exactly what the trained one does.

Usage:
  python3 tools/train_kvzap.py --model models/smollm2-135m-instruct \\
      --out models/kvzap-smollm2-135m-instruct [--texts 128] [--target kvzip+|kvzip] \\
      [--hidden-dim 64] [--seed 0] [--threads 2] [--texts-cache PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import sys
import sysconfig
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."

TOPICS = [
    "the water cycle", "the history of the printing press", "black holes", "honeybees and pollination",
    "the French Revolution", "machine learning", "volcanoes", "the human immune system", "coffee farming",
    "medieval castles", "renewable energy", "the Roman Empire", "photosynthesis", "chess strategy",
    "the stock market", "climate change", "ancient Egypt", "the internet's early days", "deep sea creatures",
    "baking bread", "the Silk Road", "quantum computing", "marathon training", "jazz music",
    "the solar system", "urban gardening", "the Apollo moon landings", "antibiotics", "origami",
    "the Amazon rainforest", "electric cars", "the Olympic Games", "sleep and dreams", "sorting algorithms",
    "a small bakery in Lisbon", "a lighthouse keeper", "train travel across Europe", "personal budgeting",
    "earthquakes", "the life of Marie Curie", "databases and SQL", "birds migrating south", "a robot learning to paint",
]

FORMATS = [
    "Write a detailed essay about {topic}, with an introduction, several body paragraphs and a conclusion.",
    "Write a long short story involving {topic}. Give the characters names and include dialogue.",
    "Write a Python program related to {topic}. Include several functions, comments and an explanation "
    "of how the code works.",
    "List at least 40 interesting facts about {topic}, each with a number, a date or a statistic.",
    "Write a dialogue between two friends, Alice and Ben, who are discussing {topic} in depth.",
    "Write step-by-step instructions for a complete beginner who wants to learn about {topic}.",
    "Write a news report about a recent discovery or event related to {topic}, with quotes from experts.",
    "Explain {topic} to a high-school student with examples, then write a 10-question quiz with answers.",
    "Write a markdown table of data about {topic} with at least 12 rows, then discuss the numbers.",
    "Write a formal letter to a city council proposing a project about {topic}, with a budget breakdown.",
]


def log(msg: str) -> None:
    print(f"[train_kvzap] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct",
                   help="Hugging Face model directory (transformers-loadable, with a chat template)")
    p.add_argument("--out", default="models/kvzap-smollm2-135m-instruct",
                   help="output directory: linear/, mlp/, training.json")
    p.add_argument("--texts", type=int, default=128, help="number of texts (train + test)")
    p.add_argument("--package-fraction", type=float, default=0.75,
                   help="share of the texts taken from installed Python package files (rest: generated)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of texts held out for metrics")
    p.add_argument("--min-tokens", type=int, default=500, help="minimum tokens per text")
    p.add_argument("--max-tokens", type=int, default=640, help="maximum tokens per text (generation length cap)")
    p.add_argument("--positions", type=int, default=320, help="positions sampled per text (all layers)")
    p.add_argument("--target", choices=["kvzip+", "kvzip"], default="kvzip+",
                   help="kvzip+: attention x ||W_o v|| / ||h||; kvzip: plain attention (max over repeat queries)")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                   help="sdpa: recompute the needed attention rows in the hook (faster); eager: use the "
                        "eager kernel's attention weights")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repetition-penalty", type=float, default=1.1,
                   help="generation repetition penalty (the 135M model loops without one)")
    p.add_argument("--gen-batch", type=int, default=32, help="generation batch size")
    p.add_argument("--alpha", type=float, default=1.0, help="ridge penalty of the linear model")
    p.add_argument("--hidden-dim", type=int, default=64, help="MLP hidden width")
    p.add_argument("--epochs", type=int, default=15, help="MLP epochs")
    p.add_argument("--lr", type=float, default=5e-3, help="MLP peak learning rate (AdamW, cosine)")
    p.add_argument("--batch-size", type=int, default=512, help="MLP batch size (positions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--texts-cache", type=pathlib.Path, default=None,
                   help="optional JSON file: texts are read from it when it exists, else written to it")
    args = p.parse_args(argv)
    if args.texts < 10:
        p.error("--texts must be at least 10")
    if not 0.0 <= args.package_fraction <= 1.0 or not 0.0 < args.test_fraction < 0.5:
        p.error("--package-fraction must be in [0, 1] and --test-fraction in (0, 0.5)")
    if not 0 < args.min_tokens <= args.max_tokens:
        p.error("need 0 < --min-tokens <= --max-tokens")
    if args.positions > args.min_tokens:
        p.error("--positions must not exceed --min-tokens")
    return args


def check_model_dir(path: pathlib.Path) -> None:
    """Fail early, with a clear message, when the model directory is unusable."""
    if not path.is_dir():
        raise SystemExit(f"error: model directory {path} does not exist "
                         f"(for the default model run `make model`, which writes models/smollm2-135m-instruct)")
    missing = [f for f in ("config.json", "tokenizer.json", "tokenizer_config.json") if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("model weights (*.safetensors)")
    if missing:
        raise SystemExit(f"error: {path} is not a complete Hugging Face model directory; missing: {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Texts
# ----------------------------------------------------------------------------------------------

def generate_texts(model, tok, n: int, args, rng: random.Random) -> list[dict]:
    """Sample n texts of min..max tokens from the model itself, from varied chat seed prompts."""
    import torch

    pairs = [(f, t) for f in FORMATS for t in TOPICS]
    rng.shuffle(pairs)
    prompts = [f.format(topic=t) for f, t in pairs[:n]]
    while len(prompts) < n:  # more texts than distinct prompts: reuse prompts (sampling differs)
        prompts.append(prompts[len(prompts) % len(pairs)])
    tok.padding_side = "left"
    special = sorted({tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")} - {None})
    out: list[dict] = []
    for b in range(0, n, args.gen_batch):
        batch = prompts[b:b + args.gen_batch]
        chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True) for q in batch]
        enc = tok(chats, return_tensors="pt", padding=True)
        torch.manual_seed(args.seed * 1_000_003 + b)
        t0 = time.time()
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p,
                                 repetition_penalty=args.repetition_penalty,
                                 max_new_tokens=args.max_tokens, min_new_tokens=args.min_tokens,
                                 suppress_tokens=special, pad_token_id=tok.pad_token_id)
        for q, row in zip(batch, gen[:, enc.input_ids.shape[1]:]):
            text = tok.decode(row, skip_special_tokens=True).strip()
            out.append({"kind": "generated", "source": q, "text": text})
        log(f"generated {len(out)}/{n} texts ({time.time() - t0:.0f} s for this batch)")
    return out


def _candidate_files() -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Stdlib Python sources and site-packages prose files (METADATA, README, docs), sorted."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    purelib = pathlib.Path(sysconfig.get_paths()["purelib"])
    code = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 8000)
    code += sorted(p for d in ("email", "json", "asyncio", "http", "xml/dom", "unittest", "logging", "concurrent/futures")
                   for p in (stdlib / d).glob("*.py") if p.stat().st_size > 8000)
    prose = sorted(p for p in purelib.glob("*.dist-info/METADATA") if p.stat().st_size > 6000)
    for pattern in ("*/README*", "*/*.md", "*/*.rst", "*/docs/*.md", "*/docs/*.rst"):
        prose += sorted(p for p in purelib.glob(pattern) if p.is_file() and p.stat().st_size > 6000)
    return code, sorted(set(prose))


def _usable(text: str) -> bool:
    if "\x00" in text or not text.strip():
        return False
    lines = text.splitlines()
    return max(len(line) for line in lines) <= 400 and sum(c.isprintable() or c in "\n\t" for c in text) > 0.98 * len(text)


def package_texts(tok, n: int, args, rng: random.Random) -> list[dict]:
    """n excerpts of min..max tokens from installed Python files, alternating code and prose."""
    code, prose = _candidate_files()
    rng.shuffle(code)
    rng.shuffle(prose)
    pools = [code, prose]
    out: list[dict] = []
    base = pathlib.Path(sysconfig.get_paths()["stdlib"]).parent.parent
    while len(out) < n and (code or prose):
        pool = pools[len(out) % 2] if pools[len(out) % 2] else pools[(len(out) + 1) % 2]
        path = pool.pop()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if path.name == "METADATA":  # drop the RFC 822 header, keep the long description
            text = text.split("\n\n", 1)[-1]
        lines = text.splitlines(keepends=True)
        # Start at a random line that leaves enough text, cut at a line end past the target length.
        target = rng.randint(args.min_tokens, args.max_tokens)
        starts = [i for i in range(len(lines)) if len("".join(lines[i:i + 400])) > 6 * target] or [0]
        start = rng.choice(starts[: max(1, len(starts) // 2)])
        chunk = "".join(lines[start:start + 1500]).strip()
        enc = tok(chunk, return_offsets_mapping=True, add_special_tokens=False)
        if len(enc.input_ids) < args.min_tokens:
            continue
        cut = enc.offset_mapping[min(target, len(enc.input_ids)) - 1][1]
        nl = chunk.find("\n", cut)
        chunk = chunk[: nl if nl != -1 else len(chunk)].strip()
        n_tok = len(tok(chunk, add_special_tokens=False).input_ids)
        if not (args.min_tokens <= n_tok <= args.max_tokens + 80) or not _usable(chunk):
            continue
        try:
            src = str(path.relative_to(base))
        except ValueError:
            src = str(path)
        out.append({"kind": "package", "source": src, "text": chunk})
    if len(out) < n:
        log(f"warning: only {len(out)} package excerpts found (asked for {n})")
    return out


def build_texts(model, tok, args) -> list[dict]:
    """All texts (generated + package), from --texts-cache when it exists."""
    settings = {k: getattr(args, k) for k in ("texts", "package_fraction", "min_tokens", "max_tokens",
                                              "temperature", "top_p", "repetition_penalty", "gen_batch", "seed")}
    if args.texts_cache and args.texts_cache.is_file():
        cached = json.loads(args.texts_cache.read_text())
        if cached.get("settings") == settings:
            log(f"texts read from {args.texts_cache}")
            return cached["texts"]
        log(f"{args.texts_cache} was made with other settings; regenerating")
    rng = random.Random(args.seed)
    n_pkg = round(args.texts * args.package_fraction)
    texts = package_texts(tok, n_pkg, args, rng)
    texts += generate_texts(model, tok, args.texts - len(texts), args, rng)
    if args.texts_cache:
        args.texts_cache.parent.mkdir(parents=True, exist_ok=True)
        args.texts_cache.write_text(json.dumps({"settings": settings, "texts": texts}))
    return texts


# ----------------------------------------------------------------------------------------------
# KVzip / KVzip+ targets
# ----------------------------------------------------------------------------------------------

def repeat_prompt(tok, text: str) -> tuple[list[int], int, int, int, int]:
    """KVzip repeat prompt; returns ids and the token ranges [sp, ep) and [sr, er) of the two copies."""
    text = text.strip()
    messages = [{"role": "user", "content": text + REPEAT_INSTRUCTION},
                {"role": "assistant", "content": text}]
    s = tok.apply_chat_template(messages, tokenize=False)
    c_sp = s.index(text + REPEAT_INSTRUCTION)
    c_sr = s.rindex(text)
    enc = tok(s, return_offsets_mapping=True, add_special_tokens=False)
    starts = [a for a, _ in enc.offset_mapping]

    def first_at_or_after(c: int) -> int:
        return next(i for i, a in enumerate(starts) if a >= c)

    sp, ep = first_at_or_after(c_sp), first_at_or_after(c_sp + len(text))
    sr, er = first_at_or_after(c_sr), first_at_or_after(c_sr + len(text))
    return enc.input_ids, sp, ep, sr, er


def _rotate_half(x):
    import torch
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ScoreCollector:
    """Forward hooks on every self_attn that turn one repeat-prompt pass into (X, y) rows."""

    def __init__(self, model, target: str, attn: str, X, y):
        self.model, self.target, self.attn, self.X, self.y = model, target, attn, X, y
        self.rows = slice(0, 0)
        self.pos = None  # sampled positions, relative to sp
        self.sp = self.ep = self.sr = self.er = 0
        self.clamped = 0
        self.last_attention = {}  # layer -> attention rows, kept only when keep_attention is set
        self.keep_attention = False
        self.handles = [layer.self_attn.register_forward_hook(self.hook, with_kwargs=True)
                        for layer in model.model.layers]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def attention_rows(self, module, h, kwargs, output):
        """Softmax attention of queries [sr, er) over keys [0, er): [H, er - sr, er]."""
        import torch
        if self.attn == "eager":
            return output[1][0, :, self.sr:self.er, :self.er].float()
        cfg = module.config
        n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
        cos, sin = kwargs["position_embeddings"]
        cos, sin = cos[0], sin[0]  # [T, d]
        q = module.q_proj(h[self.sr:self.er]).view(-1, n_h, d).transpose(0, 1)
        k = module.k_proj(h[:self.er]).view(-1, n_kv, d).transpose(0, 1)
        q = q * cos[self.sr:self.er] + _rotate_half(q) * sin[self.sr:self.er]
        k = k * cos[:self.er] + _rotate_half(k) * sin[:self.er]
        k = k.repeat_interleave(n_h // n_kv, dim=0)
        logits = torch.matmul(q, k.transpose(1, 2)) * module.scaling
        qpos = torch.arange(self.sr, self.er).unsqueeze(1)
        kpos = torch.arange(self.er).unsqueeze(0)
        logits = logits.masked_fill(kpos > qpos, float("-inf"))
        return torch.softmax(logits.float(), dim=-1)

    def hook(self, module, args, kwargs, output):
        import torch
        cfg = module.config
        n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
        h = kwargs["hidden_states"][0]  # [T, hidden]: input_layernorm output
        A = self.attention_rows(module, h, kwargs, output)
        if self.keep_attention:
            self.last_attention[module.layer_idx] = A
        s = A[:, :, self.sp:self.ep]  # [H, repeat queries, original keys]
        if self.target == "kvzip+":
            h_norm = h[self.sr:self.er].norm(dim=-1)  # per query
            v = module.v_proj(h[self.sp:self.ep]).view(-1, n_kv, d).transpose(0, 1)
            v = v.repeat_interleave(n_h // n_kv, dim=0)  # [H, keys, d], GQA as repeat_kv
            w_o = module.o_proj.weight.t().reshape(n_h, d, cfg.hidden_size)  # W_o^(h): [H, d, hidden]
            gram = torch.matmul(w_o, w_o.transpose(1, 2))  # ||W_o^(h) v||^2 = v^T G_h v, G_h: [H, d, d]
            wov_norm = (torch.matmul(v, gram) * v).sum(-1).clamp_min(0).sqrt()  # [H, keys]
            s = s / h_norm[None, :, None] * wov_norm[:, None, :]
        s = s.amax(dim=1)  # max over repeat queries -> [H, keys]
        s = s.view(n_kv, n_h // n_kv, -1).amax(dim=1)  # max over each KV head's query heads
        tiny = torch.finfo(torch.float32).tiny
        self.clamped += int((s < tiny).sum())
        logs = torch.log(s.clamp_min(tiny))
        self.X[self.rows, module.layer_idx] = h[self.sp + self.pos].float()
        self.y[self.rows, module.layer_idx] = logs[:, self.pos].t()
        return output


def collect(model, tok, texts: list[dict], args):
    """Run every text's repeat prompt; returns X [N, L, hidden], y [N, L, KV], text index per row."""
    import torch
    cfg = model.config
    n = len(texts) * args.positions
    X = torch.zeros(n, cfg.num_hidden_layers, cfg.hidden_size)
    y = torch.zeros(n, cfg.num_hidden_layers, cfg.num_key_value_heads)
    owner = torch.zeros(n, dtype=torch.long)
    col = ScoreCollector(model, args.target, args.attn, X, y)
    gen = torch.Generator().manual_seed(args.seed)
    offset_mismatch, row, t0 = 0, 0, time.time()
    try:
        for i, t in enumerate(texts):
            ids, sp, ep, sr, er = repeat_prompt(tok, t["text"])
            orig = tok.decode(ids[sp:ep]).strip()
            rep = tok.decode(ids[sr:er]).strip()
            if orig != t["text"].strip() or rep != orig or ep - sp != er - sr:
                offset_mismatch += 1
            t["tokens"] = ep - sp
            k = min(args.positions, ep - sp)
            col.pos = torch.randperm(ep - sp, generator=gen)[:k].sort().values
            col.sp, col.ep, col.sr, col.er = sp, ep, sr, er
            col.rows = slice(row, row + k)
            owner[row:row + k] = i
            with torch.no_grad():
                model.model(torch.tensor([ids[:er]]), use_cache=False)
            row += k
            if (i + 1) % 16 == 0 or i + 1 == len(texts):
                el = time.time() - t0
                log(f"scored {i + 1}/{len(texts)} texts ({el:.0f} s, {el / (i + 1):.2f} s/text)")
    finally:
        col.remove()
    info = {"offset_mismatches": offset_mismatch, "clamped_zero_scores": col.clamped}
    return X[:row], y[:row], owner[:row], info


# ----------------------------------------------------------------------------------------------
# Training and metrics
# ----------------------------------------------------------------------------------------------

def train_linear(X, y, alpha: float):
    """Per-layer ridge regression (intercept not penalised), float64 closed form -> KVzapModel."""
    import torch
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    n_layers, dim, out = X.shape[1], X.shape[2], y.shape[2]
    model = KVzapModel(KVzapConfig(input_dim=dim, output_dim=out, n_modules=n_layers, hidden_dim=None))
    eye = torch.eye(dim, dtype=torch.float64)
    for li in range(n_layers):
        x = X[:, li].double()
        t = y[:, li].double()
        xm, tm = x.mean(0), t.mean(0)
        xc, tc = x - xm, t - tm
        w = torch.linalg.solve(xc.T @ xc + alpha * eye, xc.T @ tc)  # [dim, out]
        b = tm - xm @ w
        model.layers[li].weight.data = w.T.float().contiguous()
        model.layers[li].bias.data = b.float()
    return model.eval()


def train_mlp(X, y, args):
    """All layers' MLPs at once (kvpress style): AdamW, MSE, cosine LR per step, grad-norm clip 1.0."""
    import torch
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    torch.manual_seed(args.seed)
    n, n_layers, dim = X.shape
    model = KVzapModel(KVzapConfig(input_dim=dim, output_dim=y.shape[2], n_modules=n_layers,
                                   hidden_dim=args.hidden_dim))
    for li, seq in enumerate(model.layers):  # start at the mean: only speeds up the first epoch
        seq[2].bias.data = y[:, li].mean(0).clone()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.epochs * math.ceil(n / args.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=gen)
        total = 0.0
        for b in range(0, n, args.batch_size):
            idx = perm[b:b + args.batch_size]
            loss = torch.nn.functional.mse_loss(model(X[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        history.append(total / n)
        log(f"mlp epoch {epoch + 1}/{args.epochs}: train mse {history[-1]:.4f}")
    return model.eval(), history


def _ranks(v):
    import torch
    r = torch.empty_like(v)
    r[v.argsort()] = torch.arange(len(v), dtype=v.dtype)
    return r


def metrics(pred, true) -> dict:
    """Per-layer R^2 / Spearman (averaged over KV heads) and global top-k recall; inputs [N, L, KV]."""
    import torch
    pred, true = pred.double(), true.double()
    n_layers, n_kv = true.shape[1], true.shape[2]
    r2 = torch.zeros(n_layers)
    rho = torch.zeros(n_layers)
    for li in range(n_layers):
        r2s, rhos = [], []
        for k in range(n_kv):
            t, p = true[:, li, k], pred[:, li, k]
            r2s.append(1 - ((t - p) ** 2).sum() / ((t - t.mean()) ** 2).sum())
            rt, rp = _ranks(t), _ranks(p)
            rhos.append(torch.corrcoef(torch.stack([rt, rp]))[0, 1])
        r2[li], rho[li] = torch.stack(r2s).mean(), torch.stack(rhos).mean()
    t, p = true.flatten(), pred.flatten()
    recall = {}
    for name, frac in (("top25", 0.25), ("top12.5", 0.125)):
        k = int(round(frac * len(t)))
        mt = torch.zeros(len(t), dtype=torch.bool)
        mp = torch.zeros(len(t), dtype=torch.bool)
        mt[t.topk(k).indices] = True
        mp[p.topk(k).indices] = True
        recall[name] = float((mt & mp).sum()) / k
    return {"r2_per_layer": [round(float(v), 4) for v in r2], "spearman_per_layer": [round(float(v), 4) for v in rho],
            "r2_mean": round(float(r2.mean()), 4), "r2_min": round(float(r2.min()), 4),
            "spearman_mean": round(float(rho.mean()), 4), "spearman_min": round(float(rho.min()), 4),
            "recall": {k: round(v, 4) for k, v in recall.items()}}


def dir_size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_dir(args.model if isinstance(args.model, pathlib.Path) else pathlib.Path(args.model))
    import torch
    import transformers
    import kvpress
    from kvpress.presses.kvzap_press import KVzapModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_start = time.time()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    cfg = model.config
    log(f"model {args.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} q heads, {cfg.num_key_value_heads} kv heads")

    t0 = time.time()
    texts = build_texts(model, tok, args)
    timings["texts_s"] = round(time.time() - t0, 1)
    log(f"{len(texts)} texts ({timings['texts_s']} s)")

    if args.attn == "eager":
        model.set_attn_implementation("eager")
    t0 = time.time()
    X, y, owner, info = collect(model, tok, texts, args)
    timings["scores_s"] = round(time.time() - t0, 1)
    del model
    if info["offset_mismatches"]:
        log(f"warning: {info['offset_mismatches']} texts whose token ranges do not decode back to the text")

    # Hold out ~test_fraction of each kind of text.
    rng = random.Random(args.seed + 1)
    test_ids: set[int] = set()
    for kind in ("generated", "package"):
        ids = [i for i, t in enumerate(texts) if t["kind"] == kind]
        rng.shuffle(ids)
        test_ids.update(ids[:max(1, round(args.test_fraction * len(ids)))] if ids else [])
    is_test = torch.tensor([int(o) in test_ids for o in owner])
    Xtr, ytr, Xte, yte = X[~is_test], y[~is_test], X[is_test], y[is_test]
    log(f"train {len(Xtr)} rows ({len(texts) - len(test_ids)} texts), test {len(Xte)} rows ({len(test_ids)} texts); "
        f"y mean {float(y.mean()):.2f} std {float(y.std()):.2f}")

    t0 = time.time()
    linear = train_linear(Xtr, ytr, args.alpha)
    timings["linear_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    mlp, history = train_mlp(Xtr, ytr, args)
    timings["mlp_s"] = round(time.time() - t0, 1)

    results = {}
    sizes = {}
    for name, m in (("linear", linear), ("mlp", mlp)):
        with torch.no_grad():
            pred = m(Xte)
        results[name] = metrics(pred, yte)
        path = out / name
        m.save_pretrained(path)
        loaded = KVzapModel.from_pretrained(path).eval()
        with torch.no_grad():
            diff = float((loaded(Xte) - pred).abs().max())
        if diff != 0.0:
            raise SystemExit(f"error: {path} reloaded with KVzapModel.from_pretrained predicts differently (max |diff| {diff})")
        sizes[name] = dir_size(path)
        r = results[name]
        log(f"{name}: R2 mean {r['r2_mean']} min {r['r2_min']}, Spearman mean {r['spearman_mean']} "
            f"min {r['spearman_min']}, recall top25 {r['recall']['top25']} top12.5 {r['recall']['top12.5']}, "
            f"{sizes[name] / 1e6:.2f} MB, reload check ok")
    timings["total_s"] = round(time.time() - t_start, 1)

    lengths = [t["tokens"] for t in texts]
    report = {
        "method": "KVzap (arXiv 2601.07891) predictors of log " + ("KVzip+" if args.target == "kvzip+" else "KVzip")
                  + " scores from the self_attn input hidden states, kvpress KVzapModel format",
        "model": str(args.model),
        "command": "python3 tools/train_kvzap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress")},
        "data": {
            "texts": len(texts), "generated": sum(t["kind"] == "generated" for t in texts),
            "package": sum(t["kind"] == "package" for t in texts),
            "test_texts": len(test_ids), "train_rows": len(Xtr), "test_rows": len(Xte),
            "tokens_per_text": {"min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / len(lengths), 1)},
            "target_mean": round(float(y.mean()), 3), "target_std": round(float(y.std()), 3),
            **info,
            "sources": [{"kind": t["kind"], "source": t["source"], "tokens": t["tokens"],
                         "split": "test" if i in test_ids else "train"} for i, t in enumerate(texts)],
        },
        "mlp_train_mse_per_epoch": [round(v, 4) for v in history],
        "metrics_test": results,
        "chance_recall": {"top25": 0.25, "top12.5": 0.125},
        "sizes_bytes": sizes,
        "timings_s": timings,
    }
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {out}/linear, {out}/mlp, {out}/training.json in {timings['total_s']} s")
    return 0


def _dist_version(name: str) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
