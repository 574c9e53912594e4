#!/usr/bin/env python3
"""Train the embedded default model `models/tiny-retriever`: a small Llama (GQA, RoPE) that
retrieves facts from contexts up to 2048 tokens (passkey, needle, multi-key), plus plain text.
Runs on CPU or on one CUDA GPU (--device); the recipe is the same.

  python3 tools/train_tiny_model.py --out models/tiny-retriever            # the shipped recipe
  python3 tools/train_tiny_model.py --dry-run          # 60 s of training: measures tokens/s

Deterministic by --seed: the tokenizer corpus, every step's batch (a random.Random seeded by
(seed, step), so batches do not depend on --workers or on resuming) and the initialisation
(torch.manual_seed) all derive from it; floating-point results differ between CPU and GPU, and
wall time depends on the machine. Data and task formats are in tools/retrieval_tasks.py (shared with
tools/eval_retrieval.py, whose held-out sets use other seeds). Checkpoints go to <out>.ckpt/ every
--ckpt-every steps; --resume continues from one.

Loss: mean cross-entropy over the answer tokens + --lm-weight x mean cross-entropy over every other
token (retrieval is learned much faster when the answer dominates; the text loss keeps it a
language model for the perplexity check).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import retrieval_tasks as rt  # noqa: E402

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

# Llama-3's split regex with single digits (\p{N} instead of \p{N}{1,3}): numbers are spelled digit
# by digit, so copying a number is copying digits.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|reserved_special_token_0|>"]
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def tokenizer_corpus(seed: int, n: int = 30000) -> list:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cast = rt.make_cast(rng)
        line = " ".join(rt.haystack_sentence(rng, cast) for _ in range(4))
        fact, q, ap, ans = rt.needle_fact(rng)
        out.append(line + " " + fact + " " + q + " " + ap + ans + ".")
    out.append(" ".join(rt.NAMES + rt.CITIES + rt.COLORS + rt.ANIMALS + rt.ADJS + rt.OBJECTS + rt.PLACES
                        + rt.WORDS + rt.NOUNS + rt.THINGS))
    out.append("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
               "The pass key is 12345. Remember it. What is the pass key? Below are several keys and their "
               "values, hidden in some text. Remember them. The value of key quiet-owl is 123456. Read the "
               "following text and answer the question at the end. user assistant system")
    return out


def train_tokenizer(seed: int, vocab: int, out: pathlib.Path) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    bos = SPECIALS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": bos, "eos_token": "<|eot_id|>",
              "model_max_length": 2048, "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def make_model(vocab: int, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      max_position_embeddings=args.max_len, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                      bos_token_id=0, eos_token_id=4, tie_word_embeddings=False, initializer_range=0.02,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


TASKS = (("passkey", 0.22), ("needle", 0.33), ("multikey", 0.27), ("continue", 0.18))
# "repeat" samples (short random token sequences, each repeated, every token of a copy a target) help
# form the copying (induction) heads; "copy" samples (repeat a list of words/numbers across filler
# text) bridge to the real tasks. Both fade.
REPEAT_SHARE = lambda progress: 0.3 if progress < 0.2 else max(0.1, 0.3 - (progress - 0.2) * 0.5)  # noqa: E731
COPY_SHARE = lambda progress: max(0.0, 0.2 * (1 - progress / 0.5))  # noqa: E731


def curriculum_len(progress: float, rng: random.Random, max_len: int) -> int:
    """Short contexts while the copying circuits form, then up to the full length; the last 30 % of
    steps keep every length (so short prompts are not forgotten)."""
    if progress < 0.25:
        top = min(512, max_len)
    else:
        top = int(min(512, max_len) + (max_len - min(512, max_len)) * min(1.0, (progress - 0.25) / 0.35))
    if rng.random() < 0.4:
        length = top
    else:
        length = rng.randint(64, max(64, top))
    return max(64, (length // 32) * 32)


def step_batch(builder, step: int, args, vocab: int):
    """The batch of one step: a pure function of (args.seed, step), so data workers and resumes agree."""
    rng = random.Random(args.seed * 1_000_003 + step)
    progress = 0.6 if args.dry_run else step / args.steps
    length = curriculum_len(progress, rng, args.max_len)
    n = min(args.max_rows, max(4, args.batch_tokens // length))
    x, am, valid = make_batch(builder, rng, length, n, args.max_len, copy_share=COPY_SHARE(progress),
                              repeat_share=REPEAT_SHARE(progress), vocab=vocab)
    return length, x, am, valid


class StepBatches(torch.utils.data.IterableDataset):
    """Batches for steps step0.. in order; worker w of W builds steps step0+w, step0+w+W, ... (the
    DataLoader takes one from each worker in turn, so the order is the step order)."""

    def __init__(self, builder, step0, args, vocab):
        super().__init__()
        self.builder, self.step0, self.args, self.vocab = builder, step0, args, vocab

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        for step in range(self.step0 + w, self.args.steps, nw):
            yield (step,) + step_batch(self.builder, step, self.args, self.vocab)


def make_batch(builder, rng, length, n, cap, chat_frac=0.15, copy_share=0.0, repeat_share=0.0, vocab=0):
    rows, masks = [], []
    for _ in range(n):
        if rng.random() < repeat_share:
            # Packed short repeats: [bos] r1 r1 r2 r2 ..., |r| in 8..32, every repeated token a target.
            # Short spans matter: attention at init is spread over the whole row, so the copying heads
            # form far faster over 8-32 tokens than over hundreds.
            row, mask = [builder.bos], [0]
            while len(row) < length:
                k = rng.randint(8, 32)
                seq = [rng.randrange(len(SPECIALS), vocab) for _ in range(k)]
                row += seq + seq
                mask += [0] * (k + 1) + [1] * (k - 1)
            rows.append(row[:length])
            masks.append(mask[:length])
            continue
        r = rng.random()
        acc = 0.0
        for task, p in TASKS:
            acc += p
            if r < acc:
                break
        if rng.random() < copy_share:
            task = "copy"
        chat = task not in ("continue", "copy") and rng.random() < chat_frac
        n_needles = 1 if chat or rng.random() < 0.4 else rng.randint(2, 4)
        text, ids, ans, ans_ids, meta = rt.build(builder, rng, task, length, chat=chat, n_needles=n_needles)
        full = ids + ans_ids
        # mask[i] = 1 where token i is an answer token (a target of position i-1)
        mask = [0] * len(ids) + [1] * len(ans_ids)
        # More questions after the first answer (more answer signal per sequence; not for chat).
        extra = meta.get("extra_qa", []) if not chat else []
        rng.shuffle(extra)
        for q, pre, a in extra[: rng.randint(0, 3)]:
            qi = builder.ids(q) + builder.ids(pre)
            ai = builder.ids(a) + builder.ids(".")
            full += qi + ai
            mask += [0] * len(qi) + [1] * len(ai)
        rows.append(full[:cap])
        masks.append(mask[:cap])
    width = max(len(r) for r in rows)
    x = torch.zeros(n, width, dtype=torch.long)
    am = torch.zeros(n, width, dtype=torch.float32)
    valid = torch.zeros(n, width, dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        x[i, : len(r)] = torch.tensor(r)
        am[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        valid[i, : len(r)] = 1
    return x, am, valid


def loss_fn(model, x, am, valid, lm_weight):
    logits = model(input_ids=x).logits[:, :-1].float()
    tgt = x[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                           reduction="none").view_as(tgt)
    a = am[:, 1:]
    v = valid[:, 1:] * (1 - a)
    ans = (ce * a).sum() / a.sum().clamp(min=1)
    lm = (ce * v).sum() / v.sum().clamp(min=1)
    return ans + lm_weight * lm, ans.detach(), lm.detach()


@torch.no_grad()
def quick_eval(model, builder, seed, length, device, n=24):
    """Teacher-forced exact match of the answer (= greedy decoding when every token is right)."""
    model.eval()
    rng = random.Random(seed)
    res = {}
    for task in ("passkey", "needle", "multikey"):
        ok = 0
        for _ in range(n // 8):
            rows = [rt.build(builder, rng, task, length, passkey_digits=5 if task == "passkey" else None)
                    for _ in range(8)]
            width = max(len(r[1]) + len(r[3]) for r in rows)
            x = torch.zeros(len(rows), width, dtype=torch.long)
            for i, r in enumerate(rows):
                seq = r[1] + r[3]
                x[i, : len(seq)] = torch.tensor(seq)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                pred = model(input_ids=x.to(device)).logits.argmax(-1).cpu()
            for i, r in enumerate(rows):
                p0 = len(r[1])
                n_ans = len(builder.ids(r[2]))  # the answer value itself, not the '.'
                if torch.equal(pred[i, p0 - 1: p0 - 1 + n_ans], x[i, p0: p0 + n_ans]):
                    ok += 1
        res[task] = ok / (n // 8 * 8)
    model.train()
    return res


def save(model, tok_dir: pathlib.Path, out: pathlib.Path, dtype=torch.float32):
    out.mkdir(parents=True, exist_ok=True)
    m = model.to(dtype)
    m.generation_config.bos_token_id = 0
    m.generation_config.eos_token_id = 4
    m.save_pretrained(str(out), safe_serialization=True)
    model.to(torch.float32)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((tok_dir / f).read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("models/tiny-retriever"))
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-tokens", type=int, default=65536, help="tokens per step (rows = this / length)")
    ap.add_argument("--max-rows", type=int, default=256, help="at most this many rows per step")
    ap.add_argument("--max-len", type=int, default=2048, help="longest training sequence = max_position_embeddings")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lm-weight", type=float, default=0.3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    ap.add_argument("--workers", type=int, default=-1,
                    help="data-building processes (-1: CPUs - 2 on GPU, 0 on CPU, where the main process builds)")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="stop early (saving the model) after this much wall time; 0: no limit")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="train for 60 s and report tokens/s")
    args = ap.parse_args()

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    workers = args.workers if args.workers >= 0 else (max(1, (os.cpu_count() or 2) - 2) if device.type == "cuda" else 0)
    torch.manual_seed(args.seed)
    t_start = time.time()
    ckpt = pathlib.Path(str(args.out) + ".ckpt")
    tok_dir = ckpt / "tokenizer"
    tok = train_tokenizer(args.seed, args.vocab, tok_dir)
    vocab = tok.get_vocab_size()
    builder = rt.Builder(tok, tok.token_to_id("<|begin_of_text|>"))
    bad = rt.check_segment_concat(builder, random.Random(args.seed + 7), 60)
    print(f"tokenizer: vocab {vocab}; segment/whole tokenization mismatches: {bad}/120", flush=True)
    if bad:
        raise SystemExit("segment tokenization does not match whole-text tokenization")

    model = make_model(vocab, args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters on {device}; data workers: {workers}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step0 = 0
    log = []
    prior_wall = 0.0
    if args.resume and (ckpt / "state.pt").exists():
        st = torch.load(ckpt / "state.pt", weights_only=False, map_location=device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step0, log, prior_wall = st["step"], st["log"], st.get("wall", 0.0)
        print(f"resumed at step {step0}", flush=True)
    model.train()
    steps = args.steps
    tokens = 0
    t0 = time.time()
    data = StepBatches(builder, step0, args, vocab)
    if workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        data = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers, prefetch_factor=4,
                                           pin_memory=device.type == "cuda")
    stopped_early = False
    for step, length, x, am, valid in data:
        progress = step / steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        n = x.shape[0]
        x, am, valid = (t.to(device, non_blocking=True) for t in (x, am, valid))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss, ans, lm = loss_fn(model, x, am, valid, args.lm_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int(valid.sum())
        el = time.time() - t0
        if step % 10 == 0:
            print(f"step {step} len {length} bs {n} loss {loss.item():.3f} ans {ans.item():.3f} lm {lm.item():.3f} "
                  f"lr {lr:.2e} tok/s {tokens / el:.0f} elapsed {el:.0f}s", flush=True)
            log.append({"step": step, "len": length, "ans": round(ans.item(), 4), "lm": round(lm.item(), 4)})
        if args.dry_run and el > 60:
            print(f"dry run: {tokens} tokens in {el:.1f}s = {tokens / el:.0f} tokens/s at length {length}")
            return
        stopped_early = args.max_minutes > 0 and (time.time() - t_start) > args.max_minutes * 60
        last = step + 1 == steps or stopped_early
        if (step + 1) % args.eval_every == 0 or last:
            for ev_len in sorted({min(args.max_len, max(256, length)), args.max_len} if last else
                                 {min(args.max_len, max(256, length))}):
                res = quick_eval(model, builder, 999, ev_len, device)
                print(f"eval step {step + 1} len {ev_len}: {res}", flush=True)
                log.append({"step": step + 1, "eval_len": ev_len, **res})
        if (step + 1) % args.ckpt_every == 0 or last:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1, "log": log,
                        "wall": prior_wall + time.time() - t0}, ckpt / "state.pt")
            save(model, tok_dir, ckpt / "model")
        if stopped_early:
            print(f"stopping early at step {step + 1} of {steps} (--max-minutes {args.max_minutes})", flush=True)
            steps = step + 1
            break
    wall = prior_wall + time.time() - t_start
    save(model, tok_dir, args.out)
    info = {"seed": args.seed, "steps": steps, "schedule_steps": args.steps, "stopped_early": stopped_early,
            "batch_tokens": args.batch_tokens, "max_len": args.max_len, "lr": args.lr, "lm_weight": args.lm_weight,
            "params": n_params, "vocab": vocab, "device": str(device) if device.type == "cpu"
            else torch.cuda.get_device_name(device), "workers": workers, "wall_s": round(wall, 1),
            "tokens_this_run": tokens, "tokens_per_s_this_run": round(tokens / max(1e-9, time.time() - t0)),
            "torch": torch.__version__, "log": log}
    (args.out / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"done: {steps} steps, wall {wall:.0f}s; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
