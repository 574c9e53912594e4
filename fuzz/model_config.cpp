// config.json of a checkpoint: a ModelConfig whose shapes the model can be built from, or a KvError
// naming the file and key.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_common.h"
#include "common/check.h"
#include "backend/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvfuzz::expect_only<kvserve::KvError>([&] {
    const kvserve::ModelConfig c = kvserve::parse_model_config(text, "fuzz/config.json");
    // The model divides by these and sizes tensors from them: the parser must have rejected
    // anything that would make that undefined.
    if (c.num_key_value_heads <= 0 || c.num_attention_heads <= 0 || c.num_attention_heads % c.num_key_value_heads != 0)
      std::abort();
    if (c.hidden_size <= 0 || c.vocab_size <= 0 || c.num_hidden_layers <= 0 || c.head_dim <= 0 ||
        c.intermediate_size <= 0 || c.max_position_embeddings <= 0)
      std::abort();
    (void)c.q_per_kv();
  });
  return 0;
}
