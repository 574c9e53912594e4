// Quantized KV rows (cache_manager/kv_quant.h): byte for byte gguf's q8_0 / q4_0 / q4_1 (the fixture
// tools/make_kv_quant_reference.py writes with the `gguf` package), and a quantized pool through
// every PagedKvCache path: write, extend, append, compact, shared blocks, the host tier, capacity.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "backend/model/safetensors_file.h"
#include "cache_manager/host_kv_tier.h"
#include "cache_manager/kv_quant.h"
#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

const char* kFixture = KVSERVE_SOURCE_DIR "/tests/cache_manager/data/kv_quant_reference.safetensors";

torch::Tensor tensor_of(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsEntry& e = f.at(name);
  const auto dtype = e.dtype == "F32" ? torch::kFloat32 : torch::kUInt8;
  torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(dtype));
  EXPECT_EQ(static_cast<size_t>(t.nbytes()), e.nbytes) << name;
  std::memcpy(t.data_ptr(), e.data, e.nbytes);
  return t;
}

class KvQuantFormat : public ::testing::TestWithParam<KvQuant> {};

TEST_P(KvQuantFormat, EncodesAsGguf) {
  const KvQuant q = GetParam();
  const SafetensorsFile f(kFixture);
  const torch::Tensor x = tensor_of(f, "x");
  const torch::Tensor want = tensor_of(f, kv_quant_name(q));
  const torch::Tensor got = kv_quant_encode(x, q);
  ASSERT_EQ(got.sizes(), want.sizes());
  const torch::Tensor diff = (got != want).nonzero();
  EXPECT_EQ(diff.size(0), 0) << "first differing (row, byte): " << (diff.size(0) ? diff[0] : diff);
  // Decoding gguf's bytes gives gguf's values (up to a fused multiply-add's last bit).
  const torch::Tensor dec = kv_quant_decode(want, q, x.size(1));
  const torch::Tensor ref = tensor_of(f, std::string(kv_quant_name(q)) + ".decoded");
  EXPECT_TRUE(torch::allclose(dec, ref, 1e-6, 1e-6)) << (dec - ref).abs().max();
}

TEST_P(KvQuantFormat, RoundTripErrorWithinHalfAStep) {
  const KvQuant q = GetParam();
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({50, 4, 128}) * 3;
  const torch::Tensor rows = kv_quant_encode(x, q);
  EXPECT_EQ(rows.size(2), kv_quant_row_bytes(q, 128));
  const torch::Tensor y = kv_quant_decode(rows, q, 128);
  const torch::Tensor g = x.view({50, 4, 4, 32});
  const torch::Tensor amax = g.abs().amax(-1, true), range = g.amax(-1, true) - g.amin(-1, true);
  // The step of each group (and a little for the fp16-rounded scale).
  const torch::Tensor step = q == KvQuant::q8_0 ? amax / 127 : q == KvQuant::q4_0 ? amax / 8 : range / 15;
  const torch::Tensor err = (y.view({50, 4, 4, 32}) - g).abs();
  // Half a step, or a whole one for q4_0 (its +8.5 truncation misses by one at the positive end),
  // plus the scale's (and q4_1's minimum's) rounding to fp16: 2^-11 relative, up to 127 steps away.
  const double slack = q == KvQuant::q4_0 ? 1.0 : 0.5;
  EXPECT_TRUE((err <= step * slack + amax * (128.0 / 2048)).all().item<bool>()) << (err / step).max();
  EXPECT_TRUE((err <= step * slack + amax * (1.0 / 2048) * (q == KvQuant::q8_0 ? 127 : 16)).all().item<bool>());
}

