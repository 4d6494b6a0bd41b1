#include "moeflex/train/indexed_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"

namespace moeflex {
namespace fs = std::filesystem;

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(fmt::format("Cannot open '{}': {}.", path.string(), std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    throw DataError(fmt::format("'{}' is empty or cannot be read.", path.string()));
  }
  void* p = ::mmap(nullptr, std::size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  if (p == MAP_FAILED) throw DataError(fmt::format("Cannot map '{}': {}.", path.string(), std::strerror(err)));
  data_ = static_cast<const std::byte*>(p);
  size_ = Bytes(st.st_size);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), std::size_t(size_));
}

std::optional<fs::path> megatron_prefix(const fs::path& data) {
  const std::string ext = data.extension().string();
  fs::path prefix = data;
  if (ext == ".idx" || ext == ".bin") prefix.replace_extension();
  const fs::path idx = prefix.string() + ".idx", bin = prefix.string() + ".bin";
  if (ext == ".idx" || ext == ".bin" || (fs::is_regular_file(idx) && fs::is_regular_file(bin))) return prefix;
  return std::nullopt;
}

namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr Bytes kIndexHeaderBytes = 9 + 8 + 1 + 8 + 8;

TokenCode token_code(int code, const fs::path& idx) {
  switch (code) {
    case 1: return {1, 1, false};  // uint8
    case 2: return {2, 1, true};   // int8
    case 3: return {3, 2, true};   // int16
    case 4: return {4, 4, true};   // int32
    case 5: return {5, 8, true};   // int64
    case 8: return {8, 2, false};  // uint16
    default:
      throw DataError(fmt::format("'{}': dtype code {} is not an integer token type (1 uint8, 2 int8, 3 int16, "
                                  "4 int32, 5 int64, 8 uint16).", idx.string(), code));
  }
}

template <typename T>
T load(const std::vector<char>& b, Bytes at) {
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  return v;
}

}  // namespace

MegatronIndex read_megatron_index(const fs::path& idx, Bytes bin_bytes) {
  const std::vector<char> b = read_file_bytes(idx);
  const Bytes size = Bytes(b.size());
  auto bad = [&](const std::string& what) { return DataError(fmt::format("Megatron index '{}': {}.", idx.string(), what)); };
  if (size < kIndexHeaderBytes)
    throw bad(fmt::format("{} bytes, shorter than the {}-byte header", size, kIndexHeaderBytes));
  if (std::memcmp(b.data(), kIndexMagic, sizeof(kIndexMagic)) != 0)
    throw bad("no MMIDIDX magic at the start (not an index written by Megatron's indexed dataset)");
  if (const auto version = load<std::uint64_t>(b, 9); version != 1)
    throw bad(fmt::format("version {}; moeflex reads version 1", version));
  MegatronIndex ix;
  ix.dtype = token_code(int(static_cast<unsigned char>(b[17])), idx);
  const auto sc = load<std::uint64_t>(b, 18), dc = load<std::uint64_t>(b, 26);
  const Bytes limit = Bytes(1) << 40;
  if (sc > std::uint64_t(limit) || dc > std::uint64_t(limit))
    throw bad(fmt::format("{} sequences and {} document entries cannot be right", sc, dc));
  const Bytes want = kIndexHeaderBytes + Bytes(sc) * 12 + Bytes(dc) * 8;
  if (size != want && size != want + Bytes(sc))
    throw bad(fmt::format("{} bytes, but {} sequences and {} document entries take {} (or {} with sequence modes)",
                          size, sc, dc, want, want + Bytes(sc)));
  ix.sequences = std::int64_t(sc);
  const Bytes lengths_at = kIndexHeaderBytes, pointers_at = lengths_at + Bytes(sc) * 4;
  const Bytes docs_at = pointers_at + Bytes(sc) * 8;
  std::vector<Bytes> seq_begin(sc + 1, 0);  // byte offsets; seq_begin[sc] = the .bin size
  for (std::uint64_t i = 0; i < sc; ++i) {
    const auto len = load<std::int32_t>(b, lengths_at + Bytes(i) * 4);
    const auto ptr = load<std::int64_t>(b, pointers_at + Bytes(i) * 8);
    if (len < 0) throw bad(fmt::format("sequence {} has length {}", i, len));
    if (ptr != seq_begin[i])
      throw bad(fmt::format("sequence {} starts at byte {}, not at {} where the sequences before it end", i, ptr,
                            seq_begin[i]));
    seq_begin[i + 1] = seq_begin[i] + Bytes(len) * ix.dtype.bytes;
  }
  ix.bin_bytes = seq_begin[sc];
  if (bin_bytes != ix.bin_bytes)
    throw bad(fmt::format("its .bin holds {} bytes, but the index describes {} ({} sequences of {}-byte tokens)",
                          bin_bytes, ix.bin_bytes, sc, ix.dtype.bytes));
  if (dc < 2) throw bad(fmt::format("{} document entries: no document", dc));
  std::int64_t prev = 0;
  for (std::uint64_t d = 0; d < dc; ++d) {
    const auto s = load<std::int64_t>(b, docs_at + Bytes(d) * 8);
    if ((d == 0 && s != 0) || s < prev || s > std::int64_t(sc) || (d + 1 == dc && s != std::int64_t(sc)))
      throw bad(fmt::format("document entry {} is {}: the entries must rise from 0 to the sequence count {}", d, s,
                            sc));
    if (d > 0) {
      ix.doc_begin.push_back(seq_begin[std::size_t(prev)] / ix.dtype.bytes);
      ix.doc_tokens.push_back((seq_begin[std::size_t(s)] - seq_begin[std::size_t(prev)]) / ix.dtype.bytes);
    }
    prev = s;
  }
  ix.index_sha256 = sha256_hex(b.data(), b.size());
  return ix;
}

}  // namespace moeflex

