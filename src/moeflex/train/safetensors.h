// safetensors reading and writing (https://huggingface.co/docs/safetensors).
//
// File layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
//   {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string>"}}
// (padded with spaces to an 8-byte boundary), then the data buffer; offsets are
// relative to the buffer's start, the tensors tile it without gaps or overlap,
// and the data is row-major little-endian.
//
// Only the dtypes moeflex stores are supported: F32, F64, I32, I64. Files are
// read whole into memory and validated completely before any tensor is served,
// so a truncated or corrupt file is refused with a DataError naming the file.
#pragma once
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/file_io.h"
#include "moeflex/core/units.h"

namespace moeflex::train {

/// Element types of a safetensors tensor that moeflex reads and writes (BF16 and F16,
/// the dtypes of published checkpoints, are read into float).
enum class StDType { F32, F64, I32, I64, BF16, F16 };

/// Size of one element in bytes.
Bytes st_dtype_size(StDType t);
/// The spec's spelling: "F32", "F64", "I32", "I64", "BF16", "F16".
std::string_view st_dtype_name(StDType t);

/// What the header says about one tensor.
struct TensorInfo {
  StDType dtype = StDType::F32;  ///< element type
  std::vector<std::int64_t> shape;  ///< row-major extents; empty for a scalar
  Bytes begin = 0;  ///< offset of the first byte, relative to the data buffer
  Bytes end = 0;    ///< one past the last byte, relative to the data buffer
  std::int64_t numel() const;
};

/// Collects tensors and writes them as one safetensors file. Only pointers are
/// kept: every `data` must stay valid and unchanged until write() returns.
class SafetensorsWriter {
 public:
  /// Adds a tensor; names must be unique, non-empty and not "__metadata__".
  /// `data` may be null only when the shape has no elements.
  void add(std::string name, StDType dtype, std::vector<std::int64_t> shape, const void* data);

  /// Writes the file atomically: a temporary file in the same directory, fsync,
  /// rename over `path`, fsync of the directory. Returns its size and checksum.
  WrittenFile write(const std::filesystem::path& path,
                    const std::map<std::string, std::string>& metadata = {}) const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<std::int64_t> shape;
    const void* data;
  };
  std::vector<Entry> entries_;
};

/// A validated safetensors file held in memory.
class SafetensorsFile {
 public:
  /// Reads and validates `path`. Throws DataError on a missing, truncated or
  /// corrupt file.
  static SafetensorsFile open(const std::filesystem::path& path);
  /// Validates bytes already read; `source` names them in error messages.
  static SafetensorsFile from_bytes(std::vector<char> bytes, std::string source);

  /// Tensor names in the order of their data in the file.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return infos_.count(name) != 0; }
  /// Throws DataError naming the file when there is no such tensor.
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }

  /// Copies tensor `name` into dst, which holds `expected_numel` elements.
  /// read_f32 converts F64, BF16 and F16 and read_f64 converts F32; read_i32 narrows I64 when
  /// every value fits, read_i64 widens I32. Other conversions, a missing
  /// tensor or a different element count throw DataError.
  void read_f32(const std::string& name, float* dst, std::int64_t expected_numel) const;
  void read_f64(const std::string& name, double* dst, std::int64_t expected_numel) const;
  void read_i32(const std::string& name, std::int32_t* dst, std::int64_t expected_numel) const;
  void read_i64(const std::string& name, std::int64_t* dst, std::int64_t expected_numel) const;

 private:
  const char* data_of(const TensorInfo& info) const { return bytes_.data() + data_start_ + info.begin; }
  const TensorInfo& checked(const std::string& name, std::int64_t expected_numel) const;

  std::string source_;
  std::vector<char> bytes_;
  Bytes data_start_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, TensorInfo> infos_;
  std::map<std::string, std::string> metadata_;
};

// The file helpers (WrittenFile, write_file_atomically, read_file_bytes, append_line,
// fsync_directory, sha256_hex) are in core/file_io.h.

}  // namespace moeflex::train
