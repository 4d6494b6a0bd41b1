// A byte-level-safe BPE tokenizer: a thin wrapper over SentencePiece.
//
// Training settings and why:
//  - model_type=bpe, byte_fallback=true: any byte sequence encodes (characters
//    missing from the vocabulary become <0xNN> byte pieces), so no <unk>.
//  - normalization_rule_name=identity, remove_extra_whitespaces=false: the
//    text is not rewritten, so decode(encode(s)) == s for any valid UTF-8 s.
//  - split_digits=true: numbers are spelled digit by digit.
//  - Newlines: SentencePiece works on lines. encode() cuts the text at '\n',
//    encodes each line on its own (each gets the usual "▁" word-start prefix)
//    and joins them with the <0x0A> byte piece; decode() reverses that. The
//    trainer sees the same lines, so the pieces it learns match what encode
//    produces.
//  - Determinism: the training lines are subsampled by our own counter-based
//    rng (not SentencePiece's shuffler), lines over kMaxTrainingLineBytes are
//    cut at spaces (SentencePiece would silently drop them) and num_threads=1.
//    The same documents and options give a byte-identical model file.
//  - A vocabulary larger than the corpus supports is an error (DataError that
//    names the requested and the possible size), never a silently smaller one,
//    because the model's embedding size is taken from vocab_size().
//
// Ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos), then 256 byte pieces, then merges.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/units.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace moeflex {

/// Options of Tokenizer::train beyond the vocabulary size.
struct TokenizerTrainOptions {
  /// Cap on the text fed to the trainer; above it, lines are subsampled
  /// (the 5.7 MiB Brown corpus trains a 4096-piece BPE in ~4.5 s on one core).
  Bytes max_training_bytes = 8 * kMiB;
  /// Seed of the subsampling.
  std::uint64_t seed = 0;
  /// Print SentencePiece's own progress log to stderr.
  bool verbose = false;
};

/// Lines longer than this are cut at spaces before training.
constexpr Bytes kMaxTrainingLineBytes = 4096;

class Tokenizer {
 public:
  /// Trains a BPE model on `docs` and writes `model_prefix`.model and
  /// `model_prefix`.vocab (written to temporary names, then renamed).
  /// Throws ConfigError for a vocab_size below kMinVocabSize, and DataError
  /// when the corpus has no text, cannot support vocab_size pieces (too
  /// large), or has more distinct characters than fit (too small; the
  /// message quotes SentencePiece's numbers).
  static void train(const std::vector<std::string>& docs, const std::string& model_prefix, int vocab_size,
                    const TokenizerTrainOptions& options = {});

  /// Loads a model written by train(). Throws DataError naming the path.
  static Tokenizer load(const std::string& model_path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// Token ids of `text`, without bos/eos.
  std::vector<std::int32_t> encode(std::string_view text) const;
  /// Text of `ids`; control ids (bos, eos) decode to nothing.
  /// Throws DataError for an id outside [0, vocab_size()).
  std::string decode(std::span<const std::int32_t> ids) const;
  /// The piece of one id, e.g. "▁the" or "<0x0A>" (for debugging and tests).
  std::string id_to_piece(std::int32_t id) const;

  int vocab_size() const { return vocab_size_; }
  std::int32_t bos_id() const { return bos_id_; }
  std::int32_t eos_id() const { return eos_id_; }
  std::int32_t unk_id() const { return unk_id_; }
  std::int32_t newline_id() const { return newline_id_; }

  /// Smallest vocabulary: 3 special pieces + 256 byte pieces + a few merges.
  static constexpr int kMinVocabSize = 3 + 256 + 8;

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  int vocab_size_ = 0;
  std::int32_t bos_id_ = -1, eos_id_ = -1, unk_id_ = -1, newline_id_ = -1;
};

}  // namespace moeflex
