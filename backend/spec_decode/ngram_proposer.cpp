#include "backend/spec_decode/ngram_proposer.h"

#include <algorithm>

namespace kvserve {

std::vector<int64_t> propose_ngram(std::span<const int64_t> prompt, std::span<const int64_t> output, int64_t k,
                                   int64_t min_n, int64_t max_n) {
  const int64_t P = static_cast<int64_t>(prompt.size()), L = P + static_cast<int64_t>(output.size());
  auto at = [&](int64_t i) { return i < P ? prompt[static_cast<size_t>(i)] : output[static_cast<size_t>(i - P)]; };
  if (k <= 0) return {};
  for (int64_t n = std::min(max_n, L - 1); n >= std::max<int64_t>(min_n, 1); --n) {
    // The suffix is [L - n, L); an occurrence [i, i + n) with i + n < L has a following token.
    const int64_t last = at(L - 1);
    for (int64_t i = L - n - 1; i >= 0; --i) {
      if (at(i + n - 1) != last) continue;
      bool match = true;
      for (int64_t j = 0; j < n - 1 && match; ++j) match = at(i + j) == at(L - n + j);
      if (!match) continue;
      std::vector<int64_t> draft;
      for (int64_t t = i + n; t < L && static_cast<int64_t>(draft.size()) < k; ++t) draft.push_back(at(t));
      return draft;
    }
  }
  return {};
}

}  // namespace kvserve
