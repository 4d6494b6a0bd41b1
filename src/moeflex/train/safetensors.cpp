#include "moeflex/train/safetensors.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "moeflex/core/error.h"

namespace moeflex::train {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; moeflex copies it without byte swapping");

namespace fs = std::filesystem;

namespace {

// The reference implementation refuses headers above 100 MB; a larger length is
// corruption, not a model, and must not make us allocate gigabytes.
constexpr Bytes kMaxHeaderBytes = 100'000'000;
// Header plus length prefix are padded to this so the data buffer is aligned.
constexpr Bytes kHeaderAlignment = 8;

std::string shape_text(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

/// Element count of a shape, or -1 when a dimension is negative or the count of
/// bytes would overflow.
std::int64_t checked_numel(const std::vector<std::int64_t>& shape, Bytes elem_size) {
  std::int64_t n = 1;
  const std::int64_t limit = std::numeric_limits<std::int64_t>::max() / elem_size;
  for (std::int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > limit / d) return -1;
    n *= d;
  }
  return n;
}

bool parse_dtype(std::string_view s, StDType* out) {
  for (StDType t : {StDType::F32, StDType::F64, StDType::I32, StDType::I64, StDType::BF16, StDType::F16})
    if (st_dtype_name(t) == s) {
      *out = t;
      return true;
    }
  return false;
}

/// A non-negative JSON integer that fits int64, or -1.
std::int64_t json_index(const nlohmann::json& j) {
  if (j.is_number_unsigned()) {
    auto v = j.get<std::uint64_t>();
    return v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ? -1
                                                                                    : static_cast<std::int64_t>(v);
  }
  if (j.is_number_integer()) {
    auto v = j.get<std::int64_t>();
    return v < 0 ? -1 : v;
  }
  return -1;
}

}  // namespace

Bytes st_dtype_size(StDType t) {
  switch (t) {
    case StDType::F32:
    case StDType::I32:
      return 4;
    case StDType::F64:
    case StDType::I64:
      return 8;
    case StDType::BF16:
    case StDType::F16:
      return 2;
  }
  return 0;
}

std::string_view st_dtype_name(StDType t) {
  switch (t) {
    case StDType::F32: return "F32";
    case StDType::F64: return "F64";
    case StDType::I32: return "I32";
    case StDType::I64: return "I64";
    case StDType::BF16: return "BF16";
    case StDType::F16: return "F16";
  }
  return "?";
}

std::int64_t TensorInfo::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// ---- Writer ----

void SafetensorsWriter::add(std::string name, StDType dtype, std::vector<std::int64_t> shape, const void* data) {
  if (name.empty() || name == "__metadata__")
    throw Error(fmt::format("A safetensors tensor cannot be named '{}'.", name));
  for (const Entry& e : entries_)
    if (e.name == name) throw Error(fmt::format("Tensor '{}' was added twice to one safetensors file.", name));
  std::int64_t n = checked_numel(shape, st_dtype_size(dtype));
  if (n < 0) throw Error(fmt::format("Tensor '{}' has an invalid shape {}.", name, shape_text(shape)));
  if (n > 0 && data == nullptr) throw Error(fmt::format("Tensor '{}' has {} elements but no data.", name, n));
  entries_.push_back(Entry{std::move(name), dtype, std::move(shape), data});
}

WrittenFile SafetensorsWriter::write(const fs::path& path, const std::map<std::string, std::string>& metadata) const {
  // ordered_json keeps the header in data order, which makes files easy to read.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  Bytes offset = 0;
  std::vector<Bytes> sizes;
  for (const Entry& e : entries_) {
    Bytes size = checked_numel(e.shape, st_dtype_size(e.dtype)) * st_dtype_size(e.dtype);
    header[e.name] = {{"dtype", st_dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + size}}};
    sizes.push_back(size);
    offset += size;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % kHeaderAlignment != 0) text += ' ';

  AtomicFile f(path);
  unsigned char len_le[8];
  std::uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(len >> (8 * i));
  f.write(len_le, sizeof len_le);
  f.write(text.data(), text.size());
  for (std::size_t i = 0; i < entries_.size(); ++i)
    if (sizes[i] > 0) f.write(entries_[i].data, static_cast<std::size_t>(sizes[i]));
  return f.commit();
}

