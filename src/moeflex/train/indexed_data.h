// Pre-tokenized data in Megatron-LM's indexed dataset format: PREFIX.idx (the index)
// and PREFIX.bin (the tokens), as megatron/core/datasets/indexed_dataset.py and
// tools/preprocess_data.py write them. The .bin file is memory-mapped, never read
// whole.
//
// PREFIX.idx, little-endian, no padding:
//   char magic[9] = "MMIDIDX\0\0"; u64 version = 1; u8 dtype code (1 uint8, 2 int8,
//   3 int16, 4 int32, 5 int64, 8 uint16; 6 and 7, float64 and float32, are not
//   tokens); u64 sequence_count; u64 document_count;
//   i32 sequence_lengths[sequence_count]      tokens of each sequence
//   i64 sequence_pointers[sequence_count]     byte offset of each sequence in .bin
//   i64 document_indices[document_count]      0, then the sequence index where each
//                                             document ends (so documents + 1 entries)
//   [i8 sequence_modes[sequence_count]]       multimodal datasets only; ignored
// PREFIX.bin: the sequences back to back, each sequence_lengths[i] tokens of the dtype.
// A document is sequences [document_indices[d], document_indices[d + 1]).
//
// A flat token file (FILE.u16 / FILE.uint16, FILE.u32 / FILE.uint32) is the tokens and
// nothing else, little-endian unsigned, as nanoGPT's prepare scripts write uint16; its
// documents end after each end-of-document id when one is named (data.eos_id).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "moeflex/core/units.h"

namespace moeflex {

/// A whole file mapped read-only (mmap); unmapped on destruction.
class MappedFile {
 public:
  /// Maps `path`. Throws DataError naming it when it cannot be opened or mapped, or is empty.
  explicit MappedFile(const std::filesystem::path& path);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const std::byte* data() const { return data_; }
  Bytes size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  Bytes size_ = 0;
};

/// The token width and signedness of a Megatron dtype code.
struct TokenCode {
  int code = 4;        ///< the .idx dtype code; kUint32Code for a flat uint32 file
  int bytes = 4;       ///< bytes per token
  bool is_signed = true;
};

/// The code of flat uint32 tokens (Megatron's index has no uint32 type).
inline constexpr int kUint32Code = 9;
/// Pieces a flat file without an end-of-document id is cut into, as documents.
inline constexpr std::int64_t kFlatPieces = 100;

/// The token code of a flat token file by its name's ending (.u16/.uint16 uint16,
/// .u32/.uint32 uint32); nullopt for any other name.
std::optional<TokenCode> flat_token_code(const std::filesystem::path& data);

/// Token `i` of `base` holding tokens of `code`, widened.
std::int64_t decode_token(const std::byte* base, int code, std::int64_t i);

/// The documents of a Megatron index, as token ranges of the .bin file.
struct MegatronIndex {
  TokenCode dtype;
  std::int64_t sequences = 0;
  Bytes bin_bytes = 0;                              ///< what the index says .bin holds
  std::string index_sha256;                         ///< of the .idx file's bytes (empty for a flat file)
  std::vector<std::int64_t> doc_begin, doc_tokens;  ///< per document: first token (in .bin) and length
};

/// The documents of a flat file of `tokens` tokens of `code` at `base`: each ends after
/// an `eos_id` token (the last may end without one); eos_id < 0 cuts the file into
/// min(kFlatPieces, tokens) pieces of nearly equal size. Reads every token when
/// eos_id >= 0 (one pass over the mapping).
MegatronIndex flat_documents(const std::byte* base, TokenCode code, std::int64_t tokens, std::int64_t eos_id);

/// PREFIX when `data` names a Megatron dataset: PREFIX.idx or PREFIX.bin itself, or a
/// prefix beside which both files exist; nullopt for anything else (a text corpus).
std::optional<std::filesystem::path> megatron_prefix(const std::filesystem::path& data);

/// Reads and checks the index `idx` against a .bin file of `bin_bytes` bytes. Throws
/// DataError naming the file and what is wrong: a short file, the magic, the version,
/// a dtype that is not an integer type, a size that does not match the counts
/// (expected vs actual bytes), document indices that do not run from 0 up to the
/// sequence count, negative lengths, sequence pointers that are not the running sum
/// of the lengths, or a .bin of another size than the index describes.
MegatronIndex read_megatron_index(const std::filesystem::path& idx, Bytes bin_bytes);

}  // namespace moeflex
