"""The rest of a vLLM drop-in (issue 24, item 4) against a real `kvserve serve`: the request-field
table (every refused field is a 400 naming it), logit_bias / allowed_token_ids / bad_words, echo
(streamed too, and with max_tokens 0 as evaluation harnesses score), prompt_logprobs against
transformers, /tokenize and /detokenize against Hugging Face tokenizers, CORS, X-Request-Id and
the vllm: metric names. Through the official openai client, raw HTTP where it cannot send a field."""
from __future__ import annotations

import json
import re

import openai
import pytest

from kvserve_server import REPO, Server, raw

ORIGIN = "https://app.example.com"
PROMPT = "The passkey is 4711. Remember it. The passkey is"


@pytest.fixture(scope="module")
def srv():
    s = Server(server_yaml=f'  allowed_origins: ["{ORIGIN}"]\n')
    yield s
    s.close()


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(s, path: str, body: dict, headers: dict | None = None):
    status, h, data = raw(s, "POST", path, json.dumps(body), headers)
    return status, h, json.loads(data) if data else None


def refused_fields() -> list[tuple[str, str]]:
    """(route, field) for every 400 of docs/api.md's field table (the table the server uses)."""
    out = []
    for line in (REPO / "docs" / "api.md").read_text().splitlines():
        m = re.match(r"\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if not m:
            continue
        for route, status in (("/v1/completions", m.group(2)), ("/v1/chat/completions", m.group(3))):
            if status.strip().startswith("400"):
                out.append((route, m.group(1)))
    return out


def test_every_refused_field_is_a_400_naming_it(srv):
    fields = refused_fields()
    assert len(fields) > 40  # the table parsed (56 refusals when the grammar fields became supported)
    for route, name in fields:
        body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
        body[name] = {"kvserve_test": True}
        status, _, err = post(srv, route, body)
        assert status == 400, (route, name)
        assert err["error"]["param"] == name and name in err["error"]["message"], (route, name, err)
    # The official client's extra_body reaches the same check.
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"
    # A field kvserve does not know is ignored and named, as vLLM ignores it (server.strict_fields
    # makes it a 400: test_dropin_tools.py).
    r = client(srv).completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=1,
                                                         extra_body={"temprature": 0})
    assert r.headers["x-kv-ignored-fields"] == "temprature"
    # A refused field at its default value is no request for anything: accepted.
    r = client(srv).completions.create(model="tiny", prompt="hi", max_tokens=1,
                                       extra_body={"use_beam_search": False, "priority": 0})
    assert r.usage.completion_tokens == 1


def tokenize(s, text: str, add_special_tokens: bool = False) -> list[int]:
    status, _, body = post(s, "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
    assert status == 200, body
    return body["tokens"]


def detokenize(s, ids: list[int]) -> str:
    return post(s, "/detokenize", {"tokens": ids})[2]["prompt"]


def test_logit_bias_and_allowed_token_ids(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    base = c.completions.create(logprobs=0, **kw).choices[0]
    first = base.logprobs.tokens[0]
    # +100 on a token the model does not pick makes it the first one.
    target = next(t for t in tokenize(srv, " apple banana") if detokenize(srv, [t]) != first)
    r = c.completions.create(logprobs=0, logit_bias={str(target): 100}, **kw).choices[0]
    assert r.logprobs.tokens[0] == detokenize(srv, [target])
    # -100 on the greedy first token moves the first token elsewhere.
    first_id = tokenize(srv, PROMPT + base.text)[len(tokenize(srv, PROMPT))]
    if detokenize(srv, [first_id]) == first:
        r = c.completions.create(logprobs=0, logit_bias={str(first_id): -100}, **kw).choices[0]
        assert r.logprobs.tokens[0] != first
    # allowed_token_ids, sampled: nothing else comes out.
    allowed = tokenize(srv, " red green blue")
    texts = {detokenize(srv, [t]) for t in allowed}
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=0,
                             extra_body={"ignore_eos": True, "allowed_token_ids": allowed}).choices[0]
    assert set(r.logprobs.tokens) <= texts, (r.logprobs.tokens, texts)
    # Ids outside the vocabulary are a 400 naming the field.
    for field, value in (("logit_bias", {"999999": 1}), ("allowed_token_ids", [999999])):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="hi", extra_body={field: value})
        assert e.value.body["param"] == field


