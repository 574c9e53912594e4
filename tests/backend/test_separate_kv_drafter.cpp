// The draft model with a cache of its own (SeparateKvDrafter) on a random fixture: it follows a
// prompt's prefill, drafts as the model's greedy continuation, and takes a repeated prompt's full
// blocks from its own prefix cache (where the served model has one) with the same drafts after.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/engine/step_plan.h"
#include "backend/model/decoder_model.h"
#include "backend/spec_decode/separate_kv_drafter.h"
#include "cache_manager/kv_memory_factory.h"
#include "tests/support/fixture_models.h"

namespace kvserve {
namespace {

using test::fixture;
using test::make_prompt;

constexpr int64_t kPrompt = 41;  // two full blocks of 16 and a partial one
constexpr int64_t kDrafts = 3;

std::unique_ptr<PagedKvMemory> served_memory(const DecoderModel& m, bool prefix_caching) {
  KvPoolSize size;
  size.block_size = 16;
  size.num_blocks = 64 * m.config().num_hidden_layers;
  size.layout = KvLayout::kLayer;
  size.prefix_caching = prefix_caching;
  return make_kv_memory(m.kv_layout(), size, {});
}

// Follows `prompt` as sequence `id`'s whole prefill, then drafts kDrafts tokens after `next` (the
// token the served model sampled at the prompt's end).
std::vector<int64_t> follow_and_draft(SeparateKvDrafter& d, int64_t id, const std::vector<int64_t>& prompt, int64_t next) {
  PrefillWork w;
  w.seq_id = id;
  w.tokens = prompt;
  d.follow_prefill(w);
  DecodeBatch b;
  std::vector<int64_t> tokens;
  for (int64_t j = 0; j <= kDrafts; ++j) {
    b.seq_ids.push_back(id);
    b.positions.push_back(kPrompt + j);
    tokens.push_back(j == 0 ? next : -1);
  }
  EXPECT_EQ(d.draft(b, tokens, nullptr, nullptr), kDrafts);
  return std::vector<int64_t>(tokens.begin() + 1, tokens.end());
}

class SeparateKvDraft : public ::testing::TestWithParam<bool> {};

TEST_P(SeparateKvDraft, DraftsTheGreedyContinuationAndReusesItsPrefixCache) {
  const bool prefix_caching = GetParam();
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  // The served model itself as the draft, on a cache of its own: its drafts are the model's greedy tokens.
  std::shared_ptr<DecoderModel> model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  auto served = served_memory(*model, prefix_caching);
  auto drafter = make_separate_kv_drafter(model, *served, "a test");
  EXPECT_EQ(drafter->memory().prefix_caching(), prefix_caching);

  const auto prompt = make_prompt(kPrompt, 5, model->config().vocab_size);
  const int64_t next = 7;
  // The reference: greedy decoding over a cache the drafter never touches.
  auto ref = served_memory(*model, false);
  model->prefill(100, prompt, *ref);
  std::vector<int64_t> greedy;
  int64_t tok = next;
  for (int64_t j = 0; j < kDrafts; ++j) {
    DecodeBatch b;
    b.seq_ids = {100};
    b.positions = {kPrompt + j};
    tok = model->decode(b, {tok}, *ref).argmax(-1).item<int64_t>();
    greedy.push_back(tok);
  }

  EXPECT_EQ(follow_and_draft(*drafter, 1, prompt, next), greedy);
  EXPECT_EQ(drafter->prefix_hits(), 0);
  drafter->release(1);
  // The same prompt again: its two full blocks come from the draft's prefix cache, and the drafts
  // over them are the same.
  EXPECT_EQ(follow_and_draft(*drafter, 2, prompt, next), greedy);
  EXPECT_EQ(drafter->prefix_hits(), prefix_caching ? 32 : 0);
  drafter->release(2);
  // Only the cached blocks stay held.
  EXPECT_EQ(drafter->memory().blocks_used(), 0);
}

INSTANTIATE_TEST_SUITE_P(PrefixCaching, SeparateKvDraft, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "on" : "off"; });

}  // namespace
}  // namespace kvserve
