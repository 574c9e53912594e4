// The fused elementwise ops on the CPU (backend/kernels/fused_ops_cpu.h, reached through backend/kernels/fused_ops.h):
// each against the torch op chain it replaces (the same call at CPU level 0) and against fp64, for
// fp32, bf16 and fp16, odd widths, one and many rows (the threaded path), strided views and the
// rope scalings' tables. Level 1 must give the chain's bits; level 2 the chain's values up to the
// order of RMSNorm's sum and SiLU's exp; layouts the loops do not take the chain itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "backend/kernels/fused_ops.h"
#include "backend/model/rope.h"

namespace kvserve {
namespace {

// KVSERVE_FUSED_OPS_CPU=0 in the environment would leave the loops off; this binary tests them, so
// it turns them on before any op reads the switch.
const bool kLoopsOn = [] { return setenv("KVSERVE_FUSED_OPS_CPU", "2", 1) == 0; }();

const std::vector<torch::ScalarType> kDtypes = {torch::kFloat32, torch::kBFloat16, torch::kFloat16};

// fn() with the CPU ops at `level`, then the process's level again.
template <typename F> auto at_cpu_level(int level, F fn) {
  const int was = fused::cpu_level();
  fused::set_cpu_level(level);
  auto out = fn();
  fused::set_cpu_level(was);
  return out;
}

// Each 16-bit value's place on the number line, so that neighbours differ by 1 (-0 and +0 meet at 0).
torch::Tensor ordinal16(const torch::Tensor& t) {
  auto bits = t.contiguous().view(torch::kInt16).to(torch::kInt32);
  auto mag = bits.bitwise_and(0x7FFF);
  return torch::where(bits.lt(0), -mag, mag);
}

// How two tensors of a dtype differ: the largest gap (units in the last place of a 16-bit dtype; a
// relative error with floor 1e-30 for fp32) and the share of elements that are bit for bit equal.
// NaNs must sit at the same places (they count as equal).
struct Gap {
  double max = 0;
  double equal_share = 1;
};
Gap gap(const torch::Tensor& got, const torch::Tensor& want) {
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_EQ(got.scalar_type(), want.scalar_type());
  auto g = got.contiguous(), w = want.contiguous();
  auto nan_g = g.isnan(), nan_w = w.isnan();
  EXPECT_TRUE(torch::equal(nan_g, nan_w)) << "NaNs at other places";
  auto same = torch::logical_or(g.eq(w), torch::logical_and(nan_g, nan_w));
  Gap out;
  if (g.numel() == 0) return out;
  out.equal_share = same.to(torch::kFloat64).mean().item<double>();
  auto live = torch::logical_not(nan_w);
  if (g.scalar_type() == torch::kFloat32) {
    auto gd = g.to(torch::kFloat64), wd = w.to(torch::kFloat64);
    auto rel = ((gd - wd).abs() / (wd.abs() + 1e-30)).masked_fill(torch::logical_not(live), 0).masked_fill(same, 0);
    out.max = rel.max().item<double>();
  } else {
    out.max = (ordinal16(g) - ordinal16(w)).abs().masked_fill(torch::logical_not(live), 0).max().item<double>();
  }
  return out;
}

// max |a - b| / (|b| + floor) against an fp64 reference.
double rel_err(const torch::Tensor& a, const torch::Tensor& ref, double floor) {
  return ((a.to(torch::kFloat64) - ref).abs() / (ref.abs() + floor)).max().item<double>();
}

// The dtype's relative rounding step.
double eps_of(torch::ScalarType t) { return t == torch::kFloat32 ? 6e-8 : t == torch::kBFloat16 ? 1.0 / 128 : 1.0 / 1024; }
// How far an op may land from fp64: a few roundings of a 16-bit dtype; fp32 also carries the sum of
// squares' rounding (the chain lands as far, ~2e-7).
double fp64_tol(torch::ScalarType t) { return t == torch::kFloat32 ? 1e-6 : 3 * eps_of(t); }

std::string name(torch::ScalarType t, int64_t a, int64_t b) {
  return std::string(c10::toString(t)) + " " + std::to_string(a) + "x" + std::to_string(b);
}

torch::Tensor norm_ref(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto xd = x.to(torch::kFloat64);
  return w.to(torch::kFloat64) * (xd * torch::rsqrt(xd.pow(2).mean(-1, true) + eps));
}

// Level 2's norm differs from the chain's only by the fp32 sum of squares, added in another order:
// fp32 by a few ulps, a 16-bit dtype where that moves a rounding of x r or w y by one (rarely two:
// one step of y times w) units in the last place, and almost everywhere not at all.
void expect_norm_close(const torch::Tensor& got, const torch::Tensor& chain, torch::ScalarType dt, const std::string& where) {
  const Gap g = gap(got, chain);
  if (dt == torch::kFloat32) {
    EXPECT_LE(g.max, 1e-6) << where;
  } else {
    EXPECT_LE(g.max, 2) << where;
    EXPECT_GE(g.equal_share, 0.995) << where;
  }
}

TEST(FusedOpsCpu, RmsNormMatchesTheChainAndFp64) {
  ASSERT_TRUE(kLoopsOn);
  torch::manual_seed(11);
  for (auto dt : kDtypes) {
    // 300 rows of 577 and 64 of 4096 run threaded; 577 and 7 leave a partial vector at each row's end.
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 576}, {8, 576}, {1, 577}, {300, 577}, {5, 64}, {1, 4096}, {64, 4096}, {3, 7}, {2, 1}}) {
      auto x = (torch::randn({rows, cols}) * 3).to(dt);
      auto w = (torch::rand({cols}) + 0.5).to(dt);
      const std::string where = name(dt, rows, cols);
      auto exact = at_cpu_level(1, [&] { return fused::rms_norm(x, w, 1e-5); });
      auto got = at_cpu_level(2, [&] { return fused::rms_norm(x, w, 1e-5); });
      auto chain = at_cpu_level(0, [&] { return fused::rms_norm(x, w, 1e-5); });
      ASSERT_TRUE(exact.is_contiguous() && got.is_contiguous()) << where;
      EXPECT_TRUE(torch::equal(exact, chain)) << where;
      expect_norm_close(got, chain, dt, where);
      EXPECT_LE(rel_err(got, norm_ref(x, w, 1e-5), 1e-2), fp64_tol(dt)) << where;
      // Rows at a wider stride (a narrow of a wider activation) and a 3-D batch give the same rows.
      auto wide = torch::zeros({rows, cols + 5}, x.options());
      wide.narrow(1, 3, cols).copy_(x);
      auto x3 = x.view({1, rows, cols});
      for (int level : {1, 2}) {
        const auto& want = level == 1 ? exact : got;
        EXPECT_TRUE(torch::equal(at_cpu_level(level, [&] { return fused::rms_norm(wide.narrow(1, 3, cols), w, 1e-5); }), want))
            << where << " level " << level;
        EXPECT_TRUE(torch::equal(at_cpu_level(level, [&] { return fused::rms_norm(x3, w, 1e-5); }), want.view({1, rows, cols})))
            << where << " level " << level;
      }
    }
  }
}

