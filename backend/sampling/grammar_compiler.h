#pragma once
// GrammarCompiler: turns a request's StructuredOutputSpec into a compiled grammar over the model's
// vocabulary (xgrammar), off the engine thread, cached by spec and bounded in time.
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/sampling/structured_output_spec.h"
#include "common/check.h"

namespace xgrammar {
class CompiledGrammar;
class TokenizerInfo;
class GrammarCompiler;
}  // namespace xgrammar

namespace kvserve {

class Tokenizer;

// A spec the compiler refuses (bad schema, regex or grammar, or a compile over its time limit);
// the message says why, `field` is the request field it came from.
class GrammarError : public KvError {
 public:
  GrammarError(const std::string& field, const std::string& message) : KvError(message), field_(field) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// A compiled grammar, shared by every sequence of the requests that asked for the same spec.
struct StructuredGrammar {
  StructuredOutputSpec spec;
  std::shared_ptr<const xgrammar::CompiledGrammar> compiled;
  int64_t vocab_size = 0;  // the logits' width it masks
  std::vector<int32_t> stop_ids;  // tokens that end the output once the grammar is complete
};

// The EBNF grammar of a guided_choice: one of the strings exactly.
std::string choice_grammar(const std::vector<std::string>& choices);

struct GrammarCompilerOptions {
  std::chrono::milliseconds timeout{10000};  // a compile running longer answers 400
  int max_in_flight = 4;                     // compiles running at once (timed-out ones included)
  int64_t cache_bytes = int64_t{256} << 20;  // xgrammar's compiled-grammar cache (0: none)
  int threads = 0;                           // xgrammar's threads per compile (0: the cores, at most 4)
};

class GrammarCompiler {
 public:
  // `vocab_size`: the model's logits width (>= the tokenizer's); `stop_ids`: the model's EOS ids.
  GrammarCompiler(const Tokenizer& tokenizer, int64_t vocab_size, std::vector<int64_t> stop_ids,
                  GrammarCompilerOptions options = {});
  ~GrammarCompiler();
  GrammarCompiler(const GrammarCompiler&) = delete;
  GrammarCompiler& operator=(const GrammarCompiler&) = delete;

  // Compiles on a worker thread and waits at most options.timeout; a compile that overruns is
  // left to finish in the background (its result lands in the cache) and this throws.
  // Throws GrammarError naming spec.field for anything the compiler refuses.
  std::shared_ptr<const StructuredGrammar> compile(const StructuredOutputSpec& spec);

  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct State;
  int64_t vocab_size_;
  GrammarCompilerOptions options_;
  std::shared_ptr<State> state_;  // shared with compiles still running after a timeout
};

}  // namespace kvserve
