"""Compress once, serve many, through a real server on the default model (SmolLM2-135M-Instruct):
under kvzip (25 % kept) a ~4K-token document in the system message is asked four questions. The first
request compresses the document (the conversation before the last user message) and caches it
compressed; the next three report it as `cached_tokens`; the first and the last answer with the
tokens of a server whose context cache is off (each uncached question costs a whole kvzip prefill);
`/metrics` shows the entry holding <= 30 % of the document's full blocks. A
completion's `kv_context` and a chat's `cache_control` marker set the context too; bad values are
400s naming the field."""
from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from tokenizers import Tokenizer

from kvserve_server import REPO, Server, raw

MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
sys.path.insert(0, str(REPO / "tools"))
import context_doc  # noqa: E402

POLICY = """  kvzip:
    budget: 0.25
  kvzap:
    budget: 0.25
"""


def stop_all(*servers):
    for s in servers:
        rc = s.stop()
        log = s.log()
        s.tmp.cleanup()
        assert rc == 0, log[-4000:]


@pytest.fixture(scope="module")
def servers():
    subprocess.run([sys.executable, str(REPO / "tools" / "make_smollm2.py"), "--out", str(MODEL_DIR)], check=True)
    assert (MODEL_DIR / "kvzap" / "config.json").is_file(), "kvzap's predictor is not in the model directory: `make model`"
    on = Server(model=str(MODEL_DIR), extra_yaml=POLICY, kv_cache_bytes="1GiB")
    off = Server(model=str(MODEL_DIR), extra_yaml=POLICY, kv_cache_bytes="1GiB",
                 extra_args=("--no-enable-context-caching",))
    yield on, off
    stop_all(on, off)


@pytest.fixture(scope="module")
def doc():
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text, recs = context_doc.document_of_tokens(tok, 4000)
    return text, recs


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)


def ask(srv, messages, policy="kvzip", max_tokens=12, **kw):
    return client(srv).chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                               extra_body={"kv_policy": policy, **kw.pop("extra", {})}, **kw)


def test_four_questions_on_one_document(servers, doc):
    on, off = servers
    text, recs = doc
    before = on.metrics()
    cached, answers = [], []
    for i, (q, _) in enumerate(context_doc.questions(recs, 4)):
        messages = [{"role": "system", "content": text}, {"role": "user", "content": q}]
        a = ask(on, messages)
        cached.append(a.usage.prompt_tokens_details.cached_tokens)
        answers.append(a.choices[0].message.content)
        # The server without the context cache compresses the document afresh for every question
        # (each costs a whole kvzip prefill on CPU): compared on the first and the last.
        if i in (0, 3):
            b = ask(off, messages)
            assert a.choices[0].message.content == b.choices[0].message.content, q
            assert b.usage.prompt_tokens_details.cached_tokens == 0
            assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert cached[0] == 0
    # The system message's tokens (the template's rendering of the conversation before the question).
    assert cached[1] == cached[2] == cached[3] > 3500, cached
    m = on.metrics()
    assert m["kvserve:compressed_contexts"] >= 1
    assert m["kvserve:compressed_contexts"] - before.get("kvserve:compressed_contexts", 0) == 1
    ratio = m["kvserve:kv_cache_blocks_compressed_contexts"] / m["kvserve:compressed_context_full_blocks"]
    assert ratio <= 0.30, ratio
    assert m['kvserve:prefix_cache_bytes{model_name="tiny",tier="context"}'] > 0
    assert off.metrics()["kvserve:compressed_contexts"] == 0
    assert m["kvserve:num_requests_running"] == 0


def test_kvzap_four_questions_on_one_document(servers, doc):
    """kvzap (the committed predictor in <model>/kvzap): the same compress-once contract as kvzip,
    the entry at <= 30 % of the document's blocks, the answers of the server without the cache."""
    on, off = servers
    text, recs = doc
    before = on.metrics()
    cached = []
    for i, (q, _) in enumerate(context_doc.questions(recs, 4)):
        messages = [{"role": "system", "content": text}, {"role": "user", "content": q}]
        a = ask(on, messages, policy="kvzap")
        cached.append(a.usage.prompt_tokens_details.cached_tokens)
        if i in (0, 3):
            b = ask(off, messages, policy="kvzap")
            assert a.choices[0].message.content == b.choices[0].message.content, q
            assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert cached[0] == 0 and cached[1] == cached[2] == cached[3] > 3500, cached
    m = on.metrics()
    assert m["kvserve:compressed_contexts"] - before.get("kvserve:compressed_contexts", 0) == 1
    assert m["kvserve:num_requests_running"] == 0


def test_completion_kv_context(servers, doc):
    on, off = servers
    text, recs = doc
    short = "\n".join(text.split("\n")[:40])
    outs = []
    for q, _ in context_doc.questions(recs[:39], 2, seed=5):
        prompt = f"\nQuestion: {q}\nAnswer:"
        a = client(on).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"kv_policy": "kvzip", "kv_context": short})
        b = client(off).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"kv_policy": "kvzip", "kv_context": short})
        assert a.choices[0].text == b.choices[0].text
        outs.append(a.usage.prompt_tokens_details.cached_tokens)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert outs == [0, len(tok.encode(short).ids)], outs