// ---- Reader ----

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  if (!fs::exists(path)) throw DataError(fmt::format("Safetensors file '{}' does not exist.", path.string()));
  return from_bytes(read_file_bytes(path), path.string());
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<char> bytes, std::string source) {
  SafetensorsFile f;
  f.source_ = std::move(source);
  f.bytes_ = std::move(bytes);
  const std::string& src = f.source_;
  const Bytes file_size = static_cast<Bytes>(f.bytes_.size());

  if (file_size < 8)
    throw DataError(fmt::format("Safetensors file '{}' is truncated: it has {} bytes, fewer than the 8-byte "
                                "header length.",
                                src, file_size));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(f.bytes_[i]);
  if (n > static_cast<std::uint64_t>(kMaxHeaderBytes))
    throw DataError(fmt::format("Safetensors file '{}' is corrupt: its header length is {} bytes, above the "
                                "{}-byte limit.",
                                src, n, kMaxHeaderBytes));
  const Bytes header_len = static_cast<Bytes>(n);
  if (header_len > file_size - 8)
    throw DataError(fmt::format("Safetensors file '{}' is truncated: the header needs {} bytes after the length "
                                "but only {} follow.",
                                src, header_len, file_size - 8));
  if (header_len == 0 || f.bytes_[8] != '{')
    throw DataError(fmt::format("Safetensors file '{}' is corrupt: its header does not start with '{{'.", src));

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(f.bytes_.begin() + 8, f.bytes_.begin() + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("Safetensors file '{}' is corrupt: its header is not valid JSON ({}).", src, e.what()));
  }
  if (!header.is_object())
    throw DataError(fmt::format("Safetensors file '{}' is corrupt: its header is not a JSON object.", src));

  f.data_start_ = 8 + header_len;
  const Bytes buffer_size = file_size - f.data_start_;
  std::vector<std::pair<std::string, TensorInfo>> tensors;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw DataError(fmt::format("Safetensors file '{}' is corrupt: '__metadata__' is not an object.", src));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw DataError(fmt::format("Safetensors file '{}' is corrupt: metadata value '{}' is not a string.", src, k));
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return DataError(fmt::format("Safetensors file '{}' is corrupt: tensor '{}' {}.", src, name, what));
    };
    if (!entry.is_object()) throw bad("is not described by a JSON object");
    TensorInfo info;
    auto dt = entry.find("dtype");
    if (dt == entry.end() || !dt->is_string()) throw bad("has no string 'dtype'");
    if (!parse_dtype(dt->get<std::string>(), &info.dtype))
      throw DataError(fmt::format("Safetensors file '{}': tensor '{}' has dtype '{}', which moeflex does not support "
                                  "(supported: F32, F64, BF16, F16, I32, I64).",
                                  src, name, dt->get<std::string>()));
    auto sh = entry.find("shape");
    if (sh == entry.end() || !sh->is_array()) throw bad("has no 'shape' array");
    for (const auto& d : *sh) {
      std::int64_t v = json_index(d);
      if (v < 0) throw bad(fmt::format("has an invalid shape {}", sh->dump()));
      info.shape.push_back(v);
    }
    auto off = entry.find("data_offsets");
    if (off == entry.end() || !off->is_array() || off->size() != 2)
      throw bad("has no 'data_offsets' pair [begin, end]");
    info.begin = json_index((*off)[0]);
    info.end = json_index((*off)[1]);
    if (info.begin < 0 || info.end < 0 || info.begin > info.end)
      throw bad(fmt::format("has invalid data_offsets {}", off->dump()));
    const Bytes esize = st_dtype_size(info.dtype);
    std::int64_t numel = checked_numel(info.shape, esize);
    if (numel < 0) throw bad(fmt::format("has a shape {} too large to address", shape_text(info.shape)));
    if (info.end - info.begin != numel * esize)
      throw bad(fmt::format("spans {} bytes but its shape {} of {} needs {} bytes", info.end - info.begin,
                            shape_text(info.shape), st_dtype_name(info.dtype), numel * esize));
    if (info.end > buffer_size)
      throw DataError(fmt::format("Safetensors file '{}' is truncated: tensor '{}' ends at byte {} of the data "
                                  "buffer, but the buffer has only {} bytes.",
                                  src, name, info.end, buffer_size));
    tensors.emplace_back(name, std::move(info));
  }

  // The tensors must tile the buffer exactly: no gaps, no overlaps, no tail.
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second.begin, a.second.end) < std::tie(b.second.begin, b.second.end);
  });
  Bytes expected = 0;
  for (const auto& [name, info] : tensors) {
    if (info.begin != expected)
      throw DataError(fmt::format("Safetensors file '{}' is corrupt: tensor '{}' starts at byte {} of the data "
                                  "buffer, but the previous tensor ends at byte {} ({}).",
                                  src, name, info.begin, expected, info.begin < expected ? "overlap" : "gap"));
    expected = info.end;
  }
  if (expected != buffer_size)
    throw DataError(fmt::format("Safetensors file '{}' is corrupt: its tensors cover {} bytes but the data buffer "
                                "has {} bytes.",
                                src, expected, buffer_size));
  for (auto& [name, info] : tensors) {
    f.names_.push_back(name);
    f.infos_.emplace(name, std::move(info));
  }
  return f;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = infos_.find(name);
  if (it == infos_.end())
    throw DataError(fmt::format("Safetensors file '{}' has no tensor named '{}'.", source_, name));
  return it->second;
}

