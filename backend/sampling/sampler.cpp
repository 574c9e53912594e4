#include "backend/sampling/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "backend/sampling/logits_processors.h"
#include "backend/sampling/speculative_sampling.h"
#include "common/check.h"

namespace kvserve {

namespace {

bool uses_penalties(const SamplingParams& p) {
  return p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
}

// Host values for one step, packed as int64 words (doubles bit-cast) so that they reach the device
// in one copy; the device side reads a section back as int64 or, through a view, as float64.
class StepWords {
 public:
  // A run of values: where it starts in the packed words and how many it holds.
  struct Section {
    int64_t at = 0, size = 0;
  };
  Section add(const std::vector<int64_t>& v) {
    Section s{static_cast<int64_t>(words_.size()), static_cast<int64_t>(v.size())};
    words_.insert(words_.end(), v.begin(), v.end());
    return s;
  }
  Section add(const std::vector<double>& v) {
    Section s{static_cast<int64_t>(words_.size()), static_cast<int64_t>(v.size())};
    for (double d : v) words_.push_back(std::bit_cast<int64_t>(d));
    return s;
  }
  // One host-to-device copy (from pinned memory and asynchronous on CUDA).
  torch::Tensor to(const torch::Device& device) const {
    auto host = torch::empty({static_cast<int64_t>(words_.size())},
                             torch::TensorOptions().dtype(torch::kInt64).pinned_memory(device.is_cuda()));
    if (!words_.empty()) std::memcpy(host.data_ptr<int64_t>(), words_.data(), words_.size() * sizeof(int64_t));
    return host.to(device, /*non_blocking=*/true);
  }

 private:
  std::vector<int64_t> words_;
};

torch::Tensor longs(const torch::Tensor& dev, StepWords::Section s) { return dev.narrow(0, s.at, s.size); }
torch::Tensor doubles(const torch::Tensor& dev, StepWords::Section s) {
  return dev.narrow(0, s.at, s.size).view(torch::kFloat64);
}

// Log-softmax of fp32 rows as the host sampler computed it: float max, float differences summed as
// float64 exponentials, float log-sum-exp. Only the summation order differs (last-bit effects).
torch::Tensor model_logprobs(const torch::Tensor& l) {
  const auto mx = std::get<0>(l.max(1, /*keepdim=*/true));
  const auto sum = torch::exp((l - mx).to(torch::kFloat64)).sum(1, /*keepdim=*/true);
  return l - (mx + torch::log(sum).to(torch::kFloat32));
}

// Keys that order each row of fp32 `l` [R, V] exactly as a stable descending sort does: the float's
// order-preserving int32 image in the high half, V-1-id in the low half (lower id first among
// equal values). With no two keys equal, topk and an unstable sort give that order too, and topk
// runs in one pass over the row where a sort of the whole vocabulary costs far more.
torch::Tensor order_keys(const torch::Tensor& l) {
  const int64_t V = l.size(1);
  // In place where possible: on the CPU each fresh [R, V] temporary costs its page faults.
  const auto bits = (l + 0.0).view(torch::kInt32);  // + 0 turns -0 into +0: the two compare equal
  const auto mono = torch::bitwise_right_shift(bits, 31).bitwise_and_(0x7fffffff).bitwise_xor_(bits);
  const auto low = (V - 1) - torch::arange(V, torch::TensorOptions().dtype(torch::kInt64).device(l.device()));
  return mono.to(torch::kInt64).mul_(int64_t{1} << 32).add_(low);
}

// order_keys' high half for one float: its order-preserving int32 image, -0 folded onto +0.
int32_t order_key(float f) {
  const int32_t bits = std::bit_cast<int32_t>(f + 0.0f);
  return ((bits >> 31) & 0x7fffffff) ^ bits;
}

// A CPU row's candidate: (order_key, id).
using Cand = std::pair<int32_t, int32_t>;
// "a ranks before b" in the candidates' order: value descending, id ascending.
bool ranks_before(const Cand& a, const Cand& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); }
bool ranks_after(const Cand& a, const Cand& b) { return ranks_before(b, a); }

// The k best candidates of one row in order, by one pass keeping a heap whose front is the worst
// kept; the tensor version builds several full-vocabulary temporaries and a topk.
void top_candidates(const float* row, int64_t V, int64_t k, std::vector<Cand>& heap) {
  heap.clear();
  heap.reserve(static_cast<size_t>(k));
  for (int64_t t = 0; t < V; ++t) {
    const Cand c{order_key(row[t]), static_cast<int32_t>(t)};
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    } else if (ranks_before(c, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), ranks_before);
      heap.back() = c;
      std::push_heap(heap.begin(), heap.end(), ranks_before);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), ranks_before);
}