TEST(FusedOpsCpu, RmsNormKeepsTheChainForWhatTheLoopsDoNotTake) {
  torch::manual_seed(12);
  auto x = torch::randn({6, 40});
  auto w = torch::rand({40}) + 0.5;
  auto chain = [](const torch::Tensor& x, const torch::Tensor& w) {
    return w * (x.to(torch::kFloat32) * torch::rsqrt(x.to(torch::kFloat32).pow(2).mean(-1, true) + 1e-6)).to(x.scalar_type());
  };
  // Column-strided rows (a transpose), fp64, a weight of another dtype: the chain itself, bit for bit.
  auto xt = torch::randn({40, 6}).t();
  auto xd = x.to(torch::kFloat64), wd = w.to(torch::kFloat64);
  auto xb = x.to(torch::kBFloat16);
  for (int level : {1, 2}) {
    EXPECT_TRUE(torch::equal(at_cpu_level(level, [&] { return fused::rms_norm(xt, w, 1e-6); }), chain(xt, w)));
    EXPECT_TRUE(torch::equal(at_cpu_level(level, [&] { return fused::rms_norm(xd, wd, 1e-6); }), chain(xd, wd)));
    EXPECT_TRUE(torch::equal(at_cpu_level(level, [&] { return fused::rms_norm(xb, w, 1e-6); }), chain(xb, w)));
    // No rows at all.
    EXPECT_EQ(at_cpu_level(level, [&] { return fused::rms_norm(torch::zeros({0, 40}), w, 1e-6); }).sizes(),
              torch::IntArrayRef({0, 40}));
  }
}

