// Encode and decode arbitrary bytes with the repository's real tokenizers (the served models'),
// which is what every prompt and every generated id goes through. Checks, besides memory safety:
//  - encode never fails, whatever the bytes (invalid UTF-8 is repaired, not rejected);
//  - decode(encode(valid UTF-8 text)) == text, for tokenizers without a normalizer;
//  - the incremental detokenizer's pieces add up to decode() of the same ids, with and without
//    special tokens.
// Input: byte 0 picks the tokenizer and mode; the rest is text (mode 0) or 16-bit ids (mode 1).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/fuzz_common.h"
#include "common/check.h"
#include "text/tokenizer.h"

namespace {

const std::vector<std::unique_ptr<kvserve::Tokenizer>>& tokenizers() {
  static auto* all = [] {
    auto* v = new std::vector<std::unique_ptr<kvserve::Tokenizer>>();
    for (const char* dir : {"models/tiny-llama", "models/tiny-retriever"})
      v->push_back(std::make_unique<kvserve::Tokenizer>(kvserve::Tokenizer::from_json(
          kvfuzz::read_source_file(std::string(dir) + "/tokenizer.json"),
          kvfuzz::read_source_file(std::string(dir) + "/tokenizer_config.json"), dir)));
    return v;
  }();
  return *all;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; k < n; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto& all = tokenizers();
  const kvserve::Tokenizer& tok = *all[data[0] % all.size()];
  const bool ids_mode = (data[0] >> 4) & 1;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    std::vector<int64_t> ids;
    if (ids_mode) {
      // Any ids, also outside the vocabulary (decode skips them, as HF does).
      for (size_t i = 0; i + 1 < rest.size(); i += 2)
        ids.push_back(static_cast<int64_t>(static_cast<uint8_t>(rest[i]) | (static_cast<uint8_t>(rest[i + 1]) << 8)) %
                      (tok.vocab_size() + 8));
    } else {
      ids = tok.encode(rest, /*add_special_tokens=*/false);
      for (int64_t id : ids)
        if (id < 0 || id >= tok.vocab_size()) std::abort();
      // Special-token text in the input is split out as its special token, which decode with
      // skip_special_tokens=false writes back: the round trip holds for all valid UTF-8.
      if (valid_utf8(rest) && tok.decode(ids, false) != rest) {
        std::fprintf(stderr, "fuzz: decode(encode(text)) != text\n");
        std::abort();
      }
    }
    // Both ways the server streams: with special tokens (echo, logprobs) and without (the default).
    for (const bool skip : {false, true}) {
      const std::string whole = tok.decode(ids, skip);
      kvserve::IncrementalDetokenizer detok(tok, skip);
      std::string pieces;
      for (int64_t id : ids) pieces += detok.add(id);
      pieces += detok.flush();
      if (pieces != whole) {
        std::fprintf(stderr, "fuzz: incremental detokenizer (%zu bytes) != decode (%zu bytes), skip_special=%d\n",
                     pieces.size(), whole.size(), skip);
        std::abort();
      }
    }
  } catch (const std::exception& e) {
    kvfuzz::unexpected(e.what());
  }
  return 0;
}
