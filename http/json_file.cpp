#include "json_file.h"

#include <fstream>

#include "kv_check.h"

namespace kvserve::cli {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  KV_CHECK(f, path << ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::parse_error& e) {
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