TEST(FusedOpsCpu, AddRmsNormWritesTheSumAndNormalisesIt) {
  torch::manual_seed(13);
  for (auto dt : kDtypes) {
    for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 576}, {8, 576}, {3, 577}, {200, 577}, {2, 4096}}) {
      auto x = torch::randn({rows, cols}).to(dt);
      // The delta is a view, as an attention output's rows in a wider buffer are.
      auto delta = torch::randn({rows, cols + 9}).to(dt).narrow(1, 4, cols);
      auto w = (torch::rand({cols}) + 0.5).to(dt);
      const std::string where = name(dt, rows, cols);
      auto [esum, enormed] = at_cpu_level(1, [&] { return fused::add_rms_norm(x, delta, w, 1e-6); });
      auto [sum, normed] = at_cpu_level(2, [&] { return fused::add_rms_norm(x, delta, w, 1e-6); });
      auto [csum, cnormed] = at_cpu_level(0, [&] { return fused::add_rms_norm(x, delta, w, 1e-6); });
      // The sum is the dtype's own add, bit for bit; the norm is rms_norm's of it.
      EXPECT_TRUE(torch::equal(esum, csum)) << where;
      EXPECT_TRUE(torch::equal(enormed, cnormed)) << where;
      EXPECT_TRUE(torch::equal(sum, csum)) << where;
      expect_norm_close(normed, cnormed, dt, where);
      EXPECT_TRUE(torch::equal(normed, at_cpu_level(2, [&] { return fused::rms_norm(x + delta, w, 1e-6); }))) << where;
      EXPECT_LE(rel_err(normed, norm_ref(x + delta, w, 1e-6), 1e-2), fp64_tol(dt)) << where;
    }
  }
}

// Tables of each rope scaling the model supports, for positions of a decode step and of a prefill
// past the length-dependent scalings' thresholds.
struct RopeCase {
  std::string name;
  ModelConfig config;
};
std::vector<RopeCase> rope_cases(int64_t D) {
  ModelConfig base;
  base.head_dim = D;
  base.rope_theta = 10000.0;
  base.max_position_embeddings = 64;
  std::vector<RopeCase> out{{"default", base}};
  auto with = [&](const std::string& n, RopeScaling::Kind kind, double factor, double attention) {
    ModelConfig c = base;
    c.rope_scaling.kind = kind;
    c.rope_scaling.factor = factor;
    c.rope_scaling.attention_factor = attention;
    c.rope_scaling.original_max_position_embeddings = 32;
    if (kind == RopeScaling::Kind::kLongRope) {
      for (int64_t i = 0; i < D / 2; ++i) {
        c.rope_scaling.short_factor.push_back(1.0 + 0.01 * static_cast<double>(i));
        c.rope_scaling.long_factor.push_back(1.5 + 0.2 * static_cast<double>(i));
      }
    }
    out.push_back({n, c});
  };
  with("linear", RopeScaling::Kind::kLinear, 2.0, 1.0);
  with("llama3", RopeScaling::Kind::kLlama3, 8.0, 1.0);
  with("yarn", RopeScaling::Kind::kYarn, 4.0, 1.1386);
  with("dynamic", RopeScaling::Kind::kDynamic, 2.0, 1.0);
  with("longrope", RopeScaling::Kind::kLongRope, 4.0, 1.19);
  return out;
}