def test_cache_control_marks_the_end_of_the_context(servers, doc):
    on, _ = servers
    text, _ = doc
    short = "\n".join(text.split("\n")[:30])
    marked = {"role": "user", "content": [{"type": "text", "text": short, "cache_control": {"type": "ephemeral"}}]}
    first = ask(on, [marked, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Record 3?"}])
    second = ask(on, [marked, {"role": "assistant", "content": "I read it."}, {"role": "user", "content": "Record 4?"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_one_message_prompt_keeps_its_question(servers, doc):
    """lm-eval's layout: the document and the question in one user message, no other boundary. Under
    kvzip the context is everything before the message's last paragraph (the question), which stays
    whole; the context is tokenized alone, so the next question about the same text finds it cached.
    usage.kv_context_boundary and /metrics name the boundary; a query-aware policy has none."""
    on, _ = servers
    text, recs = doc
    short = "\n".join(text.split("\n")[:30])
    key = 'kvserve:kv_context_boundary_total{model_name="tiny",kind="protected_question"}'
    before = on.metrics().get(key, 0)
    usages = []
    for q, _ in context_doc.questions(recs[:29], 2, seed=9):
        usages.append(ask(on, [{"role": "user", "content": f"{short}\n\n{q}"}]).usage)
    assert [u.kv_context_boundary for u in usages] == ["protected_question"] * 2
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    # The second question reuses the compressed document; its own tokens (> 10) were prefilled whole.
    assert 500 < usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens - 10, usages[1]
    assert on.metrics()[key] - before == 2
    # A completion without kv_context: the same split on its text.
    q, _ = context_doc.questions(recs[:29], 1, seed=11)[0]
    c = client(on).completions.create(model="tiny", prompt=f"{short}\n\nQuestion: {q}\nAnswer:", max_tokens=4,
                                      temperature=0, extra_body={"kv_policy": "kvzip"})
    assert c.usage.kv_context_boundary == "protected_question"
    # A query-aware policy compresses the whole prompt as before: no context, no boundary.
    snap = ask(on, [{"role": "user", "content": f"{short}\n\n{q}"}], policy="snapkv", max_tokens=1)
    assert getattr(snap.usage, "kv_context_boundary", None) is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "kv_context": 5}, "kv_context"),
    ("/v1/completions", {"prompt": "hi", "kv_context": ""}, "kv_context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "kv_context": "x"}, "kv_context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "forever"}}]},
     "messages[0].cache_control.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                           "cache_control": "yes"}]}]},
     "messages[0].content[0].cache_control"),
])
def test_bad_context_fields_are_400(servers, path, body, param):
    import json
    on, _ = servers
    status, _, data = raw(on, "POST", path, json.dumps({"model": "tiny", "max_tokens": 2, **body}))
    assert status == 400, data
    assert json.loads(data)["error"]["param"] == param


@pytest.fixture(scope="module")
def gemma_servers():
    import os
    import pathlib
    model = pathlib.Path(os.environ.get("KVSERVE_FIXTURES", REPO / ".fixtures")) / "gemma3"
    if not (model / "config.json").exists():
        pytest.skip("no gemma3 fixture (make fixtures)")
    yaml = "  kvzip:\n    budget: 24\n"
    on = Server(model=str(model), extra_yaml=yaml, kv_cache_bytes="64MiB")
    off = Server(model=str(model), extra_yaml=yaml, kv_cache_bytes="64MiB", extra_args=("--no-enable-context-caching",))
    yield on, off
    stop_all(on, off)


def test_gemma3_context_compressed_once(gemma_servers):
    """Gemma 3 (local layers of window 12 beside global ones; a random fixture): kvzip compresses a
    completion's kv_context over its global layers once, the local layers keep their rings in the
    cached entry, and a later question reuses it with the tokens of a server that compresses afresh."""
    on, off = gemma_servers
    context = " ".join(f"Record {i}: the {w} is kept in box {i * 7 % 31}." for i, w in
                       enumerate(["lamp", "coin", "map", "key", "rope", "ink", "bell", "dice"] * 3))
    outs = []
    for q in ("Where is the lamp?", "Where is the bell?", "Where is the coin?"):
        kw = dict(model="tiny", prompt=f"\nQuestion: {q}\nAnswer:", max_tokens=8, temperature=0,
                  extra_body={"kv_policy": "kvzip", "kv_context": context})
        a, b = client(on).completions.create(**kw), client(off).completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text, q
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        outs.append(a.usage.prompt_tokens_details.cached_tokens)
    assert outs[0] == 0 and outs[1] == outs[2] > 100, outs
    m = on.metrics()
    assert m["kvserve:compressed_contexts"] >= 1
    assert m["kvserve:num_requests_running"] == 0
