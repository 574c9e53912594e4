// Checkpoint-format parsing (safetensors headers, config.json) on malformed input: clear errors, no UB.
// Also built as formats_asan_test under AddressSanitizer + UBSan (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/model/model_config.h"
#include "backend/model/model_family.h"
#include "backend/model/safetensors_file.h"
#include "common/check.h"

using kvserve::KvError;
using kvserve::model_shape;
using kvserve::parse_model_config;
using kvserve::SafetensorsFile;

namespace {

std::vector<std::byte> image(const std::string& header, size_t data_bytes, uint64_t declared_len = UINT64_MAX) {
  const uint64_t len = declared_len == UINT64_MAX ? header.size() : declared_len;
  std::vector<std::byte> out(8 + header.size() + data_bytes);
  std::memcpy(out.data(), &len, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

std::string error_of(const std::vector<std::byte>& bytes) {
  try {
    SafetensorsFile f(bytes.data(), bytes.size(), "model.safetensors");
  } catch (const KvError& e) {
    return e.what();
  }
  return "";
}

const char* kGoodHeader = R"({"a.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"format":"pt"}})";

}  // namespace

TEST(SafetensorsFile, ParsesAValidImage) {
  auto bytes = image(kGoodHeader, 24);
  SafetensorsFile f(bytes.data(), bytes.size(), "model.safetensors");
  ASSERT_TRUE(f.contains("a.weight"));
  EXPECT_EQ(f.at("a.weight").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.at("a.weight").nbytes, 24u);
  EXPECT_THROW(f.at("b.weight"), KvError);
}

TEST(SafetensorsFile, RejectsTruncatedAndLyingFiles) {
  EXPECT_NE(error_of(std::vector<std::byte>(5)).find("truncated"), std::string::npos);
  EXPECT_NE(error_of(image(kGoodHeader, 24, 1u << 30)).find("past the end"), std::string::npos);
  EXPECT_NE(error_of(image(kGoodHeader, 10)).find("a.weight"), std::string::npos);  // data cut short
  EXPECT_NE(error_of(image("{not json", 0)).find("malformed header"), std::string::npos);
  EXPECT_NE(error_of(image(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 16)).find("does not match"),
            std::string::npos);
  EXPECT_NE(error_of(image(R"({"x":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", 16)).find("unsupported dtype"),
            std::string::npos);
  EXPECT_NE(error_of(image(R"({"x":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", 16)).find("shape"),
            std::string::npos);
  EXPECT_NE(error_of(image(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", 16)).find("outside"),
            std::string::npos);
  EXPECT_NE(error_of(image(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", 16))
                .find("x"),
            std::string::npos);
  EXPECT_NE(error_of(image(R"([1,2])", 0)).find("object"), std::string::npos);
}

TEST(SafetensorsFile, SurvivesRandomCorruption) {
  auto good = image(kGoodHeader, 24);
  std::mt19937 rng(7);
  for (int i = 0; i < 3000; ++i) {
    auto bytes = good;
    const int flips = 1 + rng() % 4;
    for (int k = 0; k < flips; ++k) bytes[rng() % bytes.size()] = static_cast<std::byte>(rng() & 0xff);
    bytes.resize(rng() % 3 == 0 ? rng() % bytes.size() : bytes.size());
    try {
      SafetensorsFile f(bytes.data(), bytes.size(), "fuzz.safetensors");
      for (const auto& [name, e] : f.entries()) ASSERT_LE(e.data + e.nbytes, bytes.data() + bytes.size());
    } catch (const KvError&) {
    }
  }
}

TEST(ModelConfig, ParsesLlama3RopeAndGqa) {
  auto c = parse_model_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":100,"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":2,
    "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
    "high_freq_factor":4.0,"original_max_position_embeddings":8192},"eos_token_id":[1,2]})",
                              "config.json");
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.q_per_kv(), 4);
  EXPECT_EQ(c.rope_scaling.kind, kvserve::RopeScaling::Kind::kLlama3);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{1, 2}));
}