TEST(FusedOpsCpu, RopeQkvEqualsTheChainForEveryScaling) {
  torch::manual_seed(14);
  for (auto dt : kDtypes) {
    // {9, 3, 64}: SmolLM2; {2, 2, 72}: a half (36) that is no whole number of vectors; {3, 1, 6}: 3.
    for (auto [H, KV, D] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {9, 3, 64}, {32, 8, 128}, {2, 2, 72}, {4, 2, 8}, {3, 1, 6}}) {
      for (const RopeCase& rc : rope_cases(D)) {
        Rope rope(rc.config, torch::kCPU);
        // A decode batch (scattered positions) and a 100-token prefill (past every threshold, so
        // dynamic and longrope use their own frequencies; many rows: the threaded path).
        const std::vector<int64_t> positions{0, 5, 63, 70, 200, 1};
        const std::vector<std::pair<std::string, RopeAngles>> tables{
            {"decode", rope.angles(torch::tensor(positions), 201, dt)},
            {"prefill", rope.prefill_angles(torch::arange(100), {0}, {100}, dt)}};
        for (const auto& [kind, a] : tables) {
          const int64_t N = a.cos.size(0);
          // A projection with a bias column block past the heads: rows at a wider stride.
          auto wide = (torch::randn({N, (H + 2 * KV) * D + 8}) * 2).to(dt);
          auto qkv = wide.narrow(1, 0, (H + 2 * KV) * D);
          const std::string where = std::string(c10::toString(dt)) + " " + rc.name + " " + kind + " H" + std::to_string(H) +
                                    " D" + std::to_string(D);
          auto [q, k, v] = at_cpu_level(1, [&] { return fused::rope_qkv(qkv, a, H, KV, D); });
          auto [cq, ck, cv] = at_cpu_level(0, [&] { return fused::rope_qkv(qkv, a, H, KV, D); });
          ASSERT_TRUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous()) << where;
          auto [q2, k2, v2] = at_cpu_level(2, [&] { return fused::rope_qkv(qkv, a, H, KV, D); });
          EXPECT_TRUE(torch::equal(q2, q) && torch::equal(k2, k) && torch::equal(v2, v)) << where;
          // The same three roundings as the chain, none fused: equal.
          EXPECT_TRUE(torch::equal(q, cq)) << where;
          EXPECT_TRUE(torch::equal(k, ck)) << where;
          EXPECT_TRUE(torch::equal(v, cv)) << where;
          // fp64: x cos + rotate_half(x) sin.
          auto xd = qkv.narrow(1, H * D, KV * D).view({N, KV, D}).to(torch::kFloat64);
          auto cd = a.cos.to(torch::kFloat64), sd = a.sin.to(torch::kFloat64);
          auto rot = torch::cat({-xd.narrow(-1, D / 2, D / 2), xd.narrow(-1, 0, D / 2)}, -1);
          EXPECT_LE((k.to(torch::kFloat64) - (xd * cd + rot * sd)).abs().max().item<double>(), 16 * eps_of(dt) * 4)
              << where;
        }
      }
    }
  }
}

TEST(FusedOpsCpu, RopeQkvKeepsTheChainForWhatTheLoopsDoNotTake) {
  torch::manual_seed(15);
  const int64_t N = 3, H = 2, KV = 1, D = 8;
  auto qkv = torch::randn({N, (H + 2 * KV) * D});
  auto theta = torch::rand({N, 1, D});
  // Angles of one row broadcast over all (the chain broadcasts; the loops want a row each), angles
  // of another dtype: the chain, bit for bit.
  for (const RopeAngles& a : {RopeAngles{torch::cos(theta[0]).unsqueeze(0), torch::sin(theta[0]).unsqueeze(0)},
                              RopeAngles{torch::cos(theta).to(torch::kFloat64), torch::sin(theta).to(torch::kFloat64)}}) {
    auto [q, k, v] = at_cpu_level(2, [&] { return fused::rope_qkv(qkv, a, H, KV, D); });
    auto [cq, ck, cv] = at_cpu_level(0, [&] { return fused::rope_qkv(qkv, a, H, KV, D); });
    EXPECT_TRUE(torch::equal(q, cq));
    EXPECT_TRUE(torch::equal(k, ck));
    EXPECT_TRUE(torch::equal(v, cv));
  }
}

TEST(FusedOpsCpu, SiluMulMatchesTheChainAndFp64) {
  torch::manual_seed(16);
  for (auto dt : kDtypes) {
    // 64 x 1536 runs threaded; 7 and 13 end in a partial vector.
    for (auto [N, I] : std::vector<std::pair<int64_t, int64_t>>{{1, 1536}, {8, 1536}, {64, 1536}, {3, 7}, {1, 14336}, {2, 13}}) {
      auto gu = (torch::randn({N, 2 * I + 6}) * 4).to(dt).narrow(1, 2, 2 * I);  // a view: rows at a wider stride
      const std::string where = name(dt, N, I);
      auto got = at_cpu_level(2, [&] { return fused::silu_mul(gu, I); });
      auto chain = at_cpu_level(0, [&] { return fused::silu_mul(gu, I); });
      ASSERT_TRUE(got.is_contiguous()) << where;
      // Level 1 keeps the chain (torch's exp).
      EXPECT_TRUE(torch::equal(at_cpu_level(1, [&] { return fused::silu_mul(gu, I); }), chain)) << where;
      // The loops' e^x and torch's are both within ~1 ulp of fp32: fp32 agrees to a few of them; a
      // 16-bit dtype rounds silu(g) alike almost always, else one step apart (two after the product).
      const Gap g = gap(got, chain);
      if (dt == torch::kFloat32) {
        EXPECT_LE(g.max, 1e-6) << where;
      } else {
        EXPECT_LE(g.max, 2) << where;
        EXPECT_GE(g.equal_share, 0.99) << where;
      }
      auto gd = gu.to(torch::kFloat64);
      auto ref = gd.narrow(1, 0, I) * torch::sigmoid(gd.narrow(1, 0, I)) * gd.narrow(1, I, I);
      EXPECT_LE(rel_err(got, ref, 1e-2), fp64_tol(dt)) << where;
    }
  }
}

