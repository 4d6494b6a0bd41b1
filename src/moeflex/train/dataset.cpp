#include "moeflex/train/dataset.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <bit>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/train/corpus.h"
#include "moeflex/train/tokenizer.h"

namespace moeflex {
namespace fs = std::filesystem;
using json = nlohmann::json;

static_assert(std::endian::native == std::endian::little, "token shards are read and written little-endian");

namespace {

constexpr int kDatasetFormatVersion = 1;
constexpr const char* kDatasetJson = "dataset.json";
constexpr const char* kTokenizerPrefix = "tokenizer";
// rng stream of which split a document goes to (token_dataset.cpp: of window sampling).
constexpr std::uint64_t kSplitStream = 0x5E1EC7;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string shard_name(Split split, std::size_t index) { return fmt::format("{}_{:03d}.bin", split_name(split), index); }

int token_bytes_for(int vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// Holds an exclusive flock on `dir`/.lock for its lifetime.
class DirLock {
 public:
  explicit DirLock(const fs::path& dir) {
    const fs::path lock = dir / ".lock";
    fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw DataError(fmt::format("Cannot create the lock file '{}'.", lock.string()));
    while (::flock(fd_, LOCK_EX) != 0)
      if (errno != EINTR) break;
  }
  ~DirLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the lock
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

void write_atomically(const fs::path& path, const void* data, std::size_t size) {
  const fs::path tmp = path.string() + fmt::format(".tmp{}", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), std::streamsize(size));
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw DataError(fmt::format("Cannot write '{}' (disk full or no permission?).", path.string()));
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw DataError(fmt::format("Cannot rename a temporary file to '{}': {}.", path.string(), ec.message()));
  }
}

// Files are cut into documents so that even a small corpus yields about
// kMinTargetDocuments of them (both splits need some).
Bytes target_document_bytes(const fs::path& corpus_path) {
  Bytes total = 0;
  for (const fs::path& f : list_corpus_files(corpus_path)) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    if (!ec) total += Bytes(size);
  }
  return std::clamp<Bytes>(total / kMinTargetDocuments, 256, kMaxTargetDocumentBytes);
}

// The settings that, with the corpus hash, determine the dataset's content.
json settings_json(const std::string& corpus_hash, int vocab_size, double val_fraction, std::uint64_t seed,
                   Bytes target_doc_bytes) {
  return json{{"format_version", kDatasetFormatVersion},
              {"corpus_hash", corpus_hash},
              {"vocab_size", vocab_size},
              {"val_fraction", val_fraction},
              {"seed", seed},
              {"target_document_bytes", target_doc_bytes}};
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("Cannot open '{}'.", path.string()));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw DataError(fmt::format("'{}' is not valid JSON: {}.", path.string(), e.what()));
  }
}

// Why the dataset in `dir` cannot be reused, or "" if it can.
std::string reuse_blocker(const fs::path& dir, const json& wanted) {
  const fs::path meta = dir / kDatasetJson;
  if (!fs::exists(meta)) return "no dataset.json";
  json have;
  try {
    have = read_json(meta);
  } catch (const DataError& e) {
    return e.what();
  }
  for (const auto& [key, value] : wanted.items())
    if (!have.contains(key) || have[key] != value)
      return fmt::format("{} changed ({} -> {})", key, have.contains(key) ? have[key].dump() : "missing", value.dump());
  if (!fs::is_regular_file(dir / (std::string(kTokenizerPrefix) + ".model"))) return "tokenizer.model is missing";
  try {
    const int width = have.at("token_bytes").get<int>();
    for (const char* split : {"train", "val"})
      for (const json& shard : have.at("splits").at(split).at("shards")) {
        const fs::path file = dir / shard.at("file").get<std::string>();
        std::error_code ec;
        const auto size = fs::file_size(file, ec);
        const auto expected = std::uintmax_t(kShardHeaderBytes + shard.at("tokens").get<std::int64_t>() * width);
        if (ec) return fmt::format("{} is missing", file.filename().string());
        if (size != expected) return fmt::format("{} has {} bytes, expected {}", file.filename().string(), size, expected);
      }
  } catch (const json::exception& e) {
    return fmt::format("dataset.json is incomplete ({})", e.what());
  }
  return "";
}

DatasetInfo info_from_json(const fs::path& dir, const json& j) {
  DatasetInfo info;
  info.dir = dir;
  info.corpus_hash = j.at("corpus_hash").get<std::string>();
  info.vocab_size = j.at("vocab_size").get<int>();
  info.train_documents = j.at("splits").at("train").at("documents").get<std::int64_t>();
  info.val_documents = j.at("splits").at("val").at("documents").get<std::int64_t>();
  info.train_tokens = j.at("splits").at("train").at("tokens").get<std::int64_t>();
  info.val_tokens = j.at("splits").at("val").at("tokens").get<std::int64_t>();
  return info;
}

