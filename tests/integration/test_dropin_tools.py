"""What third-party clients send, against a real `kvserve serve` (issues 50 and 51): fields kvserve does
not know are ignored and named as vLLM ignores them (a 400 with `server.strict_fields: true`), fields
it knows but cannot honour stay 400s; `GET /tokenizer_info` in vLLM's shape, read as
lm-evaluation-harness's `tokenizer_backend=remote` reads it (its chat template renders what the
server renders, its special tokens round-trip through /tokenize); GuideLLM's
`stream_options.continuous_usage_stats` puts the usage so far in every chunk and unknown
`stream_options` keys are a 400; `usage.kv_rollout_rule` is absent without rollout rules."""
from __future__ import annotations

import json

import jinja2
import openai
import pytest

from kvserve_server import Server, raw

MESSAGES = [{"role": "user", "content": "The passkey is 4711. What is the passkey?"}]


@pytest.fixture(scope="module")
def srv():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def strict():
    s = Server(server_yaml="  strict_fields: true\n")
    yield s
    s.close()


def post(s, path: str, body: dict):
    status, headers, data = raw(s, "POST", path, json.dumps(body))
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(data) if data else None


def test_unknown_fields_are_ignored_and_named(srv, strict):
    # lm-eval's Hugging Face generation keys, as its generate_until tasks send them.
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "max_new_tokens": 2, "num_beams": 1,
            "do_sample": False}
    status, headers, out = post(srv, "/v1/chat/completions", body)
    assert status == 200, out
    assert headers["x-kv-ignored-fields"] == "do_sample, max_new_tokens, num_beams"
    assert out["usage"]["completion_tokens"] == 2
    assert "ignored_fields=do_sample, max_new_tokens, num_beams" in srv.log()
    # The other endpoint's fields are known, and a 400 here; a request with nothing unknown gets no header.
    status, _, err = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, "messages": []})
    assert status == 400 and err["error"]["param"] == "messages", err
    status, headers, _ = post(srv, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert status == 200 and "x-kv-ignored-fields" not in headers
    # Known and not honoured: still a 400 naming the field.
    status, _, err = post(srv, "/v1/chat/completions", {**body, "use_beam_search": True})
    assert status == 400 and err["error"]["param"] == "use_beam_search"
    # server.strict_fields: true refuses the first unknown field (in key order).
    status, _, err = post(strict, "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "do_sample", err
    assert "unknown field 'do_sample'" in err["error"]["message"]
    # Through the official client as well.
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                    extra_body={"num_beams": 4})
    assert r.headers["x-kv-ignored-fields"] == "num_beams"
    assert getattr(r.parse().usage, "kv_rollout_rule", None) is None  # absent without rollout rules
    assert "kv_rollout_rule" not in r.parse().usage.model_dump(exclude_unset=True)


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(srv):
    status, headers, data = raw(srv, "GET", "/tokenizer_info")
    assert status == 200, data
    info = json.loads(data)
    config = json.loads((__import__("pathlib").Path(srv.model) / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
    assert info["eos_token"] == config["eos_token"] and info["bos_token"] == config["bos_token"]
    assert "added_tokens_decoder" not in info
    # What lm-eval's RemoteTokenizer does with it: special tokens' ids through /tokenize, and its
    # chat template rendered with jinja2 equals the server's own rendering (/tokenize with messages).
    for name in ("eos_token", "bos_token"):
        status, _, tok = post(srv, "/tokenize", {"prompt": info[name], "add_special_tokens": False})
        assert status == 200 and len(tok["tokens"]) == 1, tok
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(info["chat_template"]).render(messages=MESSAGES, add_generation_prompt=True,
                                                         bos_token=info["bos_token"], eos_token=info["eos_token"])
    _, _, mine = post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False})
    _, _, server = post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": True})
    assert mine["tokens"] == server["tokens"]
    assert raw(srv, "POST", "/tokenizer_info")[0] == 405


def stream_chunks(s, stream_options: dict) -> list[dict]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": stream_options}
    status, _, data = raw(s, "POST", "/v1/chat/completions", json.dumps(body))
    assert status == 200, data
    return [json.loads(line[6:]) for line in data.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_continuous_usage_stats(srv):
    chunks = stream_chunks(srv, {"include_usage": True, "continuous_usage_stats": True})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), chunks
    prompt = usages[-1]["prompt_tokens"]
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 4 and completion[0] == 0
    # Without it, OpenAI's shape: null in every chunk, the usage in a last one.
    chunks = stream_chunks(srv, {"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 4
    status, _, err = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stream": True,
                                                        "stream_options": {"bogus_key": 1}})
    assert status == 400 and err["error"]["param"] == "stream_options.bogus_key", err
