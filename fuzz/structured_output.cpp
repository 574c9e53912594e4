// Structured-output specs (JSON schema, regex, EBNF grammar, choice, tool-call schema) through
// GrammarCompiler (xgrammar) over a byte-level vocabulary: every input either compiles or is a
// GrammarError; a compiled grammar's matcher accepts every token its own mask allows.
#include <xgrammar/xgrammar.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/sampling/grammar_compiler.h"
#include "fuzz/fuzz_common.h"
#include "text/tokenizer.h"

using kvserve::GrammarError;
using kvserve::StructuredOutputSpec;

namespace {

// A byte-level BPE tokenizer whose vocabulary is the 256 bytes (GPT-2's alphabet) plus a few
// merges, and an end-of-text token: enough for every grammar to have tokens to allow.
std::string tokenizer_json() {
  nlohmann::json vocab = nlohmann::json::object();
  int n = 0;
  auto cp = [](int b) {
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) return b;
    static int extra[256] = {};
    static bool init = false;
    if (!init) {
      int k = 0;
      for (int x = 0; x < 256; ++x)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) extra[x] = 256 + k++;
      init = true;
    }
    return extra[b];
  };
  auto utf8 = [](int c) {
    std::string s;
    if (c < 0x80) s += static_cast<char>(c);
    else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    return s;
  };
  for (int b = 0; b < 256; ++b) vocab[utf8(cp(b))] = n++;
  nlohmann::json merges = nlohmann::json::array();
  for (const char* m : {"\"", "{", "}", ":", ","}) {
    const std::string a = m, c = "\"";
    if (!vocab.contains(a + c)) {
      merges.push_back(a + " " + c);
      vocab[a + c] = n++;
    }
  }
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array({{{"id", n}, {"content", "<|end|>"}, {"special", true}, {"single_word", false},
                                               {"lstrip", false}, {"rstrip", false}, {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
  return j.dump();
}

struct World {
  kvserve::Tokenizer tok = kvserve::Tokenizer::from_json(tokenizer_json(), R"({"eos_token": "<|end|>"})", "fuzz");
  std::unique_ptr<kvserve::GrammarCompiler> compiler;
  World() {
    kvserve::GrammarCompilerOptions o;
    // No compiled-grammar cache: what it keeps between inputs would make libFuzzer's leak check
    // (mallocs != frees) scan the heap after every input.
    o.cache_bytes = 0;
    o.max_in_flight = 1 << 20;  // the fuzzer waits for each compile (timeout below)
    o.timeout = std::chrono::milliseconds(8000);
    o.threads = 1;  // a thread pool per compile would cost more than the compile under ASan
    compiler = std::make_unique<kvserve::GrammarCompiler>(tok, tok.vocab_size() + 5, std::vector<int64_t>{*tok.eos_id()}, o);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World w;
  if (size < 3) return 0;
  // Byte 0: the kind; byte 1: matcher steps to drive; the rest: the spec's text.
  const std::string text(reinterpret_cast<const char*>(data) + 2, size - 2);
  StructuredOutputSpec s;
  s.field = "fuzz";
  switch (data[0] % 6) {
    case 0: s.kind = StructuredOutputSpec::Kind::kJsonSchema, s.text = text; break;
    case 1: s.kind = StructuredOutputSpec::Kind::kRegex, s.text = text; break;
    case 2: s.kind = StructuredOutputSpec::Kind::kGrammar, s.text = text; break;
    case 3: {
      s.kind = StructuredOutputSpec::Kind::kChoice;
      size_t at = 0;
      while (at <= text.size()) {
        const size_t nl = text.find('\n', at);
        s.choices.push_back(text.substr(at, nl == std::string::npos ? std::string::npos : nl - at));
        if (nl == std::string::npos) break;
        at = nl + 1;
      }
      break;
    }
    case 4: s.kind = StructuredOutputSpec::Kind::kToolCall, s.text = text, s.prefix = "<tool_call>\n", s.suffix = "\n</tool_call>"; break;
    default: s.kind = StructuredOutputSpec::Kind::kJsonObject; break;
  }
  std::shared_ptr<const kvserve::StructuredGrammar> g;
  kvfuzz::expect_only<GrammarError>([&] { g = w.compiler->compile(s); });
  if (!g) return 0;
  // Drive the matcher: at each step take an allowed token picked by the input's bytes.
  xgrammar::GrammarMatcher m(*g->compiled);
  const int words = xgrammar::GetBitmaskSize(static_cast<int>(g->vocab_size));
  std::vector<int32_t> bits(static_cast<size_t>(words));
  int64_t shape[1] = {words};
  DLTensor t{};
  t.data = bits.data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  for (int step = 0; step < data[1] % 32 && !m.IsTerminated(); ++step) {
    m.FillNextTokenBitmask(&t);
    std::vector<int32_t> allowed;
    for (int64_t id = 0; id < g->vocab_size; ++id)
      if ((static_cast<uint32_t>(bits[static_cast<size_t>(id >> 5)]) >> (id & 31)) & 1u) allowed.push_back(static_cast<int32_t>(id));
    if (allowed.empty()) break;
    const int32_t pick = allowed[static_cast<size_t>(data[2 + step % (size - 2)]) % allowed.size()];
    if (!m.AcceptToken(pick)) {
      std::fprintf(stderr, "fuzz: the matcher refused token %d that its mask allowed\n", pick);
      std::abort();
    }
  }
  return 0;
}
