#pragma once
// StepProfile: wall time per stage of DecoderModel's decode step, summed over steps, for `kvserve bench
// decode --profile` (docs/benchmarks.md "Where a decode step's time goes").
#include <array>
#include <chrono>
#include <cstdint>

namespace kvserve {

struct StepProfile {
  enum Stage { kEmbed, kNorm, kQkv, kRope, kAttention, kOProj, kMlp, kResidual, kLogits, kCount };
  static constexpr const char* kNames[kCount] = {"embed",     "rms_norm",          "qkv_proj",  "rope",   "kv_append_attention",
                                                 "o_proj",    "mlp",               "residual",  "lm_head"};
  std::array<double, kCount> seconds{};
  int64_t steps = 0;

  // Runs one stage, adding its wall time to `p` (on CPU every op has finished when it returns, so
  // wall time is the stage's); with p null it only runs it.
  template <class F>
  static auto time(StepProfile* p, Stage s, F&& f) {
    if (!p) return f();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = f();
    p->seconds[s] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
};

}  // namespace kvserve