TEST(ModelConfig, ParsesQwen3) {
  // Qwen3 writes head_dim apart from hidden_size / heads and normalises q and k per head.
  auto c = parse_model_config(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":100,"hidden_size":64,
    "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
    "use_sliding_window":false,"sliding_window":4096})",
                              "config.json");
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_TRUE(c.block.qk_norm);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_TRUE(model_shape(c).qk_norm);
  // Qwen3Config's default head_dim is 128, not hidden / heads.
  auto d = parse_model_config(R"({"model_type":"qwen3","vocab_size":100,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":2,"num_attention_heads":4})",
                              "config.json");
  EXPECT_EQ(d.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_FALSE(parse_model_config(R"({"model_type":"qwen2","vocab_size":100,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":2,"num_attention_heads":4})",
                                  "config.json")
                   .block.qk_norm);
}

TEST(ModelConfig, ParsesGemma3) {
  // transformers 5 writes layer_types and one rope parameter object per layer type.
  auto c = parse_model_config(R"({"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","vocab_size":100,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,
    "head_dim":32,"query_pre_attn_scalar":24,"sliding_window":12,"final_logit_softcapping":null,
    "attn_logit_softcapping":null,"hidden_activation":"gelu_pytorch_tanh",
    "layer_types":["sliding_attention","full_attention","sliding_attention"],
    "rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0},
                       "sliding_attention":{"rope_type":"default","rope_theta":10000.0}}})",
                              "config.json");
  EXPECT_EQ(c.block.norm, kvserve::BlockSpec::Norm::kRmsOnePlus);
  EXPECT_EQ(c.block.activation, kvserve::BlockSpec::Activation::kGeluTanh);
  EXPECT_TRUE(c.block.qk_norm && c.block.sandwich_norms && c.block.scaled_embeddings);
  EXPECT_TRUE(c.tie_word_embeddings) << "Gemma ties by default";
  EXPECT_EQ(c.layer_windows, (std::vector<int64_t>{12, 0, 12}));
  EXPECT_TRUE(c.has_local_layers());
  EXPECT_DOUBLE_EQ(c.query_pre_attn_scalar, 24.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_scaling.kind, kvserve::RopeScaling::Kind::kLinear);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.local_rope_theta, 10000.0);
  EXPECT_EQ(c.local_rope_scaling.kind, kvserve::RopeScaling::Kind::kDefault);
  // Older configs: sliding_window_pattern, rope_theta + rope_scaling for the global layers,
  // rope_local_base_freq for the local ones; head_dim defaults to 256.
  auto o = parse_model_config(R"({"model_type":"gemma3_text","vocab_size":100,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":7,"num_attention_heads":4,"num_key_value_heads":1,"sliding_window":512,
    "sliding_window_pattern":6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,
    "rope_scaling":{"rope_type":"linear","factor":8.0}})",
                              "config.json");
  EXPECT_EQ(o.architecture, "Gemma3ForCausalLM");
  EXPECT_EQ(o.head_dim, 256);
  EXPECT_EQ(o.layer_windows, (std::vector<int64_t>{512, 512, 512, 512, 512, 0, 512}));
  EXPECT_EQ(o.rope_scaling.kind, kvserve::RopeScaling::Kind::kLinear);
  EXPECT_DOUBLE_EQ(o.local_rope_theta, 10000.0);
  // What kvserve does not compute is refused by name.
  auto err = [](const std::string& extra) {
    try {
      parse_model_config(R"({"model_type":"gemma3_text","vocab_size":100,"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4)" + extra + "}",
                         "m/config.json");
    } catch (const KvError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err(R"(,"final_logit_softcapping":30.0)").find("final_logit_softcapping"), std::string::npos);
  EXPECT_NE(err(R"(,"attn_logit_softcapping":50.0)").find("attn_logit_softcapping"), std::string::npos);
  EXPECT_NE(err(R"(,"hidden_activation":"relu")").find("hidden_activation 'relu'"), std::string::npos);
  EXPECT_NE(err(R"(,"layer_types":["full_attention"])").find("layer_types"), std::string::npos);
  EXPECT_NE(err(R"(,"layer_types":["full_attention","chunked_attention"])").find("layer_types[1]"), std::string::npos);
  EXPECT_NE(err(R"(,"use_bidirectional_attention":true)").find("use_bidirectional_attention"), std::string::npos);
  EXPECT_NE(err(R"(,"sliding_window":0)").find("sliding_window"), std::string::npos);
  EXPECT_NE(err(R"(,"rope_parameters":{"full_attention":{"rope_type":"mrope"}})").find("unsupported rope_type 'mrope'"),
            std::string::npos);
  // The multimodal model's config is not the text model's.
  try {
    parse_model_config(R"({"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3","vocab_size":100,
      "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4})",
                       "m/config.json");
    ADD_FAILURE() << "the multimodal config was accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("gemma3_text"), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, ParsesYarnDynamicAndLongRope) {
  const std::string base = R"({"model_type":"llama","vocab_size":100,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":2,"num_attention_heads":8,"max_position_embeddings":256,)";
  // yarn: attention factor 0.1 ln(factor) + 1 (transformers' get_mscale), beta 32 / 1 by default.
  auto y = parse_model_config(base + R"("rope_scaling":{"rope_type":"yarn","factor":4.0,
    "original_max_position_embeddings":64}})", "config.json");
  EXPECT_EQ(y.rope_scaling.kind, kvserve::RopeScaling::Kind::kYarn);
  EXPECT_DOUBLE_EQ(y.rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_EQ(y.rope_scaling.original_max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(y.rope_scaling.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(y.rope_scaling.beta_slow, 1.0);
  EXPECT_TRUE(y.rope_scaling.truncate);
  EXPECT_FALSE(y.rope_scaling.length_dependent());
  // mscale / mscale_all_dim (DeepSeek style) and a factor derived from the two contexts.
  auto m = parse_model_config(base + R"("rope_parameters":{"rope_type":"yarn","original_max_position_embeddings":32,
    "mscale":0.707,"mscale_all_dim":1.0,"beta_fast":16,"truncate":false}})", "config.json");
  EXPECT_DOUBLE_EQ(m.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(m.rope_scaling.attention_factor, (0.1 * 0.707 * std::log(8.0) + 1) / (0.1 * std::log(8.0) + 1));
  EXPECT_DOUBLE_EQ(m.rope_scaling.beta_fast, 16.0);
  EXPECT_FALSE(m.rope_scaling.truncate);
  // dynamic NTK scales past max_position_embeddings and changes with the length.
  auto d = parse_model_config(base + R"("rope_scaling":{"type":"dynamic","factor":2.0}})", "config.json");
  EXPECT_EQ(d.rope_scaling.kind, kvserve::RopeScaling::Kind::kDynamic);
  EXPECT_EQ(d.rope_scaling.original_max_position_embeddings, 256);
  EXPECT_TRUE(d.rope_scaling.length_dependent());
  // longrope: sqrt(1 + ln(factor) / ln(original)) with the factor from the two contexts.
  auto l = parse_model_config(base + R"("rope_scaling":{"rope_type":"longrope","original_max_position_embeddings":64,
    "short_factor":[1,1,1,1],"long_factor":[1,2,3,4.5]}})", "config.json");
  EXPECT_EQ(l.rope_scaling.kind, kvserve::RopeScaling::Kind::kLongRope);
  EXPECT_DOUBLE_EQ(l.rope_scaling.attention_factor, std::sqrt(1 + std::log(4.0) / std::log(64.0)));
  EXPECT_EQ(l.rope_scaling.long_factor, (std::vector<double>{1, 2, 3, 4.5}));
  EXPECT_TRUE(l.rope_scaling.length_dependent());
  // The default max_model_len counts the run-time extensions as vLLM does.
  EXPECT_EQ(kvserve::context_length(y), 256);
  EXPECT_EQ(kvserve::context_length(m), 256);
  EXPECT_EQ(kvserve::context_length(d), 512);
  EXPECT_EQ(kvserve::context_length(l), 256);
}

