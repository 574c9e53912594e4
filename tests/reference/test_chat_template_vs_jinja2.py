"""Chat templates rendered by `kvserve chat-template` must equal Python jinja2's output byte for byte.

The reference environment is transformers' own (`_compile_jinja_template`) when transformers is
installed, else an identical replica: ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks,
loopcontrols) with raise_exception, strftime_now and transformers' tojson. Templates that raise must
fail in kvserve too, with raise_exception's message in the error.
"""
import json
import os
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402
import jinja2.ext  # noqa: E402

TEMPLATES = Path(__file__).parent / "templates"
KVSERVE_BIN = os.environ.get("KVSERVE_BIN")


def _replica_compile(source):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


try:
    from transformers.utils.chat_template_utils import _compile_jinja_template as _hf_compile
except Exception:  # transformers missing or moved: the replica is the same environment
    _hf_compile = None


def compile_reference(source):
    return _hf_compile(source) if _hf_compile is not None else _replica_compile(source)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city — «quoted» & <escaped>?",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
                },
                "required": ["city"],
            },
            "return": {"type": "string"},
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "description": "Does nothing.", "parameters": {"type": "object", "properties": {}}},
    },
]

SYSTEM = {"role": "system", "content": "You are a helpful assistant.  "}
CONVERSATIONS = {
    "single": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system": {"messages": [SYSTEM, {"role": "user", "content": "What is 2+2?"}]},
    "multi_turn": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "  Hello! How can I help?\n"},
            {"role": "user", "content": "Tell me a joke.\n\nA short one."},
        ]
    },
    "no_system_multi": {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "<think>hmm</think>four"},
        ]
    },
    "unicode": {
        "messages": [
            {"role": "user", "content": "Grüße aus Köln 🌍 — 中文 \"quotes\" 'single' \\ back\tslash\u00a0nbsp"},
            {"role": "assistant", "content": "Привет! ß → SS? ﬁ ligature"},
            {"role": "user", "content": "emoji 👩‍💻 and RTL مرحبا"},
        ]
    },
    "tools": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "abc123xyz",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_weather", "content": "22 degrees, sunny"},
            {"role": "assistant", "content": "It is 22 °C and sunny in Paris."},
            {"role": "user", "content": "Thanks!"},
        ],
        "tools": TOOLS,
    },
    "tools_string_args": {
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                    {"id": "call00002", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call00001", "content": "-3"},
            {"role": "tool", "tool_call_id": "call00002", "content": "18"},
            {"role": "assistant", "content": "Oslo -3, Rome 18."},
        ],
        "tools": TOOLS,
    },
    "multimodal_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
        ]
    },
    "bad_alternation": {
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
        ]
    },
    "assistant_first": {"messages": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}]},
    "empty_content": {"messages": [{"role": "user", "content": ""}]},
    "extra_kwargs": {
        "messages": [SYSTEM, {"role": "user", "content": "Date?"}],
        "date_string": "01 Jan 2030",
        "tools_in_user_message": False,
        "tools": TOOLS[:1],
        "builtin_tools": ["brave_search", "code_interpreter"],
    },
    # Reasoning models (Qwen3): reasoning_content kept only for turns after the last real user query,
    # a multi-step tool exchange after it, and a user turn that merely wraps a tool response.
    "reasoning_content": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "Greeting; dropped from history.", "content": "Hello!"},
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "role": "assistant",
                "reasoning_content": "\nThe user wants the weather; call get_weather.\n\n",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call00003",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call00003", "name": "get_weather", "content": "22 degrees, sunny"},
            {"role": "assistant", "content": "Checking once more.", "reasoning_content": ""},
            {"role": "user", "content": "<tool_response>\n23 degrees\n</tool_response>"},
            {"role": "assistant", "reasoning_content": "Both agree.", "content": "\n\nIt is 22-23 °C and sunny."},
        ],
        "tools": TOOLS,
    },
    "think_in_content": {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "<think>\ncounting\n</think>\n\ntwo"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "\nno open tag\n</think>\nfour</think>five"},
            {"role": "assistant", "content": "plain six"},
            {"role": "assistant", "content": "<think>\n\n</think>\n\nseven"},
        ]
    },
}

# Extra template variables (the server's chat_template_kwargs) rendered on top of every conversation,
# per template: Qwen3's thinking switch unset, on and off.
TEMPLATE_KWARGS = {
    "qwen3": {"": {}, "think": {"enable_thinking": True}, "nothink": {"enable_thinking": False}},
}

TEMPLATE_FILES = sorted(TEMPLATES.glob("*.jinja"))
GEN_PROMPT = [False, True]


def reference_render(source, context):
    ctx = dict(context)
    messages = ctx.pop("messages")
    tools = ctx.pop("tools", None)
    documents = ctx.pop("documents", None)
    agp = ctx.pop("add_generation_prompt", False)
    try:
        out = compile_reference(source).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=agp, **ctx
        )
        return True, out
    except jinja2.exceptions.TemplateError as e:
        return False, (type(e).__name__, str(e))
    except Exception as e:  # TypeError etc. from inside the template
        return False, (type(e).__name__, str(e))