namespace moeflex {

std::optional<TokenCode> flat_token_code(const fs::path& data) {
  const std::string ext = data.extension().string();
  if (ext == ".u16" || ext == ".uint16") return TokenCode{8, 2, false};
  if (ext == ".u32" || ext == ".uint32") return TokenCode{kUint32Code, 4, false};
  return std::nullopt;
}

std::int64_t decode_token(const std::byte* base, int code, std::int64_t i) {
  switch (code) {
    case 1: return std::int64_t(std::to_integer<std::uint8_t>(base[i]));
    case 2: return std::int64_t(static_cast<std::int8_t>(std::to_integer<std::uint8_t>(base[i])));
    case 3: { std::int16_t v; std::memcpy(&v, base + 2 * i, 2); return v; }
    case 8: { std::uint16_t v; std::memcpy(&v, base + 2 * i, 2); return v; }
    case 4: { std::int32_t v; std::memcpy(&v, base + 4 * i, 4); return v; }
    case kUint32Code: { std::uint32_t v; std::memcpy(&v, base + 4 * i, 4); return v; }
    default: { std::int64_t v; std::memcpy(&v, base + 8 * i, 8); return v; }
  }
}

MegatronIndex flat_documents(const std::byte* base, TokenCode code, std::int64_t tokens, std::int64_t eos_id) {
  MegatronIndex ix;
  ix.dtype = code;
  ix.bin_bytes = tokens * code.bytes;
  auto add = [&](std::int64_t begin, std::int64_t end) {
    ix.doc_begin.push_back(begin);
    ix.doc_tokens.push_back(end - begin);
  };
  if (eos_id < 0) {
    const std::int64_t pieces = std::min(kFlatPieces, tokens);
    for (std::int64_t k = 0; k < pieces; ++k) add(tokens * k / pieces, tokens * (k + 1) / pieces);
  } else {
    std::int64_t begin = 0;
    for (std::int64_t i = 0; i < tokens; ++i)
      if (decode_token(base, code.code, i) == eos_id) add(begin, i + 1), begin = i + 1;
    if (begin < tokens) add(begin, tokens);
  }
  ix.sequences = std::int64_t(ix.doc_tokens.size());
  return ix;
}

}  // namespace moeflex
