#include "backend/sampling/grammar_compiler.h"

#include <xgrammar/xgrammar.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <future>
#include <thread>

#include "text/tokenizer.h"

namespace kvserve {

namespace {

// How the vocabulary's strings stand for bytes, read from the vocabulary itself: <0xNN> tokens
// mean SentencePiece byte fallback (with ▁ for a space), Ċ / Ġ (newline / space in GPT-2's byte
// alphabet) mean byte-level BPE; otherwise tokens are their own text.
xgrammar::VocabType vocab_type(const Tokenizer& t) {
  if (t.token_to_id("<0x0A>")) return xgrammar::VocabType::BYTE_FALLBACK;
  if (t.token_to_id("\xc4\x8a") || t.token_to_id("\xc4\xa0")) return xgrammar::VocabType::BYTE_LEVEL;
  if (t.token_to_id("\xe2\x96\x81")) return xgrammar::VocabType::BYTE_FALLBACK;
  return xgrammar::VocabType::RAW;
}

// xgrammar's messages start with "[time] file.cc:line: "; the client needs only what follows.
std::string clean_message(const std::string& m) {
  const size_t at = m.find(".cc:");
  if (at == std::string::npos) return m;
  const size_t colon = m.find(": ", at);
  return colon == std::string::npos ? m : m.substr(colon + 2);
}

// An EBNF string literal for `s`: quotes and backslashes escaped, control bytes as \u00XX (fixed
// width: xgrammar's \x takes every hex digit that follows).
std::string ebnf_literal(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

}  // namespace

std::string choice_grammar(const std::vector<std::string>& choices) {
  KV_CHECK(!choices.empty(), "guided_choice needs at least one choice");
  std::string g = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) g += (i ? " | " : "") + ebnf_literal(choices[i]);
  return g + "\n";
}

struct GrammarCompiler::State {
  std::unique_ptr<xgrammar::TokenizerInfo> info;
  std::unique_ptr<xgrammar::GrammarCompiler> compiler;  // thread-safe, with its own cache
  std::vector<int32_t> stop_ids;
  std::atomic<int> in_flight{0};
};

GrammarCompiler::GrammarCompiler(const Tokenizer& tokenizer, int64_t vocab_size, std::vector<int64_t> stop_ids,
                                 GrammarCompilerOptions options)
    : vocab_size_(vocab_size), options_(options), state_(std::make_shared<State>()) {
  KV_CHECK(vocab_size >= tokenizer.vocab_size(),
           "grammar compiler: the model's vocabulary (" << vocab_size << ") is smaller than the tokenizer's ("
                                                         << tokenizer.vocab_size() << ")");
  // Special tokens and ids the tokenizer does not know are "" (xgrammar never allows them, except
  // the stop tokens once the grammar is complete).
  std::vector<std::string> vocab(static_cast<size_t>(vocab_size));
  for (int64_t id = 0; id < tokenizer.vocab_size(); ++id)
    if (!tokenizer.is_special(id)) vocab[static_cast<size_t>(id)] = tokenizer.id_to_token(id);
  for (int64_t t : stop_ids)
    if (t >= 0 && t < vocab_size) state_->stop_ids.push_back(static_cast<int32_t>(t));
  state_->info = std::make_unique<xgrammar::TokenizerInfo>(vocab, vocab_type(tokenizer),
                                                           static_cast<int>(vocab_size), state_->stop_ids);
  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::min(4u, std::thread::hardware_concurrency())));
  state_->compiler =
      std::make_unique<xgrammar::GrammarCompiler>(*state_->info, threads, /*cache_enabled=*/options.cache_bytes != 0,
                                                    options.cache_bytes);
}

GrammarCompiler::~GrammarCompiler() = default;

namespace {

// xgrammar 0.2.8 reads "\x" and any number of hex digits after it into an int, which overflows
// (undefined behaviour) past 7 digits; the structured_output fuzz target found it through a regex.
// No code point needs more than 6, so longer ones are refused before xgrammar sees them.
void check_hex_escapes(const std::string& text) {
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    if (text[i] != '\\' || text[i + 1] != 'x') continue;
    size_t n = 0;
    while (i + 2 + n < text.size() && std::isxdigit(static_cast<unsigned char>(text[i + 2 + n]))) ++n;
    if (n > 6)
      throw std::runtime_error("a \\x escape with " + std::to_string(n) + " hex digits at offset " + std::to_string(i) +
                               " (at most 6)");
  }
}