// Every family's architectures and model types resolve to that family, no architecture to two, and
// a refusal lists them all.
TEST(ModelFamily, EveryArchitectureResolvesToItsFamily) {
  std::set<std::string> seen;
  for (const kvserve::ModelFamily* f : kvserve::all_families()) {
    ASSERT_FALSE(f->architectures.empty());
    ASSERT_NE(f->parse, nullptr);
    for (const auto& a : f->architectures) {
      EXPECT_TRUE(seen.insert(a).second) << a << " is served by two families";
      EXPECT_EQ(kvserve::family_of_architecture(a), f) << a;
      EXPECT_NE(kvserve::supported_architectures().find(a), std::string::npos) << a;
    }
    for (const auto& t : f->model_types) EXPECT_EQ(kvserve::family_of_architecture(kvserve::architecture_of_model_type(t)), f) << t;
  }
  EXPECT_EQ(kvserve::architecture_of_model_type("mistral"), "MistralForCausalLM");
  EXPECT_EQ(kvserve::family_of_architecture("GPT2LMHeadModel"), nullptr);
  EXPECT_EQ(kvserve::architecture_of_model_type("gpt2"), "");
  // The Llama family keeps Llama's block; Mistral is Llama with its window.
  const std::string sizes = R"("vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4)";
  auto m = parse_model_config(R"({"model_type":"mistral",)" + sizes + R"(,"sliding_window":4096})", "config.json");
  EXPECT_EQ(m.block.norm, kvserve::BlockSpec::Norm::kRms);
  EXPECT_EQ(m.block.activation, kvserve::BlockSpec::Activation::kSilu);
  EXPECT_FALSE(m.block.qk_norm || m.block.sandwich_norms || m.block.scaled_embeddings);
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_TRUE(parse_model_config(R"({"model_type":"qwen2",)" + sizes + "}", "config.json").attention_bias);
}