// Shards previously written into `dir` that the new dataset does not list.
void remove_stale_shards(const fs::path& dir, const std::vector<std::string>& keep) {
  static const std::regex shard_re(R"((train|val)_\d{3,}\.bin)");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, shard_re) && std::find(keep.begin(), keep.end(), name) == keep.end())
      fs::remove(entry.path(), ec);
  }
}

}  // namespace

const char* split_name(Split split) { return split == Split::kTrain ? "train" : "val"; }

void write_token_shard(const fs::path& path, std::span<const std::int32_t> tokens, int vocab_size) {
  const int width = token_bytes_for(vocab_size);
  std::vector<unsigned char> buf(std::size_t(kShardHeaderBytes) + tokens.size() * std::size_t(width));
  unsigned char* p = buf.data();
  const std::uint32_t version = kShardVersion, token_bytes = std::uint32_t(width), vocab = std::uint32_t(vocab_size),
                      reserved = 0;
  const std::uint64_t count = tokens.size();
  std::memcpy(p, kShardMagic, 8);
  std::memcpy(p + 8, &version, 4);
  std::memcpy(p + 12, &token_bytes, 4);
  std::memcpy(p + 16, &count, 8);
  std::memcpy(p + 24, &vocab, 4);
  std::memcpy(p + 28, &reserved, 4);
  p += kShardHeaderBytes;
  if (width == 2) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto v = std::uint16_t(tokens[i]);
      std::memcpy(p + 2 * i, &v, 2);
    }
  } else {
    std::memcpy(p, tokens.data(), tokens.size() * 4);
  }
  write_atomically(path, buf.data(), buf.size());
}

std::vector<std::int32_t> read_token_shard(const fs::path& path, int vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(fmt::format("Token shard '{}' does not exist or cannot be opened.", path.string()));
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Bytes actual = Bytes(data.size());
  if (actual < kShardHeaderBytes)
    throw DataError(fmt::format("Token shard '{}' is truncated: expected at least {} header bytes, found {} bytes.",
                                path.string(), kShardHeaderBytes, actual));
  if (std::memcmp(data.data(), kShardMagic, 8) != 0)
    throw DataError(fmt::format("'{}' is not a moeflex token shard (its first bytes are not the magic \"MFTOK\").",
                                path.string()));
  std::uint32_t version, width, vocab;
  std::uint64_t count;
  std::memcpy(&version, data.data() + 8, 4);
  std::memcpy(&width, data.data() + 12, 4);
  std::memcpy(&count, data.data() + 16, 8);
  std::memcpy(&vocab, data.data() + 24, 4);
  if (version != kShardVersion)
    throw DataError(fmt::format("Token shard '{}' has version {}; this moeflex reads version {}. Prepare the "
                                "dataset again.", path.string(), version, kShardVersion));
  if (width != 2 && width != 4)
    throw DataError(fmt::format("Token shard '{}' has token width {} bytes; only 2 (uint16) and 4 (int32) exist.",
                                path.string(), width));
  if (count > std::uint64_t(1) << 40)
    throw DataError(fmt::format("Token shard '{}' claims {} tokens; its header is corrupt.", path.string(), count));
  const Bytes expected = kShardHeaderBytes + Bytes(count) * Bytes(width);
  if (actual != expected)
    throw DataError(fmt::format("Token shard '{}' is {}: expected {} bytes (a {}-byte header and {} tokens of {} "
                                "bytes), found {} bytes.", path.string(), actual < expected ? "truncated" : "corrupt",
                                expected, kShardHeaderBytes, count, width, actual));
  if (vocab_size > 0 && int(vocab) != vocab_size)
    throw DataError(fmt::format("Token shard '{}' was written for vocab size {}, but the dataset's is {}.",
                                path.string(), vocab, vocab_size));
  std::vector<std::int32_t> tokens(count);
  const char* p = data.data() + kShardHeaderBytes;
  if (width == 2) {
    for (std::size_t i = 0; i < count; ++i) {
      std::uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      tokens[i] = v;
    }
  } else {
    std::memcpy(tokens.data(), p, count * 4);
  }
  for (std::size_t i = 0; i < count; ++i)
    if (tokens[i] < 0 || tokens[i] >= std::int32_t(vocab))
      throw DataError(fmt::format("Token shard '{}' holds token id {} at position {}, outside the vocabulary "
                                  "(0..{}).", path.string(), tokens[i], i, vocab - 1));
  return tokens;
}

