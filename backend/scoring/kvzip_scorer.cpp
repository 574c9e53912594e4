#include "backend/scoring/kvzip_scorer.h"

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "backend/model/decoder_model.h"
#include "backend/quantization/gguf_tokenizer.h"
#include "common/check.h"
#include "common/log.h"
#include "policies/kvzip_scores.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace kvserve {

namespace {

KvzipPrompts build_prompts(const std::string& model_dir, Semantics semantics) {
  const Tokenizer tok = load_model_tokenizer(model_dir);
  KvzipPrompts p;
  p.first = tok.encode("\n\nRepeat the previous context exactly.", false);
  // The authors' code ends the later chunks' instruction with a space; kvpress does not.
  p.later = tok.encode(semantics == Semantics::kKvpress
                           ? "\n\nRepeat the part of the previous context exactly, starting with"
                           : "\n\nRepeat the part of the previous context exactly, starting with ",
                       false);
  std::string prefix_text, suffix_text = "\n";  // a model without a chat template: kvpress's "\n"
  if (!tok.chat_template().empty()) {
    // kvpress's derivation: a user message "dummy context" + separator, rendered with the generation
    // prompt; the text after the separator is the suffix, the text before the message the prefix.
    const std::string dummy = "dummy context";
    std::string sep(dummy.size() + 1, '#');  // "\n" and as many '#' as the dummy has characters
    sep[0] = '\n';
    nlohmann::json ctx = nlohmann::json::object();
    nlohmann::json message = nlohmann::json::object();
    message["role"] = "user";
    message["content"] = dummy + sep;
    ctx["messages"] = nlohmann::json::array();
    ctx["messages"].push_back(message);
    ctx["add_generation_prompt"] = true;
    ctx["enable_thinking"] = false;
    ctx["bos_token"] = tok.bos_token();
    ctx["eos_token"] = tok.eos_token();
    const std::string text = ChatTemplate(tok.chat_template()).render(ctx);
    const auto at = text.find(sep);
    KV_CHECK(at != std::string::npos && text.find(sep, at + 1) == std::string::npos,
             model_dir << ": kvzip: the chat template does not render a user message once");
    suffix_text = text.substr(at + sep.size());
    const auto d = text.find(dummy);
    prefix_text = text.substr(0, std::min(d, at));
  }
  p.suffix = tok.encode(suffix_text, false);
  p.prefix_len = prefix_text.empty() ? 0 : static_cast<int64_t>(tok.encode(prefix_text, false).size());
  return p;
}

}  // namespace

const KvzipPrompts& kvzip_prompts(const std::string& model_dir, Semantics semantics) {
  static std::mutex mu;
  static std::map<std::pair<std::string, Semantics>, KvzipPrompts> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(model_dir, semantics);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, build_prompts(model_dir, semantics)).first;
  return it->second;
}

