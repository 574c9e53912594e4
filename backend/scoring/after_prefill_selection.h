#pragma once
// The selection of a policy whose scores come after the prefill (PolicyConfig::scores_after_prefill):
// kvzip's reconstruction pass (backend/scoring/kvzip_scorer.h) or kvzap's predicted scores, which the
// prefill's layers recorded (backend/scoring/kvzap_predictor.h).
#include <cstdint>
#include <span>

#include "backend/scoring/kvzip_scorer.h"
#include "cache_manager/kv_memory.h"
#include "policies/policy_config.h"

namespace kvserve {

class DecoderModel;

// Scores and selects what sequence seq_id (its prompt `tokens`, whose prefill's layers ran) keeps
// under cfg; KvMemory::end_prefill comes after. `io`: a pipeline stage's passes (kvzip).
void select_after_prefill(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                          const PolicyConfig& cfg, const KvzipStageIo& io = {});

}  // namespace kvserve
