// The output processor on the repository's tiny-retriever tokenizer: text deltas, stop strings held
// back across tokens, stop tokens, min_tokens, max_tokens and the final event.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/engine/output_processor.h"

namespace kvserve {
namespace {

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_dir(std::string(KVSERVE_SOURCE_DIR) + "/models/tiny-retriever");
  return t;
}

struct Events {
  std::vector<GenerationEvent> events;
  std::string text() const {
    std::string s;
    for (const auto& e : events) s += e.text_delta;
    return s;
  }
};

// Feeds `text`'s tokens one by one; returns the finish reason the processor gave (if any).
std::optional<std::string> feed(const OutputProcessor& out, Sequence& s, const std::vector<int64_t>& ids) {
  for (int64_t id : ids) {
    if (auto r = out.on_token(s, SampledToken{id, {}, {}})) {
      out.finish(s, *r);
      return r;
    }
  }
  return std::nullopt;
}

std::unique_ptr<Sequence> sequence(Events& run, SamplingParams sp) {
  auto s = std::make_unique<Sequence>();
  s->req.prompt_ids = tokenizer().encode("The passkey is", false);
  s->req.sampling = sp;
  s->on_event = [&run](const GenerationEvent& e) { run.events.push_back(e); };
  s->detok = std::make_unique<IncrementalDetokenizer>(tokenizer(), true, s->req.prompt_ids);
  return s;
}

TEST(OutputProcessor, StreamsTheTextAndStopsAtMaxTokens) {
  OutputProcessor out(tokenizer(), {}, 2048);
  const auto ids = tokenizer().encode(" 4711. Remember it.", false);
  Events run;
  SamplingParams sp;
  sp.max_tokens = static_cast<int64_t>(ids.size());
  auto s = sequence(run, sp);
  EXPECT_EQ(feed(out, *s, ids), "length");
  EXPECT_EQ(run.text(), " 4711. Remember it.");
  ASSERT_TRUE(run.events.back().finished);
  EXPECT_EQ(run.events.back().finish_reason, "length");
  EXPECT_EQ(run.events.back().completion_tokens, static_cast<int64_t>(ids.size()));
}

TEST(OutputProcessor, HoldsBackAPossibleStopStringAndCutsIt) {
  OutputProcessor out(tokenizer(), {}, 2048);
  const auto ids = tokenizer().encode(" 4711. Remember it. And more", false);
  for (bool include : {false, true}) {
    Events run;
    SamplingParams sp;
    sp.max_tokens = 100;
    sp.stop = {"Remember"};
    sp.include_stop_str_in_output = include;
    auto s = sequence(run, sp);
    EXPECT_EQ(feed(out, *s, ids), "stop");
    EXPECT_EQ(run.text(), include ? " 4711. Remember" : " 4711. ");
    // No event ever carried text past the stop string, even while "Rem..." was still ambiguous.
    std::string seen;
    for (const auto& e : run.events) {
      seen += e.text_delta;
      EXPECT_EQ(seen.find("it"), std::string::npos);
    }
  }
}

TEST(OutputProcessor, StopTokensEndTheOutputUnlessMinTokensIsNotReached) {
  const int64_t eos = 7;
  OutputProcessor out(tokenizer(), {eos}, 2048);
  const auto ids = tokenizer().encode(" 4711", false);
  {
    Events run;
    SamplingParams sp;
    auto s = sequence(run, sp);
    std::vector<int64_t> with_eos = ids;
    with_eos.push_back(eos);
    EXPECT_EQ(feed(out, *s, with_eos), "stop");
    EXPECT_EQ(run.text(), " 4711");  // the stop token's text is not output
  }
  {
    Events run;
    SamplingParams sp;
    sp.min_tokens = 3;
    sp.max_tokens = 3;
    auto s = sequence(run, sp);
    EXPECT_EQ(feed(out, *s, {eos, eos, eos}), "length");  // EOS before min_tokens does not stop
    EXPECT_EQ(s->output.size(), 3u);
  }
}

TEST(OutputProcessor, AnAbortFlushesWhatWasHeldBack) {
  OutputProcessor out(tokenizer(), {}, 2048);
  Events run;
  SamplingParams sp;
  sp.stop = {"Remember it"};
  auto s = sequence(run, sp);
  EXPECT_FALSE(feed(out, *s, tokenizer().encode(" 4711. Remember", false)).has_value());
  EXPECT_EQ(run.text(), " 4711. ");
  out.finish(*s, "abort");
  EXPECT_EQ(run.text(), " 4711. Remember");
  EXPECT_EQ(run.events.back().finish_reason, "abort");
}

}  // namespace
}  // namespace kvserve