std::vector<KvzipPass> kvzip_passes(const KvzipPrompts& prompts, std::span<const int64_t> tokens, int64_t begin,
                                    int64_t end, int64_t chunk_size) {
  KV_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(tokens.size()) && chunk_size >= 1,
           "kvzip_passes: context [" << begin << ", " << end << ") of " << tokens.size() << " tokens, chunk " << chunk_size);
  std::vector<KvzipPass> out;
  for (int64_t s = begin; s < end; s += chunk_size) {
    KvzipPass p;
    p.start = s;
    p.stop = std::min(end, s + chunk_size);
    if (s == begin) {
      p.ids = prompts.first;
    } else {
      p.ids = prompts.later;
      const int64_t from = std::max(s - prompts.tail, s - chunk_size);  // the previous chunk's last tokens
      p.ids.insert(p.ids.end(), tokens.begin() + from, tokens.begin() + s);
    }
    p.ids.insert(p.ids.end(), prompts.suffix.begin(), prompts.suffix.end());
    p.ids.insert(p.ids.end(), tokens.begin() + p.start, tokens.begin() + p.stop);
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<torch::Tensor> kvzip_scores(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                                        const PolicyConfig& cfg, const KvzipStageIo& io) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const KvzipPrompts& prompts = kvzip_prompts(model.model_dir(), cfg.semantics);
  // kvpress reconstructs what follows the chat template's prefix; the authors keep their system
  // prompt whole and use it as the sink keys: here the sinks.
  const int64_t context_begin = cfg.semantics == Semantics::kKvpress ? prompts.prefix_len : cfg.sink;
  const ReconstructionPlan plan = plan_reconstruction(cfg, T, context_begin);
  const auto& layout = model.layout();
  const int64_t KV = layout.kv_heads, L = layout.layer_end - layout.layer_begin;
  KvzipScoreBoard board(L, KV, plan.end, torch::TensorOptions().dtype(model.dtype()).device(model.device()));
  // KVSERVE_KVZIP_TIMING=1 logs where a prompt's scoring time goes (the passes' layers, the scores).
  static const bool timing = std::getenv("KVSERVE_KVZIP_TIMING") != nullptr;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  double score_s = 0;
  int64_t fed = 0;
  for (const KvzipPass& pass : kvzip_passes(prompts, tokens, plan.begin, plan.end, cfg.chunk_size)) {
    fed += static_cast<int64_t>(pass.ids.size());
    // The layer's context K/V, read once per pass: the hook scores with its keys, then the layer's
    // attention reads both.
    std::pair<torch::Tensor, torch::Tensor> ctx;
    auto context_of = [&](int64_t layer) {
      const EarlierKv held = kv.prefill_context(seq_id, layer);
      KV_CHECK(held.head_lengths.empty(), "internal: the reconstruction pass of sequence " << seq_id
                                                                                          << " finds a compressed prompt");
      const torch::Tensor& k = held.k;
      const torch::Tensor& v = held.v;
      return std::make_pair(k.narrow(1, 0, plan.end), v.narrow(1, 0, plan.end));
    };
    const int64_t sink = score_sink_keys(plan.sink, pass.start);
    torch::Tensor x = io.input ? io.input(pass.ids) : model.embed(pass.ids);
    x = model.detached_layers(
        std::move(x), plan.end, [&](int64_t) { return ctx; },
        [&](int64_t layer, const torch::Tensor& q, const torch::Tensor& k) {
          ctx = context_of(layer);
          if (model.config().layer_window(layer) > 0) return;  // a local layer keeps its window, unscored
          const auto& ck = ctx.first;
          const auto ts = clock::now();
          // A KV head's score is the most any query of its group gives: with the group split across
          // TP ranks, every rank holding the KV head sees the whole group's queries.
          auto s = reconstruction_attention_max(kv.reconstruction_queries(q), ck.narrow(1, 0, sink),
                                                ck.narrow(1, pass.start, pass.stop - pass.start), k);
          board.record(layer - layout.layer_begin, pass.start, s);
          if (timing) score_s += std::chrono::duration<double>(clock::now() - ts).count();
        });
    if (io.output && layout.layer_end < layout.num_layers_total) io.output(x);
  }
  if (timing) {
    const double all = std::chrono::duration<double>(clock::now() - t0).count();
    KV_LOG("kvzip: " << T << " prompt tokens, " << fed << " fed in " << plan.chunks.size() << " passes: " << all
                     << " s (scores " << score_s << " s)");
  }
  board.protect_sinks(plan.sink);
  std::vector<torch::Tensor> out;
  for (int64_t l = 0; l < L; ++l) out.push_back(board.layer_scores(l));
  return out;
}

void kvzip_score_and_select(DecoderModel& model, KvMemory& kv, int64_t seq_id, std::span<const int64_t> tokens,
                            const PolicyConfig& cfg, const KvzipStageIo& io) {
  kv.select_by_scores(seq_id, kvzip_scores(model, kv, seq_id, tokens, cfg, io));
}

}  // namespace kvserve
