// Token datasets: preparing token shards from a corpus, and sampling batches.
//
// Layout of a prepared dataset folder:
//   tokenizer.model / tokenizer.vocab   the BPE tokenizer (tokenizer.h)
//   train_000.bin, train_001.bin, ...   token shards of the training split
//   val_000.bin, ...                    token shards of the validation split
//   dataset.json                        what was prepared from what (written last)
// Each shard is a 32-byte little-endian header followed by the tokens:
//   char magic[8] = "MFTOK\0\0\0"; u32 version = 1; u32 token_bytes (2: uint16,
//   4: int32); u64 token_count; u32 vocab_size; u32 reserved = 0.
// A split is its documents in corpus order, each followed by the eos token;
// shards are cut at document ends once they reach kMaxShardTokens.
//
// Which document goes to validation is decided by the counter-based rng from
// (seed, document index), so the split is reproducible. The tokenizer is
// trained on the training split only.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moeflex/core/units.h"

namespace moeflex {

/// Receives one human-readable progress line (no trailing newline).
using LogFn = std::function<void(const std::string&)>;

constexpr char kShardMagic[8] = {'M', 'F', 'T', 'O', 'K', 0, 0, 0};
constexpr std::uint32_t kShardVersion = 1;
constexpr Bytes kShardHeaderBytes = 32;
constexpr std::int64_t kMaxShardTokens = std::int64_t(1) << 26;
/// Files are cut into documents of at least this size (corpus.h) ...
constexpr Bytes kMaxTargetDocumentBytes = 16 * kKiB;
/// ... or less, so that a small corpus still gives about this many documents.
constexpr std::int64_t kMinTargetDocuments = 20;

enum class Split { kTrain, kVal };
const char* split_name(Split split);

/// What prepare_dataset produced (or found).
struct DatasetInfo {
  std::filesystem::path dir;
  std::string corpus_hash;
  int vocab_size = 0;
  std::int64_t train_documents = 0, val_documents = 0;
  std::int64_t train_tokens = 0, val_tokens = 0;
  bool reused = false;              ///< an existing, matching dataset was kept
  Seconds tokenizer_seconds = 0;    ///< time to train the tokenizer
  Seconds tokenize_seconds = 0;     ///< time to tokenize the corpus
};

/// Prepares a token dataset in `out_dir` from the corpus at `corpus_path`.
/// If `out_dir` already holds a complete dataset for the same corpus content
/// hash and the same settings, it is reused (and `log` says so). Otherwise the
/// tokenizer is trained, the documents tokenized and split, and the shards
/// written: every file goes to a temporary name and is renamed into place, and
/// dataset.json is written last, so an interrupted run leaves no dataset that
/// looks complete. Concurrent calls on one `out_dir` are serialised by a lock.
/// `val_fraction` must be in (0, 1); both splits always get >= 1 document.
/// Throws DataError (corpus problems, fewer than 2 documents, write failures)
/// and ConfigError (bad arguments). `log` defaults to printing on stderr.
DatasetInfo prepare_dataset(const std::filesystem::path& corpus_path, const std::filesystem::path& out_dir,
                            int vocab_size, double val_fraction = 0.05, std::uint64_t seed = 1234,
                            const LogFn& log = {});

/// Writes one token shard (to a temporary file, then renamed).
void write_token_shard(const std::filesystem::path& path, std::span<const std::int32_t> tokens, int vocab_size);
/// Reads and validates one token shard. Throws DataError naming the file for a
/// bad magic, version or dtype, a size that does not match the header
/// (expected vs actual bytes) or a token id >= vocab_size.
std::vector<std::int32_t> read_token_shard(const std::filesystem::path& path, int vocab_size);

/// Which documents of `n` go to the validation split: document i when the
/// counter-based draw of (seed, i) is below val_fraction, moved so that both splits
/// get at least one document when n >= 2. The same arguments give the same split.
std::vector<char> assign_validation_documents(std::size_t n, double val_fraction, std::uint64_t seed);

class MappedFile;
struct MegatronIndex;

/// The token splits, with deterministic batch sampling: a prepared dataset read into
/// memory (open), or a Megatron indexed dataset or flat token file memory-mapped
/// (open_megatron, open_flat). A
/// split is its documents back to back; windows may cross document ends (a prepared
/// dataset closes every document with eos; Megatron data with its own end-of-document
/// token when preprocess_data.py ran with --append-eod).
class TokenDataset {
 public:
  /// Loads `dir`/dataset.json and every shard it lists. Throws DataError.
  static TokenDataset open(const std::filesystem::path& dir);
  /// Maps PREFIX.bin and reads PREFIX.idx (indexed_data.h), splitting the non-empty
  /// documents as assign_validation_documents. Token ids are checked against
  /// `vocab_size` as batches are read. Throws DataError for a malformed index, a
  /// .bin that does not match it, or fewer than 2 non-empty documents.
  static TokenDataset open_megatron(const std::filesystem::path& prefix, int vocab_size, double val_fraction,
                                    std::uint64_t seed);
  /// Maps a flat token file (indexed_data.h: FILE.u16/.uint16 or .u32/.uint32), whose
  /// documents end after each `eos_id` (or are kFlatPieces equal pieces when eos_id is
  /// -1), split as open_megatron. Throws ConfigError for another name, DataError for a
  /// missing file, a size that is not whole tokens, or fewer than 2 documents.
  static TokenDataset open_flat(const std::filesystem::path& file, int vocab_size, double val_fraction,
                                std::uint64_t seed, std::int64_t eos_id);