// fp8_e4m3 rows: per group of 32, d = amax / 448 (stored in fp16) and each x / d rounded by torch's own
// float8_e4m3fn conversion; decoding gives the e4m3 value times the stored scale.
TEST(KvQuant, Fp8RowsEqualTorchsFloat8Conversion) {
  torch::manual_seed(11);
  torch::Tensor x = torch::randn({40, 3, 128}) * 2;
  x.select(2, 7).mul_(60.0f);  // an outlier channel
  x[0].zero_();                // a zero row: scale 0, every byte 0
  const torch::Tensor rows = kv_quant_encode(x, KvQuant::fp8_e4m3);
  ASSERT_EQ(rows.size(-1), 128 + 4 * 2);
  const torch::Tensor g = x.view({40, 3, 4, 32});
  const torch::Tensor d = g.abs().amax(-1, true) / 448.0f;
  const torch::Tensor id = torch::where(d != 0, 1.0f / d, torch::zeros_like(d));
  const torch::Tensor q = (g * id).to(torch::kFloat8_e4m3fn);
  const torch::Tensor want_q = q.view(torch::kUInt8).reshape({40, 3, 128});
  const torch::Tensor want_d = d.to(torch::kHalf).contiguous().view(torch::kUInt8).reshape({40, 3, 8});
  EXPECT_TRUE(torch::equal(rows.narrow(2, 0, 128), want_q)) << "e4m3 bytes differ from torch's";
  EXPECT_TRUE(torch::equal(rows.narrow(2, 128, 8), want_d)) << "scales differ";
  const torch::Tensor dec = kv_quant_decode(rows, KvQuant::fp8_e4m3, 128);
  const torch::Tensor want = (q.to(torch::kFloat32) * d.to(torch::kHalf).to(torch::kFloat32)).reshape({40, 3, 128});
  EXPECT_TRUE(torch::equal(dec, want)) << (dec - want).abs().max();
  // e4m3 keeps 3 mantissa bits: every value within 2^-4 of its own magnitude (plus the scale's fp16 rounding).
  EXPECT_TRUE(((dec - x).abs() <= x.abs() / 16 + g.abs().amax(-1, true).expand({40, 3, 4, 32}).reshape({40, 3, 128}) *
                                                      (1.0 / 1024))
                  .all()
                  .item<bool>());
}

