// tokenizer.json (+ tokenizer_config.json) from a checkpoint: loads or throws a KvError naming the
// file and key. A tokenizer that loads must then encode and decode without failing.
//
// Input layout: tokenizer.json text, optionally followed by "\n\x00\n" and tokenizer_config.json.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_common.h"
#include "common/check.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const std::string sep("\n\0\n", 3);
  const size_t cut = in.find(sep);
  const std::string tj = in.substr(0, cut);
  const std::string cfg = cut == std::string::npos ? "{}" : in.substr(cut + sep.size());
  std::optional<kvserve::Tokenizer> tok;
  kvfuzz::expect_only<kvserve::KvError>([&] { tok.emplace(kvserve::Tokenizer::from_json(tj, cfg, "fuzz/tokenizer.json")); });
  if (!tok) return 0;
  // Loaded: using it on ordinary and odd text is not allowed to fail.
  try {
    for (const char* text : {"Hello world! 123 ", "  \n\t<s></s>", "\xe4\xbd\xa0\xe5\xa5\xbd \xff\xfe caf\xc3\xa9"}) {
      auto ids = tok->encode(text, true);
      (void)tok->decode(ids, false);
      (void)tok->decode(ids, true);
      kvserve::IncrementalDetokenizer detok(*tok, false);
      for (int64_t id : ids) (void)detok.add(id);
      (void)detok.flush();
    }
    (void)tok->decode({0, 1, 2, tok->vocab_size() - 1, tok->vocab_size(), -1}, false);
  } catch (const std::exception& e) {
    kvfuzz::unexpected(e.what());
  }
  return 0;
}