def kvserve_render(template_path, context, tmp_path):
    """One `kvserve chat-template --template --context` run: the CLI contract itself."""
    ctx_file = tmp_path / "context.json"
    ctx_file.write_text(json.dumps(context, ensure_ascii=False), encoding="utf-8")
    p = subprocess.run(
        [KVSERVE_BIN, "chat-template", "--template", str(template_path), "--context", str(ctx_file)],
        capture_output=True,
        timeout=60,
    )
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8", "replace")


def template_variants(template):
    return TEMPLATE_KWARGS.get(template.stem, {"": {}})


def template_context(template, conv, agp, variant=""):
    context = dict(CONVERSATIONS[conv])
    context.update(template_variants(template)[variant])
    context.update(add_generation_prompt=agp, bos_token="<s>", eos_token="</s>")
    if template.stem == "llama31_tools" and "date_string" not in context:
        context["date_string"] = "26 Jul 2024"
    return context


EXPR_CONTEXT = {"messages": [], "bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def batch_results(tmp_path_factory):
    """Renders every case in one `kvserve chat-template --batch` run (the binary's start-up, which
    loads libtorch, would otherwise dominate)."""
    cases, keys = [], []
    for template in TEMPLATE_FILES:
        source = template.read_text(encoding="utf-8")
        for conv in CONVERSATIONS:
            for agp in GEN_PROMPT:
                for variant in template_variants(template):
                    keys.append((template.stem, conv, agp, variant))
                    cases.append({"template": source, "context": template_context(template, conv, agp, variant)})
    for i, source in enumerate(EXPRESSIONS):
        keys.append(("expr", i, None, ""))
        cases.append({"template": source, "context": EXPR_CONTEXT})
    path = tmp_path_factory.mktemp("batch") / "cases.json"
    path.write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    p = subprocess.run([KVSERVE_BIN, "chat-template", "--batch", str(path)], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode("utf-8", "replace")
    results = json.loads(p.stdout.decode("utf-8"))
    assert len(results) == len(cases)
    return dict(zip(keys, results))


def check(expected_ok, expected, result):
    if expected_ok:
        assert "error" not in result, f"kvserve failed where jinja2 rendered: {result['error']}"
        assert result["output"] == expected
    else:
        kind, message = expected
        assert "error" in result, f"jinja2 raised {kind}: {message!r} but kvserve rendered {result['output']!r}"
        if kind == "TemplateError":  # raise_exception: its message verbatim
            assert result["error"] == message


needs_bin = pytest.mark.skipif(not KVSERVE_BIN, reason="KVSERVE_BIN not set")


MATCH_CASES = [
    pytest.param(template, conv, agp, variant,
                 id="-".join([template.stem, conv, "gen" if agp else "nogen"] + ([variant] if variant else [])))
    for template in TEMPLATE_FILES
    for conv in sorted(CONVERSATIONS)
    for agp in GEN_PROMPT
    for variant in template_variants(template)
]


@needs_bin
@pytest.mark.parametrize("template,conv,agp,variant", MATCH_CASES)
def test_matches_jinja2(template, conv, agp, variant, batch_results):
    context = template_context(template, conv, agp, variant)
    ok, expected = reference_render(template.read_text(encoding="utf-8"), context)
    check(ok, expected, batch_results[(template.stem, conv, agp, variant)])


@needs_bin
@pytest.mark.parametrize("template,conv", [("qwen25_tools", "tools"), ("mistral_v03_tools", "bad_alternation")])
def test_cli_prints_output_or_error_exactly(template, conv, tmp_path):
    """The single-file CLI prints the rendering with no added newline, or `kvserve: error: <msg>`."""
    path = TEMPLATES / f"{template}.jinja"
    context = template_context(path, conv, True)
    ok, expected = reference_render(path.read_text(encoding="utf-8"), context)
    rc, out, err = kvserve_render(path, context, tmp_path)
    if ok:
        assert rc == 0 and out == expected, err
    else:
        assert rc == 1 and out == ""
        assert err == f"kvserve: error: {expected[1]}\n"


@needs_bin
def test_strftime_now_matches(tmp_path):
    """Llama 3.1 falls back to strftime_now when no date_string is given."""
    template = TEMPLATES / "llama31_tools.jinja"
    context = dict(CONVERSATIONS["system"], add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    ok, expected = reference_render(template.read_text(encoding="utf-8"), context)
    rc, out, err = kvserve_render(template, context, tmp_path)
    assert ok and rc == 0, err
    assert out == expected


EXPRESSIONS = [
    "{{ [1, 'a', \"it's\", none, true, 1.5, {'k': 'v'}] }} {{ (1,) }} {{ 1e16 }} {{ 0.00001 }} {{ 1/3 }}",
    "{{ 3.7|round }} {{ 2.5|round }} {{ 2.675|round(2) }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }}",
    "{% for x in [3, 1, 2]|sort %}{{ loop.index }}{{ loop.revindex }}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{{ 'a,b,,c'.split(',') }} {{ '  a  b '.split() }} {{ 'xxhixx'.strip('x') }} {{ 'Hi'.startswith(('H', 'x')) }}",
    "{{ 'héllo wörld'|title }} {{ 'héllo'[::-1] }} {{ 'héllo'|length }} {{ 'héllo'.find('l') }} {{ 'ß'.upper() }}",
    "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
    "{% set c = 1 %}{% for i in range(3) %}{% set c = c + i %}{{ c }}{% endfor %}{{ c }}",
    "{{ {'b': 1, 'a': [1, {'x': None}]}|tojson }} {{ {'b': 1, 'a': 'é\\n'}|tojson(indent=2) }}",
    "{{ [1, 2, 3]|select('odd')|list }} {{ [1, 2]|map('string')|join('-') }} {{ [1, 2]|reverse|list }}",
    "{% if [1]|selectattr('x', 'defined') %}generators are truthy{% endif %}",
    "{{ x is defined }} {{ none is none }} {{ 4 is divisibleby 2 }} {{ 'a' is in 'abc' }} {{ {} is mapping }}",
    "{%- macro m(a, b='B') -%}[{{ a }}{{ b }}]{%- endmacro -%}{{ m(1) }}{{ m(2, b=3) }}",
    "line\n    {% if true %}\n    kept\n    {% endif %}\n  {%+ if true %}x{% endif +%}\n{# c #}\n{{- ' end ' -}}\n  tail\n",
    "{% raw %}{{ raw }}{% endraw %}{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}",
    "{{ '%s=%d' % ('n', 3) }} {{ '{} {x}'.format(1, x=2) }} {{ 'x'|center(7) }}|{{ 'a\nb'|indent(2, true) }}",
    # Qwen3's constructs: reversed and negative-step slices, strip/split with arguments, `is string`
    # and `is false`, namespace attributes set inside a loop.
    "{{ [1, 2, 3, 4][::-1] }} {{ [1, 2, 3, 4][::-2] }} {{ [1, 2, 3, 4][-1:0:-1] }} {{ 'abcdef'[4:1:-1] }} {{ (1, 2)[5::-1] }}",
    "{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ 'xa\\n'.rstrip('\\n') }}|{{ 'a</t>b</t>c'.split('</t>')[-1] }}|{{ 'a,b,c'.split(',', 1) }}",
    "{{ 'a' is string }} {{ none is string }} {{ [] is string }} {{ x is string }} {{ false is false }} {{ 0 is false }}",
    "{% set ns = namespace(a=true, b=[1, 2]|length - 1) %}{% for m in [1, 2, 3][::-1] %}{% set i = 2 - loop.index0 %}"
    "{% if ns.a and m == 2 %}{% set ns.a = false %}{% set ns.b = i %}{% endif %}{% endfor %}{{ ns.a }} {{ ns.b }}",
    "{{ [1, 2, 3][::0] }}",
    "{{ [].append }}",
    "{{ [].append(1) }}",
    "{{ undefined_var.attr }}",
    "{{ {'a': 1}.missing.x }}",
    "{{ 'a' + 1 }}",
    "{{ range(100001)|length }}",
    "{{ 1 / 0 }}",
    "{{ raise_exception('custom message: ' ~ 42) }}",
]


@needs_bin
@pytest.mark.parametrize("index", range(len(EXPRESSIONS)), ids=[f"expr{i}" for i in range(len(EXPRESSIONS))])
def test_expression_semantics(index, batch_results):
    ok, expected = reference_render(EXPRESSIONS[index], EXPR_CONTEXT)
    check(ok, expected, batch_results[("expr", index, None, "")])


@needs_bin
def test_default_model_template_matches_jinja2(tmp_path):
    """The default model's own template (from its tokenizer_config.json, which kvserve serves with),
    on every conversation, with and without the generation prompt."""
    from kvserve_testlib import default_model_dir
    cfg = json.loads((default_model_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    source = cfg["chat_template"]
    cases = [{"template": source, "context": dict(CONVERSATIONS[conv], add_generation_prompt=agp,
                                                  bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])}
             for conv in sorted(CONVERSATIONS) for agp in GEN_PROMPT]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases, ensure_ascii=False), encoding="utf-8")
    p = subprocess.run([KVSERVE_BIN, "chat-template", "--batch", str(path)], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode("utf-8", "replace")
    results = json.loads(p.stdout.decode("utf-8"))
    assert len(results) == len(cases)
    for case, result in zip(cases, results):
        ok, expected = reference_render(source, case["context"])
        check(ok, expected, result)
    assert any("<|im_start|>assistant\n" in r.get("output", "") for r in results)
