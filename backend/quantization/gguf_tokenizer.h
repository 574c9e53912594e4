#pragma once
// The tokenizer a GGUF file carries in its metadata (tokenizer.ggml.*, tokenizer.chat_template), so
// that a .gguf file served alone needs no tokenizer directory beside it.
#include <string>

#include "text/tokenizer.h"

namespace kvserve {

class GgufFile;

// tokenizer.json and tokenizer_config.json texts (what Tokenizer::from_json reads) built from a GGUF
// file's metadata: a byte-level BPE vocabulary ("gpt2") with its merges and the pre-tokenizer its
// tokenizer.ggml.pre names, or a SentencePiece vocabulary ("llama": scored pieces, byte fallback;
// Gemma's), control tokens as special tokens, BOS/EOS/padding and the chat template. Throws naming
// the key for what is not built (other kinds, a space prefix, pre-tokenizers other than those kvserve
// has checked against a reference).
struct GgufTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};
GgufTokenizerFiles gguf_tokenizer_files(const GgufFile& f);

// The tokenizer of a model path: a directory's tokenizer.json (Tokenizer::from_dir); for a .gguf
// file, the tokenizer.json beside it when there is one (as `make model` lays the default model out),
// else the file's own metadata.
Tokenizer load_model_tokenizer(const std::string& model_path);

}  // namespace kvserve
