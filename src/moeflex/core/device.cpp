#include "moeflex/core/device.h"

#include <fmt/format.h>

#include "moeflex/core/error.h"

namespace moeflex {

const char* to_string(DeviceKind kind) { return kind == DeviceKind::cuda ? "cuda" : "cpu"; }

DeviceKind parse_device_kind(std::string_view s) {
  if (s == "cpu") return DeviceKind::cpu;
  if (s == "cuda") return DeviceKind::cuda;
  throw ConfigError(fmt::format("device: '{}' is not a device (expected \"cpu\" or \"cuda\")", s));
}

}  // namespace moeflex
