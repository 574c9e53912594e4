#include "backend/sampling/grammar_mask.h"

#include <xgrammar/xgrammar.h>

#include <algorithm>
#include <limits>

#include "common/check.h"

namespace kvserve {

namespace {

// A DLTensor over one row of host bitmask words, as xgrammar writes it.
DLTensor bitmask_row(int32_t* data, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = DLDataType{kDLInt, 32, 1};
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  return t;
}

bool allowed(const int32_t* bits, int64_t t) { return (static_cast<uint32_t>(bits[t >> 5]) >> (t & 31)) & 1u; }

}  // namespace

GrammarMasks::GrammarMasks() = default;
GrammarMasks::~GrammarMasks() {
  if (pending_.valid()) pending_.wait();
}
GrammarMasks::GrammarMasks(GrammarMasks&&) noexcept = default;
GrammarMasks& GrammarMasks::operator=(GrammarMasks&&) noexcept = default;

void GrammarMasks::add(int64_t seq_id, std::shared_ptr<const StructuredGrammar> grammar) {
  if (pending_.valid()) pending_.wait();  // the worker reads the matchers
  entries_.erase(seq_id);
  if (!grammar) return;
  Entry e;
  e.matcher = std::make_unique<xgrammar::GrammarMatcher>(*grammar->compiled);
  e.grammar = std::move(grammar);
  entries_.emplace(seq_id, std::move(e));
}

void GrammarMasks::remove(int64_t seq_id) {
  if (entries_.find(seq_id) == entries_.end()) return;
  if (pending_.valid()) pending_.wait();
  entries_.erase(seq_id);
}

bool GrammarMasks::any(const std::vector<int64_t>& seq_ids) const {
  if (entries_.empty()) return false;
  return std::any_of(seq_ids.begin(), seq_ids.end(), [&](int64_t id) { return entries_.count(id) > 0; });
}

GrammarMasks::Masks GrammarMasks::compute(const std::vector<int64_t>& seq_ids) {
  Masks m;
  m.seq_ids = seq_ids;
  for (size_t i = 0; i < seq_ids.size(); ++i)
    if (auto it = entries_.find(seq_ids[i]); it != entries_.end()) {
      m.rows.push_back(static_cast<int64_t>(i));
      m.words = std::max<int64_t>(m.words, xgrammar::GetBitmaskSize(static_cast<int>(it->second.grammar->vocab_size)));
    }
  m.bits.assign(m.rows.size() * static_cast<size_t>(m.words), 0);
  m.terminated.assign(m.rows.size(), 0);
  for (size_t r = 0; r < m.rows.size(); ++r) {
    Entry& e = entries_.at(seq_ids[static_cast<size_t>(m.rows[r])]);
    if (e.matcher->IsTerminated()) {
      m.terminated[r] = 1;
      continue;
    }
    int64_t shape[1] = {m.words};
    DLTensor t = bitmask_row(m.bits.data() + r * static_cast<size_t>(m.words), shape);
    e.matcher->FillNextTokenBitmask(&t);
  }
  return m;
}

void GrammarMasks::prepare(const std::vector<int64_t>& seq_ids) {
  if (pending_.valid()) pending_.wait();
  if (!any(seq_ids)) {
    pending_ = {};
    return;
  }
  pending_ = std::async(std::launch::async, [this, seq_ids] { return compute(seq_ids); });
}

std::vector<char> GrammarMasks::apply(const std::vector<int64_t>& seq_ids, torch::Tensor& logits,
                                      const std::vector<char>& ban_eos) {
  const int64_t B = static_cast<int64_t>(seq_ids.size()), V = logits.size(1);
  std::vector<char> dead(seq_ids.size(), 0);
  Masks m;
  if (pending_.valid()) {
    m = pending_.get();
    if (m.seq_ids != seq_ids) m = compute(seq_ids);  // prepared for another batch
  } else {
    m = compute(seq_ids);
  }
  if (m.rows.empty()) return dead;
  KV_CHECK(logits.dim() == 2 && logits.size(0) == B && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
           "internal: grammar mask over logits " << logits.sizes());
  for (size_t r = 0; r < m.rows.size(); ++r) {
    const int64_t i = m.rows[r];
    const StructuredGrammar& g = *entries_.at(seq_ids[static_cast<size_t>(i)]).grammar;
    KV_CHECK(g.vocab_size == V, "internal: a grammar over " << g.vocab_size << " tokens, logits over " << V);
    if (m.terminated[r]) {
      dead[static_cast<size_t>(i)] = 1;
      continue;
    }
    const int32_t* bits = m.bits.data() + r * static_cast<size_t>(m.words);
    bool live = false;
    for (int64_t w = 0; w < m.words && !live; ++w) {
      if (bits[w] == 0) continue;
      for (int64_t t = w * 32; t < std::min(V, w * 32 + 32) && !live; ++t)
        live = allowed(bits, t) &&
               !(ban_eos[static_cast<size_t>(i)] && std::find(g.stop_ids.begin(), g.stop_ids.end(), t) != g.stop_ids.end());
    }
    dead[static_cast<size_t>(i)] = !live;
  }
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (logits.device().is_cpu()) {
    float* l0 = logits.data_ptr<float>();
    for (size_t r = 0; r < m.rows.size(); ++r) {
      if (m.terminated[r]) continue;
      const int32_t* bits = m.bits.data() + r * static_cast<size_t>(m.words);
      float* row = l0 + m.rows[r] * V;
      for (int64_t t = 0; t < V; ++t)
        if (!allowed(bits, t)) row[t] = kNegInf;
    }
  } else {
    // One host-to-device copy of the words; bits are expanded and applied on the device.
    const auto R = static_cast<int64_t>(m.rows.size());
    auto host = torch::from_blob(m.bits.data(), {R, m.words}, torch::kInt32).clone();
    const auto dev = host.to(logits.device(), /*non_blocking=*/false);
    const auto shifts = torch::arange(32, torch::TensorOptions().dtype(torch::kInt32).device(logits.device()));
    const auto keep = dev.unsqueeze(2).bitwise_right_shift(shifts).bitwise_and(1).reshape({R, m.words * 32}).narrow(1, 0, V);
    const auto rows = torch::tensor(m.rows, torch::kInt64).to(logits.device());
    auto sub = logits.index_select(0, rows);
    sub.masked_fill_(keep.eq(0), kNegInf);
    logits.index_copy_(0, rows, sub);
  }
  return dead;
}

void GrammarMasks::accept(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& tokens, std::vector<char>& dead) {
  if (entries_.empty()) return;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    auto it = entries_.find(seq_ids[i]);
    if (it == entries_.end() || dead[i]) continue;
    if (!it->second.matcher->AcceptToken(static_cast<int32_t>(tokens[i]))) dead[i] = 1;
  }
}

}  // namespace kvserve
