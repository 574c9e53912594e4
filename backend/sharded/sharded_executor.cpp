#include "backend/sharded/sharded_executor.h"

#include <algorithm>

#include "backend/scoring/after_prefill_selection.h"
#include "backend/kernels/decode_scope.h"
#include "backend/model/decoder_model.h"
#include "backend/quantization/quantized_weight.h"
#include "common/check.h"
#include "parallel/communicator.h"
#include "parallel/shard_score_exchange.h"

namespace kvserve {

namespace {
// Message tags between stages; decode micro-batch i uses kDecodeHidden + i and kDecodeLogits + i.
// DynamicKV's scores travel with tags 2 and 3 (parallel::ShardScoreExchange, called by the KV memory).
// kvzip's reconstruction passes send their hidden states with kReconHidden.
constexpr int kPrefillHidden = 1, kPrefillLogits = 4, kReconHidden = 5;
constexpr int kDecodeHidden = 64, kDecodeLogits = 4096;
static_assert(parallel::ShardScoreExchange::kScoreLayersTag < kDecodeHidden &&
              parallel::ShardScoreExchange::kScoresTag < kDecodeHidden &&
              parallel::ShardScoreExchange::kScoreLayersTag != kPrefillHidden &&
              parallel::ShardScoreExchange::kScoreLayersTag != kPrefillLogits &&
              parallel::ShardScoreExchange::kScoresTag != kPrefillHidden &&
              parallel::ShardScoreExchange::kScoresTag != kPrefillLogits &&
              parallel::ShardScoreExchange::kScoreLayersTag != kReconHidden &&
              parallel::ShardScoreExchange::kScoresTag != kReconHidden,
              "the score exchange's tags must not collide with the runtime's");
}  // namespace

ShardedExecutor::ShardedExecutor(std::shared_ptr<DecoderModel> model, KvMemory& kv, parallel::ParallelGroups groups,
                                 int64_t micro_batches)
    : model_(std::move(model)), kv_(kv), g_(std::move(groups)),
      micro_batches_(micro_batches > 0 ? micro_batches : model_->layout().pp_size) {
  KV_CHECK(g_.world && g_.data, "internal: a sharded executor needs its process groups");
  KV_CHECK(micro_batches_ < kDecodeLogits - kDecodeHidden, "too many micro-batches: " << micro_batches_);
}

const ShardLayout& ShardedExecutor::layout() const { return model_->layout(); }
int64_t ShardedExecutor::prev_rank() const { return layout().global_rank(layout().stage - 1, layout().tp_rank); }
int64_t ShardedExecutor::next_rank() const { return layout().global_rank(layout().stage + 1, layout().tp_rank); }
int64_t ShardedExecutor::last_stage_head() const { return layout().global_rank(layout().pp_size - 1, 0); }

torch::Tensor ShardedExecutor::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, const std::string& policy,
                                       bool all_logits, bool to_rank0) {
  begin_prefill(seq_id, tokens, policy, KvMemory::kNoLookup, false);
  return run_prefill(seq_id, tokens, 0, all_logits, to_rank0);
}

void ShardedExecutor::begin_prefill(int64_t seq_id, std::span<const int64_t> prompt, const std::string& policy,
                                    int64_t hit, bool keep_copy, ResumeFrom resume) {
  KV_CHECK(!prompt.empty(), "empty prompt");
  kv_.begin_prefill(seq_id, static_cast<int64_t>(prompt.size()), policy);
  const int64_t took = kv_.prefill_tokens(seq_id, 0, prompt, hit, keep_copy, resume);
  const int64_t want = resume.seq_id >= 0 ? resume.length : std::max<int64_t>(hit, 0);
  KV_CHECK(took == want, "internal: the shards agreed on " << want << " cached positions of sequence " << seq_id
                                                           << ", this one took " << took);
}

void ShardedExecutor::begin_context(int64_t seq_id, std::span<const int64_t> prompt, int64_t context_len,
                                    const std::string& policy, bool cached, bool keep_copy) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  KV_CHECK(context_len > 0 && context_len < n, "internal: a context of " << context_len << " tokens in a prompt of " << n);
  const auto context = prompt.first(static_cast<size_t>(context_len));
  kv_.begin_prefill(seq_id, context_len, policy);
  const int64_t took = kv_.begin_context(seq_id, context, n, cached);
  KV_CHECK(took == (cached ? context_len : 0), "internal: the shards agreed that sequence " << seq_id << "'s context "
                                                   << (cached ? "is" : "is not") << " cached, this one took " << took);
  // Not cached: the context starts as a prompt of its own (the full-precision prefix cache is not
  // consulted: its hits would need the shards' agreement too).
  if (!cached) kv_.prefill_tokens(seq_id, 0, context, KvMemory::kNoLookup, keep_copy);
}

torch::Tensor ShardedExecutor::run_context(int64_t seq_id, std::span<const int64_t> prompt, int64_t context_len,
                                           bool cached, bool to_rank0) {
  if (!cached) {
    run_prefill(seq_id, prompt.first(static_cast<size_t>(context_len)), 0, false, /*to_rank0=*/false);
    kv_.continue_prompt(seq_id);
  }
  return run_prefill(seq_id, prompt, context_len, false, to_rank0);
}

