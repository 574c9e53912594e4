#include "cli/cli_files.h"

#include <fstream>
#include <sstream>

#include "common/check.h"

namespace kvserve::cli {

std::optional<std::string> try_read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string read_text_file(const std::string& path) {
  auto text = try_read_text_file(path);
  KV_CHECK(text, path << ": cannot open");
  return *text;
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  KV_CHECK(f, path << ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers out of range (1e400)
    KV_FAIL(path << ": malformed JSON: " << e.what());
  }
}

std::vector<int64_t> token_ids_of(const nlohmann::json& list, const std::string& where) {
  KV_CHECK(list.is_array(), where << ": expected a JSON list of token ids");
  std::vector<int64_t> ids;
  for (const auto& e : list) {
    KV_CHECK(e.is_number_integer(), where << ": token ids must be integers");
    ids.push_back(e.get<int64_t>());
  }
  return ids;
}

}  // namespace kvserve::cli
