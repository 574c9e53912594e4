#include "backend/engine/output_processor.h"

#include <algorithm>

namespace kvserve {

size_t held_suffix(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& st : stops) {
    for (size_t k = std::min(st.size() - 1, text.size()); k > best; --k) {
      if (text.compare(text.size() - k, k, st, 0, k) == 0) {
        best = k;
        break;
      }
    }
  }
  return best;
}

std::optional<std::string> OutputProcessor::on_token(Sequence& s, const SampledToken& t) const {
  // The grammar allowed no token: the sampled one is void, the request ends here.
  if (t.grammar_dead_end) return std::string("grammar_dead_end");
  const int64_t tok = t.token;
  s.output.push_back(tok);
  const auto& sp = s.req.sampling;
  const bool is_eos = !sp.ignore_eos && std::find(eos_ids_.begin(), eos_ids_.end(), tok) != eos_ids_.end();
  const bool is_stop_id = std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), tok) != sp.stop_token_ids.end();
  GenerationEvent ev;
  ev.token_ids = {tok};
  // A sampled token's logprobs with their token texts.
  auto with_texts = [&](const SampledToken& x, std::vector<TokenLogprob>& chosen, std::vector<std::vector<TokenLogprob>>& tops) {
    TokenLogprob c = x.chosen;
    c.token = tokenizer_.decode({x.token});
    chosen.push_back(c);
    std::vector<TokenLogprob> top = x.top;
    for (auto& y : top) y.token = tokenizer_.decode({y.token_id});
    tops.push_back(std::move(top));
  };
  if (sp.logprobs >= 0) with_texts(t, ev.chosen, ev.top_logprobs);
  for (const SampledToken& p : t.prompt) with_texts(p, ev.prompt_chosen, ev.prompt_top);
  std::optional<std::string> reason;
  if ((is_eos || is_stop_id) && static_cast<int64_t>(s.output.size()) > sp.min_tokens) {
    reason = "stop";  // the stop token's own text is not part of the output
  } else {
    s.held += s.detok->add(tok);
  }
  if (!reason && !sp.stop.empty()) {
    size_t cut = std::string::npos, cut_len = 0;
    for (const auto& st : sp.stop) {
      size_t p = s.held.find(st);
      if (p != std::string::npos && p < cut) cut = p, cut_len = st.size();
    }
    if (cut != std::string::npos) {
      s.held.resize(sp.include_stop_str_in_output ? cut + cut_len : cut);
      reason = "stop";
    }
  }
  if (!reason && (static_cast<int64_t>(s.output.size()) >= sp.max_tokens || s.next_position() + 1 >= max_model_len_))
    reason = "length";
  if (reason == "length") s.held += s.detok->flush();
  const size_t keep = reason ? 0 : held_suffix(s.held, sp.stop);
  ev.text_delta = s.held.substr(0, s.held.size() - keep);
  s.held.erase(0, s.held.size() - keep);
  ev.prompt_tokens = static_cast<int64_t>(s.req.prompt_ids.size());
  ev.completion_tokens = static_cast<int64_t>(s.output.size());
  ev.cached_tokens = s.cached_tokens;
  s.on_event(ev);
  if (reason) s.detok.reset();  // nothing more to flush
  return reason;
}

void OutputProcessor::finish(Sequence& s, const std::string& reason, const std::string& error, bool request_error,
                             bool unavailable) const {
  GenerationEvent ev;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  ev.request_error = request_error;
  ev.unavailable = unavailable;
  if (reason != "stop" && s.detok) ev.text_delta = s.held + s.detok->flush();
  s.held.clear();
  ev.prompt_tokens = static_cast<int64_t>(s.req.prompt_ids.size());
  ev.completion_tokens = static_cast<int64_t>(s.output.size());
  ev.cached_tokens = s.cached_tokens;
  ev.kept_kv_tokens = s.kept_kv;
  ev.kept_head_min = s.kept_head_min;
  ev.kept_head_max = s.kept_head_max;
  ev.kept_head_mean = s.kept_head_mean;
  ev.full_kv_tokens = s.full_kv;
  ev.kv_cache_dtype = s.kv_cache_dtype;
  ev.kv_token_layer_bytes = s.kv_token_layer_bytes;
  s.on_event(ev);
}

}  // namespace kvserve