// top_ids for CPU rows and k well below V (about 5 % of a batch-8 decode step with top-k 40 in the
// tensor version). Same order.
torch::Tensor top_ids_cpu(const torch::Tensor& l_in, int64_t k) {
  const torch::Tensor l = l_in.contiguous();
  const int64_t R = l.size(0), V = l.size(1);
  torch::Tensor out = torch::empty({R, k}, torch::TensorOptions().dtype(torch::kInt64));
  std::vector<Cand> cands;
  for (int64_t r = 0; r < R; ++r) {
    top_candidates(l.data_ptr<float>() + r * V, V, k, cands);
    int64_t* o = out.data_ptr<int64_t>() + r * k;
    for (int64_t j = 0; j < k; ++j) o[j] = cands[static_cast<size_t>(j)].second;
  }
  return out;
}

// Candidates up to which a CPU row is sorted outright; a row with more (no top-k, or a large
// one) is drawn lazily from a heap.
constexpr int64_t kSortedCandidates = 4096;

// sample_rows for one fp32 CPU row: the same filters and draw. With at most kSortedCandidates
// candidates every sum runs in the same order as sample_rows', so the token is the same. With
// more (no top-k), a full sort of the vocabulary cost ~6 ms a row (~50 ms a step at batch 8, more
// than the model), so candidates come off a heap only as far as the draw needs them, and the
// normaliser and the kept mass are summed in vocabulary order: the same sums up to float64
// rounding, so the token differs only if a draw lands within ~1e-16 of a boundary.
int64_t sample_row_cpu(const float* row, int64_t V, double temp, double top_p, int64_t m, double min_p, double u) {
  std::vector<Cand> c;
  if (m <= kSortedCandidates) {
    top_candidates(row, V, m, c);
    const double top = static_cast<double>(row[c[0].second]) / temp;
    std::vector<double> p(static_cast<size_t>(m)), cum(static_cast<size_t>(m));
    double sum = 0;
    for (int64_t j = 0; j < m; ++j) sum += p[j] = std::exp(static_cast<double>(row[c[j].second]) / temp - top);
    double acc = 0;
    for (int64_t j = 0; j < m; ++j) cum[j] = acc += p[j] /= sum;
    int64_t n = 0;
    while (n < m && cum[n] < top_p) ++n;
    n = std::min(n + 1, m);
    int64_t run = 1;
    while (run < n && p[run] >= min_p * p[0]) ++run;
    n = run;
    const double r = cum[n - 1] * u;
    int64_t at = 0;
    while (at < n - 1 && cum[at] <= r) ++at;
    return c[at].second;
  }
  Cand best{order_key(row[0]), 0};
  for (int64_t t = 1; t < V; ++t) {
    const Cand x{order_key(row[t]), static_cast<int32_t>(t)};
    if (ranks_before(x, best)) best = x;
  }
  const double top = static_cast<double>(row[best.second]) / temp;
  // exp(l / temp - max) of the whole row at once (vectorised; within an ulp of std::exp).
  torch::Tensor pt = torch::from_blob(const_cast<float*>(row), {V}, torch::kFloat32)
                         .to(torch::kFloat64)
                         .div_(temp)
                         .sub_(top)
                         .exp_();
  double* p = pt.data_ptr<double>();  // by id
  if (m < V) {  // top-k: the others weigh nothing
    for (int64_t t = 0; t < V; ++t) c.push_back({order_key(row[t]), static_cast<int32_t>(t)});
    std::nth_element(c.begin(), c.begin() + (m - 1), c.end(), ranks_before);
    std::vector<char> member(static_cast<size_t>(V), 0);
    for (int64_t j = 0; j < m; ++j) member[static_cast<size_t>(c[j].second)] = 1;
    for (int64_t t = 0; t < V; ++t)
      if (!member[static_cast<size_t>(t)]) p[t] = 0;
    c.clear();
  }
  pt.div_(pt.sum().item<double>());
  // min-p keeps a prefix of the sorted candidates (p falls along it), so it is a count; its mass is
  // the kept mass when top-p is off.
  int64_t kept = m;
  double kept_mass = 0;
  if (min_p > 0) {
    const auto in = pt.ge(min_p * p[best.second]);
    kept = in.sum().item<int64_t>();
    kept_mass = pt.masked_select(in).sum().item<double>();
  } else {
    kept_mass = pt.sum().item<double>();
  }
  // Only the head of the order is walked: the candidates above a threshold whose mass already
  // exceeds what the walk needs (top-p's target, or the draw) form a prefix of the order that holds
  // the answer. The threshold falls until they do.
  const double need = std::isfinite(top_p) ? std::min(top_p, kept_mass) : kept_mass * u;
  for (double tau : {1e-2, 1e-4, 1e-8, 0.0}) {
    const double thr = tau * p[best.second];
    c.clear();
    double mass = 0;
    for (int64_t t = 0; t < V; ++t)
      if (p[t] > thr || (tau == 0.0 && (m == V || p[t] > 0)) || t == best.second) {
        c.push_back({order_key(row[t]), static_cast<int32_t>(t)});
        mass += p[t];
      }
    if (mass > need) break;
  }
  std::make_heap(c.begin(), c.end(), ranks_after);  // front: the best left
  std::vector<int32_t> ids;
  std::vector<double> cum;
  double acc = 0;
  auto take = [&] {
    std::pop_heap(c.begin(), c.end(), ranks_after);
    ids.push_back(c.back().second);
    c.pop_back();
    cum.push_back(acc += p[ids.back()]);
  };
  int64_t n = kept;
  if (std::isfinite(top_p)) {
    // top-p: the shortest prefix reaching top_p, within the min-p run.
    while (static_cast<int64_t>(ids.size()) < kept && !c.empty()) {
      take();
      if (acc >= top_p) break;
    }
    n = static_cast<int64_t>(ids.size());
    kept_mass = cum.back();
  }
  const double r = kept_mass * u;
  for (int64_t j = 0; j < n; ++j) {
    if (j == static_cast<int64_t>(ids.size())) {
      if (c.empty()) break;
      take();
    }
    if (cum[j] > r || j == n - 1) return ids[j];
  }
  return ids.back();
}

