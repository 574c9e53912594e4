#include "backend/spec_decode/speculation_governor.h"

#include <algorithm>
#include <bit>

namespace kvserve {

void SpeculationGovernor::Rate::add(double x, double weight) {
  rate = samples == 0 ? x : (1.0 - weight) * rate + weight * x;
  ++samples;
}

SpeculationGovernor::Bucket& SpeculationGovernor::at(int64_t batch) {
  // 1, 2, 3-4, 5-8, ...: the bit width of batch - 1.
  const auto b = static_cast<uint64_t>(std::max<int64_t>(batch, 1) - 1);
  return buckets_[std::min<int>(std::bit_width(b), kBuckets - 1)];
}

bool SpeculationGovernor::allow(int64_t batch) {
  if (pause_left_ > 0) {
    --pause_left_;
    return false;
  }
  // A runtime whose steps come untimed gives nothing to judge: it is not held plain for a rate it
  // never gets.
  if (!timed_ && untimed_) return true;
  // The first steps of a batch size are plain (the rate to beat), and a plain step now and then keeps
  // that rate current as contexts grow (record() of it resets the count).
  const Bucket& b = at(batch);
  return b.plain.samples >= options_.min_samples && b.since_plain < options_.plain_probe_every;
}

void SpeculationGovernor::record(int64_t batch, int64_t tokens, double seconds, bool speculative) {
  if (tokens <= 0 || batch <= 0) return;
  if (seconds <= 0.0) {
    untimed_ = true;
    return;
  }
  timed_ = true;
  Bucket& b = at(batch);
  const double rate = static_cast<double>(tokens) / seconds;
  if (!speculative) {
    b.plain.add(rate, options_.weight);
    b.since_plain = 0;
    return;
  }
  ++b.since_plain;
  b.spec.add(rate, options_.weight);
  if (b.plain.samples < options_.min_samples) return;
  const double bar = options_.min_speedup * b.plain.rate;
  if (b.spec.samples < options_.min_samples) {
    // A probe's first steps: only a loss beyond doubt is a verdict before min_samples.
    if (rate >= options_.clear_loss * bar) return;
  } else if (b.spec.rate >= bar) {
    backoff_ = 0;  // it pays: a later loss pauses briefly first
    return;
  }
  pause_left_ = backoff_ > 0 ? backoff_ : options_.first_backoff;
  backoff_ = std::min(options_.max_backoff, 2 * pause_left_);
  b.spec = {};  // the next probe judges on its own steps
  ++pauses_;
}

}  // namespace kvserve