  int vocab_size() const { return vocab_size_; }
  std::int64_t num_tokens(Split split) const { return part(split).total; }
  /// Where the tokens come from: the prepared folder, the Megatron .bin or the flat file.
  const std::filesystem::path& dir() const { return dir_; }
  /// True for pre-tokenized data that comes without moeflex's tokenizer.
  bool pretokenized() const { return bool(map_); }
  /// SHA-256 of the Megatron index with the .bin's size and sampled hash, or a flat file's
  /// size, eos id and sampled hash ("" for a prepared dataset):
  /// what a resumed run compares to know its data is the same.
  const std::string& identity() const { return identity_; }

  /// Copies tokens [start, start + n) of the split (its documents back to back) to
  /// `out`. Throws DataError for a range outside the split or a token id outside
  /// [0, vocab_size) (naming the file and the token's position in it).
  void copy_tokens(Split split, std::int64_t start, std::int64_t n, std::int32_t* out) const;

  /// Fills inputs[B*S] and targets[B*S] (row-major [B, S]) with B windows of
  /// S+1 consecutive tokens of `split`: inputs are tokens [0, S) of a window,
  /// targets tokens [1, S+1). The windows are a pure function of
  /// (seed, step, micro_batch_index, b), so a resumed run sees the same data.
  /// Throws DataError when the split has fewer than S+1 tokens.
  void sample_batch(Split split, std::uint64_t seed, std::int64_t step, std::int64_t micro_batch_index, int B,
                    int S, std::int32_t* inputs, std::int32_t* targets) const;

  /// Number of validation batches of B windows of S+1 tokens: the windows do
  /// not overlap (except one token, the last target of one is the first input
  /// of the next) and are spread evenly over the validation split; at most
  /// `max_batches` (<= 0: no limit). Throws DataError when the split cannot
  /// fill even one batch.
  std::int64_t num_val_batches(int B, int S, std::int64_t max_batches) const;
  /// Fills batch `index` (< num_val_batches) of that fixed set; the same
  /// arguments always give the same windows.
  void val_batch(std::int64_t index, int B, int S, std::int64_t max_batches, std::int32_t* inputs,
                 std::int32_t* targets) const;

 private:
  /// A split as ranges of the token source: document k holds `total`-relative tokens
  /// [offset[k], offset[k + 1]) and starts at token begin[k] of the source.
  struct Part {
    std::vector<std::int32_t> owned;  ///< a prepared dataset's tokens (the source), else empty
    std::vector<std::int64_t> begin, offset;
    std::int64_t total = 0;
  };
  /// The non-empty documents of `ix` in the mapped `map`, split; `name` heads errors.
  static TokenDataset from_documents(std::shared_ptr<const MappedFile> map, const MegatronIndex& ix,
                                     const std::string& name, int vocab_size, double val_fraction,
                                     std::uint64_t seed);
  const Part& part(Split split) const { return split == Split::kTrain ? train_ : val_; }
  void window(Split split, std::int64_t start, int S, std::int32_t* inputs, std::int32_t* targets) const;

  std::filesystem::path dir_;
  int vocab_size_ = 0;
  Part train_, val_;
  std::shared_ptr<const MappedFile> map_;  ///< the Megatron .bin or flat file, else null
  int token_code_ = 4, token_bytes_ = 4;   ///< the .bin's dtype (indexed_data.h)
  std::string identity_;
};

}  // namespace moeflex
