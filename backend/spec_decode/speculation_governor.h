#pragma once
// SpeculationGovernor: pauses speculative decoding while it does not pay on this machine and load,
// by comparing the tokens per second of the decode steps that verified drafts with those of plain
// decode steps (both on the runner's clock).
#include <cstdint>

namespace kvserve {

// A verify step of γ + 1 rows per sequence can cost several plain steps where a step is
// compute-bound (a CPU, a large batch), and a self-draft step costs nearly a plain one where the
// weights dominate: the proposers' acceptance alone cannot tell whether speculation pays. The
// governor keeps an exponentially weighted rate (tokens / second) of each kind of decode step, per
// batch size (1, 2, 3-4, 5-8, ...: a step's rate depends on how many sequences it decodes); once
// the current batch size has min_samples steps of each kind and the speculative rate is below
// min_speedup x the plain one, speculation pauses for 64 steps (doubling after every pause that
// follows another failed probe, up to 1024), then probes again with fresh samples. A loss beyond
// doubt (a probe's speculative step below clear_loss x the plain rate, e.g. a self-draft of four
// tokens whose first is rejected) pauses at once: where speculation loses, each probe step costs
// several plain ones, so three of them are a large share of a short request. A step is plain when
// no sequence carried drafts. The first min_samples steps of a batch size are made plain (the rate
// to beat), and while speculation runs and no plain step of that batch size came for
// plain_probe_every steps, one is made plain, so that the plain rate follows the context's growth.
class SpeculationGovernor {
 public:
  struct Options {
    double min_speedup = 1.0;
    double clear_loss = 0.5;  // of min_speedup x the plain rate: one such speculative step is a verdict
    int64_t min_samples = 3;
    int64_t plain_probe_every = 32;
    int64_t first_backoff = 64;
    int64_t max_backoff = 1024;
    double weight = 0.25;  // of a new step in the rates
  };
  SpeculationGovernor() = default;
  explicit SpeculationGovernor(const Options& options) : options_(options) {}

  // Whether the coming decode step of `batch` sequences may carry drafts; counts the step. A fresh
  // governor makes the first steps plain; one whose steps all came untimed lets every step speculate.
  bool allow(int64_t batch);
  // The decode part of a step that ran over `batch` sequences: the tokens it emitted, its seconds
  // (drafting, forward and sampling), and whether any sequence carried drafts. Steps without a time
  // (<= 0: a runtime that does not time its steps) are ignored.
  void record(int64_t batch, int64_t tokens, double seconds, bool speculative);

  double speculative_rate(int64_t batch) const { return at(batch).spec.rate; }
  double plain_rate(int64_t batch) const { return at(batch).plain.rate; }
  bool paused() const { return pause_left_ > 0; }
  int64_t pauses() const { return pauses_; }

 private:
  // An exponentially weighted rate and how many steps it has seen.
  struct Rate {
    double rate = 0.0;
    int64_t samples = 0;
    void add(double x, double weight);
  };
  // One batch-size class: its two rates and the speculative steps since its last plain one.
  struct Bucket {
    Rate spec, plain;
    int64_t since_plain = 0;
  };
  static constexpr int kBuckets = 16;
  Bucket& at(int64_t batch);
  const Bucket& at(int64_t batch) const { return const_cast<SpeculationGovernor*>(this)->at(batch); }
  Options options_;
  Bucket buckets_[kBuckets];
  bool timed_ = false, untimed_ = false;  // whether a step was recorded with / without a time
  int64_t pause_left_ = 0;
  int64_t backoff_ = 0;  // the next pause (0: first_backoff)
  int64_t pauses_ = 0;
};

}  // namespace kvserve
