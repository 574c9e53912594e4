#pragma once
// Unicode NFC for the tokenizer's NFC normalizer (Qwen2's tokenizer.json uses one).
#include <string>
#include <string_view>

namespace kvserve::text::nfc {

// True when s is certainly unchanged by NFC (a cheap scan; false means "run to_nfc").
bool is_nfc_quick(std::string_view s);
// Canonical decomposition, canonical ordering, then canonical composition. s must be valid UTF-8.
std::string to_nfc(std::string_view s);

}  // namespace kvserve::text::nfc
