// Scratch directories of the test binaries: named after a tag and the process,
// emptied when handed out and removed with everything in them when the binary exits,
// so that repeated test runs leave nothing in the system's temp directory.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace moeflex::test {

/// Removes, at the process's exit, every directory handed to it.
class ScratchRegistry {
 public:
  static ScratchRegistry& instance() {
    static ScratchRegistry r;
    return r;
  }
  void add(const std::filesystem::path& dir) {
    std::lock_guard lock(mu_);
    dirs_.push_back(dir);
  }
  ScratchRegistry(const ScratchRegistry&) = delete;
  ScratchRegistry& operator=(const ScratchRegistry&) = delete;
  ~ScratchRegistry() {
    std::error_code ec;  // another rank may be removing the same directory: never throw
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ec);
  }

 private:
  ScratchRegistry() = default;
  std::mutex mu_;
  std::vector<std::filesystem::path> dirs_;
};

/// `<temp>/<prefix><tag>_<id>`, removed if it exists, and removed again when the
/// binary exits. `id` defaults to this process's pid; ranks of one MPI test pass rank
/// 0's so that they share the directory.
inline std::filesystem::path scratch_dir(const std::string& prefix, const std::string& tag, long id = ::getpid()) {
  const auto d = std::filesystem::temp_directory_path() / (prefix + tag + "_" + std::to_string(id));
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  ScratchRegistry::instance().add(d);
  return d;
}

}  // namespace moeflex::test