// The same over every string of a JSON document (a schema's patterns arrive JSON-decoded).
void check_hex_escapes(const nlohmann::json& j) {
  if (j.is_string()) {
    check_hex_escapes(j.get_ref<const std::string&>());
  } else if (j.is_object()) {
    for (const auto& [k, v] : j.items()) {
      check_hex_escapes(k);
      check_hex_escapes(v);
    }
  } else if (j.is_array()) {
    for (const auto& v : j) check_hex_escapes(v);
  }
}

void check_json_hex_escapes(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded()) check_hex_escapes(j);
}

xgrammar::CompiledGrammar compile_spec(xgrammar::GrammarCompiler& c, const StructuredOutputSpec& spec) {
  using K = StructuredOutputSpec::Kind;
  switch (spec.kind) {
    case K::kJsonSchema: {
      // A clear message for text that is not JSON at all, before xgrammar sees it.
      const auto j = nlohmann::json::parse(spec.text, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) throw std::runtime_error("the schema is not valid JSON");
      if (!j.is_object() && !j.is_boolean()) throw std::runtime_error("the schema must be a JSON object");
      check_hex_escapes(j);
      // Compact separators and no free whitespace: a small model cannot loop on blanks. Strict
      // mode (no properties or items the schema does not name) as vLLM compiles it.
      return c.CompileJSONSchema(spec.text, /*any_whitespace=*/false, std::nullopt, std::nullopt, /*strict_mode=*/true);
    }
    case K::kJsonObject:
      return c.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false);
    case K::kRegex:
      check_hex_escapes(spec.text);
      return c.CompileRegex(spec.text);
    case K::kChoice:
      return c.CompileGrammar(choice_grammar(spec.choices), "root");
    case K::kGrammar:
      check_hex_escapes(spec.text);
      return c.CompileGrammar(spec.text, "root");
    case K::kToolCall: {
      check_json_hex_escapes(spec.text);
      std::vector<xgrammar::Grammar> parts;
      if (!spec.prefix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.prefix)));
      parts.push_back(xgrammar::Grammar::FromJSONSchema(spec.text, /*any_whitespace=*/false, std::nullopt, std::nullopt,
                                                        /*strict_mode=*/true));
      if (!spec.suffix.empty()) parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.suffix)));
      return c.CompileGrammar(parts.size() == 1 ? parts[0] : xgrammar::Grammar::Concat(parts));
    }
    case K::kNone:
      break;
  }
  throw std::runtime_error("no grammar requested");
}

const char* what_kind(StructuredOutputSpec::Kind k) {
  using K = StructuredOutputSpec::Kind;
  switch (k) {
    case K::kJsonSchema: return "JSON schema";
    case K::kJsonObject: return "JSON object grammar";
    case K::kRegex: return "regex";
    case K::kChoice: return "choice";
    case K::kGrammar: return "grammar";
    case K::kToolCall: return "tool-call schema";
    case K::kNone: break;
  }
  return "grammar";
}

}  // namespace

std::shared_ptr<const StructuredGrammar> GrammarCompiler::compile(const StructuredOutputSpec& spec) {
  KV_CHECK(spec.active(), "internal: compile() of an empty structured-output spec");
  auto state = state_;
  if (state->in_flight.fetch_add(1) >= options_.max_in_flight) {
    --state->in_flight;
    throw GrammarError(spec.field, "too many grammar compiles are running (" + std::to_string(options_.max_in_flight) +
                                       "); retry later");
  }
  auto done = std::make_shared<std::promise<std::shared_ptr<const StructuredGrammar>>>();
  auto result = done->get_future();
  const int64_t vocab = vocab_size_;
  std::thread([state, spec, done, vocab] {
    try {
      auto g = std::make_shared<StructuredGrammar>();
      g->spec = spec;
      g->compiled = std::make_shared<const xgrammar::CompiledGrammar>(compile_spec(*state->compiler, spec));
      g->vocab_size = vocab;
      g->stop_ids = state->stop_ids;
      done->set_value(std::move(g));
    } catch (const std::exception& e) {
      done->set_exception(std::make_exception_ptr(
          GrammarError(spec.field, std::string("invalid ") + what_kind(spec.kind) + ": " + clean_message(e.what()))));
    } catch (...) {
      done->set_exception(std::make_exception_ptr(GrammarError(spec.field, "the grammar compiler failed")));
    }
    --state->in_flight;
  }).detach();
  if (result.wait_for(options_.timeout) != std::future_status::ready)
    throw GrammarError(spec.field, std::string("compiling the ") + what_kind(spec.kind) + " took longer than " +
                                       std::to_string(options_.timeout.count()) + " ms");
  return result.get();
}

}  // namespace kvserve
