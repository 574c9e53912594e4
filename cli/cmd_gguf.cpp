// kvserve gguf inspect | dequantize: what a GGUF file holds, and its tensors as kvserve reads them.
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/model/weight_source.h"
#include "backend/quantization/gguf_file.h"
#include "backend/model/safetensors_writer.h"
#include "cli/commands.h"

namespace kvserve::cli {
namespace {

struct GgufArgs {
  std::string model, out;
  bool json = false;
};

void inspect(const GgufArgs& a) {
  const GgufFile f(a.model);
  nlohmann::json tensors = nlohmann::json::array();
  std::map<std::string, int64_t> bytes_by_type;
  int64_t total = 0;
  for (const std::string& name : f.tensor_names()) {
    const std::string type = quant_type_name(f.tensor_type(name));
    tensors.push_back({{"name", name}, {"type", type}, {"shape", f.shape(name)}, {"bytes", f.tensor_bytes(name)}});
    bytes_by_type[type] += f.tensor_bytes(name);
    total += f.tensor_bytes(name);
  }
  const ModelConfig c = read_model_config(a.model);
  nlohmann::json out = {{"path", a.model},
                        {"architecture", f.architecture()},
                        {"config", nlohmann::json::parse(gguf_hf_config_json(f))},
                        {"served_as", c.architecture},
                        {"tensor_bytes", total},
                        {"bytes_by_type", bytes_by_type},
                        {"tensors", tensors}};
  if (a.json) {
    std::cout << out.dump() << std::endl;
    return;
  }
  std::cout << a.model << ": " << f.architecture() << " (" << c.architecture << "), " << c.num_hidden_layers << " layers, "
            << tensors.size() << " tensors, " << total << " bytes\n";
  for (const auto& [type, n] : bytes_by_type) std::cout << "  " << type << ": " << n << " bytes\n";
}

// Every tensor dequantized to fp32 under its GGUF name and shape, as stored (no renaming or
// reordering): what the gguf Python package's dequantize gives for the same file.
void dequantize(const GgufArgs& a) {
  const GgufFile f(a.model);
  std::map<std::string, torch::Tensor> out;
  for (const std::string& name : f.tensor_names()) out[name] = f.load_float(name);
  write_safetensors(a.out, out);
  std::cerr << "kvserve: wrote " << out.size() << " tensors of " << a.model << " to " << a.out << std::endl;
}

}  // namespace

void add_gguf_commands(CLI::App& app) {
  auto* gguf = app.add_subcommand("gguf", "Inspect a GGUF model file, or write its tensors dequantized");
  gguf->require_subcommand(1);
  auto ia = std::make_shared<GgufArgs>();
  auto* ins = gguf->add_subcommand("inspect", "Architecture, config and tensor types of a GGUF file");
  ins->add_option("--model", ia->model, ".gguf file")->required();
  ins->add_flag("--json", ia->json, "one JSON object (config, every tensor's type, shape and bytes)");
  ins->callback([ia] { inspect(*ia); });
  auto da = std::make_shared<GgufArgs>();
  auto* deq = gguf->add_subcommand("dequantize", "Write every tensor as fp32 (.safetensors, GGUF names and shapes)");
  deq->add_option("--model", da->model, ".gguf file")->required();
  deq->add_option("--out", da->out, "output .safetensors file")->required();
  deq->callback([da] { dequantize(*da); });
}

}  // namespace kvserve::cli