std::vector<char> assign_validation_documents(std::size_t n, double val_fraction, std::uint64_t seed) {
  // Document i is held out when its draw is below val_fraction.
  auto draw = [&](std::size_t i) { return uniform01(seed, kSplitStream, i); };
  std::vector<char> is_val(n);
  std::size_t val_count = 0;
  for (std::size_t i = 0; i < n; ++i) {
    is_val[i] = draw(i) < val_fraction;
    val_count += std::size_t(is_val[i]);
  }
  if (n < 2) return is_val;
  if (val_count == 0) {  // hold out the document with the lowest draw
    std::size_t best = 0;
    for (std::size_t i = 1; i < n; ++i)
      if (draw(i) < draw(best)) best = i;
    is_val[best] = 1;
  } else if (val_count == n) {  // keep the one with the highest draw for training
    std::size_t best = 0;
    for (std::size_t i = 1; i < n; ++i)
      if (draw(i) > draw(best)) best = i;
    is_val[best] = 0;
  }
  return is_val;
}

DatasetInfo prepare_dataset(const fs::path& corpus_path, const fs::path& out_dir, int vocab_size,
                            double val_fraction, std::uint64_t seed, const LogFn& log_fn) {
  const LogFn log = log_fn ? log_fn : LogFn([](const std::string& line) { fmt::print(stderr, "{}\n", line); });
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    throw ConfigError(fmt::format("val_fraction must be in (0, 1), got {}.", val_fraction));
  if (vocab_size < Tokenizer::kMinVocabSize)
    throw ConfigError(fmt::format("vocab_size must be at least {}, got {}.", Tokenizer::kMinVocabSize, vocab_size));

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw DataError(fmt::format("Cannot create the dataset folder '{}': {}.", out_dir.string(), ec.message()));
  DirLock lock(out_dir);

  // Fast path: the same corpus content and settings were prepared before.
  const Bytes target_doc_bytes = target_document_bytes(corpus_path);
  const std::string corpus_hash = corpus_content_hash(corpus_path);
  const json settings = settings_json(corpus_hash, vocab_size, val_fraction, seed, target_doc_bytes);
  const std::string blocker = reuse_blocker(out_dir, settings);
  if (blocker.empty()) {
    DatasetInfo info = info_from_json(out_dir, read_json(out_dir / kDatasetJson));
    info.reused = true;
    log(fmt::format("dataset: reusing '{}' (corpus hash {}, vocab {}): {} train / {} val tokens.",
                    out_dir.string(), corpus_hash, vocab_size, info.train_tokens, info.val_tokens));
    return info;
  }
  if (fs::exists(out_dir / kDatasetJson)) log(fmt::format("dataset: rebuilding '{}': {}.", out_dir.string(), blocker));
  // From here on the folder holds no complete-looking dataset until the end.
  fs::remove(out_dir / kDatasetJson, ec);

  const Corpus corpus = read_corpus(corpus_path, CorpusOptions{target_doc_bytes});
  const std::size_t n = corpus.documents.size();
  if (n < 2)
    throw DataError(
        fmt::format("Corpus '{}' yields only {} document; at least 2 are needed to hold out a "
                    "validation split. Add text: paragraphs (separated by blank lines) shorter than {} "
                    "bytes are merged into one document.",
                    corpus_path.string(), n, target_doc_bytes));

  const std::vector<char> is_val = assign_validation_documents(n, val_fraction, seed);

  log(fmt::format("dataset: {} documents from {} file(s) ({}) in '{}'; training a {}-piece BPE tokenizer...", n,
                  corpus.files.size(), format_bytes(corpus.total_bytes), corpus_path.string(), vocab_size));
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> train_docs;
  for (std::size_t i = 0; i < n; ++i)
    if (!is_val[i]) train_docs.push_back(corpus.documents[i].text);
  const std::string prefix = (out_dir / kTokenizerPrefix).string();
  TokenizerTrainOptions topt;
  topt.seed = seed;
  Tokenizer::train(train_docs, prefix, vocab_size, topt);
  train_docs.clear();
  const Tokenizer tokenizer = Tokenizer::load(prefix + ".model");
  DatasetInfo info;
  info.tokenizer_seconds = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<std::int32_t>> doc_tokens(n);
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t i = 0; i < std::int64_t(n); ++i) {
    doc_tokens[i] = tokenizer.encode(corpus.documents[i].text);
    doc_tokens[i].push_back(tokenizer.eos_id());
  }
  info.tokenize_seconds = seconds_since(t0);

  // Write the shards of each split, cut at document ends.
  json splits = json::object();
  std::vector<std::string> written;
  for (Split split : {Split::kTrain, Split::kVal}) {
    json shards = json::array();
    std::vector<std::int32_t> buf;
    std::int64_t docs = 0, tokens = 0;
    auto flush = [&] {
      if (buf.empty()) return;
      const std::string name = shard_name(split, shards.size());
      write_token_shard(out_dir / name, buf, vocab_size);
      shards.push_back(json{{"file", name}, {"tokens", buf.size()}});
      written.push_back(name);
      buf.clear();
    };
    for (std::size_t i = 0; i < n; ++i) {
      if (bool(is_val[i]) != (split == Split::kVal)) continue;
      buf.insert(buf.end(), doc_tokens[i].begin(), doc_tokens[i].end());
      ++docs;
      tokens += std::int64_t(doc_tokens[i].size());
      if (std::int64_t(buf.size()) >= kMaxShardTokens) flush();
    }
    flush();
    splits[split_name(split)] = json{{"documents", docs}, {"tokens", tokens}, {"shards", shards}};
  }
  remove_stale_shards(out_dir, written);

  json meta = settings;
  meta["corpus_path"] = fs::absolute(corpus_path).lexically_normal().string();
  meta["corpus_bytes"] = corpus.total_bytes;
  meta["corpus_files"] = corpus.files.size();
  meta["tokenizer"] = std::string(kTokenizerPrefix) + ".model";
  meta["token_bytes"] = token_bytes_for(vocab_size);
  meta["eos_id"] = tokenizer.eos_id();
  meta["splits"] = splits;
  const std::string text = meta.dump(2) + "\n";
  write_atomically(out_dir / kDatasetJson, text.data(), text.size());

  const DatasetInfo counts = info_from_json(out_dir, meta);
  info.dir = out_dir;
  info.corpus_hash = corpus_hash;
  info.vocab_size = vocab_size;
  info.train_documents = counts.train_documents;
  info.val_documents = counts.val_documents;
  info.train_tokens = counts.train_tokens;
  info.val_tokens = counts.val_tokens;
  log(fmt::format("dataset: wrote '{}': {} train tokens ({} documents), {} val tokens ({} documents); tokenizer "
                  "{:.1f} s, tokenizing {:.1f} s.", out_dir.string(), info.train_tokens, info.train_documents,
                  info.val_tokens, info.val_documents, info.tokenizer_seconds, info.tokenize_seconds));
  return info;
}