torch::Tensor ShardedExecutor::run_prefill(int64_t seq_id, std::span<const int64_t> prompt, int64_t start,
                                           bool all_logits, bool to_rank0) {
  torch::NoGradGuard ng;
  const ShardLayout& s = layout();
  const int64_t N = static_cast<int64_t>(prompt.size()), T = N - start;
  KV_CHECK(start >= 0 && T > 0, "internal: prefill from position " << start << " of a prompt of " << N);
  KV_CHECK(start == 0 || !all_logits, "internal: every position's logits asked of a prompt that starts from its cache");
  auto& data = *g_.data;
  const auto dev = model_->device();
  const int rank = g_.world->rank();

  // A DynamicKV prefill's memory exchanges scores through its ScoreExchange: it receives the earlier
  // stages' at its first layer (after this stage's activations arrived), and at end_prefill (after
  // the activations left) sends its own on and agrees on the final budgets with every rank.
  torch::Tensor x = s.first_stage() ? model_->embed(std::vector<int64_t>(prompt.begin() + start, prompt.end()))
                                    : data.recv_tensor(static_cast<int>(prev_rank()), kPrefillHidden, dev);
  x = model_->prefill_layers(seq_id, x, kv_, start, N);
  if (!s.last_stage()) data.send_tensor(x, static_cast<int>(next_rank()), kPrefillHidden);
  // A reconstruction scorer (kvzip) runs its passes through the stages as the prompt did (a predicted
  // one, kvzap, has its scores), then every shard takes its part of the one selection
  // (KvMemory::select_by_scores gathers the scores).
  if (const PolicyConfig* cfg = kv_.pending_selection(seq_id)) {
    KvzipStageIo io;
    if (!s.first_stage())
      io.input = [&](const std::vector<int64_t>&) { return data.recv_tensor(static_cast<int>(prev_rank()), kReconHidden, dev); };
    if (!s.last_stage())
      io.output = [&](const torch::Tensor& h) { data.send_tensor(h, static_cast<int>(next_rank()), kReconHidden); };
    select_after_prefill(*model_, kv_, seq_id, prompt, *cfg, io);
  }
  kv_.end_prefill(seq_id);
  torch::Tensor logits;
  if (s.last_stage()) {
    logits = model_->logits(all_logits ? x : x.narrow(0, T - 1, 1));
    if (to_rank0 && s.tp_rank == 0 && rank != 0) data.send_tensor(logits, 0, kPrefillLogits);
  }
  data.wait_sends();
  if (!to_rank0) return logits;
  if (rank == 0 && !s.last_stage()) logits = data.recv_tensor(static_cast<int>(last_stage_head()), kPrefillLogits, dev);
  return rank == 0 ? logits.to(torch::kCPU) : torch::Tensor();
}

torch::Tensor ShardedExecutor::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, bool to_rank0,
                                      bool with_draft) {
  torch::NoGradGuard ng;
  KV_CHECK(!with_draft || draft_, "internal: a draft model's step on a rank that holds none");
  DecoderModel& model = with_draft ? *draft_ : *model_;
  const ShardLayout& s = layout();
  const int64_t B = static_cast<int64_t>(tokens.size());
  KV_CHECK(B > 0 && batch.seq_ids.size() == tokens.size() && batch.positions.size() == tokens.size(),
           "decode batch of " << B << " tokens does not match its sequence list");
  auto& data = *g_.data;
  const auto dev = model_->device();
  const int rank = g_.world->rank();
  // Contiguous micro-batches: stage s works on micro-batch i while stage s+1 works on i-1.
  const int64_t M = std::min<int64_t>(micro_batches_, B);
  std::vector<torch::Tensor> out;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t lo = B * m / M, hi = B * (m + 1) / M;
    DecodeBatch mb;
    mb.seq_ids.assign(batch.seq_ids.begin() + lo, batch.seq_ids.begin() + hi);
    mb.positions.assign(batch.positions.begin() + lo, batch.positions.begin() + hi);
    mb.view = batch.view;
    torch::Tensor x = s.first_stage()
                          ? model.embed(std::vector<int64_t>(tokens.begin() + lo, tokens.begin() + hi))
                          : data.recv_tensor(static_cast<int>(prev_rank()), kDecodeHidden + static_cast<int>(m), dev);
    mb.draft = batch.draft;
    x = model.decode_layers(mb, x, kv_);
    if (!s.last_stage()) {
      data.send_tensor(x, static_cast<int>(next_rank()), kDecodeHidden + static_cast<int>(m));
    } else {
      const DecodeScope decoding;  // a decode step's LM head
      auto lg = model.logits(x);
      if (rank == 0 || !to_rank0) {
        out.push_back(lg);
      } else if (s.tp_rank == 0) {
        data.send_tensor(lg, 0, kDecodeLogits + static_cast<int>(m));
      }
    }
  }
  if (!to_rank0) {
    data.wait_sends();
    return s.last_stage() ? torch::cat(out) : torch::Tensor();
  }
  if (rank == 0 && !s.last_stage()) {
    for (int64_t m = 0; m < M; ++m)
      out.push_back(data.recv_tensor(static_cast<int>(last_stage_head()), kDecodeLogits + static_cast<int>(m), dev));
  }
  data.wait_sends();
  return rank == 0 ? torch::cat(out).to(torch::kCPU) : torch::Tensor();
}

}  // namespace kvserve
