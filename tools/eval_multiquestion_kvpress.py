"""kvpress side of tools/eval_multiquestion.py (`--kvpress`): the same documents, questions and chat
prompt in transformers, full KV and kvpress's `KVzipPress` at the given kept fractions.

Each document's context (the chat template's rendering of the first two messages on their own, as
kvserve cuts a chat's context: system prompt, user: the haystack, assistant: "I have memorized
them.") is prefilled once (under the press: compressed once, query-agnostic), then each question
(the rest of the rendered prompt: the question turn and the answer prefix, continue_final_message)
is answered from that cache by kvpress's own `KVPressTextGenerationPipeline._forward`: the question
ids are prefilled at positions `context_length...` after the (fake-)compressed context, greedy
decoding up to `max_new_tokens` or the EOS, then the question and answer are cut from the cache
before the next question. Only the split of the prompt differs from kvpress's `preprocess` (which
puts the question in the context's user turn): here the ids are kvserve's.
"""
from __future__ import annotations

import logging
import os
import time


def load(model_path: str, threads: int):
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    from kvpress import KVPressTextGenerationPipeline

    hf_logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzipPress warns of its cost on every instance

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    return model, tok, pipe


def split_prompt(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of the chat prompt: the context is every message before the last
    user message, rendered on its own; the question is the rest of the whole rendering (the answer
    prefix continued, no generation prompt). Both tokenized without special tokens added."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    whole = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ctx = tok.apply_chat_template(messages[:last_user], tokenize=False)
    assert whole.startswith(ctx), (ctx[-80:], whole[len(ctx) - 80:len(ctx) + 80])
    c = tok.encode(ctx, add_special_tokens=False)
    q = tok.encode(whole[len(ctx):], add_special_tokens=False)
    assert c + q == tok.encode(whole, add_special_tokens=False), "context/question split changes the tokens"
    return c, q


def run(model_path: str, docs: list, messages_of, kept: list[float], max_new_tokens: int, threads: int = 0,
        log=print) -> dict:
    """docs: [(haystack, [(key, number)...])]; messages_of(body, key) -> the chat messages.
    Returns {row name: [row dicts as eval_multiquestion's]} for full KV and each kept fraction."""
    import torch
    from kvpress import KVzipPress
    from transformers import DynamicCache

    model, tok, pipe = load(model_path, threads)
    configs = [("kvpress full", None)] + [(f"kvpress KVzipPress {r:g}", r) for r in kept]
    out = {}
    for name, r in configs:
        rows = []
        t_all = time.perf_counter()
        for d, (body, facts) in enumerate(docs):
            splits = [split_prompt(tok, messages_of(body, key)) for key, _ in facts]
            ctx = splits[0][0]
            assert all(c == ctx for c, _ in splits), "the questions of a document must share its context"
            press = KVzipPress(compression_ratio=1 - r) if r is not None else None
            # kvpress's multi-question path as is: _forward prefills the context under the press
            # (compressed once), then per question generate_answer + _remove_answer_from_cache.
            # generate_answer is timed to split the first question's time (compression included).
            times = []
            inner = pipe.generate_answer

            def timed(*args, **kw):
                t1 = time.perf_counter()
                try:
                    return inner(*args, **kw)
                finally:
                    times.append(time.perf_counter() - t1)

            pipe.generate_answer = timed
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    inputs = {"context_ids": torch.tensor([ctx]), "questions_ids": [torch.tensor([q]) for _, q in splits]}
                    texts = pipe._forward(inputs, max_new_tokens=max_new_tokens, press=press, cache=DynamicCache())
            finally:
                del pipe.generate_answer
            compress_s = time.perf_counter() - t0 - sum(times)
            kept_n = _kept(model, len(ctx))
            for i, ((key, answer), text) in enumerate(zip(facts, texts)):
                rows.append({"doc": d, "question": i, "answer": answer, "text": text, "correct": answer in text,
                             "seconds": times[i] + (compress_s if i == 0 else 0.0), "cached_tokens": len(ctx) if i else 0,
                             "context_tokens": len(ctx), "kept_fraction": kept_n})
        out[name] = rows
        k = sum(x["correct"] for x in rows)
        log(f"{name}: {k}/{len(rows)} ({time.perf_counter() - t_all:.0f} s)")
        _clear(model)
    return out


def _kept(model, n: int) -> float:
    """Fraction of the context's (layer, KV head, position) entries left unmasked by the press."""
    layers = model.model.layers
    heads = model.config.num_key_value_heads
    masked = sum(len(m[0]) for m in (getattr(layer.self_attn, "masked_key_indices", None) for layer in layers)
                 if m is not None)
    return 1 - masked / (len(layers) * heads * n)


def _clear(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
