// `kvserve tokenize` / `kvserve detokenize`: the tokenizer on files, one JSON value per line, so
// reference tests can compare it with Hugging Face tokenizers in bulk.
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "backend/quantization/gguf_tokenizer.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "common/check.h"
#include "text/tokenizer.h"

namespace kvserve::cli {

namespace {

// Options of both subcommands; shared_ptr because CLI11 callbacks outlive add_tokenize_commands.
struct TokenizeOptions {
  std::string model;
  std::string file;
  bool no_special = false;
  bool json_input = false;
  bool skip_special = false;
};

// Lines split on '\n' only (a '\r' stays part of its line); a final '\n' ends the last line.
std::vector<std::string> read_lines(const std::string& path) {
  const std::string all = read_text_file(path);
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < all.size()) {
    size_t nl = all.find('\n', start);
    if (nl == std::string::npos) nl = all.size();
    lines.push_back(all.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

void run_tokenize(const TokenizeOptions& o) {
  const Tokenizer tok = load_model_tokenizer(o.model);
  const auto lines = read_lines(o.file);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    std::string text = lines[i];
    if (o.json_input) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        KV_FAIL(o.file << ":" << i + 1 << ": not a JSON string: " << e.what());
      }
      KV_CHECK(j.is_string(), o.file << ":" << i + 1 << ": expected a JSON string, found " << j.type_name());
      text = j.get<std::string>();
    }
    out += nlohmann::json(tok.encode(text, !o.no_special)).dump();
    out += '\n';
  }
  std::cout << out << std::flush;
}

void run_detokenize(const TokenizeOptions& o) {
  const Tokenizer tok = load_model_tokenizer(o.model);
  const auto lines = read_lines(o.file);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(lines[i]);
    } catch (const nlohmann::json::exception& e) {
      KV_FAIL(o.file << ":" << i + 1 << ": not a JSON list of token ids: " << e.what());
    }
    KV_CHECK(j.is_array(), o.file << ":" << i + 1 << ": expected a JSON list of token ids");
    std::vector<int64_t> ids;
    for (const auto& e : j) {
      KV_CHECK(e.is_number_integer(), o.file << ":" << i + 1 << ": token ids must be integers, found " << e.dump());
      ids.push_back(e.get<int64_t>());
    }
    out += nlohmann::json(tok.decode(ids, o.skip_special)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    out += '\n';
  }
  std::cout << out << std::flush;
}

}  // namespace

void add_tokenize_commands(CLI::App& app) {
  auto opts = std::make_shared<TokenizeOptions>();
  auto* tok = app.add_subcommand("tokenize", "print a JSON list of token ids per line of a text file");
  tok->add_option("--model", opts->model, "model directory with tokenizer.json, or a .gguf file")->required();
  tok->add_option("--text-file", opts->file, "input text; one line per output line (split on \\n only)")->required();
  tok->add_flag("--no-special", opts->no_special, "do not add bos/eos (add_special_tokens=False)");
  tok->add_flag("--json-input", opts->json_input, "each input line is a JSON string (so texts can hold newlines)");
  tok->callback([opts] { run_tokenize(*opts); });

  auto* detok = app.add_subcommand("detokenize", "print the decoded text, as a JSON string, per line of JSON id lists");
  detok->add_option("--model", opts->model, "model directory with tokenizer.json, or a .gguf file")->required();
  detok->add_option("--ids-file", opts->file, "one JSON list of token ids per line")->required();
  detok->add_flag("--skip-special", opts->skip_special, "leave special tokens out of the text");
  detok->callback([opts] { run_detokenize(*opts); });
}

}  // namespace kvserve::cli