const TensorInfo& SafetensorsFile::checked(const std::string& name, std::int64_t expected_numel) const {
  const TensorInfo& ti = info(name);
  if (ti.numel() != expected_numel)
    throw DataError(fmt::format("Tensor '{}' in '{}' has shape {} ({} elements), but {} elements were expected.",
                                name, source_, shape_text(ti.shape), ti.numel(), expected_numel));
  return ti;
}

namespace {
template <typename Dst, typename Src>
void convert_copy(const char* src, Dst* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    Src v;
    std::memcpy(&v, src + i * sizeof(Src), sizeof(Src));
    dst[i] = static_cast<Dst>(v);
  }
}
/// The float a bfloat16's bits stand for (its top 16 bits).
float bf16_bits_to_float(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// The float an IEEE 754 binary16's bits stand for (subnormals, infinities and NaN included).
float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(float(frac), -24);  // subnormal (or zero): frac * 2^-24
  } else if (exp == 31) {
    magnitude = frac ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(float(frac | 0x400), int(exp) - 25);  // (1024 + frac) * 2^(exp-15-10)
  }
  std::uint32_t u;
  std::memcpy(&u, &magnitude, 4);
  u |= sign;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void SafetensorsFile::read_f32(const std::string& name, float* dst, std::int64_t expected_numel) const {
  const TensorInfo& ti = checked(name, expected_numel);
  const std::int64_t n = expected_numel;
  if (ti.dtype == StDType::F32) {
    if (n > 0) std::memcpy(dst, data_of(ti), static_cast<std::size_t>(n) * sizeof(float));
  } else if (ti.dtype == StDType::F64) {
    convert_copy<float, double>(data_of(ti), dst, n);
  } else if (ti.dtype == StDType::BF16 || ti.dtype == StDType::F16) {
    const char* src = data_of(ti);
    const bool bf16 = ti.dtype == StDType::BF16;
    for (std::int64_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = bf16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  } else {
    throw DataError(fmt::format("Tensor '{}' in '{}' has dtype {}; a floating-point tensor (F32, F64, BF16 or F16) "
                                "was expected.", name, source_, st_dtype_name(ti.dtype)));
  }
}

void SafetensorsFile::read_f64(const std::string& name, double* dst, std::int64_t expected_numel) const {
  const TensorInfo& ti = checked(name, expected_numel);
  const std::int64_t n = expected_numel;
  if (ti.dtype == StDType::F64) {
    if (n > 0) std::memcpy(dst, data_of(ti), static_cast<std::size_t>(n) * sizeof(double));
  } else if (ti.dtype == StDType::F32) {
    convert_copy<double, float>(data_of(ti), dst, n);
  } else {
    throw DataError(fmt::format("Tensor '{}' in '{}' has dtype {}; a floating-point tensor (F32 or F64) was expected.",
                                name, source_, st_dtype_name(ti.dtype)));
  }
}

void SafetensorsFile::read_i32(const std::string& name, std::int32_t* dst, std::int64_t expected_numel) const {
  const TensorInfo& ti = checked(name, expected_numel);
  const std::int64_t n = expected_numel;
  if (ti.dtype == StDType::I32) {
    if (n > 0) std::memcpy(dst, data_of(ti), static_cast<std::size_t>(n) * sizeof(std::int32_t));
  } else if (ti.dtype == StDType::I64) {
    const char* src = data_of(ti);
    // Check every value before writing any, so a refused read leaves dst alone.
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t v;
      std::memcpy(&v, src + i * 8, 8);
      if (v < std::numeric_limits<std::int32_t>::min() || v > std::numeric_limits<std::int32_t>::max())
        throw DataError(fmt::format("Tensor '{}' in '{}' holds {} at index {}, which does not fit in I32.", name,
                                    source_, v, i));
    }
    convert_copy<std::int32_t, std::int64_t>(src, dst, n);
  } else {
    throw DataError(fmt::format("Tensor '{}' in '{}' has dtype {}; an integer tensor (I32 or I64) was expected.", name,
                                source_, st_dtype_name(ti.dtype)));
  }
}

void SafetensorsFile::read_i64(const std::string& name, std::int64_t* dst, std::int64_t expected_numel) const {
  const TensorInfo& ti = checked(name, expected_numel);
  const std::int64_t n = expected_numel;
  if (ti.dtype == StDType::I64) {
    if (n > 0) std::memcpy(dst, data_of(ti), static_cast<std::size_t>(n) * sizeof(std::int64_t));
  } else if (ti.dtype == StDType::I32) {
    convert_copy<std::int64_t, std::int32_t>(data_of(ti), dst, n);
  } else {
    throw DataError(fmt::format("Tensor '{}' in '{}' has dtype {}; an integer tensor (I32 or I64) was expected.", name,
                                source_, st_dtype_name(ti.dtype)));
  }
}

}  // namespace moeflex::train
