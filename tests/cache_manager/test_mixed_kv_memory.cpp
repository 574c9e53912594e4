// MixedKvMemory: sequences of two KV formats (int8 and int4) in one memory on one storage. A decode
// step over both formats' sequences, rows interleaved, computes for every row what that format's
// memory on a pool of its own computes; a step one format cannot fit leaves the other's sequences as
// they were; the factory gives each policy its format and resolves budget_bytes in it.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "cache_manager/kv_memory_factory.h"
#include "cache_manager/kv_slabs.h"
#include "cache_manager/mixed_kv_memory.h"
#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t kLayers = 3, kKv = 2, kH = 4, kD = 64;

KvPoolOptions format(KvQuant q, int64_t num_blocks) {
  KvPoolOptions o;
  o.num_kv_heads = kKv;
  o.head_dim = kD;
  o.block_size = 4;
  o.quant = q;
  o.num_blocks = num_blocks;
  return o;
}

const std::map<std::string, std::map<std::string, std::string>> kSpecs = {
    {"snap", {{"name", "snapkv"}, {"budget", "24"}, {"window", "4"}, {"kernel", "3"}}},
    {"snap4", {{"name", "snapkv"}, {"budget", "24"}, {"window", "4"}, {"kernel", "3"}}},
    {"full4", {{"name", "full"}}}};

struct Twins {
  std::shared_ptr<KvSlabs> slabs;
  std::unique_ptr<MixedKvMemory> mixed;
  std::unique_ptr<PagedKvMemory> own8, own4;
};

// int8 (the default format) and int4 (policies snap4 and full4) on `slabs_n` slabs, and each format
// on a pool of its own.
Twins make_twins(int64_t slabs_n) {
  Twins t;
  const KvPoolOptions i8 = format(KvQuant::q8_0, 9 * slabs_n), i4 = format(KvQuant::q4_0, 17 * slabs_n);
  t.slabs = std::make_shared<KvSlabs>(std::vector<KvPoolOptions>{i8, i4});
  std::vector<std::unique_ptr<PagedKvMemory>> m;
  m.push_back(std::make_unique<PagedKvMemory>(kLayers, i8, resolve_policies(kSpecs), "full", KvShard{}, t.slabs));
  m.push_back(std::make_unique<PagedKvMemory>(kLayers, i4, resolve_policies(kSpecs), "full", KvShard{}, t.slabs));
  t.mixed = std::make_unique<MixedKvMemory>(std::move(m), std::map<std::string, size_t>{{"snap4", 1}, {"full4", 1}}, t.slabs);
  t.own8 = std::make_unique<PagedKvMemory>(kLayers, i8, resolve_policies(kSpecs));
  t.own4 = std::make_unique<PagedKvMemory>(kLayers, i4, resolve_policies(kSpecs));
  return t;
}

struct Seq {
  int64_t id, prompt;
  std::string policy;
  bool int4() const { return policy == "snap4" || policy == "full4"; }
};

void prefill(Twins& t, const Seq& s) {
  PagedKvMemory& own = s.int4() ? *t.own4 : *t.own8;
  t.mixed->begin_prefill(s.id, s.prompt, s.policy);
  own.begin_prefill(s.id, s.prompt, s.policy);
  for (int64_t l = 0; l < kLayers; ++l) {
    const auto q = torch::randn({kH, s.prompt, kD}), k = torch::randn({kKv, s.prompt, kD}), v = torch::randn({kKv, s.prompt, kD});
    t.mixed->store_prefill(s.id, l, q, k, v);
    own.store_prefill(s.id, l, q, k, v);
  }
  t.mixed->end_prefill(s.id);
  own.end_prefill(s.id);
}