TEST(ModelConfig, ErrorsNameTheFileAndKey) {
  auto err = [](const std::string& text) {
    try {
      parse_model_config(text, "m/config.json");
    } catch (const KvError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string base = R"("vocab_size":100,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":8)";
  EXPECT_NE(err("{").find("m/config.json: malformed JSON"), std::string::npos);
  EXPECT_NE(err(R"({"architectures":["GPT2LMHeadModel"]})").find("unknown architecture 'GPT2LMHeadModel'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","hidden_size":64})").find("missing required key 'vocab_size'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base + R"(,"num_key_value_heads":3})").find("multiple"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama","vocab_size":"big"})").find("'vocab_size' has the wrong type"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base + R"(,"rope_scaling":{"rope_type":"mrope","factor":2}})")
                .find("unsupported rope_type 'mrope'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base + R"(,"rope_scaling":{"rope_type":"longrope","short_factor":[1,1]}})")
                .find("missing required key 'long_factor'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base +
                R"(,"rope_scaling":{"rope_type":"longrope","short_factor":[1,1],"long_factor":[1,2]}})")
                .find("key 'short_factor' has 2 entries, head_dim / 2 = 4"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base + R"(,"rope_scaling":{"rope_type":"dynamic"}})")
                .find("missing required key 'factor'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base +
                R"(,"rope_scaling":{"rope_type":"yarn","factor":4,"partial_rotary_factor":0.5}})")
                .find("partial_rotary_factor 0.5 is not supported"),
            std::string::npos);
  EXPECT_NE(err(R"({"architectures":["Qwen3MoeForCausalLM"]})").find("unknown architecture 'Qwen3MoeForCausalLM'"),
            std::string::npos);
  EXPECT_NE(err(R"({"model_type":"llama",)" + base + R"(,"num_hidden_layers":-1})").find("num_hidden_layers"),
            std::string::npos);
}

// Found by fuzz/model_config: a float too large for int64 was cast (undefined behaviour under UBSan)
// and a fractional one silently truncated.
TEST(ModelConfig, FloatsForIntegerKeysMustBeIntegralAndInRange) {
  auto err = [](const std::string& text) {
    try {
      parse_model_config(text, "m/config.json");
    } catch (const KvError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string head = R"({"model_type":"llama","vocab_size":100,"intermediate_size":128,"num_hidden_layers":2,)"
                           R"("num_attention_heads":8,)";
  EXPECT_NE(err(head + R"("hidden_size":4.44444e+44})").find("key 'hidden_size' must be an integer, got 4.44444e+44"),
            std::string::npos);
  EXPECT_NE(err(head + R"("hidden_size":64.5})").find("key 'hidden_size' must be an integer"), std::string::npos);
  EXPECT_NE(err(head + R"("hidden_size":64,"head_dim":18446744073709551615})").find("'head_dim' is out of range"),
            std::string::npos);
  EXPECT_EQ(parse_model_config(head + R"("hidden_size":64.0})", "m/config.json").hidden_size, 64);
}

// Found by fuzz/model_config: nlohmann reports a number beyond double range as out_of_range, not
// parse_error, and it escaped the parsers as a bare json exception (no file name).
TEST(ModelConfig, NumberOverflowIsMalformedJsonNamingTheFile) {
  try {
    parse_model_config(R"({"architectures":1e400})", "m/config.json");
    FAIL() << "accepted 1e400";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("m/config.json: malformed JSON"), std::string::npos) << e.what();
  }
  auto bytes = image(R"({"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", 4);
  EXPECT_NE(error_of(bytes).find("model.safetensors: malformed header JSON"), std::string::npos) << error_of(bytes);
}