def test_bad_words(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    base = c.completions.create(**kw).choices[0].logprobs.tokens
    # A generated word that is one token alone and one token after a space: vLLM bans both forms.
    at = next((i for i, t in enumerate(base) if t.strip() and len(tokenize(srv, t.strip())) == 1
               and len(tokenize(srv, " " + t.strip())) == 1), None)
    if at is None:
        pytest.skip(f"no one-token word in the greedy output {base!r}")
    word = base[at].strip()
    r = c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "bad_words": [word]}}).choices[0]
    assert r.logprobs.tokens[:at] == base[:at]  # the same greedy path up to the word
    assert word not in {t.strip() for t in r.logprobs.tokens}, (word, r.logprobs.tokens)


def test_echo_streamed_equals_non_streamed(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].text
    assert full.startswith(PROMPT) and len(full) > len(PROMPT)
    chunks = list(c.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full
    only = c.completions.create(**{**kw, "max_tokens": 0}).choices[0]
    assert only.text == PROMPT
    streamed = list(c.completions.create(stream=True, **{**kw, "max_tokens": 0}))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == PROMPT


def transformers_logprobs(model_dir: str, ids: list[int]):
    """Per position from the second: log p(token | the tokens before it), and each row's best."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return [lp[t, ids[t + 1]].item() for t in range(len(ids) - 1)], [lp[t].max().item() for t in range(len(ids) - 1)]


def test_echo_logprobs_score_the_prompt_as_transformers(srv):
    ids = tokenize(srv, PROMPT, add_special_tokens=True)
    want, best = transformers_logprobs(srv.model, ids)
    c = client(srv)
    # lm-eval's loglikelihood request: echo, one generated token, logprobs 1; it reads [ctxlen:-1].
    for max_tokens in (0, 1):
        ch = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
                                  logprobs=1).choices[0]
        lp = ch.logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=2e-4)
        for t in range(1, len(ids)):
            assert max(lp.top_logprobs[t].values()) == pytest.approx(best[t - 1], abs=2e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert "".join(lp.tokens[:len(ids)]) == detokenize(srv, ids)
    # vLLM's prompt_logprobs, on completions and chat: [None, {id: {logprob, rank, decoded_token}}, ...].
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for t in range(1, len(ids)):
        entry = plp[t][str(ids[t])]
        assert entry["logprob"] == pytest.approx(want[t - 1], abs=2e-4)
        assert entry["rank"] >= 1 and len(plp[t]) <= 3
    # One forward over the whole prompt, before any compression: the same under a compressing policy.
    long_ids = tokenize(srv, " ".join(f"item {i} is {i * 7 % 13}." for i in range(30)), add_special_tokens=True)
    by_policy = [c.completions.create(model="tiny", prompt=long_ids, max_tokens=1,
                                      extra_body={"prompt_logprobs": 0, "kv_policy": p}).choices[0].model_extra
                 ["prompt_logprobs"] for p in ("full", "pyramidkv")]
    assert len(long_ids) > 24 and by_policy[0] == by_policy[1]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])


def test_tokenize_detokenize_match_hf(srv):
    import pathlib

    import tokenizers
    import transformers
    hf = tokenizers.Tokenizer.from_file(str(pathlib.Path(srv.model) / "tokenizer.json"))
    for text in ["Hello world", "  spaces\tand\nnewlines ", "ünïcödé 漢字 🙂", PROMPT]:
        for special in (True, False):
            status, _, body = post(srv, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": special,
                                                      "return_token_strs": True})
            assert status == 200
            want = hf.encode(text, add_special_tokens=special).ids
            assert body["tokens"] == want and body["count"] == len(want)
            assert body["token_strs"] == [hf.id_to_token(i) for i in want]
            assert body["max_model_len"] > 0
            assert detokenize(srv, want) == hf.decode(want, skip_special_tokens=False)
    tok = transformers.AutoTokenizer.from_pretrained(srv.model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    status, _, body = post(srv, "/tokenize", {"messages": messages})
    assert status == 200 and body["token_strs"] is None
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf.encode(text, add_special_tokens=False).ids
    assert post(srv, "/detokenize", {"tokens": [1, -1]})[2]["error"]["param"] == "tokens[1]"
    assert post(srv, "/tokenize", {"prompt": "x", "tools": []})[2]["error"]["param"] == "tools"


def test_cors(srv):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, h, _ = raw(srv, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 204
    assert h["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in h["Access-Control-Allow-Methods"]
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, h, _ = raw(srv, "OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
    assert status == 400 and "Access-Control-Allow-Origin" not in h
    status, h, _ = raw(srv, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in h["Access-Control-Expose-Headers"]
    status, h, _ = raw(srv, "GET", "/v1/models", headers={"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in h
    chunks = raw(srv, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}),
                 {"Origin": ORIGIN})
    assert chunks[0] == 200 and chunks[1]["Access-Control-Allow-Origin"] == ORIGIN


def test_x_request_id_on_every_response(srv):
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/nowhere", None), ("POST", "/v1/completions", "{"),
                               ("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1})),
                               ("POST", "/tokenize", json.dumps({"prompt": "hi"}))]:
        status, h, _ = raw(srv, method, path, body, {"X-Request-Id": "client-id-42"})
        assert h["X-Request-Id"] == "client-id-42", (method, path, status)
        status, h, _ = raw(srv, method, path, body)
        assert re.fullmatch(r"[0-9a-f]{32}|(chat)?cmpl-[0-9a-f]+", h["X-Request-Id"]), (path, h["X-Request-Id"])


def test_metrics_under_vllm_names(srv):
    client(srv).completions.create(model="tiny", prompt="hi", max_tokens=2)
    m = srv.metrics()
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count", "e2e_request_latency_seconds_sum",
                 "inter_token_latency_seconds_count", "request_queue_time_seconds_count", "num_preemptions_total"]:
        assert m[f'vllm:{name}{{model_name="tiny"}}'] == m[f'kvserve:{name}{{model_name="tiny"}}'], name
    assert m['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] >= 1


def test_metrics_count_a_request_before_its_response(srv):
    """A step records its counters before it hands finished requests their responses: a /metrics read
    right after a response already counts that response's tokens."""
    key = 'vllm:generation_tokens_total{model_name="tiny"}'
    c = client(srv)
    before = srv.metrics()[key]
    for i in range(8):
        r = c.completions.create(model="tiny", prompt=f"Count to {i}:", max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
        m = srv.metrics()
        before += r.usage.completion_tokens
        assert m[key] == before, (i, m[key], before)


def test_return_token_ids_as_vllm_sends_them(srv):
    """return_token_ids: the prompt's ids and each choice's generated ids, streamed or not."""
    prompt = "The capital of France is"
    r = client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tokenize(srv, prompt, add_special_tokens=True)
    assert len(choice["token_ids"]) == r.usage.completion_tokens == 6
    assert detokenize(srv, choice["token_ids"]) == choice["text"]
    streamed, prompt_ids = [], None
    for chunk in client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}):
        for c in chunk.choices:
            d = c.model_dump()
            streamed += d.get("token_ids") or []
            if d.get("prompt_token_ids") is not None:
                assert prompt_ids is None, "the prompt's ids come once"
                prompt_ids = d["prompt_token_ids"]
    assert streamed == choice["token_ids"] and prompt_ids == choice["prompt_token_ids"]
    chat = client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                               temperature=0, extra_body={"return_token_ids": True})
    body = chat.model_dump()
    assert body["prompt_token_ids"] and len(body["choices"][0]["token_ids"]) == chat.usage.completion_tokens
    # Without it, neither appears.
    plain = client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).choices[0]
    assert "token_ids" not in plain.model_dump() or plain.model_dump()["token_ids"] is None
