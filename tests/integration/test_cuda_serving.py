"""`kvserve serve` on one CUDA device (skipped without one), over HTTP with the official openai
client: streamed chat, per-request KV policies, and greedy output identical to a CPU server."""
from __future__ import annotations

import pathlib

import openai
import pytest

from kvserve_server import Server

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "models" / "tiny-retriever")
TEXT = ("Read the following text and answer the question at the end. Boris painted the old bridge near Lima. "
        "In the morning, the baker from Lima walked to the tower. Julia keeps the lamp in the attic. "
        "Boris and Julia shared some bread by the tower. The rain lasted for 12 days in Lima. "
        "Where does Julia keep the lamp?")
PROMPT = TEXT + " Julia keeps the lamp in the"


def completions(url: str) -> dict:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    out = {}
    for policy in ("full", "snapkv", "pyramidkv"):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"kv_policy": policy})
        out[policy] = r.choices[0].text
    return out


def test_cuda_server_matches_cpu_server():
    cuda = Server(model=MODEL, extra_args=("--device", "cuda"))
    try:
        got = completions(cuda.url)
        c = openai.OpenAI(base_url=cuda.url + "/v1", api_key="unused")
        stream = c.chat.completions.create(model="tiny", stream=True, max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": TEXT}])
        chat = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    finally:
        assert cuda.stop() == 0, cuda.log()[-3000:]
    cpu = Server(model=MODEL)
    try:
        want = completions(cpu.url)
    finally:
        cpu.stop()
    assert got == want
    assert got["full"].strip().startswith("attic"), got
    assert "attic" in chat, chat
