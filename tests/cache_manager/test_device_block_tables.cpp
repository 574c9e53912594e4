// DeviceBlockTables: diffs land where the host put them, last change wins, growth keeps content,
// rows are reused, and one flush is one copy.
#include <gtest/gtest.h>

#include "cache_manager/device_block_tables.h"
#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

using kvserve::DeviceBlockTables;
using kvserve::KvError;

namespace {
std::vector<int32_t> row_of(const DeviceBlockTables& t, int64_t layer, int32_t row, int64_t n) {
  auto r = t.tables(layer)[row].narrow(0, 0, n).to(torch::kCPU).contiguous();
  return std::vector<int32_t>(r.data_ptr<int32_t>(), r.data_ptr<int32_t>() + n);
}
int32_t length_of(const DeviceBlockTables& t, int64_t layer, int32_t row) {
  return t.lengths(layer)[row].item<int32_t>();
}
}  // namespace

TEST(DeviceBlockTables, ChangesLandAndTheLastOneWins) {
  DeviceBlockTables t(3, torch::kCPU);
  const int32_t a = t.add(7), b = t.add(9);
  EXPECT_NE(a, b);
  EXPECT_EQ(t.row(7), a);
  t.set_blocks(a, 1, {5, 6, 7});
  t.set_length(a, 1, 40);
  t.set_block(a, 1, 1, 11);  // overrides the 6 recorded above
  t.set_length(a, 1, 41);
  t.set_blocks(b, 2, {3});
  t.set_length(b, 2, 2);
  EXPECT_TRUE(t.dirty());
  const int64_t before = t.copies();
  t.flush();
  EXPECT_EQ(t.copies(), before + 1);
  EXPECT_FALSE(t.dirty());
  t.flush();  // nothing pending: no copy
  EXPECT_EQ(t.copies(), before + 1);
  EXPECT_EQ(row_of(t, 1, a, 3), (std::vector<int32_t>{5, 11, 7}));
  EXPECT_EQ(length_of(t, 1, a), 41);
  EXPECT_EQ(length_of(t, 0, a), 0);
  EXPECT_EQ(row_of(t, 2, b, 1), (std::vector<int32_t>{3}));
  EXPECT_EQ(length_of(t, 2, b), 2);
}

TEST(DeviceBlockTables, GrowingKeepsEveryTableAndLength) {
  DeviceBlockTables t(2, torch::kCPU);
  std::vector<int32_t> rows;
  for (int64_t s = 0; s < 5; ++s) {
    rows.push_back(t.add(s));
    for (int64_t l = 0; l < 2; ++l) {
      t.set_blocks(rows.back(), l, {static_cast<int32_t>(100 * s + l), static_cast<int32_t>(100 * s + l + 50)});
      t.set_length(rows.back(), l, 17 + s);
    }
  }
  t.flush();
  const int64_t rows_before = t.row_capacity(), blocks_before = t.block_capacity();
  // More sequences and a longer table than the capacities hold.
  for (int64_t s = 5; s < 40; ++s) rows.push_back(t.add(s));
  std::vector<int32_t> long_table(3 * blocks_before);
  for (size_t i = 0; i < long_table.size(); ++i) long_table[i] = static_cast<int32_t>(i);
  t.set_blocks(rows[39], 1, long_table);
  t.flush();
  EXPECT_GT(t.row_capacity(), rows_before);
  EXPECT_GT(t.block_capacity(), blocks_before);
  for (int64_t s = 0; s < 5; ++s) {
    for (int64_t l = 0; l < 2; ++l) {
      EXPECT_EQ(row_of(t, l, rows[s], 2),
                (std::vector<int32_t>{static_cast<int32_t>(100 * s + l), static_cast<int32_t>(100 * s + l + 50)}));
      EXPECT_EQ(length_of(t, l, rows[s]), 17 + s);
    }
  }
  EXPECT_EQ(row_of(t, 1, rows[39], static_cast<int64_t>(long_table.size())), long_table);
}

TEST(DeviceBlockTables, RowsAreReusedWithTheirLengthsCleared) {
  DeviceBlockTables t(1, torch::kCPU);
  const int32_t a = t.add(1);
  t.set_length(a, 0, 99);
  t.flush();
  t.remove(1);
  EXPECT_THROW(t.row(1), KvError);
  EXPECT_THROW(t.remove(1), KvError);
  const int32_t b = t.add(2);
  EXPECT_EQ(a, b);
  t.flush();
  EXPECT_EQ(length_of(t, 0, b), 0);
  EXPECT_THROW(t.add(2), KvError);
}

TEST(DeviceBlockTables, BatchRowsAndPositions) {
  DeviceBlockTables t(1, torch::kCPU);
  for (int64_t s = 0; s < 12; ++s) t.add(s);
  t.set_batch({11, 3, 5}, {1000, 0, 70000});
  t.flush();
  auto r = t.batch_rows(3), p = t.batch_positions(3);
  EXPECT_TRUE(torch::equal(r, torch::tensor({11, 3, 5}, torch::kInt32)));
  EXPECT_TRUE(torch::equal(p, torch::tensor({1000, 0, 70000}, torch::kInt32)));
  EXPECT_THROW(t.set_batch({1}, {-1}), KvError);
  EXPECT_THROW(t.set_batch({1, 2}, {1}), KvError);
}