// The first k ids of each row in that order ([R, k]).
torch::Tensor top_ids(const torch::Tensor& l, int64_t k) {
  const int64_t V = l.size(1);
  if (l.device().is_cpu() && l.scalar_type() == torch::kFloat32 && k * 16 <= V && V <= std::numeric_limits<int32_t>::max())
    return top_ids_cpu(l, k);
  const auto keys = order_keys(l);
  const auto top = k < V ? std::get<0>(keys.topk(k, 1)) : std::get<0>(keys.sort(/*dim=*/1, /*descending=*/true));
  return (V - 1) - top.bitwise_and(int64_t{0xffffffff});
}

// Temperature sampling of fp32 rows [S, V]: per row temp, top-p (inf = off), candidate count n_k
// (top-k, else V; K is their maximum), min-p (0 = off) and u in [0, 1) from the sequence's RNG.
// Sequential cumulative sums stand in for the host loops, so every sum and comparison is the one
// the host sampler made.
torch::Tensor sample_rows(const torch::Tensor& l, int64_t K, const torch::Tensor& temp, const torch::Tensor& top_p,
                          const torch::Tensor& n_k, const torch::Tensor& min_p, const torch::Tensor& u) {
  // Candidates in descending logit order, lower id first on ties, so every filter keeps a prefix.
  const auto idx = top_ids(l, K);
  auto p = l.gather(1, idx).to(torch::kFloat64).div_(temp.unsqueeze(1));
  p.sub_(p.narrow(1, 0, 1).clone()).exp_();  // exp(l / temp - max)
  const auto pos = torch::arange(K, torch::TensorOptions().dtype(torch::kInt64).device(l.device())).unsqueeze(0);
  const auto nk = n_k.unsqueeze(1);
  p.masked_fill_(pos >= nk, 0.0);
  p.div_(p.cumsum(1).gather(1, nk - 1));
  const auto cum = p.cumsum(1);
  // top-p: the shortest prefix whose cumulative sum reaches top_p (cum never decreases).
  auto n = torch::minimum(((cum < top_p.unsqueeze(1)) & (pos < nk)).sum(1, /*keepdim=*/true) + 1, nk);
  // min-p: the run of candidates from the first on whose probability is >= min_p * p_max.
  const auto kept = (p >= min_p.unsqueeze(1) * p.narrow(1, 0, 1)) | (pos == 0);
  n = (kept & (pos < n)).to(torch::kInt32).cumprod(1).sum(1, /*keepdim=*/true);
  // The draw: r = u * kept mass; the first candidate whose cumulative sum exceeds r, else the last.
  const auto r = cum.gather(1, n - 1) * u.unsqueeze(1);
  const auto at = torch::minimum(((cum <= r) & (pos < n)).sum(1, /*keepdim=*/true), n - 1);
  return idx.gather(1, at).squeeze(1);
}

}  // namespace

