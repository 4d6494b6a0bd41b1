#include "moeflex/train/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <filesystem>
#include <fmt/format.h>
#include <unordered_map>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/core/rng.h"

namespace moeflex {
namespace fs = std::filesystem;

namespace {

// rng stream of the training-line subsampling.
constexpr std::uint64_t kSubsampleStream = 0x70C3A1;

// Feeds prepared lines to the SentencePiece trainer without a temporary file.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string_view>& lines) : lines_(lines) { load(); }
  bool done() const override { return index_ >= lines_.size(); }
  void Next() override {
    ++index_;
    load();
  }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void load() {
    if (index_ < lines_.size()) current_.assign(lines_[index_]);
  }
  const std::vector<std::string_view>& lines_;
  std::size_t index_ = 0;
  std::string current_;
};

bool blank(std::string_view s) { return s.find_first_not_of(" \t\r\f\v") == std::string_view::npos; }

// Appends the lines of `doc` to `out`, cutting lines longer than
// kMaxTrainingLineBytes at a space (or hard, at a UTF-8 boundary, if none).
void append_training_lines(std::string_view doc, std::vector<std::string_view>& out) {
  std::size_t begin = 0;
  while (begin <= doc.size()) {
    std::size_t end = doc.find('\n', begin);
    if (end == std::string_view::npos) end = doc.size();
    std::string_view line = doc.substr(begin, end - begin);
    while (Bytes(line.size()) > kMaxTrainingLineBytes) {
      std::size_t cut = line.rfind(' ', std::size_t(kMaxTrainingLineBytes));
      if (cut == std::string_view::npos || cut == 0) {
        cut = std::size_t(kMaxTrainingLineBytes);
        while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
      }
      if (!blank(line.substr(0, cut))) out.push_back(line.substr(0, cut));
      line.remove_prefix(cut);
    }
    if (!blank(line)) out.push_back(line);
    if (end == doc.size()) break;
    begin = end + 1;
  }
}

}  // namespace

Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::train(const std::vector<std::string>& docs, const std::string& model_prefix, int vocab_size,
                      const TokenizerTrainOptions& options) {
  if (vocab_size < kMinVocabSize)
    throw ConfigError(fmt::format("vocab_size must be at least {} (3 special pieces, 256 byte pieces and some "
                                  "merges), got {}.", kMinVocabSize, vocab_size));
  if (options.max_training_bytes <= 0)
    throw ConfigError(fmt::format("max_training_bytes must be positive, got {}.", options.max_training_bytes));

  std::vector<std::string_view> all;
  Bytes total = 0;
  for (const std::string& d : docs) append_training_lines(d, all);
  for (std::string_view l : all) total += Bytes(l.size());
  if (all.empty()) throw DataError("Cannot train a tokenizer: the documents hold no non-blank line of text.");

  std::vector<std::string_view> lines;
  if (total <= options.max_training_bytes) {
    lines = std::move(all);
  } else {
    const double keep = double(options.max_training_bytes) / double(total);
    for (std::size_t i = 0; i < all.size(); ++i)
      if (uniform01(options.seed, kSubsampleStream, i) < keep) lines.push_back(all[i]);
    if (lines.empty()) lines.push_back(all.front());
  }

  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", "0.9995"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"split_digits", "true"},
      {"max_sentence_length", std::to_string(kMaxTrainingLineBytes)},
      {"input_sentence_size", "0"},  // we subsample ourselves, deterministically
      {"shuffle_input_sentence", "false"},
      {"num_threads", "1"},
      {"hard_vocab_limit", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", options.verbose ? "0" : "2"},
  };
  LineIterator it(lines);
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &it, &model);
  if (!status.ok()) {
    std::string msg = status.ToString();
    while (!msg.empty() && (msg.back() == '.' || msg.back() == ' ')) msg.pop_back();
    if (const auto at = msg.find("Vocabulary size too high"); at != std::string::npos)
      throw DataError(fmt::format("Cannot train a tokenizer with vocab_size {} on this corpus ({} bytes of "
                                  "training text); SentencePiece says: {}. Use a smaller vocab_size or a "
                                  "larger corpus.", vocab_size, total, msg.substr(at)));
    if (const auto at = msg.find("Vocabulary size is smaller than required_chars"); at != std::string::npos)
      throw DataError(fmt::format("Cannot train a tokenizer with vocab_size {}: this corpus has more distinct "
                                  "characters than fit beside the 256 byte pieces; SentencePiece says: {}. Use a "
                                  "larger vocab_size.", vocab_size, msg.substr(at)));
    throw DataError(fmt::format("Training the tokenizer '{}.model' failed: {}.", model_prefix, msg));
  }

  // Check the result before publishing it: a BPE that ran out of merges stops
  // early instead of failing, which would shrink the model's vocabulary.
  Tokenizer trained;
  const auto load_status = trained.sp_->LoadFromSerializedProto(model);
  if (!load_status.ok())
    throw DataError(fmt::format("The trained tokenizer cannot be loaded back: {}.", load_status.ToString()));
  const int got = trained.sp_->GetPieceSize();
  if (got != vocab_size)
    throw DataError(fmt::format("Cannot train a tokenizer with vocab_size {} on this corpus: its {} bytes of "
                                "training text support only {} pieces. Use vocab_size <= {} or a larger corpus.",
                                vocab_size, total, got, got));

  const fs::path prefix(model_prefix);
  if (prefix.has_parent_path()) fs::create_directories(prefix.parent_path());
  std::string vocab;
  for (int id = 0; id < got; ++id)
    vocab += fmt::format("{}\t{}\n", trained.sp_->IdToPiece(id), trained.sp_->GetScore(id));
  write_file_atomically(model_prefix + ".vocab", vocab);
  write_file_atomically(model_prefix + ".model", model);
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::error_code ec;
  if (!fs::is_regular_file(model_path, ec))
    throw DataError(fmt::format("Tokenizer model '{}' does not exist.", model_path));
  Tokenizer t;
  const auto status = t.sp_->Load(model_path);
  if (!status.ok())
    throw DataError(fmt::format("Cannot load tokenizer model '{}': {}.", model_path, status.ToString()));
  t.vocab_size_ = t.sp_->GetPieceSize();
  t.bos_id_ = t.sp_->bos_id();
  t.eos_id_ = t.sp_->eos_id();
  t.unk_id_ = t.sp_->unk_id();
  t.newline_id_ = t.sp_->PieceToId("<0x0A>");
  if (t.bos_id_ < 0 || t.eos_id_ < 0 || t.newline_id_ == t.unk_id_ || !t.sp_->IsByte(t.newline_id_))
    throw DataError(fmt::format("Tokenizer model '{}' lacks bos/eos pieces or byte fallback; train it with "
                                "moeflex (Tokenizer::train).", model_path));
  return t;
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  std::vector<int> ids;
  std::size_t begin = 0;
  for (;;) {
    std::size_t end = text.find('\n', begin);
    const std::string_view line = text.substr(begin, end == std::string_view::npos ? end : end - begin);
    if (!line.empty()) {
      const auto status = sp_->Encode(line, &ids);
      if (!status.ok()) throw DataError(fmt::format("Tokenizing text failed: {}.", status.ToString()));
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (end == std::string_view::npos) break;
    out.push_back(newline_id_);
    begin = end + 1;
  }
  return out;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string out, piece;
  std::vector<int> segment;
  auto flush = [&] {
    if (segment.empty()) return;
    const auto status = sp_->Decode(segment, &piece);
    if (!status.ok()) throw DataError(fmt::format("Detokenizing failed: {}.", status.ToString()));
    out += piece;
    segment.clear();
  };
  for (std::int32_t id : ids) {
    if (id < 0 || id >= vocab_size_)
      throw DataError(fmt::format("Cannot decode token id {}: the vocabulary has ids 0..{}.", id, vocab_size_ - 1));
    if (id == newline_id_) {
      flush();
      out += '\n';
    } else {
      segment.push_back(id);
    }
  }
  flush();
  return out;
}

std::string Tokenizer::id_to_piece(std::int32_t id) const {
  if (id < 0 || id >= vocab_size_)
    throw DataError(fmt::format("Token id {} is outside the vocabulary (0..{}).", id, vocab_size_ - 1));
  return sp_->IdToPiece(id);
}

}  // namespace moeflex
