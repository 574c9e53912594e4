#include "text/tokenizer_nfc.h"

#include <algorithm>
#include <vector>

#include "text/tokenizer_nfc_data.h"
#include "text/tokenizer_text.h"

// The tables in tokenizer_nfc_data.h were generated from Python's unicodedata: every code point
// with a canonical (untagged) decomposition(), every non-zero combining(), and as composable pairs
// the two-character decompositions whose composite is its own NFC (this leaves out the
// composition exclusions, singletons and non-starter decompositions).

namespace kvserve::text::nfc {
namespace {

constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

unsigned ccc(char32_t c) {
  if (c < 0x300) return 0;
  const auto* end = std::end(data::kCcc);
  const auto* it = std::lower_bound(std::begin(data::kCcc), end, c, [](const data::Ccc& e, char32_t v) { return e.cp < v; });
  return it != end && it->cp == c ? it->ccc : 0;
}

void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  const auto* end = std::end(data::kDecomp);
  const auto* it =
      std::lower_bound(std::begin(data::kDecomp), end, c, [](const data::Decomp& e, char32_t v) { return e.cp < v; });
  if (it == end || it->cp != c) {
    out.push_back(c);
    return;
  }
  decompose(it->a, out);
  if (it->b) decompose(it->b, out);
}

// The primary composite of (a, b), or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* end = std::end(data::kComp);
  const auto* it = std::lower_bound(std::begin(data::kComp), end, std::make_pair(a, b),
                                    [](const data::Comp& e, const std::pair<char32_t, char32_t>& v) {
                                      return e.a != v.first ? e.a < v.first : e.b < v.second;
                                    });
  return it != end && it->a == a && it->b == b ? it->c : 0;
}

}  // namespace

bool is_nfc_quick(std::string_view s) {
  // Below U+0300 there are no combining marks and no composable pairs; everything else gets the
  // full algorithm, which is cheap enough for prompts.
  for (unsigned char c : s)
    if (c >= 0xCC) return false;  // lead bytes of U+0300 and above
  return true;
}

std::string to_nfc(std::string_view s) {
  std::vector<char32_t> d;
  d.reserve(s.size());
  for (size_t i = 0; i < s.size();) decompose(text::next_codepoint(s, i), d);
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < d.size();) {
    if (ccc(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && ccc(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + static_cast<long>(i), d.begin() + static_cast<long>(j),
                     [](char32_t a, char32_t b) { return ccc(a) < ccc(b); });
    i = j;
  }
  // Canonical composition.
  std::vector<char32_t> out;
  out.reserve(d.size());
  long starter = -1;   // index in out of the last starter
  unsigned last_cc = 0;
  for (char32_t c : d) {
    const unsigned cc = ccc(c);
    if (starter >= 0) {
      const bool blocked = out.size() - 1 != static_cast<size_t>(starter) && (last_cc == 0 || last_cc >= cc);
      if (!blocked) {
        if (char32_t comp = compose(out[static_cast<size_t>(starter)], c)) {
          out[static_cast<size_t>(starter)] = comp;
          continue;
        }
      }
    }
    if (cc == 0) {
      starter = static_cast<long>(out.size());
      last_cc = 0;
    } else {
      last_cc = cc;
    }
    out.push_back(c);
  }
  std::string r;
  r.reserve(s.size());
  for (char32_t c : out) text::append_utf8(r, c);
  return r;
}

}  // namespace kvserve::text::nfc