// The cache keeps the device tables equal to its host tables through every kind of change, and a
// planned decode step costs one copy.
TEST(DeviceBlockTables, PagedCacheMirrorsEveryChangeAndADecodeStepIsOneCopy) {
  kvserve::KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 8;
  o.block_size = 4;
  o.num_blocks = 200;
  kvserve::PagedKvCache c(3, o);
  for (int64_t id : {1, 2, 3}) c.add_sequence(id);
  for (int64_t l = 0; l < 3; ++l) {
    for (int64_t id : {1, 2, 3}) {
      const int64_t n = 5 * id + l;
      c.write(id, l, torch::randn({2, n, 8}), torch::randn({2, n, 8}),
              torch::arange(n, torch::kLong).unsqueeze(0).expand({2, n}).contiguous());
    }
  }
  c.check_invariants();
  c.compact(2, 1, torch::tensor({0, 2, 4}, torch::kLong).unsqueeze(0).expand({2, 3}).contiguous());
  c.release(3);
  c.add_sequence(4);  // reuses sequence 3's row
  c.check_invariants();
  std::vector<int64_t> pos = {5, 10};
  for (int step = 0; step < 9; ++step) {
    const int64_t copies = c.device_tables().copies();
    c.begin_decode({1, 2}, pos);
    EXPECT_EQ(c.device_tables().copies(), copies + 1);
    for (int64_t l = 0; l < 3; ++l) {
      EXPECT_TRUE(c.decode_planned({1, 2}, l));
      auto out = c.decode_layer(l, torch::randn({2, 4, 8}), torch::randn({2, 2, 8}), torch::randn({2, 2, 8}));
      EXPECT_FALSE(c.decode_planned({1, 2}, l));
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 8}));
    }
    EXPECT_EQ(c.device_tables().copies(), copies + 1) << "the layer loop copied tables";
    EXPECT_THROW(c.decode_layer(0, torch::randn({2, 4, 8}), torch::randn({2, 2, 8}), torch::randn({2, 2, 8})), KvError);
    for (auto& p : pos) ++p;
    c.check_invariants();
  }
  EXPECT_EQ(c.length(1, 0), 5 + 9);
  EXPECT_EQ(c.length(2, 1), 3 + 9);
  EXPECT_EQ(c.positions(2, 1)[0][-1].item<int64_t>(), 18);
  // A sequence may repeat only in consecutive rows at consecutive positions (a speculative step).
  EXPECT_THROW(c.begin_decode({1, 2, 1}, {14, 12, 15}), KvError);
  EXPECT_THROW(c.begin_decode({1, 1}, {14, 16}), KvError);
  EXPECT_THROW(c.begin_decode({1, 99}, {1, 2}), KvError);
}

// On a GPU: the same changes land in CUDA tables (pinned copy, device scatter), and a cache on a
// CUDA pool decodes like one on the CPU (the CUDA kernels read those tables).
TEST(DeviceBlockTables, OnTheDeviceAsOnTheHost) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBlockTables cpu(2, torch::kCPU), gpu(2, torch::Device(torch::kCUDA));
  for (DeviceBlockTables* t : {&cpu, &gpu}) {
    for (int64_t s = 0; s < 20; ++s) {
      const int32_t r = t->add(s);
      std::vector<int32_t> blocks;
      for (int64_t i = 0; i <= s * 3; ++i) blocks.push_back(static_cast<int32_t>(1000 * s + i));
      t->set_blocks(r, s % 2, blocks);
      t->set_length(r, s % 2, 7 * s);
    }
    t->set_batch({3, 1, 4}, {15, 9, 26});
    t->flush();
  }
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_TRUE(torch::equal(cpu.tables(l), gpu.tables(l).cpu()));
    EXPECT_TRUE(torch::equal(cpu.lengths(l), gpu.lengths(l).cpu()));
  }
  EXPECT_TRUE(torch::equal(cpu.batch_positions(3), gpu.batch_positions(3).cpu()));

  kvserve::KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.block_size = 16;
  o.num_blocks = 256;
  kvserve::KvPoolOptions og = o;
  og.device = torch::Device(torch::kCUDA);
  kvserve::PagedKvCache hc(2, o), dc(2, og);
  torch::manual_seed(3);
  for (kvserve::PagedKvCache* c : {&hc, &dc}) {
    for (int64_t id : {1, 2, 3}) c->add_sequence(id);
  }
  for (int64_t id : {1, 2, 3}) {
    for (int64_t l = 0; l < 2; ++l) {
      const int64_t n = 40 * id + 13 * l;
      auto k = torch::randn({2, n, 64}), v = torch::randn({2, n, 64});
      auto pos = torch::arange(n, torch::kLong).unsqueeze(0).expand({2, n}).contiguous();
      hc.write(id, l, k, v, pos);
      dc.write(id, l, k, v, pos);
    }
  }
  std::vector<int64_t> ids = {3, 1, 2}, pos = {200, 100, 150};
  for (int step = 0; step < 20; ++step) {
    hc.begin_decode(ids, pos);
    dc.begin_decode(ids, pos);
    for (int64_t l = 0; l < 2; ++l) {
      auto q = torch::randn({3, 8, 64}), k = torch::randn({3, 2, 64}), v = torch::randn({3, 2, 64});
      auto want = hc.decode_layer(l, q, k, v);
      auto got = dc.decode_layer(l, q.cuda(), k.cuda(), v.cuda()).cpu();
      EXPECT_LE((want - got).abs().max().item<double>(), 1e-4) << "step " << step << " layer " << l;
    }
    for (auto& p : pos) ++p;
  }
  dc.check_invariants();
}
