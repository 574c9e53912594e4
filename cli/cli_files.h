#pragma once
// The files CLI commands read (config, template and token-id files), with errors that name the file.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvserve::cli {

// The file's bytes; nullopt when it cannot be opened.
std::optional<std::string> try_read_text_file(const std::string& path);
// The file's bytes; a KvError "<path>: cannot open" when it cannot be opened.
std::string read_text_file(const std::string& path);
// Parses the file; a missing file or malformed JSON is a KvError naming it.
nlohmann::json read_json_file(const std::string& path);
// A JSON array of integer token ids; `where` names the file in errors.
std::vector<int64_t> token_ids_of(const nlohmann::json& list, const std::string& where);

}  // namespace kvserve::cli
