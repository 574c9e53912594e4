#pragma once
// Draft models (speculative_config method "draft_model"): a second set of weights with the served
// model's KV layout, such as a quantized copy of it, drafts over the sequence's own cache. It reads
// the K/V the served model wrote and appends only draft slots, which the step truncates before the
// served model verifies them, so the cache is never copied and never holds anything of the draft's.
#include <memory>
#include <string>

#include "backend/model/decoder_model.h"
#include "backend/spec_decode/speculative_config.h"

namespace kvserve {

// Why `draft` cannot draft over `target`'s KV ("" when it can; otherwise it drafts over a cache of its
// own, backend/spec_decode/separate_kv_drafter.h): the layers, KV heads, head size,
// sliding windows and vocabulary must be equal, and the RoPE too (a draft's queries meet keys the
// target rotated), the compute dtype and the device.
std::string draft_model_mismatch(const DecoderModel& target, const DecoderModel& draft);
// The part of that its configs decide (all but the dtype and device), before either is loaded.
std::string draft_layout_mismatch(const ModelConfig& target, const ModelConfig& draft);

// Loads spec.model (or the served model's own `target_path` when empty) with spec.quantization, as
// `target` was loaded (`load`: device, compute dtype, KV cache dtype, and a sharded job's slice and
// tensor-parallel group), and checks that its token ids are the served model's (vocab_size) and that
// it sits on the same device. Errors name speculative_config and the field.
std::shared_ptr<DecoderModel> load_draft_model(const SpeculativeConfig& spec, const DecoderModel& target,
                                               const std::string& target_path, LoadOptions load);

}  // namespace kvserve