TEST(MixedKvMemory, MixedStepComputesWhatEachFormatComputesAlone) {
  Twins t = make_twins(20);
  // Formats interleaved in the batch: rows go out by format and come back in the step's order.
  const std::vector<Seq> seqs = {{1, 80, "snap"}, {2, 60, "full4"}, {3, 40, "full"}, {4, 90, "snap4"}, {5, 33, "snap4"}};
  torch::manual_seed(9);
  for (const Seq& s : seqs) prefill(t, s);
  EXPECT_EQ(&t.mixed->of(1), &t.mixed->format(0));
  EXPECT_EQ(&t.mixed->of(4), &t.mixed->format(1));
  EXPECT_GT(t.mixed->format(0).blocks_used(), 0);
  EXPECT_GT(t.mixed->format(1).blocks_used(), 0);
  std::map<int64_t, int64_t> next;
  for (const Seq& s : seqs) next[s.id] = s.prompt;
  for (int step = 0; step < 6; ++step) {
    DecodeBatch all, b8, b4;
    std::vector<int64_t> rows8, rows4;
    for (const Seq& s : seqs) {
      if (step == 3 && s.id == 3) continue;  // a batch without one of them
      const int64_t p = next[s.id]++;
      (s.int4() ? rows4 : rows8).push_back(static_cast<int64_t>(all.seq_ids.size()));
      all.seq_ids.push_back(s.id);
      all.positions.push_back(p);
      (s.int4() ? b4 : b8).seq_ids.push_back(s.id);
      (s.int4() ? b4 : b8).positions.push_back(p);
    }
    const auto B = static_cast<int64_t>(all.seq_ids.size());
    if (step % 2 == 0) t.mixed->begin_decode(all);  // or planned by the first layer
    for (int64_t l = 0; l < kLayers; ++l) {
      const auto q = torch::randn({B, kH, kD}), k = torch::randn({B, kKv, kD}), v = torch::randn({B, kKv, kD});
      const auto out = t.mixed->decode_attention(l, all, q, k, v);
      const auto i8 = torch::tensor(rows8), i4 = torch::tensor(rows4);
      const auto o8 = t.own8->decode_attention(l, b8, q.index_select(0, i8), k.index_select(0, i8), v.index_select(0, i8));
      const auto o4 = t.own4->decode_attention(l, b4, q.index_select(0, i4), k.index_select(0, i4), v.index_select(0, i4));
      ASSERT_TRUE(torch::equal(out.index_select(0, i8), o8)) << "int8 rows, step " << step << " layer " << l;
      ASSERT_TRUE(torch::equal(out.index_select(0, i4), o4)) << "int4 rows, step " << step << " layer " << l;
    }
  }
  for (const Seq& s : seqs) {
    const PagedKvMemory& own = s.int4() ? *t.own4 : *t.own8;
    EXPECT_EQ(t.mixed->kept_tokens(s.id), own.kept_tokens(s.id)) << "sequence " << s.id;
    for (int64_t l = 0; l < kLayers; ++l)
      ASSERT_TRUE(torch::equal(t.mixed->of(s.id).kept_positions(s.id, l), own.kept_positions(s.id, l))) << "sequence " << s.id;
  }
  EXPECT_LT(t.mixed->cached_tokens(4, 0), 90 + 6);  // SnapKV compressed the int4 prompt
  // Bytes: each format's own blocks, counted once, within the storage.
  EXPECT_EQ(t.mixed->bytes_used(), t.own8->blocks_used() * t.own8->cache().block_bytes() +
                                       t.own4->blocks_used() * t.own4->cache().block_bytes());
  EXPECT_LE(t.mixed->bytes_used(), t.mixed->bytes_total());
  EXPECT_EQ(t.mixed->bytes_total(), 20 * t.slabs->slab_bytes());
  // Counted in units that divide both blocks: a slab is 9 int8 or 17 int4 blocks.
  const int64_t u8 = t.mixed->block_units(0), u4 = t.mixed->block_units(1);
  EXPECT_EQ(u8 * t.mixed->unit_bytes(), t.own8->cache().block_bytes());
  EXPECT_EQ(u4 * t.mixed->unit_bytes(), t.own4->cache().block_bytes());
  EXPECT_EQ(9 * u8, 17 * u4);
  EXPECT_EQ(t.mixed->policy_block_units("full4"), u4);
  EXPECT_EQ(t.mixed->policy_block_units("no such policy"), u8);
  EXPECT_EQ(t.mixed->blocks_total(), 20 * 9 * u8);
  EXPECT_EQ(t.mixed->blocks_used() * t.mixed->unit_bytes(), t.mixed->bytes_used());
  // A padded step (a CUDA graph's bucket) cannot span formats.
  DecodeBatch two{{1, 2}, {next[1], next[2]}};
  EXPECT_THROW(t.mixed->begin_decode(two, 4), KvError);
  for (const Seq& s : seqs) t.mixed->release(s.id);
  EXPECT_FALSE(t.mixed->holds(1));
  EXPECT_EQ(t.slabs->free_slabs(), t.slabs->num_slabs());
  t.slabs->check_invariants();
}

