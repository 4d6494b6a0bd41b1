// Model presets for the simulator and the search: Hugging Face config.json files
// under configs/models/ (docs/simulator.md lists their sources), found by name or
// read from a path.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "moeflex/model/config.h"

namespace moeflex::sim {

/// The folder holding configs/: the current directory when it has configs/models,
/// else the repository the running binary was built in (its parent's parent).
std::filesystem::path preset_root();

/// A model by preset name (configs/models/<name>.json) or path to a Hugging Face
/// config.json. Throws ConfigError naming the known presets, DataError for a file
/// that does not parse.
ModelConfig load_model(const std::string& name_or_path, const std::filesystem::path& root);

/// The names of the presets under root/configs/<kind> ("models" or "clusters").
std::vector<std::string> preset_names(const std::filesystem::path& root, const std::string& kind);

}  // namespace moeflex::sim
