// Unit tests of the chat-template interpreter; byte-identity with jinja2 on whole templates is
// checked by tests/reference/test_chat_template_vs_jinja2.py.
#include <gtest/gtest.h>

#include "text/chat_template.h"

namespace kvserve {
namespace {

std::string R(const std::string& src, const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  return ChatTemplate(src).render(ctx);
}

std::string error_of(const std::string& src, const nlohmann::ordered_json& ctx = nlohmann::ordered_json::object()) {
  try {
    ChatTemplate(src).render(ctx);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(ChatTemplate, PrintsValuesLikePythonStr) {
  EXPECT_EQ(R("{{ [1, 'a', \"it's\", none, true, 1.5] }}"), "[1, 'a', \"it's\", None, True, 1.5]");
  EXPECT_EQ(R("{{ {'k': (1,)} }}"), "{'k': (1,)}");
  EXPECT_EQ(R("{{ 1e16 }} {{ 0.00001 }} {{ 10 / 4 }} {{ 2.0 }} {{ 1/3 }}"), "1e+16 1e-05 2.5 2.0 0.3333333333333333");
  EXPECT_EQ(R("{{ undefined_thing }}|{{ none }}"), "|None");
}

TEST(ChatTemplate, Arithmetic) {
  EXPECT_EQ(R("{{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }}"), "-4 2 1024 7 9");
  EXPECT_EQ(R("{{ 'ab' ~ 1 ~ none }} {{ 'ab' * 2 }} {{ [1] + [2] }}"), "ab1None abab [1, 2]");
  EXPECT_EQ(R("{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' in 'cat' }} {{ 2 not in [1] }}"), "True True True True True");
  EXPECT_EQ(R("{{ 'y' if 0 else 'n' }} {{ 0 or 'x' }} {{ 1 and 2 }} {{ not [] }}"), "n x 2 True");
}

TEST(ChatTemplate, WhitespaceControlMatchesTrimAndLstripBlocks) {
  EXPECT_EQ(R("a\n  {% if true %}\n  b\n  {% endif %}\nc"), "a\n  b\nc");
  EXPECT_EQ(R("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(R("  {%+ if true %}x{% endif +%}\ny"), "  x\ny");
  EXPECT_EQ(R("a {# comment #}\nb"), "a b");
  EXPECT_EQ(R("x\n"), "x");  // keep_trailing_newline=False
  EXPECT_EQ(R("a\r\nb"), "a\nb");
  EXPECT_EQ(R("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
}

TEST(ChatTemplate, LoopsAndScoping) {
  EXPECT_EQ(R("{% for x in [5, 6, 7] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }};{% endfor %}"),
            "103TrueFalse;212FalseFalse;321FalseTrue;");
  EXPECT_EQ(R("{% for x in [1, 2, 3] if x > 1 %}{{ loop.length }}{{ x }}{% else %}none{% endfor %}"), "2223");
  EXPECT_EQ(R("{% for x in [] %}x{% else %}none{% endfor %}"), "none");
  EXPECT_EQ(R("{% for x in 'ab' %}{{ loop.previtem is defined }}{{ loop.nextitem }}{% endfor %}"), "FalsebTrue");
  EXPECT_EQ(R("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}{{ v }}{% endfor %}"), "a1b2");
  EXPECT_EQ(R("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% elif i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"), "02");
  // A set inside a loop body does not leak out; namespaces carry state across iterations.
  EXPECT_EQ(R("{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{% endfor %}{{ c }}"), "0");
  EXPECT_EQ(R("{% set ns = namespace(c=0) %}{% for i in range(3) %}{% set ns.c = ns.c + 1 %}{% endfor %}{{ ns.c }}"), "3");
  EXPECT_EQ(R("{% if true %}{% set y = 2 %}{% endif %}{{ y }}"), "2");
}

TEST(ChatTemplate, MacrosAndBlocks) {
  EXPECT_EQ(R("{% macro m(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}"), "[1B][23]");
  EXPECT_EQ(R("{% macro w() %}<{{ caller() }}>{% endmacro %}{% call w() %}in{% endcall %}"), "<in>");
  EXPECT_EQ(R("{% set x %}a{{ 1 }}{% endset %}{{ x }}|{% filter upper %}b{% endfilter %}"), "a1|B");
  EXPECT_EQ(R("{% generation %}gen{% endgeneration %}"), "gen");
}

TEST(ChatTemplate, FiltersAndMethods) {
  EXPECT_EQ(R("{{ '  x  '|trim }}|{{ 'héllo'|upper }}|{{ 'a-b c'|title }}|{{ 'ab'|length }}|{{ 'héllo'|length }}"), "x|HÉLLO|A-B C|2|5");
  EXPECT_EQ(R("{{ [3, 1, 2]|sort|join(',') }} {{ [1, 2]|first }} {{ [1, 2]|last }} {{ ['a', 'A']|unique|list }}"), "1,2,3 1 2 ['a']");
  EXPECT_EQ(R("{{ '3'|int + 1 }} {{ '2.5'|float }} {{ 2.5|round }} {{ 3.14159|round(2) }} {{ -3|abs }}"), "4 2.5 2.0 3.14 3");
  EXPECT_EQ(R("{{ x|default('d') }} {{ ''|default('e', true) }} {{ {'b': 1, 'a': 2}|dictsort }}"), "d e [('a', 2), ('b', 1)]");
  EXPECT_EQ(R("{{ 'a,b'.split(',') }} {{ 'xhix'.strip('x') }} {{ 'abc'.startswith('ab') }} {{ 'abc'[::-1] }} {{ 'abc'[1:] }}"),
            "['a', 'b'] hi True cba bc");
  EXPECT_EQ(R("{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('z', 0) }} {{ {'a': 1}.keys()|list }} {{ 'a b'.replace(' ', '_') }}"),
            "1 0 ['a'] a_b");
  EXPECT_EQ(R("{{ m|selectattr('r', 'equalto', 'u')|map(attribute='c')|join }}",
              {{"m", {{{"r", "u"}, {"c", "x"}}, {{"r", "a"}, {"c", "y"}}, {{"r", "u"}, {"c", "z"}}}}}),
            "xz");
  EXPECT_EQ(R("{{ 'a\nb'|indent(2) }}|{{ 'x'|center(5) }}|{{ 'a b c'|wordcount }}"), "a\n  b|  x  |3");
}

TEST(ChatTemplate, ToJsonIsTransformersJsonDumps) {
  nlohmann::ordered_json ctx = {{"t", {{"z", 1}, {"a", {1.5, nullptr, "é\"\n"}}}}};
  EXPECT_EQ(R("{{ t|tojson }}", ctx), "{\"z\": 1, \"a\": [1.5, null, \"é\\\"\\n\"]}");  // key order kept
  EXPECT_EQ(R("{{ t|tojson(indent=2) }}", ctx), "{\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    null,\n    \"é\\\"\\n\"\n  ]\n}");
  EXPECT_EQ(R("{{ t|tojson(sort_keys=true, separators=(',', ':')) }}", ctx), "{\"a\":[1.5,null,\"é\\\"\\n\"],\"z\":1}");
  EXPECT_EQ(R("{{ [] | tojson }} {{ {} | tojson(indent=4) }}"), "[] {}");
}

TEST(ChatTemplate, Tests) {
  EXPECT_EQ(R("{{ x is defined }} {{ none is none }} {{ 'a' is string }} {{ 1 is number }} {{ {} is mapping }} {{ [] is iterable }}"),
            "False True True True True True");
  EXPECT_EQ(R("{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 1 is integer }} {{ true is boolean }} {{ 2 is gt 1 }}"),
            "True True True True True True");
}

TEST(ChatTemplate, TransformersDefaults) {
  EXPECT_EQ(R("{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}"), "True True False");
  nlohmann::json sorted_ctx = {{"bos_token", "<s>"}};
  EXPECT_EQ(ChatTemplate("{{ bos_token }}").render(sorted_ctx), "<s>");
}

TEST(ChatTemplate, RaiseExceptionCarriesMessageVerbatim) {
  try {
    R("{% if true %}{{ raise_exception('Conversation roles must alternate!') }}{% endif %}");
    FAIL() << "expected TemplateError";
  } catch (const TemplateError& e) {
    EXPECT_STREQ(e.what(), "Conversation roles must alternate!");
    EXPECT_TRUE(e.raised_by_template());
  }
}

TEST(ChatTemplate, ErrorsAreTemplateErrors) {
  EXPECT_EQ(error_of("{{ x.y }}"), "'x' is undefined");
  EXPECT_EQ(error_of("{{ {'a': 1}.b.c }}"), "'dict object' has no attribute 'b'");
  EXPECT_EQ(error_of("{{ [].append(1) }}"), "access to attribute 'append' of 'list' object is unsafe.");
  EXPECT_NE(error_of("{{ 'a' + 1 }}"), "<no error>");
  EXPECT_NE(error_of("{{ 1 / 0 }}"), "<no error>");
  EXPECT_NE(error_of("{{ x|nosuchfilter }}"), "<no error>");
  EXPECT_NE(error_of("{{ range(100001) }}"), "<no error>");
  EXPECT_THROW(ChatTemplate("{% if x %}"), TemplateError);
  EXPECT_THROW(ChatTemplate("{{ x "), TemplateError);
  EXPECT_THROW(ChatTemplate("{% for %}{% endfor %}"), TemplateError);
  EXPECT_THROW(ChatTemplate("{% include 'x' %}"), TemplateError);
  EXPECT_THROW(ChatTemplate("{{ (1 }}"), TemplateError);
  EXPECT_THROW(R("{{ x }}", nlohmann::ordered_json::array()), TemplateError);
}

TEST(ChatTemplate, AdversarialTemplatesStopCleanly) {
  // Deep nesting is refused at parse time instead of overflowing the stack.
  EXPECT_THROW(ChatTemplate("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"), TemplateError);
  EXPECT_THROW(ChatTemplate("{{ " + std::string(3000, '[') + " }}"), TemplateError);
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += "{% if true %}";
  EXPECT_THROW(ChatTemplate(nested + "x"), TemplateError);
  // Runaway loops, recursion and blow-ups hit the limits.
  EXPECT_THROW(R("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"), TemplateError);
  EXPECT_THROW(R("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), TemplateError);
  EXPECT_THROW(R("{{ 'x' * 1000000000 }}"), TemplateError);
  EXPECT_THROW(R("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"), TemplateError);
  EXPECT_THROW(R("{{ 2 ** 100 }}"), TemplateError);
  EXPECT_THROW(R("{{ x.__class__() }}"), TemplateError);
}

}  // namespace
}  // namespace kvserve
