"""`kvserve serve --config configs/default.yaml` (what `make serve` runs) with the official openai
client: the README's snippet answers sensibly, and chat answers are transformers' greedy ones."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest
import torch
import transformers

from kvserve_server import REPO, Server

MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
NAME = "smollm2-135m-instruct"
CHAT_PROMPTS = json.loads((REPO / "tests" / "reference" / "chat_prompts.json").read_text())


@pytest.fixture(scope="module")
def default_server():
    # The default config names models/smollm2-135m-instruct; make it if `make model` has not.
    subprocess.run([sys.executable, str(REPO / "tools" / "make_smollm2.py"), "--out", str(MODEL_DIR)], check=True)
    s = Server(config=REPO / "configs" / "default.yaml")
    yield s
    s.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_readme_snippet_answers_the_question(default_server):
    """The README's Python block, run as it stands (pointed at this server's port)."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S)
    assert block, "README.md has no python block"
    code = block.group(1).replace("http://127.0.0.1:8000", default_server.url)
    assert default_server.url in code, "the README snippet does not use http://127.0.0.1:8000"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout


def test_models_list_names_the_default(default_server):
    assert [m.id for m in client(default_server).models.list().data] == [NAME]


def test_chat_answers_equal_transformers_greedy(default_server):
    """Four conversations (one with a system prompt, one multi-turn): kvserve's own chat template and
    tokenizer behind the API give the prompt transformers' apply_chat_template gives, and the greedy
    answer, streamed or not, is transformers' decoded one."""
    convs = [CHAT_PROMPTS[0], CHAT_PROMPTS[3], CHAT_PROMPTS[-2], CHAT_PROMPTS[-1]]
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    c = client(default_server)
    for conv in convs:
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):]
        want = tok.decode(ref, skip_special_tokens=True)
        r = c.chat.completions.create(model=NAME, messages=conv, max_tokens=32, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == want
        stream = c.chat.completions.create(model=NAME, messages=conv, max_tokens=32, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want
