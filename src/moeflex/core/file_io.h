// Durable files, shared by every module that writes results (checkpoints, run
// folders, traces, hardware profiles): a file is written under a temporary name in
// its folder, fsynced and renamed into place, so that a reader finds the old file or
// the whole new one, never a torn one; plus whole-file reads, append-only logs and
// SHA-256 checksums of what was written.
#pragma once
#include <cstddef>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/units.h"

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX

namespace moeflex {

/// Size and SHA-256 (lower-case hex) of a file as written.
struct WrittenFile {
  Bytes bytes = 0;
  std::string sha256;
};

/// Incremental SHA-256 over OpenSSL's EVP interface.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, std::size_t size);
  /// The digest of everything given so far, as lower-case hex.
  std::string hex();

 private:
  std::unique_ptr<evp_md_ctx_st, void (*)(evp_md_ctx_st*)> ctx_;
};

/// A file written under a temporary name in its final directory and renamed
/// into place by commit(); abandoned (unlinked) if destroyed before that.
class AtomicFile {
 public:
  /// Creates the temporary file beside `path`; DataError when it cannot.
  explicit AtomicFile(std::filesystem::path path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  /// Appends `size` bytes; DataError naming the file when the write fails.
  void write(const void* data, std::size_t size);
  /// fsync, rename over the final path, fsync of its directory. Returns the size
  /// and checksum of what was written; DataError on failure.
  WrittenFile commit();

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
  Bytes bytes_ = 0;
  Sha256 sha_;
};

/// SHA-256 of a byte range as lower-case hex.
std::string sha256_hex(const void* data, std::size_t size);

/// Writes `content` to `path` atomically (temporary file, fsync, rename, fsync
/// of the directory). Throws DataError on an I/O failure.
WrittenFile write_file_atomically(const std::filesystem::path& path, std::string_view content);

/// Appends `line` and a newline to `out` (an append-only log such as a run's
/// metrics.jsonl, opened from `path`) and flushes it. Throws DataError naming the file
/// when the write fails (a full disk), so that no line goes missing or torn unnoticed.
void append_line(std::ostream& out, const std::filesystem::path& path, std::string_view line);

/// Reads a whole file. Throws DataError naming it when it cannot be read.
std::vector<char> read_file_bytes(const std::filesystem::path& path);

/// fsyncs a directory so that renames and creations in it are durable.
void fsync_directory(const std::filesystem::path& dir);

}  // namespace moeflex
