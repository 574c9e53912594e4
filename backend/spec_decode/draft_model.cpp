#include "backend/spec_decode/draft_model.h"

#include <sstream>

#include "common/check.h"

namespace kvserve {

namespace {

template <typename T>
void differ(std::ostringstream& out, const char* what, const T& target, const T& draft) {
  if (target == draft) return;
  out << (out.tellp() > 0 ? "; " : "") << what << " " << draft << " (the served model: " << target << ")";
}

const char* rope_kind(RopeScaling::Kind k) {
  switch (k) {
    case RopeScaling::Kind::kDefault: return "default";
    case RopeScaling::Kind::kLinear: return "linear";
    case RopeScaling::Kind::kLlama3: return "llama3";
    case RopeScaling::Kind::kYarn: return "yarn";
    case RopeScaling::Kind::kDynamic: return "dynamic";
    case RopeScaling::Kind::kLongRope: return "longrope";
  }
  return "?";
}

std::string windows(const std::vector<int64_t>& w) {
  std::ostringstream s;
  for (size_t i = 0; i < w.size(); ++i) s << (i ? "," : "[") << w[i];
  s << (w.empty() ? "[]" : "]");
  return s.str();
}

}  // namespace

std::string draft_layout_mismatch(const ModelConfig& t, const ModelConfig& d) {
  std::ostringstream out;
  differ(out, "num_hidden_layers", t.num_hidden_layers, d.num_hidden_layers);
  differ(out, "num_key_value_heads", t.num_key_value_heads, d.num_key_value_heads);
  differ(out, "head_dim", t.head_dim, d.head_dim);
  differ(out, "vocab_size", t.vocab_size, d.vocab_size);
  differ(out, "layer windows", windows(t.layer_windows), windows(d.layer_windows));
  differ(out, "rope_theta", t.rope_theta, d.rope_theta);
  differ(out, "local_rope_theta", t.local_rope_theta, d.local_rope_theta);
  differ(out, "rope_scaling kind", std::string(rope_kind(t.rope_scaling.kind)), std::string(rope_kind(d.rope_scaling.kind)));
  differ(out, "rope_scaling factor", t.rope_scaling.factor, d.rope_scaling.factor);
  return out.str();
}

std::string draft_model_mismatch(const DecoderModel& target, const DecoderModel& draft) {
  std::ostringstream out;
  out << draft_layout_mismatch(target.config(), draft.config());
  differ(out, "compute dtype", std::string(c10::toString(target.dtype())), std::string(c10::toString(draft.dtype())));
  differ(out, "device", target.device().str(), draft.device().str());
  return out.str();
}

std::shared_ptr<DecoderModel> load_draft_model(const SpeculativeConfig& spec, const DecoderModel& target,
                                               const std::string& target_path, LoadOptions load) {
  KV_CHECK(spec.loads_draft_model(), "internal: load_draft_model without a draft model configured");
  const std::string path = spec.model.empty() ? target_path : spec.model;
  const std::string field = spec.model.empty() ? "speculative_config.quantization" : "speculative_config.model";
  load.quantization = spec.quantization;
  std::shared_ptr<DecoderModel> draft;
  try {
    draft = DecoderModel::load(path, load);
  } catch (const std::exception& e) {
    KV_FAIL(field << ": the draft model " << path << " did not load: " << e.what());
  }
  // Token ids must mean the same; the rest decides whether the draft shares the served model's cache.
  KV_CHECK(draft->config().vocab_size == target.config().vocab_size,
           "speculative_config.model: " << path << " has vocab_size " << draft->config().vocab_size
                                        << " (the served model: " << target.config().vocab_size
                                        << "); a draft model needs the served model's tokenizer");
  KV_CHECK(draft->device() == target.device(), "speculative_config.model: " << path << " loaded on " << draft->device()
                                                                            << ", the served model on " << target.device());
  return draft;
}

}  // namespace kvserve
