#pragma once
// The JSON files CLI commands read (token id lists), with errors that name the file.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvserve::cli {

// Parses the file; a missing file or malformed JSON is a KvError naming it.
nlohmann::json read_json_file(const std::string& path);
// A JSON array of integer token ids; `where` names the file in errors.
std::vector<int64_t> token_ids_of(const nlohmann::json& list, const std::string& where);

}  // namespace kvserve::cli
