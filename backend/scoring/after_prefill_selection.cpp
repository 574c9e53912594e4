#include "backend/scoring/after_prefill_selection.h"

#include "backend/scoring/kvzap_predictor.h"
#include "common/check.h"

namespace kvserve {

void select_after_prefill(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                          const PolicyConfig& cfg, const KvzipStageIo& io) {
  switch (cfg.scorer) {
    case ScorerKind::kReconstruction:
      kvzip_score_and_select(model, kv, seq_id, tokens, cfg, io);
      return;
    case ScorerKind::kPredicted:
      kvzap_select(kv, seq_id, static_cast<int64_t>(tokens.size()), cfg);
      return;
    default:
      KV_FAIL("internal: policy '" << cfg.name << "' (scorer " << to_string(cfg.scorer) << ") selects as its prefill runs");
  }
}

}  // namespace kvserve