std::vector<SampledToken> prompt_logprobs(const torch::Tensor& logits, const std::vector<int64_t>& tokens, int64_t k) {
  const auto T = static_cast<int64_t>(tokens.size());
  KV_CHECK(logits.dim() == 2 && logits.size(0) == T, "internal: prompt logits " << logits.sizes() << " for " << T << " tokens");
  if (T < 2) return {};
  const int64_t V = logits.size(1);
  k = std::min(k, V);
  const torch::Device device = logits.device();
  const auto next = torch::tensor(std::vector<int64_t>(tokens.begin() + 1, tokens.end()), torch::kInt64).to(device);
  // Row blocks bound the float64 temporaries of the log-softmax (a long prompt's [T, V] would not).
  constexpr int64_t kRows = 256;
  std::vector<torch::Tensor> chosen, rank, top_id, top_lp;
  for (int64_t at = 0; at < T - 1; at += kRows) {
    const int64_t n = std::min(kRows, T - 1 - at);
    const auto lp = model_logprobs(logits.narrow(0, at, n).to(torch::kFloat32).contiguous());
    const auto c = lp.gather(1, next.narrow(0, at, n).unsqueeze(1));
    chosen.push_back(c.to(torch::kFloat64).view(torch::kInt64).view(-1));
    rank.push_back((lp > c).sum(1) + 1);
    if (k > 0) {
      const auto ids = top_ids(lp, k);
      top_id.push_back(ids.reshape(-1));
      top_lp.push_back(lp.gather(1, ids).to(torch::kFloat64).view(torch::kInt64).reshape(-1));
    }
  }
  std::vector<torch::Tensor> parts = chosen;
  parts.insert(parts.end(), rank.begin(), rank.end());
  parts.insert(parts.end(), top_id.begin(), top_id.end());
  parts.insert(parts.end(), top_lp.begin(), top_lp.end());
  const torch::Tensor host = torch::cat(parts).to(torch::kCPU).contiguous();
  const int64_t* h = host.data_ptr<int64_t>();
  const int64_t R = T - 1;
  std::vector<SampledToken> out(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    SampledToken& s = out[static_cast<size_t>(r)];
    s.token = tokens[static_cast<size_t>(r + 1)];
    s.chosen = TokenLogprob{s.token, "", std::bit_cast<double>(h[r]), h[R + r]};
    const int64_t* ids = h + 2 * R + r * k;
    const int64_t* lps = h + 2 * R + R * k + r * k;
    for (int64_t c = 0; c < k; ++c) s.top.push_back(TokenLogprob{ids[c], "", std::bit_cast<double>(lps[c]), c + 1});
  }
  return out;
}

int64_t SamplerBank::prompt_logprobs(int64_t seq_id) const {
  auto it = entries_.find(seq_id);
  return it == entries_.end() ? -1 : it->second.params.prompt_logprobs;
}

void SamplerBank::add(int64_t seq_id, const SamplingParams& params, const std::vector<int64_t>& prompt, uint64_t seed,
                      std::vector<int64_t> eos_ids) {
  remove(seq_id);
  Entry e{params, std::mt19937_64(params.seed.value_or(seed)), std::move(eos_ids), {}, -1, {}};
  if (uses_penalties(params)) e.prompt = prompt;
  entries_.emplace(seq_id, std::move(e));
  grammar_.add(seq_id, params.grammar);
}

