"""Structured outputs and tool calls through the official openai client against the default model
(`make serve`'s configs/default.yaml): 30 JSON schemas validate with jsonschema, json_object parses,
regex and choice match, vLLM's field names give the same greedy tokens as OpenAI's, forced tool
calls parse and validate (streamed too), and bad specs are 400s naming the field."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jsonschema
import openai
import pytest

from kvserve_server import REPO, Server

MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
SCHEMAS = json.loads((pathlib.Path(__file__).parent / "structured_schemas.json").read_text())
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}


@pytest.fixture(scope="module")
def srv():
    subprocess.run([sys.executable, str(REPO / "tools" / "make_smollm2.py"), "--out", str(MODEL_DIR)], check=True)
    s = Server(config=REPO / "configs" / "default.yaml")
    yield s
    s.close()


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def ask(c, content: str, **kw):
    kw.setdefault("max_tokens", 200)
    return c.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                     messages=[{"role": "user", "content": content}], **kw)


# Settings for the 30-schema run. The 135M model, greedy, otherwise keeps writing inside a free-text
# string ("Axelon-Axelon-...", "a team coach, a team coach, ...") until max_tokens, grammar or not:
# measured on this model, no instruction and no penalty finish 26/30, repetition_penalty 1.1 alone 29,
# 1.2 alone 29, the schema in the prompt 27-28; this system message plus 1.1 finish 30/30.
SHORT_VALUES = "You answer in compact JSON. Keep every string value short: a few words."


def test_thirty_schemas_validate(srv):
    c = client(srv)

    def one(i):
        s = SCHEMAS[i]
        r = c.chat.completions.create(
            model="smollm2-135m-instruct", temperature=0, max_tokens=200, extra_body={"repetition_penalty": 1.1},
            messages=[{"role": "system", "content": SHORT_VALUES}, {"role": "user", "content": f"Describe {s['topic']} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s["schema"], "strict": True}})
        return r.choices[0]

    # One at a time: a batch's composition changes the float sums and so, rarely, a greedy token.
    choices = [one(i) for i in range(len(SCHEMAS))]
    failures = []
    for i, ch in enumerate(choices):
        try:
            assert ch.finish_reason == "stop", f"finish_reason {ch.finish_reason}"
            jsonschema.validate(json.loads(ch.message.content), SCHEMAS[i]["schema"])
        except Exception as e:  # noqa: BLE001 - collected and reported together
            failures.append(f"{i} ({SCHEMAS[i]['topic']}): {ch.message.content[:160]!r}: {e}")
    assert not failures, f"{len(failures)}/30 outputs do not finish and validate:\n" + "\n".join(failures)


def test_json_object_parses(srv):
    r = ask(client(srv), "Give me a JSON object about a cat.", response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choice_match_also_streamed_and_with_n(srv):
    c = client(srv)
    r = ask(c, "What is the phone number?", extra_body={"guided_regex": r"\d{3}-\d{4}"}, n=2)
    for ch in r.choices:
        assert re.fullmatch(r"\d{3}-\d{4}", ch.message.content), ch.message.content
    r = ask(c, "Is Paris in France?", extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe not")
    text = ""
    for chunk in ask(c, "Pick a color.", extra_body={"structured_outputs": {"choice": ["red", "green"]}}, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text in ("red", "green")
    # Completions too, with a stop string that cuts the constrained text.
    r = client(srv).completions.create(model="smollm2-135m-instruct", prompt="Digits:", max_tokens=20, temperature=0,
                                       extra_body={"guided_regex": "[0-9]{6}"}, stop=["5"])
    assert re.fullmatch(r"[0-9]{0,6}", r.choices[0].text) and "5" not in r.choices[0].text


def test_vllm_field_names_give_the_same_tokens(srv):
    c = client(srv)
    schema = SCHEMAS[0]["schema"]
    kw = dict(logprobs=True)
    a = ask(c, "Describe a person as JSON.", response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}, **kw)
    b = ask(c, "Describe a person as JSON.", extra_body={"guided_json": schema}, **kw)
    d = ask(c, "Describe a person as JSON.", extra_body={"structured_outputs": {"json": schema}}, **kw)
    toks = [[t.token for t in x.choices[0].logprobs.content] for x in (a, b, d)]
    assert toks[0] == toks[1] == toks[2]
    g = ask(c, "Is it?", extra_body={"guided_grammar": 'root ::= "yes" | "no"'}, **kw)
    h = ask(c, "Is it?", extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, **kw)
    assert g.choices[0].message.content == h.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a\\x" + "B" * 60}, "guided_regex"),  # xgrammar's \x overflow (fuzz regression)
    ({"guided_json": {"type": "string", "pattern": "\\x1234567"}}, "guided_json"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
])
def test_bad_specs_are_400_naming_the_field(srv, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(srv), "hi", extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def collect(response, stream: bool) -> tuple[str, str, list]:
    """(finish_reason, content, [(id, name, arguments)]) of a chat response, whole or streamed."""
    if not stream:
        ch = response.choices[0]
        calls = [(t.id, t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return ch.finish_reason, ch.message.content or "", calls
    calls: dict[int, list] = {}
    finish, content = None, ""
    for chunk in response:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            e = calls.setdefault(t.index, ["", "", ""])
            e[0] += t.id or ""
            e[1] += (t.function.name or "") if t.function else ""
            e[2] += (t.function.arguments or "") if t.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, content, [tuple(calls[i]) for i in sorted(calls)]


def forced_call(c, tool_choice, stream=False):
    kw = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=100)
    finish, _, calls = collect(ask(c, "What is the weather in Paris?", stream=stream, **kw), stream)
    assert finish == "tool_calls"
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse_and_validate(srv, stream):
    c = client(srv)
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    named = forced_call(c, {"type": "function", "function": {"name": "get_weather"}}, stream)
    assert len(named) == 1 and named[0][1] == "get_weather" and named[0][0].startswith("call_")
    jsonschema.validate(json.loads(named[0][2]), params["get_weather"])
    required = forced_call(c, "required", stream)
    assert len(required) == 1 and required[0][1] in params
    jsonschema.validate(json.loads(required[0][2]), params[required[0][1]])


def test_tool_history_renders(srv):
    """An assistant tool_calls turn and a tool result in the history reach the template."""
    c = client(srv)
    r = c.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=20, tools=[WEATHER],
                                  tool_choice="none", messages=[
                                      {"role": "user", "content": "Weather in Paris?"},
                                      {"role": "assistant", "content": None, "tool_calls": [
                                          {"id": "call_1", "type": "function",
                                           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


# tool_choice "auto": whether to call is the model's own decision, so this needs a model trained to
# make it: models/tiny-toolcaller (tools/train_tool_model.py), a Llama 3.1 JSON tool template, trained
# on these two tools (the "auto" parser detects the format from the template).
TOOLCALLER = REPO / "models" / "tiny-toolcaller"
sys.path.insert(0, str(REPO / "tools"))
from train_tool_model import TIME as TC_TIME, WEATHER as TC_WEATHER  # noqa: E402


@pytest.fixture(scope="module")
def tool_srv():
    s = Server(model=str(TOOLCALLER))
    yield s
    s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_a_tool_only_when_the_prompt_needs_one(tool_srv, stream):
    c = client(tool_srv)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (TC_WEATHER, TC_TIME)}

    def chat(q, tools=(TC_WEATHER, TC_TIME), tool_choice="auto"):
        r = c.chat.completions.create(model="tiny", temperature=0, max_tokens=60, stream=stream, tools=list(tools),
                                      tool_choice=tool_choice, messages=[{"role": "user", "content": q}])
        return collect(r, stream)

    # The 0.6M-parameter model learned when to call (every prompt below) better than what to pass: it
    # may name the other tool or another city (training_log.json: 74/100 held-out answers exact), so
    # the call is checked for what the server owns: it parses, names an offered tool, and its
    # arguments validate against that tool's parameters.
    for q in ["What is the weather in Oslo?", "What time is it in Tokyo?"]:
        finish, content, calls = chat(q)
        assert finish == "tool_calls" and content == "" and len(calls) == 1, (q, finish, content, calls)
        assert calls[0][0].startswith("call_") and calls[0][1] in params, calls
        jsonschema.validate(json.loads(calls[0][2]), params[calls[0][1]])
    for q in ["Tell me a joke.", "What is 2 + 3?"]:
        finish, content, calls = chat(q)
        assert finish == "stop" and calls == [] and content.strip(), (q, finish, content, calls)
    # "none": the same weather question gets no tool_calls.
    finish, content, calls = chat("What is the weather in Oslo?", tool_choice="none")
    assert calls == [] and finish == "stop" and content.strip()
