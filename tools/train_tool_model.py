#!/usr/bin/env python3
"""Train models/tiny-toolcaller: a small Llama that decides between calling a tool and answering.

A random-weight fixture cannot test `tool_choice: "auto"` (whether the model calls a tool is its own
decision), and the default model (SmolLM2-135M-Instruct) was not trained to call tools. This trains a
0.6M-parameter Llama on generated chats rendered with a Llama 3.1 JSON tool-calling chat template (tools
listed after "Environment: ipython"; a call is a bare {"name": ..., "parameters": ...} object, as Llama
3.1 writes them): questions about the weather or the time become calls to get_weather / get_time
with the city (and unit, or time zone) taken from the question; greetings, arithmetic and small
talk get a short text answer, with or without tools offered. The tokenizer is tiny-retriever's
(byte-level BPE with Llama 3's special tokens). Deterministic for a seed on one machine; the
committed weights are what the tests use.

  python3 tools/train_tool_model.py --out models/tiny-toolcaller     # about 10 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
TOKENIZER_FROM = REPO / "models" / "tiny-retriever"

# A Llama 3.1 style tool-calling template (own wording). Tool results come back as "ipython" turns.
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Functions you can call:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "To call one, reply with only {\"name\": function name, \"parameters\": arguments object}.<|eot_id|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}{\"name\": \"{{ call.function.name }}\", \"parameters\": "
    "{% if call.function.arguments is string %}{{ call.function.arguments }}{% else %}{{ call.function.arguments | tojson }}"
    "{% endif %}}{% endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content | trim }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                         "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                                        "required": ["timezone"]}}}
CITIES = {"Paris": "Europe/Paris", "London": "Europe/London", "Tokyo": "Asia/Tokyo", "Berlin": "Europe/Berlin",
          "Madrid": "Europe/Madrid", "Rome": "Europe/Rome", "Cairo": "Africa/Cairo", "Lima": "America/Lima",
          "Oslo": "Europe/Oslo", "Seoul": "Asia/Seoul", "Sydney": "Australia/Sydney", "Boston": "America/New_York",
          "Dublin": "Europe/Dublin", "Vienna": "Europe/Vienna", "Prague": "Europe/Prague", "Denver": "America/Denver"}
WEATHER_Q = ["What is the weather in {c}?", "What's the weather like in {c} right now?", "Is it raining in {c}?",
             "How warm is it in {c} today?", "Tell me the current weather in {c}.", "Weather in {c}, please.",
             "Do I need an umbrella in {c}?", "How cold is it in {c}?"]
TIME_Q = ["What time is it in {c}?", "What is the current time in {c}?", "Tell me the time in {c}.",
          "Which hour is it now in {c}?", "Time in {c}, please."]
TALK = {"Hello!": "Hello! How can I help you today?", "Hi, how are you?": "I am well, thank you. How can I help?",
        "What is 2 + 3?": "2 + 3 is 5.", "What is 7 + 1?": "7 + 1 is 8.", "Tell me a joke.":
        "Why did the cat sit on the computer? To keep an eye on the mouse.", "Write a haiku about the sea.":
        "Grey waves fold and break, salt wind carries gull voices, the tide keeps its time.",
        "Thank you!": "You are welcome.", "Who are you?": "I am a small assistant that can call tools.",
        "What is the capital of France?": "The capital of France is Paris.", "Spell the word cat.": "C, A, T.",
        "Name a color.": "Blue.", "Say goodbye.": "Goodbye!"}


def shuffled_tool(t: dict, rng: random.Random) -> dict:
    """The same tool with its keys in a random order: servers re-serialize tools (some sort keys)."""
    def sh(x):
        if isinstance(x, dict):
            items = list(x.items())
            if rng.random() < 0.5:
                items.sort()
            return {k: sh(v) for k, v in items}
        return x
    return sh(t)


def sample(rng: random.Random) -> tuple[list, list, dict]:
    """(tools, messages, assistant turn) for one generated chat."""
    offered = [t for t in (WEATHER, TIME) if rng.random() < 0.75]
    rng.shuffle(offered)
    names = {t["function"]["name"] for t in offered}
    kind = rng.choice(["weather", "time", "talk", "talk"])
    city = rng.choice(list(CITIES))
    if kind == "weather" and "get_weather" in names:
        unit = "fahrenheit" if rng.random() < 0.3 else "celsius"
        q = rng.choice(WEATHER_Q).format(c=city) + (" In fahrenheit." if unit == "fahrenheit" else "")
        call = {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": unit})}
        answer = {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]}
    elif kind == "time" and "get_time" in names:
        q = rng.choice(TIME_Q).format(c=city)
        call = {"name": "get_time", "arguments": json.dumps({"timezone": CITIES[city]})}
        answer = {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]}
    elif kind in ("weather", "time"):
        q = rng.choice(WEATHER_Q if kind == "weather" else TIME_Q).format(c=city)
        answer = {"role": "assistant", "content": "I have no tool to look that up."}
    else:
        q, a = rng.choice(list(TALK.items()))
        answer = {"role": "assistant", "content": a}
    return [shuffled_tool(t, rng) for t in offered], [{"role": "user", "content": q}], answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "models" / "tiny-toolcaller")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import transformers
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = random.Random(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.copy(TOKENIZER_FROM / "tokenizer.json", a.out / "tokenizer.json")
    tok_cfg = json.loads((TOKENIZER_FROM / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = TEMPLATE
    (a.out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    tok = transformers.AutoTokenizer.from_pretrained(a.out)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=288, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                                   bos_token_id=tok.bos_token_id, eos_token_id=eot)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps, pct_start=0.1)

    def encode(tools, msgs, answer):
        prompt = tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs + [answer], tools=tools or None, tokenize=False)
        assert full.startswith(prompt), (prompt, full)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        f = tok(full, add_special_tokens=False)["input_ids"]
        return f, len(p)

    log, t0 = [], time.time()
    model.train()
    for step in range(a.steps):
        batch = [encode(*sample(rng)) for _ in range(a.batch)]
        width = max(len(f) for f, _ in batch)
        ids = torch.full((len(batch), width), eot, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (f, p) in enumerate(batch):
            ids[i, :len(f)] = torch.tensor(f)
            labels[i, p:len(f)] = torch.tensor(f[p:])  # loss on the assistant turn only
            mask[i, :len(f)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)})
            print(f"[train_tool_model] step {step} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)

    # Greedy check on held-out draws: the call (or the text) must be exactly the target.
    model.eval()
    check = random.Random(a.seed + 1)
    right = 0
    n_check = 100
    for _ in range(n_check):
        tools, msgs, answer = sample(check)
        prompt = tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs + [answer], tools=tools or None, tokenize=False)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=eot, pad_token_id=eot)
        got = tok.decode(out[0, ids.shape[1]:])
        right += got == full[len(prompt):]
    print(f"[train_tool_model] held-out exact answers: {right}/{n_check}", flush=True)
    model.save_pretrained(a.out, safe_serialization=True)
    (a.out / "training_log.json").write_text(json.dumps({"steps": a.steps, "batch": a.batch, "seed": a.seed,
                                                         "heldout_exact": f"{right}/{n_check}", "log": log}, indent=1))


if __name__ == "__main__":
    main()