void SamplerBank::remove(int64_t seq_id) {
  auto it = entries_.find(seq_id);
  grammar_.remove(seq_id);
  if (it == entries_.end()) return;
  if (it->second.slot >= 0) free_slots_.push_back(it->second.slot);
  entries_.erase(it);
}

int64_t SamplerBank::acquire_slot(int64_t vocab, const torch::Device& device) {
  if (free_slots_.empty()) {
    // Doubling keeps growth rare; old rows move with one device copy.
    const int64_t grown = std::max<int64_t>(8, 2 * pool_capacity_);
    auto counts = torch::zeros({grown, vocab}, torch::TensorOptions().dtype(torch::kInt32).device(device));
    auto seen = torch::zeros({grown, vocab}, torch::TensorOptions().dtype(torch::kBool).device(device));
    if (pool_capacity_ > 0) {
      counts.narrow(0, 0, pool_capacity_).copy_(counts_);
      seen.narrow(0, 0, pool_capacity_).copy_(seen_);
    }
    counts_ = counts, seen_ = seen;
    for (int64_t s = grown - 1; s >= pool_capacity_; --s) free_slots_.push_back(s);
    pool_capacity_ = grown;
  }
  const int64_t s = free_slots_.back();
  free_slots_.pop_back();
  return s;
}

bool SamplerBank::samples(int64_t seq_id) const {
  auto it = entries_.find(seq_id);
  KV_CHECK(it != entries_.end(), "internal: no sampler for sequence " << seq_id);
  return it->second.params.temperature > 0.0;
}

SampledDraft SamplerBank::draft(int64_t seq_id, const float* logits, int64_t V) {
  auto it = entries_.find(seq_id);
  KV_CHECK(it != entries_.end() && it->second.params.temperature > 0.0,
           "internal: no sampling sampler for sequence " << seq_id << " to draft with");
  SampledDraft d;
  d.q = kept_distribution(logits, V, it->second.params);
  d.token = draw_by_id(d.q, std::uniform_real_distribution<double>(0.0, 1.0)(it->second.rng));
  return d;
}

std::vector<SampledToken> SamplerBank::sample_batch(const std::vector<int64_t>& seq_ids, const torch::Tensor& logits_in,
                                                    const std::vector<char>& ban_eos) {
  return sample_batch(seq_ids, logits_in, ban_eos, {});
}