TEST(FusedOpsCpu, SiluMulAtTheEdgesOfExp) {
  // Where e^-g overflows, underflows, or g is not finite, the loops give the chain's answer.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> g{0.0f, -0.0f, 1e-30f, -1e-30f, 1e-3f, -1e-3f, 20, -20, 80, -80, 86, -86, 87.5f, -87.5f,
                       88.5f, -88.5f, 88.72f, -88.72f, 88.8f, -88.8f, 89, -89, 100, -100, 1e4f, -1e4f, inf, -inf, nan};
  const int64_t I = static_cast<int64_t>(g.size());
  for (auto dt : kDtypes) {
    auto gt = torch::tensor(g);
    auto gu = torch::cat({gt, torch::full({I}, 1.5f)}).view({1, 2 * I}).to(dt);
    auto got = at_cpu_level(2, [&] { return fused::silu_mul(gu, I); });
    auto chain = at_cpu_level(0, [&] { return fused::silu_mul(gu, I); });
    const Gap gp = gap(got, chain);
    // fp32: relative, but the outputs near -88.7 are ~1e-37 either way (e^88.7 is finite in one exp
    // and +inf in the other): compare those as absolute.
    if (dt == torch::kFloat32) {
      auto diff = (got.to(torch::kFloat64) - chain.to(torch::kFloat64)).abs().nan_to_num(0);
      auto tol = chain.to(torch::kFloat64).abs().nan_to_num(0) * 1e-6 + 1e-35;
      EXPECT_TRUE(diff.le(tol).all().item<bool>()) << got << "\n" << chain;
    } else {
      EXPECT_LE(gp.max, 1) << c10::toString(dt) << "\n" << got << "\n" << chain;
    }
  }
}

TEST(FusedOpsCpu, CpuLevelIsCheckedAndSwitchesThePath) {
  const int was = fused::cpu_level();
  EXPECT_THROW(fused::set_cpu_level(3), std::exception);
  EXPECT_THROW(fused::set_cpu_level(-1), std::exception);
  EXPECT_EQ(fused::cpu_level(), was);
  fused::set_cpu_level(1);
  EXPECT_TRUE(fused::cpu_active(torch::zeros({2, 8})));
  EXPECT_TRUE(fused::cpu_active(torch::zeros({2, 8}, torch::kBFloat16)));
  EXPECT_TRUE(fused::cpu_active(torch::zeros({2, 8}, torch::kFloat16)));
  EXPECT_FALSE(fused::cpu_active(torch::zeros({2, 8}, torch::kFloat64)));
  EXPECT_FALSE(fused::cpu_active(torch::zeros({0, 8})));
  // The CUDA switch is another one: a CPU tensor never counts as active there.
  EXPECT_FALSE(fused::active(torch::zeros({2, 8})));
  fused::set_cpu_level(0);
  EXPECT_FALSE(fused::cpu_active(torch::zeros({2, 8})));
  // At level 0 every op is the torch chain, bit for bit (the A/B baseline).
  torch::manual_seed(17);
  for (auto dt : kDtypes) {
    auto x = torch::randn({4, 64}).to(dt), d = torch::randn({4, 64}).to(dt), w = torch::rand({64}).to(dt);
    auto chain = w * (x.to(torch::kFloat32) * torch::rsqrt(x.to(torch::kFloat32).pow(2).mean(-1, true) + 1e-6)).to(dt);
    EXPECT_TRUE(torch::equal(fused::rms_norm(x, w, 1e-6), chain));
    auto gu = torch::randn({3, 16}).to(dt);
    EXPECT_TRUE(torch::equal(fused::silu_mul(gu, 8), torch::silu(gu.narrow(1, 0, 8)) * gu.narrow(1, 8, 8)));
  }
  fused::set_cpu_level(was);
}

}  // namespace
}  // namespace kvserve
