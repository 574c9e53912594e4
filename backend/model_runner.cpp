#include "backend/model_runner.h"

#include "backend/llama_model.h"

namespace kvserve {

StepResult LocalRunner::execute(const StepPlan& plan) {
  StepResult r;
  for (int64_t id : plan.release) kv_->release(id);
  for (int64_t id : plan.remove) samplers_.remove(id);
  for (const auto& s : plan.start) samplers_.add(s.seq_id, s.sampling, s.prompt, s.seed, s.eos_ids);
  if (!plan.decode.seq_ids.empty()) {
    try {
      // Sampled where the logits are: only token ids (and asked-for logprobs) reach the host.
      torch::Tensor logits = model_->decode(plan.decode, plan.decode_tokens, *kv_);
      r.decoded = samplers_.sample_batch(plan.decode.seq_ids, logits, plan.decode_ban_eos);
    } catch (const std::exception& e) {
      r.decoded.clear();
      r.decode_error = e.what();
    }
  }
  for (const auto& p : plan.prefill) {
    PrefillOutcome o;
    try {
      torch::Tensor logits = model_->prefill(p.seq_id, p.tokens, *kv_, false, p.policy);
      if (p.sample) o.first = samplers_.sample(p.seq_id, logits[0], p.ban_eos);
      o.kept_tokens = kv_->kept_tokens(p.seq_id);
    } catch (const std::exception& e) {
      o.error = e.what();
    }
    r.prefilled.push_back(std::move(o));
  }
  r.shards.push_back(shard_usage(*kv_, plan));
  return r;
}

}  // namespace kvserve