TokenDataset TokenDataset::open(const fs::path& dir) {
  const fs::path meta_path = dir / kDatasetJson;
  if (!fs::exists(meta_path))
    throw DataError(fmt::format("'{}' holds no prepared dataset ({} is missing).", dir.string(), kDatasetJson));
  const json meta = read_json(meta_path);
  TokenDataset ds;
  ds.dir_ = dir;
  try {
    if (meta.at("format_version").get<int>() != kDatasetFormatVersion)
      throw DataError(fmt::format("'{}' has format version {}; this moeflex reads version {}. Prepare the dataset "
                                  "again.", meta_path.string(), meta.at("format_version").dump(),
                                  kDatasetFormatVersion));
    ds.vocab_size_ = meta.at("vocab_size").get<int>();
    for (Split split : {Split::kTrain, Split::kVal}) {
      Part& part = split == Split::kTrain ? ds.train_ : ds.val_;
      std::vector<std::int32_t>& out = part.owned;
      const json& s = meta.at("splits").at(split_name(split));
      out.reserve(s.at("tokens").get<std::size_t>());
      for (const json& shard : s.at("shards")) {
        const fs::path file = dir / shard.at("file").get<std::string>();
        const std::vector<std::int32_t> tokens = read_token_shard(file, ds.vocab_size_);
        const auto listed = shard.at("tokens").get<std::size_t>();
        if (tokens.size() != listed)
          throw DataError(fmt::format("Token shard '{}' holds {} tokens but {} lists {}.", file.string(),
                                      tokens.size(), meta_path.string(), listed));
        out.insert(out.end(), tokens.begin(), tokens.end());
      }
      if (out.empty())
        throw DataError(fmt::format("The {} split of '{}' is empty.", split_name(split), dir.string()));
      part.total = std::int64_t(out.size());
      part.begin = {0};  // its shards as one range of `owned`
      part.offset = {0, part.total};
    }
  } catch (const json::exception& e) {
    throw DataError(fmt::format("'{}' is incomplete or malformed: {}.", meta_path.string(), e.what()));
  }
  return ds;
}

}  // namespace moeflex