// The rotation is orthonormal and its own inverse, group by group.
TEST(KvQuant, RotationIsAnOrthonormalInvolution) {
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({7, 3, 96}, torch::kFloat64).to(torch::kFloat32);
  const torch::Tensor r = kv_quant_rotate(x);
  EXPECT_TRUE(torch::allclose(kv_quant_rotate(r), x, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(r.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
  // Groups stay apart: a change in channel 40 (group 1) moves channels 32..63 only.
  torch::Tensor y = x.clone();
  y[0][0][40] += 1;
  const torch::Tensor d = (kv_quant_rotate(y) - r)[0][0].abs() > 1e-6;
  EXPECT_EQ(d.narrow(0, 32, 32).sum().item<int64_t>(), 32);
  EXPECT_EQ(d.sum().item<int64_t>(), 32);
  // An outlier channel is spread over its group: 32x less peak.
  torch::Tensor spike = torch::zeros({1, 32});
  spike[0][3] = 32;
  EXPECT_NEAR(kv_quant_rotate(spike).abs().max().item<float>(), 32 / std::sqrt(32.0f), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Formats, KvQuantFormat, ::testing::Values(KvQuant::q8_0, KvQuant::q4_0, KvQuant::q4_1),
                         [](const auto& info) { return std::string(kv_quant_name(info.param)); });

TEST(KvQuant, RefusesHeadDimsNotInGroupsOf32) {
  EXPECT_THROW(kv_quant_encode(torch::randn({2, 48}), KvQuant::q8_0), KvError);
  KvPoolOptions o;
  o.num_kv_heads = 1;
  o.head_dim = 48;
  o.num_blocks = 4;
  o.quant = KvQuant::q4_0;
  try {
    KvBlockPool pool(o);
    FAIL() << "a head_dim of 48 was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim is 48"), std::string::npos) << e.what();
  }
}

// The acceptance row: in the same bytes a pool holds >= 1.85x (int8) and >= 3.2x (int4) the tokens of
// float16 (head_dim 64, the default model's, and 128).
TEST(KvQuant, PoolCapacityAgainstFloat16) {
  for (int64_t d : {64, 128}) {
    KvPoolOptions o;
    o.num_kv_heads = 3;
    o.head_dim = d;
    o.kv_cache_bytes = int64_t{64} << 20;
    o.dtype = torch::kFloat16;
    const int64_t f16 = KvBlockPool(o).num_blocks();
    o.dtype = torch::kFloat32;
    o.quant = KvQuant::q8_0;
    const KvBlockPool i8(o);
    o.quant = KvQuant::q4_0;
    const KvBlockPool i4(o);
    EXPECT_GE(static_cast<double>(i8.num_blocks()) / f16, 1.85) << d;
    EXPECT_GE(static_cast<double>(i4.num_blocks()) / f16, 3.2) << d;
    EXPECT_LE(i8.total_bytes(), o.kv_cache_bytes);
    EXPECT_LE(i4.total_bytes(), o.kv_cache_bytes);
    EXPECT_EQ(i8.storage().scalar_type(), torch::kUInt8);
  }
}

// Every write path stores the encoded rows; reads decode them; compaction and copies move rows as bytes.
class QuantCache : public ::testing::TestWithParam<std::pair<KvQuant, bool>> {
 protected:
  static constexpr int64_t kKv = 2, kD = 64, kBs = 16;
  PagedKvCache make(int64_t blocks) const {
    KvPoolOptions o;
    o.num_kv_heads = kKv;
    o.head_dim = kD;
    o.block_size = kBs;
    o.num_blocks = blocks;
    o.quant = GetParam().first;
    o.head_blocks = GetParam().second;
    return PagedKvCache(3, o);
  }
  // What a read gives back: the row (rotated where the pool rotates) encoded, decoded, rotated back.
  torch::Tensor stored(const torch::Tensor& x) const {
    const KvQuant q = GetParam().first;
    if (!kv_quant_rotation_enabled()) return kv_quant_decode(kv_quant_encode(x, q), q, kD);
    return kv_quant_rotate(kv_quant_decode(kv_quant_encode(kv_quant_rotate(x), q), q, kD));
  }
};

TEST_P(QuantCache, WriteExtendAppendCompactGather) {
  torch::manual_seed(5);
  PagedKvCache cache = make(64);
  cache.add_sequence(1);
  const torch::Tensor k = torch::randn({kKv, 37, kD}), v = torch::randn({kKv, 37, kD});
  cache.write(1, 0, k.narrow(1, 0, 20), v.narrow(1, 0, 20), torch::arange(20).expand({kKv, 20}));
  cache.extend(1, 0, k.narrow(1, 20, 16), v.narrow(1, 20, 16), torch::arange(20, 36).expand({kKv, 16}));
  cache.append(0, {1}, k.narrow(1, 36, 1).transpose(0, 1), v.narrow(1, 36, 1).transpose(0, 1), {36});
  auto [gk, gv] = cache.gather(1, 0);
  EXPECT_EQ(gk.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(gk, stored(k)));
  EXPECT_TRUE(torch::equal(gv, stored(v)));
  // Keep every third slot, reversed per head: the rows move as they are (no re-quantization).
  const torch::Tensor keep = torch::arange(36, -1, -3).expand({kKv, 13}).contiguous();
  cache.compact(1, 0, keep);
  auto [ck, cv] = cache.gather(1, 0);
  EXPECT_TRUE(torch::equal(ck, stored(k).index_select(1, keep[0])));
  EXPECT_TRUE(torch::equal(cv, stored(v).index_select(1, keep[0])));
  EXPECT_TRUE(torch::equal(cache.positions(1, 0)[0], keep[0]));
  // A snapshot copies the partly filled last block (as bytes); the copy reads the same.
  const auto tables = cache.snapshot(1);
  cache.add_sequence(2);
  cache.adopt(2, tables);
  auto [ak, av] = cache.gather(2, 0);
  EXPECT_TRUE(torch::equal(ak, ck));
  EXPECT_TRUE(torch::equal(av, cv));
  for (auto t : tables) cache.drop(t.blocks);
  cache.release(1);
  cache.release(2);
  cache.check_invariants();
  EXPECT_EQ(cache.used_blocks(), 0);
}

TEST_P(QuantCache, HostTierMovesBlocksAsBytes) {
  torch::manual_seed(6);
  PagedKvCache cache = make(64);
  const int64_t lanes = cache.lanes();
  const torch::Tensor k = torch::randn({kKv, kBs, kD}), v = torch::randn({kKv, kBs, kD});
  std::vector<int32_t> blocks = cache.store_blocks(k, v, 0);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), lanes);
  HostKvTier tier(cache.pool(), lanes, cache.pool().block_bytes() * lanes * 2);
  const int32_t slot = tier.store(blocks);
  const torch::Tensor before = cache.pool().storage().index_select(0, torch::tensor(std::vector<int64_t>(blocks.begin(), blocks.end())));
  cache.pool().storage().index_fill_(0, torch::tensor(std::vector<int64_t>(blocks.begin(), blocks.end())), 0);
  tier.load(slot, blocks);
  const torch::Tensor after = cache.pool().storage().index_select(0, torch::tensor(std::vector<int64_t>(blocks.begin(), blocks.end())));
  EXPECT_TRUE(torch::equal(before, after));
  cache.drop(blocks);
}

INSTANTIATE_TEST_SUITE_P(Layouts, QuantCache,
                         ::testing::Values(std::make_pair(KvQuant::q8_0, false), std::make_pair(KvQuant::q4_0, false),
                                           std::make_pair(KvQuant::q4_1, false), std::make_pair(KvQuant::q8_0, true),
                                           std::make_pair(KvQuant::q4_0, true), std::make_pair(KvQuant::fp8_e4m3, false),
                                           std::make_pair(KvQuant::fp8_e4m3, true)),
                         [](const auto& info) {
                           return std::string(kv_quant_name(info.param.first)) + (info.param.second ? "_head" : "_layer");
                         });

}  // namespace
}  // namespace kvserve