std::vector<SampledToken> SamplerBank::sample_batch(const std::vector<int64_t>& seq_ids, const torch::Tensor& logits_in,
                                                    const std::vector<char>& ban_eos,
                                                    std::span<const SampledDraft* const> drafts) {
  const auto B = static_cast<int64_t>(seq_ids.size());
  KV_CHECK(logits_in.dim() == 2 && logits_in.size(0) == B && logits_in.size(1) > 0,
           "internal: sampler logits " << logits_in.sizes() << " for " << B << " sequences");
  KV_CHECK(ban_eos.size() == seq_ids.size(), "internal: " << ban_eos.size() << " ban_eos flags for " << B << " rows");
  KV_CHECK(drafts.empty() || drafts.size() == seq_ids.size(),
           "internal: " << drafts.size() << " draft slots for " << B << " rows");
  if (B == 0) return {};
  const int64_t V = logits_in.size(1);
  const torch::Device device = logits_in.device();

  // Host side: per-row parameters, the uniforms, penalty rows to seed, all in one packed copy.
  std::vector<Entry*> rows;
  bool penalised = false;
  std::vector<int64_t> ban, s_rows, s_nk, p_rows, p_slots, l_rows, new_slots, seen_init;
  std::vector<double> s_temp, s_top_p, s_min_p, s_u, p_rp, p_freq, p_pres;
  // Rows that verify a draft drawn from q (speculative sampling on the host): row, two uniforms.
  std::vector<int64_t> d_rows;
  std::vector<std::pair<double, double>> d_u;
  int64_t top_n = 0;
  // Checks first, so that a bad batch changes no sequence's state.
  for (int64_t id : seq_ids) {
    auto it = entries_.find(id);
    KV_CHECK(it != entries_.end(), "internal: no sampler for sequence " << id);
    KV_CHECK(std::find(rows.begin(), rows.end(), &it->second) == rows.end(),
             "internal: sequence " << id << " twice in one sampled batch");
    rows.push_back(&it->second);
    penalised = penalised || uses_penalties(it->second.params);
  }
  if (penalised && pool_capacity_ > 0)
    KV_CHECK(counts_.size(1) == V && counts_.device() == device,
             "internal: penalty rows are [" << counts_.size(1) << "] on " << counts_.device() << ", logits [" << V
                                            << "] on " << device);
  for (int64_t i = 0; i < B; ++i) {
    Entry& e = *rows[static_cast<size_t>(i)];
    const SamplingParams& p = e.params;
    if (ban_eos[static_cast<size_t>(i)])
      for (int64_t t : e.eos_ids)
        if (t >= 0 && t < V) ban.push_back(i * V + t);
    const SampledDraft* d = drafts.empty() ? nullptr : drafts[static_cast<size_t>(i)];
    if (p.temperature > 0.0 && d != nullptr && d->token >= 0) {
      KV_CHECK(static_cast<int64_t>(d->q.size()) == V && d->token < V,
               "internal: draft " << d->token << " of sequence " << seq_ids[static_cast<size_t>(i)] << " drawn from "
                                  << d->q.size() << " probabilities, logits [" << V << "]");
      d_rows.push_back(i);
      std::uniform_real_distribution<double> uniform(0.0, 1.0);
      const double u_accept = uniform(e.rng);
      d_u.emplace_back(u_accept, uniform(e.rng));
    } else if (p.temperature > 0.0) {
      s_rows.push_back(i);
      s_temp.push_back(p.temperature);
      s_top_p.push_back(p.top_p < 1.0 ? p.top_p : std::numeric_limits<double>::infinity());
      s_nk.push_back(p.top_k > 0 && p.top_k < V ? p.top_k : V);
      s_min_p.push_back(p.min_p > 0.0 ? p.min_p : 0.0);
      // uniform(0, total) is total * generate_canonical; uniform(0, 1) is generate_canonical itself,
      // and the device multiplies by the kept mass: the same draw from the same stream.
      s_u.push_back(std::uniform_real_distribution<double>(0.0, 1.0)(e.rng));
    }
    if (uses_penalties(p)) {
      if (e.slot < 0) {
        e.slot = acquire_slot(V, device);
        new_slots.push_back(e.slot);
        for (int64_t t : e.prompt)
          if (t >= 0 && t < V) seen_init.push_back(e.slot * V + t);
        e.prompt = {};
      }
      p_rows.push_back(i);
      p_slots.push_back(e.slot);
      p_rp.push_back(p.repetition_penalty);
      p_freq.push_back(p.frequency_penalty);
      p_pres.push_back(p.presence_penalty);
    }
    if (p.logprobs >= 0) {
      l_rows.push_back(i);
      top_n = std::max(top_n, std::min(p.logprobs, V));
    }
  }
  std::vector<LogitEditRow> edits;
  for (int64_t i = 0; i < B; ++i)
    if (has_logit_edits(rows[static_cast<size_t>(i)]->params))
      edits.push_back({i, &rows[static_cast<size_t>(i)]->params, &rows[static_cast<size_t>(i)]->output});
  StepWords w;
  const auto w_ban = w.add(ban), w_s_rows = w.add(s_rows), w_s_nk = w.add(s_nk), w_p_rows = w.add(p_rows),
             w_p_slots = w.add(p_slots), w_l_rows = w.add(l_rows), w_new = w.add(new_slots),
             w_seen_init = w.add(seen_init);
  const auto w_temp = w.add(s_temp), w_top_p = w.add(s_top_p), w_min_p = w.add(s_min_p), w_u = w.add(s_u),
             w_rp = w.add(p_rp), w_freq = w.add(p_freq), w_pres = w.add(p_pres);
  const torch::Tensor dev = w.to(device);

  // Device side: no host syncs until the results are copied back.
  torch::Tensor l = logits_in.to(torch::kFloat32).contiguous();
  if (!ban.empty() || !p_rows.empty() || !edits.empty() || grammar_.any(seq_ids))
    l = l.clone();  // never write into the model's logits
  if (!ban.empty()) l.view(-1).index_fill_(0, longs(dev, w_ban), -std::numeric_limits<float>::infinity());

  torch::Tensor l_idx, lp, top_lp_vals, top_lp_ids;
  if (!l_rows.empty()) {
    l_idx = longs(dev, w_l_rows);
    lp = model_logprobs(l.index_select(0, l_idx));
    if (top_n > 0) {
      // Lower id first among equal logprobs, as the host sampler did.
      top_lp_ids = top_ids(lp, top_n);
      top_lp_vals = lp.gather(1, top_lp_ids);
    }
  }

  apply_logit_edits(l, edits);  // after the logprobs, which report the model's own distribution
  std::vector<char> dead = grammar_.apply(seq_ids, l, ban_eos);

  if (!new_slots.empty()) {
    const auto fresh = longs(dev, w_new);
    counts_.index_fill_(0, fresh, 0);
    seen_.index_fill_(0, fresh, false);
    if (!seen_init.empty()) seen_.view(-1).index_fill_(0, longs(dev, w_seen_init), true);
  }
  torch::Tensor p_idx, p_slot;
  if (!p_rows.empty() && device.is_cpu()) {
    // On the CPU one pass over each penalised row in place: the tensor version below makes a dozen
    // full-vocabulary temporaries (fresh pages each), about 2 ms a step at batch 8. Same arithmetic.
    p_idx = longs(dev, w_p_rows), p_slot = longs(dev, w_p_slots);
    float* lp0 = l.data_ptr<float>();
    const bool* seen0 = seen_.data_ptr<bool>();
    const int32_t* counts0 = counts_.data_ptr<int32_t>();
    for (size_t j = 0; j < p_rows.size(); ++j) {
      float* row = lp0 + p_rows[j] * V;
      const bool* seen = seen0 + p_slots[j] * V;
      const int32_t* counts = counts0 + p_slots[j] * V;
      const float rp = static_cast<float>(p_rp[j]);
      const double freq = p_freq[j], pres = p_pres[j];
      for (int64_t t = 0; t < V; ++t) {
        if (seen[t]) row[t] = row[t] > 0 ? row[t] / rp : row[t] * rp;
        if (counts[t] > 0) row[t] -= static_cast<float>(freq * counts[t] + pres);
      }
    }
  } else if (!p_rows.empty()) {
    p_idx = longs(dev, w_p_rows), p_slot = longs(dev, w_p_slots);
    auto x = l.index_select(0, p_idx);
    const auto seen = seen_.index_select(0, p_slot);
    const auto counts = counts_.index_select(0, p_slot);
    // A row without a repetition penalty has rp = 1: l / 1 and l * 1 are l exactly.
    const auto rp = doubles(dev, w_rp).to(torch::kFloat32).unsqueeze(1);
    // l > 0 ? l / rp : l * rp without a select on the sign (slow on the CPU for random signs):
    // one side is +0, and adding +0 to the other is exact.
    x = torch::where(seen, x.clamp_min(0).div_(rp).add_(x.clamp_max(0).mul_(rp)), x);
    // freq * n + pres in float64, then subtracted in float; 0 * n + 0 leaves a row unchanged.
    const auto pen =
        counts.to(torch::kFloat64).mul_(doubles(dev, w_freq).unsqueeze(1)).add_(doubles(dev, w_pres).unsqueeze(1));
    x = torch::where(counts > 0, x - pen.to(torch::kFloat32), x);
    l.index_copy_(0, p_idx, x);
  }

  torch::Tensor tokens;
  if (s_rows.size() + d_rows.size() < rows.size())
    tokens = l.argmax(1);  // greedy: the first maximum
  else
    tokens = torch::empty({B}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  if (!s_rows.empty()) {
    const auto s_idx = longs(dev, w_s_rows);
    const int64_t K = *std::max_element(s_nk.begin(), s_nk.end());
    if (device.is_cpu()) {
      int64_t* tp = tokens.data_ptr<int64_t>();
      const float* l0 = l.data_ptr<float>();
      for (size_t j = 0; j < s_rows.size(); ++j)
        tp[s_rows[j]] = sample_row_cpu(l0 + s_rows[j] * V, V, s_temp[j], s_top_p[j], s_nk[j], s_min_p[j], s_u[j]);
    } else {
      tokens.index_copy_(0, s_idx,
                         sample_rows(l.index_select(0, s_idx), K, doubles(dev, w_temp), doubles(dev, w_top_p),
                                     longs(dev, w_s_nk), doubles(dev, w_min_p), doubles(dev, w_u)));
    }
  }

  if (!d_rows.empty()) {
    // Whole distributions are compared on the host: these rows' logits come over once.
    const torch::Tensor d_idx = torch::tensor(d_rows);
    const torch::Tensor host_l = device.is_cpu() ? l : l.index_select(0, d_idx.to(device)).to(torch::kCPU).contiguous();
    std::vector<int64_t> got(d_rows.size());
    for (size_t j = 0; j < d_rows.size(); ++j) {
      const auto i = static_cast<size_t>(d_rows[j]);
      const SampledDraft& d = *drafts[i];
      if (dead[i]) {  // the grammar allows nothing: the token is void, as a plain draw's would be
        got[j] = d.token;
        continue;
      }
      const float* row = host_l.data_ptr<float>() + (device.is_cpu() ? d_rows[j] : static_cast<int64_t>(j)) * V;
      got[j] = accept_or_resample(kept_distribution(row, V, rows[i]->params), d.q, d.token, d_u[j].first, d_u[j].second);
    }
    tokens.index_copy_(0, d_idx.to(device), torch::tensor(got).to(device));
  }

  if (!p_rows.empty()) {
    const auto flat = p_slot * V + tokens.index_select(0, p_idx);
    counts_.view(-1).index_add_(0, flat, torch::ones({flat.size(0)}, counts_.options()));
    seen_.view(-1).index_fill_(0, flat, true);
  }

  // Results: tokens [B], then for the logprob rows the chosen logprob [L] and top ids / logprobs
  // [L, top_n], all as int64 words (logprobs bit-cast from float64) in one device-to-host copy.
  std::vector<torch::Tensor> parts{tokens};
  if (!l_rows.empty()) {
    const auto chosen = lp.gather(1, tokens.index_select(0, l_idx).unsqueeze(1));
    parts.push_back(chosen.to(torch::kFloat64).view(torch::kInt64).view(-1));
    if (top_n > 0) {
      parts.push_back(top_lp_ids.reshape(-1));
      parts.push_back(top_lp_vals.to(torch::kFloat64).view(torch::kInt64).reshape(-1));
    }
  }
  const torch::Tensor host = (parts.size() == 1 ? tokens : torch::cat(parts)).to(torch::kCPU).contiguous();
  const int64_t* h = host.data_ptr<int64_t>();
  const int64_t L = static_cast<int64_t>(l_rows.size());
  const int64_t* chosen_lp = h + B;
  const int64_t* top_id = chosen_lp + L;
  const int64_t* top_lp = top_id + L * top_n;

  std::vector<SampledToken> out(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) {
    out[static_cast<size_t>(i)].token = h[i];
    Entry& e = *rows[static_cast<size_t>(i)];
    if (!e.params.bad_words_ids.empty() && !dead[static_cast<size_t>(i)]) e.output.push_back(h[i]);
  }
  grammar_.accept(seq_ids, std::vector<int64_t>(h, h + B), dead);
  for (int64_t i = 0; i < B; ++i) out[static_cast<size_t>(i)].grammar_dead_end = dead[static_cast<size_t>(i)];
  for (int64_t j = 0; j < L; ++j) {
    SampledToken& s = out[static_cast<size_t>(l_rows[static_cast<size_t>(j)])];
    s.chosen = TokenLogprob{s.token, "", std::bit_cast<double>(chosen_lp[j]), 0};
    const int64_t k = std::min(rows[static_cast<size_t>(l_rows[static_cast<size_t>(j)])]->params.logprobs, V);
    for (int64_t c = 0; c < k; ++c)
      s.top.push_back(TokenLogprob{top_id[j * top_n + c], "", std::bit_cast<double>(top_lp[j * top_n + c]), 0});
  }
  return out;
}

SampledToken SamplerBank::sample(int64_t seq_id, const torch::Tensor& logits, bool ban_eos) {
  KV_CHECK(logits.dim() == 1 || (logits.dim() == 2 && logits.size(0) == 1),
           "internal: one row of logits expected, got " << logits.sizes());
  return std::move(sample_batch({seq_id}, logits.reshape({1, -1}), {static_cast<char>(ban_eos)}).at(0));
}

}  // namespace kvserve
