// `moeflex calibrate --device KIND`: the device calibration (profile/calibrate_device.h)
// at the shapes of a run config (train_config.h), which is why it lives here rather
// than in profile/, which knows no run configs.
#pragma once
#include <filesystem>
#include <string>

#include "moeflex/core/units.h"
#include "moeflex/profile/calibrate_device.h"

namespace moeflex {

/// `moeflex calibrate --device KIND [--config FILE] [--seconds S] [--out FILE]`:
/// calibrate_device on a fresh context of `device` ("cuda"; "cpu" runs the generic
/// measurement on the CPU backend, for testing it) at the model and micro-batch of
/// the run config `config_path` (default: the built-in default config), prints the
/// tables' sizes and writes the profile to `out_path` atomically. Returns 0.
/// Throws ConfigError for an unknown device or a build without it.
int run_device_calibrate_command(const std::string& device, const std::string& config_path,
                                 const std::filesystem::path& out_path, Seconds budget);

}  // namespace moeflex