TEST(MixedKvMemory, StepOneFormatCannotFitLeavesTheOtherAsItWas) {
  Twins t = make_twins(3);
  torch::manual_seed(4);
  // int8: one sequence of 6 tokens per layer (2 blocks of 4 in each of 3 layers: one slab of 9); int4:
  // a prompt of 44 whose 33 blocks, every last one full, take the other two slabs (34 blocks).
  prefill(t, {1, 6, "full"});
  prefill(t, {2, 44, "full4"});
  EXPECT_EQ(t.slabs->free_slabs(), 0);
  const int64_t len1 = t.mixed->cached_tokens(1, 0), len2 = t.mixed->cached_tokens(2, 0);
  const auto used = t.mixed->bytes_used();
  // Sequence 1 fits its token in its last blocks; sequence 2 needs 3 new blocks and 1 is free.
  DecodeBatch batch{{1, 2}, {6, 44}};
  EXPECT_THROW(t.mixed->begin_decode(batch), KvError);
  EXPECT_EQ(t.mixed->cached_tokens(1, 0), len1);
  EXPECT_EQ(t.mixed->cached_tokens(2, 0), len2);
  EXPECT_EQ(t.mixed->bytes_used(), used);
  // Without the int4 rows the step runs.
  DecodeBatch one{{1}, {6}};
  const auto out = t.mixed->decode_attention(0, one, torch::randn({1, kH, kD}), torch::randn({1, kKv, kD}), torch::randn({1, kKv, kD}));
  EXPECT_EQ(out.size(0), 1);
  for (int64_t id : {1, 2}) t.mixed->release(id);
  EXPECT_EQ(t.slabs->free_slabs(), 3);
}

TEST(MixedKvMemory, RoomIsExactlyWhatEachFormatCanTake) {
  Twins t = make_twins(4);
  torch::manual_seed(5);
  // Blocks of 1,088 (int8) and 576 bytes (int4): units of 64 bytes, 17 and 9 of them, 153 a slab.
  ASSERT_EQ(t.mixed->block_units(0), 17);
  ASSERT_EQ(t.mixed->block_units(1), 9);
  // int8: 6 tokens (2 blocks in each of 3 layers) leave 3 of its slab's 9 blocks free; int4: 20
  // tokens (5 blocks a layer) leave 2 of 17.
  prefill(t, {1, 6, "full"});
  prefill(t, {2, 20, "full4"});
  MixedKvMemory::Room r = t.mixed->room();
  EXPECT_EQ(r.own_units, (std::vector<int64_t>{3 * 17, 2 * 9}));
  EXPECT_EQ(r.free_slabs, 2);
  EXPECT_EQ(r.slab_units, 153);
  // One count over the storage would offer int4 the int8 slab's 3 free blocks too (41 blocks).
  EXPECT_EQ((t.mixed->blocks_total() - t.mixed->blocks_used()) / 9, 41);
  // int4 can take 2 + 2 x 17 = 36 blocks: 12 a layer (48 tokens), and then nothing.
  prefill(t, {3, 48, "full4"});
  r = t.mixed->room();
  EXPECT_EQ(r.own_units, (std::vector<int64_t>{3 * 17, 0}));
  EXPECT_EQ(r.free_slabs, 0);
  EXPECT_THROW(prefill(t, {4, 1, "full4"}), KvError);
  t.mixed->release(4);
  // int8's 3 free blocks are still its own: one block a layer fits.
  prefill(t, {5, 4, "full"});
  EXPECT_EQ(t.mixed->room().own_units[0], 0);
  // Released, the int4 sequences' slabs show as free again.
  t.mixed->release(2);
  t.mixed->release(3);
  r = t.mixed->room();
  EXPECT_EQ(r.free_slabs, 3);
  EXPECT_EQ(r.own_units[1], 0);
  for (int64_t id : {1, 5}) t.mixed->release(id);
  EXPECT_EQ(t.mixed->room().free_slabs, 4);
}

KvMemoryLayout layout(KvQuant q) {
  KvMemoryLayout l;
  l.num_layers = l.total_layers = kLayers;
  l.num_kv_heads = kKv;
  l.head_dim = kD;
  l.quant = q;
  l.dtype = q == KvQuant::none ? torch::kFloat16 : torch::kFloat32;
  l.rounds = true;
  l.model_token_layer_bytes = 2 * kKv * KvBlockPool::row_bytes(kD, l.dtype, q);
  l.kv_salt = static_cast<uint64_t>(q) + 1;
  return l;
}

