// The model decoding over the paged pool (policy full) gives the logits of the contiguous cache.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "backend/model/decoder_model.h"
#include "cache_manager/paged_kv_memory.h"
#include "tests/support/contiguous_kv_cache.h"

using namespace kvserve;

TEST(PagedVsContiguous, BatchedDecodeLogitsAgree) {
  const char* env = std::getenv("KVSERVE_FIXTURES");
  const std::string dir = env ? std::string(env) + "/llama-gqa" : "";
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  ContiguousKvCache contiguous(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                               torch::TensorOptions().dtype(torch::kFloat32));
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.num_blocks = 256;
  PagedKvMemory paged(c.num_hidden_layers, pool, resolve_policies({}));

  // Three sequences whose lengths straddle block boundaries differently.
  const std::vector<int64_t> lens = {5, 16, 37};
  std::vector<std::vector<int64_t>> prompts;
  DecodeBatch batch;
  std::vector<int64_t> next;
  for (size_t i = 0; i < lens.size(); ++i) {
    std::vector<int64_t> p;
    for (int64_t t = 0; t < lens[i]; ++t) p.push_back((t * 37 + 11 * static_cast<int64_t>(i) + 3) % c.vocab_size);
    auto a = model->prefill(static_cast<int64_t>(i), p, contiguous);
    auto b = model->prefill(static_cast<int64_t>(i), p, paged);
    EXPECT_LE((a - b).abs().max().item<float>(), 1e-6);
    batch.seq_ids.push_back(static_cast<int64_t>(i));
    batch.positions.push_back(lens[i]);
    next.push_back(a[0].argmax().item<int64_t>());
  }
  for (int step = 0; step < 24; ++step) {
    auto a = model->decode(batch, next, contiguous);
    auto b = model->decode(batch, next, paged);
    ASSERT_LE((a - b).abs().max().item<float>(), 1e-5) << "step " << step;
    for (size_t i = 0; i < next.size(); ++i) {
      next[i] = a[i].argmax().item<int64_t>();
      ++batch.positions[i];
    }
  }
  for (int64_t id : batch.seq_ids) {
    EXPECT_EQ(paged.cached_tokens(id, 0), contiguous.cached_tokens(id, 0));
    paged.release(id);
    contiguous.release(id);
  }
  EXPECT_EQ(paged.blocks_used(), 0);
}
