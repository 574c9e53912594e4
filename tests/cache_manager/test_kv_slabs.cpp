// KvSlabs: caches of different KV formats (int8 and int4 rows) carve their blocks from one storage a
// slab at a time: their bytes never overlap, every sequence reads back what it stored, exhaustion is
// all-or-nothing, allocations fill the fullest slab, one cache's idle cached blocks make room for the
// other's, and two policy-driven memories on one storage compute what each computes on its own pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "cache_manager/block_allocator.h"
#include "cache_manager/kv_slabs.h"
#include "cache_manager/paged_kv_cache.h"
#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"

namespace kvserve {
namespace {

KvPoolOptions format(KvQuant q, int64_t heads = 3, bool head_blocks = false) {
  KvPoolOptions o;
  o.num_kv_heads = heads;
  o.head_dim = 64;
  o.block_size = 16;
  o.quant = q;
  o.head_blocks = head_blocks;
  return o;
}

TEST(KvSlabs, SlabIsTheFormatsCommonMultiple) {
  // q8_0 rows of 64 values are 68 bytes, q4_0 rows 36: 9 int8 blocks fill what 17 int4 blocks fill.
  const KvPoolOptions i8 = format(KvQuant::q8_0), i4 = format(KvQuant::q4_0);
  EXPECT_EQ(KvSlabs::block_bytes_of(i8), 2 * 3 * 16 * 68);
  EXPECT_EQ(KvSlabs::slab_bytes_of({i8, i4}), 9 * KvSlabs::block_bytes_of(i8));
  EXPECT_EQ(KvSlabs::slab_bytes_of({i8, i4}), 17 * KvSlabs::block_bytes_of(i4));
  // A head-wise cache's block holds one head.
  EXPECT_EQ(KvSlabs::slab_bytes_of({format(KvQuant::q8_0, 3, true), format(KvQuant::q4_0, 3, true)}), 9 * 2 * 16 * 68);
  // float16 beside int8: 17 blocks of 128-byte rows, 32 of 68-byte rows.
  KvPoolOptions f16 = format(KvQuant::none);
  f16.dtype = torch::kFloat16;
  EXPECT_EQ(KvSlabs::slab_bytes_of({f16, i8}), 17 * KvSlabs::block_bytes_of(f16));
  // Sized as the first format's pool would be, rounded down to whole slabs.
  KvPoolOptions sized = i8;
  sized.num_blocks = 40;
  const KvSlabs slabs({sized, i4});
  EXPECT_EQ(slabs.num_slabs(), 4);
  EXPECT_EQ(slabs.storage().numel(), 4 * slabs.slab_bytes());
  EXPECT_EQ(slabs.free_slabs(), 4);
}

TEST(KvSlabs, RefusesFormatsThatShareNoSmallSlab) {
  KvPoolOptions a = format(KvQuant::none), b = format(KvQuant::none);
  b.block_size = 4099;  // 16 and 4099 (a prime) share only 16 x 4099
  try {
    (void)KvSlabs::slab_bytes_of({a, b});
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("share no slab"), std::string::npos) << e.what();
  }
  KvPoolOptions c = format(KvQuant::q4_0);
  c.device = torch::Device(torch::kCUDA, 0);
  EXPECT_THROW((void)KvSlabs::slab_bytes_of({format(KvQuant::q8_0), c}), std::exception);
}

// Which bytes of the storage each used block covers: [first, last) per (allocator, block).
void expect_disjoint(const std::vector<std::pair<const BlockAllocator*, int64_t>>& allocs) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (auto [a, bytes] : allocs) {
    for (int32_t b = 0; b < a->total_blocks(); ++b) {
      if (a->refcount(b) > 0) ranges.emplace_back(int64_t{b} * bytes, int64_t{b + 1} * bytes);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    ASSERT_LE(ranges[i - 1].second, ranges[i].first) << "two used blocks share bytes";
  }
}

TEST(KvSlabs, AllocatorsTakeAndReturnWholeSlabs) {
  auto slabs = std::make_shared<KvSlabs>(3, 6);
  BlockAllocator a(slabs, 2), b(slabs, 3);  // 3-byte and 2-byte blocks
  EXPECT_EQ(a.total_blocks(), 6);
  EXPECT_EQ(b.total_blocks(), 9);
  EXPECT_EQ(a.free_blocks(), 6);
  EXPECT_EQ(a.allocate(), 0);
  EXPECT_EQ(a.allocate(), 1);
  EXPECT_EQ(slabs->holder(0), a.slab_client());
  EXPECT_EQ(b.allocate(), 3);  // slab 1: b's blocks 3, 4, 5
  EXPECT_EQ(slabs->holder(1), b.slab_client());
  EXPECT_EQ(a.free_blocks(), 2);  // slab 2 only
  EXPECT_EQ(b.free_blocks(), 2 + 3);
  // All or nothing: b may have its own 2 free blocks and slab 2's 3, not 6.
  EXPECT_THROW(b.allocate(6), std::exception);
  EXPECT_EQ(b.used_blocks(), 1);
  EXPECT_EQ(slabs->free_slabs(), 1);
  // a's slab goes back when its last block does, and b can then take it.
  a.decref(0);
  EXPECT_EQ(slabs->holder(0), a.slab_client());
  a.decref(1);
  EXPECT_EQ(slabs->holder(0), -1);
  EXPECT_EQ(b.allocate(6).size(), 6u);
  EXPECT_EQ(slabs->free_slabs(), 0);
  EXPECT_THROW(a.allocate(), std::exception);
  a.check_invariants();
  b.check_invariants();
  slabs->check_invariants();
}

TEST(KvSlabs, RandomTrafficOfTwoAllocatorsKeepsBytesApart) {
  auto slabs = std::make_shared<KvSlabs>(8, 6);
  BlockAllocator a(slabs, 2), b(slabs, 3);
  std::mt19937 rng(11);
  std::vector<int32_t> held_a, held_b;
  for (int step = 0; step < 3000; ++step) {
    const bool on_a = rng() % 2;
    BlockAllocator& al = on_a ? a : b;
    std::vector<int32_t>& held = on_a ? held_a : held_b;
    if (rng() % 5 < 3) {
      const int64_t n = 1 + rng() % 4;
      if (n <= al.free_blocks()) {
        for (int32_t x : al.allocate(n)) held.push_back(x);
      } else {
        EXPECT_THROW(al.allocate(n), std::exception);
      }
    } else if (!held.empty()) {
      const size_t i = rng() % held.size();
      if (rng() % 4 == 0) {
        al.incref(held[i]);
        held.push_back(held[i]);
      } else {
        al.decref(held[i]);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    if (step % 50 == 0) {
      a.check_invariants();
      b.check_invariants();
      slabs->check_invariants();
      expect_disjoint({{&a, 3}, {&b, 2}});
    }
  }
  for (int32_t x : held_a) a.decref(x);
  for (int32_t x : held_b) b.decref(x);
  EXPECT_EQ(slabs->free_slabs(), 8);
  a.check_invariants();
  b.check_invariants();
}

// Allocations fill the fullest slab held, so the emptiest drains back to the storage: after blocks
// 4 (slab 1) and 0, 1, 2 (slab 0) are freed, the next block is 4, not 2 (the one freed last), and
// freeing 3 then returns slab 0 for any format to take.
TEST(KvSlabs, AllocationsFillTheFullestSlab) {
  auto slabs = std::make_shared<KvSlabs>(3, 4);
  BlockAllocator a(slabs, 4);
  EXPECT_EQ(a.allocate(8), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  for (int32_t b : {4, 0, 1, 2}) a.decref(b);
  EXPECT_EQ(a.allocate(), 4);
  a.decref(3);
  EXPECT_EQ(slabs->holder(0), -1);
  EXPECT_EQ(slabs->holder(1), a.slab_client());
  // Slab 1 is full again: a new block opens a slab only when no held slab has one free.
  EXPECT_EQ(a.allocate(), 0);  // slab 0 again, the storage's last freed
  EXPECT_EQ(a.allocate(), 1);
  a.check_invariants();
  slabs->check_invariants();
}

// Under churn (one random block freed, one allocated) a pool that once held twice its live blocks
// comes back to about the slabs those need: a held slab that loses blocks gets none back while a
// fuller one has room, so it drains.
TEST(KvSlabs, ChurnDrainsSparseSlabs) {
  constexpr int64_t kPerSlab = 17, kSlabs = 24, kPeak = 20 * kPerSlab, kLive = 10 * kPerSlab;
  auto slabs = std::make_shared<KvSlabs>(kSlabs, kPerSlab);
  BlockAllocator a(slabs, kPerSlab);
  std::mt19937 rng(5);
  std::vector<int32_t> held = a.allocate(kPeak);
  auto free_one = [&] {
    const size_t i = rng() % held.size();
    a.decref(held[i]);
    held[i] = held.back();
    held.pop_back();
  };
  while (static_cast<int64_t>(held.size()) > kLive) free_one();
  const int64_t held_after_frees = kSlabs - slabs->free_slabs();
  for (int step = 0; step < 4000; ++step) {
    free_one();
    held.push_back(a.allocate());
  }
  const int64_t held_after_churn = kSlabs - slabs->free_slabs();
  EXPECT_EQ(held_after_frees, 20);  // random frees leave every slab a few blocks
  EXPECT_LE(held_after_churn, kLive / kPerSlab + 2) << "slabs held after churn (" << kLive << " blocks live)";
  a.check_invariants();
  slabs->check_invariants();
}

// Paged attention of one query per KV head over a sequence's layer, against fp64 attention over what
// gather() reads back (the decoded rows): the kernel reads the blocks through the cache's view.
void expect_attention_over_stored(PagedKvCache& c, int64_t id, int64_t layer, torch::Device device) {
  auto [k, v] = c.gather(id, layer);
  const int64_t kv = k.size(0), d = k.size(2);
  const torch::Tensor q = torch::randn({1, kv, d});
  const torch::Tensor out = c.attend(layer, {id}, q.to(device)).to(torch::kCPU, torch::kDouble);
  const auto kd = k.to(torch::kCPU, torch::kDouble), vd = v.to(torch::kCPU, torch::kDouble);
  const auto scores = torch::matmul(q[0].to(torch::kDouble).unsqueeze(1), kd.transpose(1, 2)) / std::sqrt(double(d));
  const auto ref = torch::matmul(torch::softmax(scores, -1), vd).squeeze(1);  // [KV, D]
  const double err = (out[0] - ref).abs().max().item<double>();
  ASSERT_LE(err, 1e-5) << "sequence " << id << " layer " << layer << " of " << k.size(1) << " tokens";
}

class KvSlabsCaches : public ::testing::TestWithParam<torch::DeviceType> {};

// An int8 cache and an int4 cache on one storage, under random writes, appends and releases: every
// sequence reads back exactly what its own format stores, paged attention reads the same, and the
// storage ends empty.
TEST_P(KvSlabsCaches, TwoFormatsKeepTheirContent) {
  const torch::Device device(GetParam());
  if (device.is_cuda() && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kLayers = 2, kKv = 3, kD = 64;
  KvPoolOptions i8 = format(KvQuant::q8_0), i4 = format(KvQuant::q4_0);
  i8.device = i4.device = device;
  i8.num_blocks = 45;  // 5 slabs
  auto slabs = std::make_shared<KvSlabs>(std::vector<KvPoolOptions>{i8, i4});
  PagedKvCache c8(kLayers, i8, slabs), c4(kLayers, i4, slabs);
  EXPECT_EQ(c8.total_blocks(), 45);
  EXPECT_EQ(c4.total_blocks(), 85);
  torch::manual_seed(3);
  std::mt19937 rng(5);
  // (cache, sequence) -> per layer the K and V it should read back.
  std::map<std::pair<int, int64_t>, std::vector<std::pair<torch::Tensor, torch::Tensor>>> want;
  PagedKvCache* caches[2] = {&c8, &c4};
  int64_t next_id = 1, exhausted = 0;
  for (int step = 0; step < 160; ++step) {
    const int which = static_cast<int>(rng() % 2);
    PagedKvCache& c = *caches[which];
    const int r = static_cast<int>(rng() % 10);
    if (r < 4) {  // a new sequence with a prompt of 1..80 tokens in every layer
      const int64_t n = 1 + rng() % 80, id = next_id++;
      c.add_sequence(id);
      std::vector<std::pair<torch::Tensor, torch::Tensor>> layers;
      try {
        for (int64_t l = 0; l < kLayers; ++l) {
          const torch::Tensor k = torch::randn({kKv, n, kD}), v = torch::randn({kKv, n, kD});
          c.write(id, l, k, v, torch::arange(n).expand({kKv, n}));
          layers.emplace_back(c.round_trip(k), c.round_trip(v));
        }
        want[{which, id}] = layers;
      } catch (const KvError& e) {
        EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
        ++exhausted;
        c.release(id);
      }
    } else if (r < 8) {  // one decode step of every sequence of this cache
      std::vector<int64_t> ids, pos;
      for (auto& [key, layers] : want) {
        if (key.first == which) ids.push_back(key.second), pos.push_back(layers[0].first.size(1));
      }
      if (ids.empty()) continue;
      const auto B = static_cast<int64_t>(ids.size());
      std::vector<std::pair<torch::Tensor, torch::Tensor>> kv;
      for (int64_t l = 0; l < kLayers; ++l) kv.emplace_back(torch::randn({B, kKv, kD}), torch::randn({B, kKv, kD}));
      // A step takes a block per layer for each sequence whose last block is full. One append is
      // all-or-nothing; a step whose later layers would not fit is not started (the engine's
      // admission makes the same check before a step).
      const int64_t per_layer = std::count_if(pos.begin(), pos.end(), [&](int64_t p) { return p % c.block_size() == 0; });
      if (per_layer * kLayers > c.free_blocks()) {
        if (per_layer > c.free_blocks()) {
          EXPECT_THROW(c.append(0, ids, kv[0].first.to(device), kv[0].second.to(device), pos), KvError);
          ASSERT_EQ(c.length(ids[0], 0), pos[0]) << "a failed append changed the cache";
        }
        ++exhausted;
        continue;
      }
      for (int64_t l = 0; l < kLayers; ++l) c.append(l, ids, kv[l].first.to(device), kv[l].second.to(device), pos);
      for (int64_t b = 0; b < B; ++b) {
        auto& layers = want[{which, ids[b]}];
        for (int64_t l = 0; l < kLayers; ++l) {
          layers[l].first = torch::cat({layers[l].first, c.round_trip(kv[l].first[b].unsqueeze(1))}, 1);
          layers[l].second = torch::cat({layers[l].second, c.round_trip(kv[l].second[b].unsqueeze(1))}, 1);
        }
      }
    } else {  // release this cache's oldest sequence
      for (auto it = want.begin(); it != want.end(); ++it) {
        if (it->first.first != which) continue;
        c.release(it->first.second);
        want.erase(it);
        break;
      }
    }
    for (const auto& [key, layers] : want) {
      for (int64_t l = 0; l < kLayers; ++l) {
        auto [k, v] = caches[key.first]->gather(key.second, l);
        ASSERT_TRUE(torch::equal(k.cpu(), layers[l].first.cpu())) << "cache " << key.first << " sequence " << key.second << " layer " << l;
        ASSERT_TRUE(torch::equal(v.cpu(), layers[l].second.cpu())) << "cache " << key.first << " sequence " << key.second << " layer " << l;
      }
      if (step % 8 == 0) expect_attention_over_stored(*caches[key.first], key.second, 1, device);
    }
    c8.check_invariants();
    c4.check_invariants();
    slabs->check_invariants();
  }
  EXPECT_GT(exhausted, 0) << "the traffic never filled the storage";
  for (const auto& [key, layers] : want) caches[key.first]->release(key.second);
  EXPECT_EQ(slabs->free_slabs(), slabs->num_slabs());
  EXPECT_EQ(c8.used_blocks() + c4.used_blocks(), 0);
}

INSTANTIATE_TEST_SUITE_P(Devices, KvSlabsCaches, ::testing::Values(torch::kCPU, torch::kCUDA),
                         [](const auto& info) { return std::string(info.param == torch::kCPU ? "cpu" : "cuda"); });

// Idle prefix-cache blocks of the int8 cache fill the storage; the int4 cache's write takes their
// slabs (the int8 cache reclaims its least recently used entries for it).
TEST(KvSlabs, OneCachesIdleBlocksMakeRoomForTheOther) {
  constexpr int64_t kKv = 3, kD = 64;
  KvPoolOptions i8 = format(KvQuant::q8_0), i4 = format(KvQuant::q4_0);
  i8.num_blocks = 18;  // 2 slabs: 18 int8 blocks or 34 int4 blocks
  auto slabs = std::make_shared<KvSlabs>(std::vector<KvPoolOptions>{i8, i4});
  PagedKvCache c8(1, i8, slabs), c4(1, i4, slabs);
  c8.enable_prefix_cache(7);
  torch::manual_seed(4);
  int32_t parent = -1;
  std::vector<int64_t> tokens(16);
  for (int64_t i = 0; i < 18; ++i) {
    for (int64_t t = 0; t < 16; ++t) tokens[t] = i * 16 + t;
    std::vector<int32_t> blocks = c8.store_blocks(torch::randn({kKv, 16, kD}), torch::randn({kKv, 16, kD}), i * 16);
    parent = c8.prefix_insert(parent, tokens, blocks);
    ASSERT_GE(parent, 0);
    c8.drop(blocks);
  }
  EXPECT_EQ(slabs->free_slabs(), 0);
  EXPECT_EQ(c8.cached_blocks(), 18);
  // 20 int4 blocks need both slabs: every cached int8 block goes.
  c4.add_sequence(1);
  const torch::Tensor k = torch::randn({kKv, 320, kD}), v = torch::randn({kKv, 320, kD});
  c4.write(1, 0, k, v, torch::arange(320).expand({kKv, 320}));
  EXPECT_EQ(c8.cached_blocks(), 0);
  auto [gk, gv] = c4.gather(1, 0);
  EXPECT_TRUE(torch::equal(gk, c4.round_trip(k)));
  EXPECT_TRUE(torch::equal(gv, c4.round_trip(v)));
  // Nothing of the int8 cache is idle now: a prompt that needs more than is free fails cleanly.
  c8.add_sequence(2);
  try {
    c8.write(2, 0, torch::randn({kKv, 300, kD}), torch::randn({kKv, 300, kD}), torch::arange(300).expand({kKv, 300}));
    FAIL() << "no error";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
  }
  c8.release(2);
  c4.release(1);
  c8.check_invariants();
  c4.check_invariants();
  EXPECT_EQ(slabs->free_slabs(), 2);
}

// An int8 memory and an int4 memory on one storage, prompts compressed by SnapKV or kept whole and
// decoded in turns: every attention output and kept position equals that of the same memory on a
// pool of its own (the kernels read the same bytes wherever the blocks lie), and releasing every
// sequence gives every slab back.
TEST(KvSlabs, TwoMemoriesOnOneStorageComputeWhatTheirOwnPoolsDo) {
  constexpr int64_t kLayers = 3, kKv = 2, kH = 4, kD = 64;
  const std::map<std::string, std::map<std::string, std::string>> specs = {
      {"snap", {{"name", "snapkv"}, {"budget", "24"}, {"window", "4"}, {"kernel", "3"}}}};
  KvPoolOptions i8 = format(KvQuant::q8_0, kKv), i4 = format(KvQuant::q4_0, kKv);
  i8.block_size = i4.block_size = 4;
  i8.num_blocks = 9 * 20;  // 20 slabs
  i4.num_blocks = 17 * 20;
  auto slabs = std::make_shared<KvSlabs>(std::vector<KvPoolOptions>{i8, i4});
  PagedKvMemory m8(kLayers, i8, resolve_policies(specs), "full", {}, slabs), m4(kLayers, i4, resolve_policies(specs), "full", {}, slabs);
  PagedKvMemory own8(kLayers, i8, resolve_policies(specs)), own4(kLayers, i4, resolve_policies(specs));
  struct Seq {
    int64_t id, prompt;
    std::string policy;
    bool int8;
  };
  const std::vector<Seq> seqs = {{1, 80, "snap", true}, {2, 60, "full", false}, {3, 40, "full", true}, {4, 90, "snap", false}};
  torch::manual_seed(9);
  for (const Seq& s : seqs) {
    for (PagedKvMemory* m : s.int8 ? std::vector<PagedKvMemory*>{&m8, &own8} : std::vector<PagedKvMemory*>{&m4, &own4}) {
      m->begin_prefill(s.id, s.prompt, s.policy);
    }
    for (int64_t l = 0; l < kLayers; ++l) {
      const auto q = torch::randn({kH, s.prompt, kD}), k = torch::randn({kKv, s.prompt, kD}), v = torch::randn({kKv, s.prompt, kD});
      (s.int8 ? m8 : m4).store_prefill(s.id, l, q, k, v);
      (s.int8 ? own8 : own4).store_prefill(s.id, l, q, k, v);
    }
    (s.int8 ? m8 : m4).end_prefill(s.id);
    (s.int8 ? own8 : own4).end_prefill(s.id);
  }
  EXPECT_GT(m8.blocks_used(), 0);
  EXPECT_GT(m4.blocks_used(), 0);
  std::map<int64_t, int64_t> next;
  for (const Seq& s : seqs) next[s.id] = s.prompt;
  for (int step = 0; step < 6; ++step) {
    for (bool int8 : {true, false}) {
      DecodeBatch batch;
      for (const Seq& s : seqs) {
        if (s.int8 != int8) continue;
        batch.seq_ids.push_back(s.id);
        batch.positions.push_back(next[s.id]++);
      }
      const auto B = static_cast<int64_t>(batch.seq_ids.size());
      PagedKvMemory& shared = int8 ? m8 : m4;
      PagedKvMemory& own = int8 ? own8 : own4;
      shared.begin_decode(batch);
      own.begin_decode(batch);
      for (int64_t l = 0; l < kLayers; ++l) {
        const auto q = torch::randn({B, kH, kD}), k = torch::randn({B, kKv, kD}), v = torch::randn({B, kKv, kD});
        ASSERT_TRUE(torch::equal(shared.decode_attention(l, batch, q, k, v), own.decode_attention(l, batch, q, k, v)))
            << (int8 ? "int8" : "int4") << " step " << step << " layer " << l;
      }
    }
  }
  for (const Seq& s : seqs) {
    const PagedKvMemory& shared = s.int8 ? m8 : m4;
    const PagedKvMemory& own = s.int8 ? own8 : own4;
    for (int64_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(torch::equal(shared.cache().positions(s.id, l), own.cache().positions(s.id, l))) << "sequence " << s.id;
    }
  }
  EXPECT_LT(m8.cached_tokens(1, 0), 80 + 6);  // SnapKV compressed the prompt
  // Each memory counts only its own blocks as used, and their bytes fit the storage together.
  EXPECT_EQ(m8.blocks_used(), own8.blocks_used());
  EXPECT_EQ(m4.blocks_used(), own4.blocks_used());
  EXPECT_LE(m8.blocks_used() * KvSlabs::block_bytes_of(i8) + m4.blocks_used() * KvSlabs::block_bytes_of(i4),
            slabs->num_slabs() * slabs->slab_bytes());
  for (const Seq& s : seqs) (s.int8 ? m8 : m4).release(s.id);
  EXPECT_EQ(slabs->free_slabs(), slabs->num_slabs());
  slabs->check_invariants();
}

}  // namespace
}  // namespace kvserve