TEST(MixedKvMemory, FactoryGivesEachPolicyItsFormatAndBudget) {
  KvFormats formats;
  formats.base = layout(KvQuant::none);  // float16
  formats.by_dtype["int8"] = layout(KvQuant::q8_0);
  formats.by_dtype["int4"] = layout(KvQuant::q4_0);
  formats.by_dtype["fp16"] = layout(KvQuant::none);  // another name of the base format
  std::map<std::string, std::map<std::string, std::string>> specs = {
      {"snap16", {{"name", "snapkv"}, {"budget_bytes", "96KiB"}}},
      {"snap8", {{"name", "snapkv"}, {"budget_bytes", "96KiB"}, {"kv_dtype", "int8"}}},
      {"half", {{"name", "snapkv"}, {"budget_bytes", "96KiB"}, {"kv_dtype", "fp16"}}}};
  auto policies = resolve_policies(specs);
  KvPoolSize size;
  size.block_size = 4;
  size.kv_cache_bytes = 8 << 20;
  size.prefix_caching = true;
  auto mem = make_mixed_kv_memory(formats, size, policies);
  ASSERT_EQ(mem->num_formats(), 2u);  // int4 is named by no policy
  EXPECT_EQ(mem->format_of_policy("snap8"), 1u);
  EXPECT_EQ(mem->format_of_policy("half"), 0u);
  EXPECT_EQ(mem->format_of_policy("full"), 0u);
  EXPECT_EQ(mem->format(1).cache().pool().quant(), KvQuant::q8_0);
  EXPECT_TRUE(mem->format(0).prefix_caching() && mem->format(1).prefix_caching());
  // The same bytes keep ~1.9x the tokens in int8 (68 bytes a row of 64 against float16's 128).
  auto scheduled = policies;
  apply_model_layout(scheduled, formats);
  const int64_t t16 = scheduled.at("snap16").budget, t8 = scheduled.at("snap8").budget;
  EXPECT_EQ(t16, (96 << 10) / (2 * kKv * 128 * kLayers));
  EXPECT_EQ(t8, (96 << 10) / (2 * kKv * 68 * kLayers));
  EXPECT_EQ(scheduled.at("half").budget, t16);
  // Sized as the base format's pool: 8 MiB of float16 blocks, rounded down to slabs.
  EXPECT_LE(mem->bytes_total(), 8 << 20);
  EXPECT_GT(mem->bytes_total(), (8 << 20) - mem->slabs()->slab_bytes());
  // A prompt under snap8 keeps its budget's tokens, in int8 blocks.
  torch::manual_seed(2);
  const int64_t n = 300;
  mem->begin_prefill(7, n, "snap8");
  for (int64_t l = 0; l < kLayers; ++l)
    mem->store_prefill(7, l, torch::randn({kH, n, kD}), torch::randn({kKv, n, kD}), torch::randn({kKv, n, kD}));
  mem->end_prefill(7);
  EXPECT_EQ(mem->kept_tokens(7), kLayers * t8);
  EXPECT_EQ(mem->format(1).blocks_used(), kLayers * ((t8 + 3) / 4));
  EXPECT_EQ(mem->format(0).blocks_used(), 0);
  mem->release(7);
  // One format only: the plain memory, passed through.
  std::map<std::string, std::map<std::string, std::string>> plain = {{"snap16", {{"name", "snapkv"}, {"budget", "32"}}}};
  auto one = make_mixed_kv_memory(formats, size, resolve_policies(plain));
  EXPECT_EQ(one->num_formats(), 1u);
  EXPECT_EQ(one->slabs(), nullptr);
  // A name without a layout, and a per-policy dtype where one format is built, fail naming the policy.
  specs["odd"] = {{"name", "snapkv"}, {"budget", "32"}, {"kv_dtype", "int3"}};
  try {
    make_mixed_kv_memory(formats, size, resolve_policies(specs));
    FAIL() << "int3 accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("policy 'odd': kv_dtype 'int3'"), std::string::npos) << e.what();
  }
  try {
    make_kv_memory(formats.base, size, resolve_policies({{"snap8", specs.at("snap8")}}));
    FAIL() << "a per-policy dtype accepted by a single-format memory";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("policy 'snap8': kv_dtype 'int8'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvserve
