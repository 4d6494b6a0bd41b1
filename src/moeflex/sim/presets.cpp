// Model presets (see presets.h).
#include "moeflex/sim/presets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>

#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"

namespace moeflex::sim {

namespace fs = std::filesystem;

fs::path preset_root() {
  if (fs::exists("configs/models")) return fs::current_path();
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(exe.parent_path().parent_path() / "configs" / "models")) return exe.parent_path().parent_path();
  return fs::current_path();
}

std::vector<std::string> preset_names(const fs::path& root, const std::string& kind) {
  std::vector<std::string> v;
  if (fs::exists(root / "configs" / kind))
    for (const auto& e : fs::directory_iterator(root / "configs" / kind))
      if (e.path().extension() == ".json") v.push_back(e.path().stem().string());
  std::sort(v.begin(), v.end());
  return v;
}

ModelConfig load_model(const std::string& name_or_path, const fs::path& root) {
  fs::path path = name_or_path;
  if (!fs::is_regular_file(path)) {
    path = root / "configs" / "models" / (name_or_path + ".json");
    if (!fs::is_regular_file(path))
      throw ConfigError(fmt::format("model '{}' is neither a file nor a preset (known presets: {})", name_or_path,
                                    fmt::join(preset_names(root, "models"), ", ")));
  }
  std::ifstream in(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("{}: not valid JSON ({})", path.string(), e.what()));
  }
  ModelConfig c = ModelConfig::from_hf_json(j, path.string());
  try {
    c.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", path.string(), e.what()));
  }
  return c;
}

}  // namespace moeflex::sim
