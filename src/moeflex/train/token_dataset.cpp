// TokenDataset's Megatron and flat-file sources and its reading of windows (dataset.h); the
// prepared dataset's open() is in dataset.cpp beside the writer of its shards.
#include <algorithm>
#include <cstring>
#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/core/rng.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/indexed_data.h"

namespace moeflex {
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kSampleStream = 0xBA7C4000;  // rng stream of train/val window sampling

/// SHA-256 of 17 blocks of 64 KiB spread evenly over the mapped file (all of it when
/// smaller): what a resume compares, as hashing all of a large file would cost a full
/// pass at every start.
std::string sampled_sha256(const MappedFile& map) {
  std::string sampled;
  const Bytes block = std::min<Bytes>(Bytes(1) << 16, map.size());
  for (int k = 0; k <= 16; ++k) {
    const Bytes at = (map.size() - block) * k / 16;
    sampled.append(reinterpret_cast<const char*>(map.data() + at), std::size_t(block));
  }
  return sha256_hex(sampled.data(), sampled.size());
}

}  // namespace

TokenDataset TokenDataset::from_documents(std::shared_ptr<const MappedFile> map, const MegatronIndex& ix,
                                          const std::string& name, int vocab_size, double val_fraction,
                                          std::uint64_t seed) {
  check_config(val_fraction > 0.0 && val_fraction < 1.0,
               fmt::format("val_fraction must be in (0, 1), got {}.", val_fraction));
  TokenDataset ds;
  ds.map_ = std::move(map);
  ds.dir_ = ds.map_->path();
  ds.vocab_size_ = vocab_size;
  ds.token_code_ = ix.dtype.code;
  ds.token_bytes_ = ix.dtype.bytes;
  std::vector<std::size_t> docs;  // the non-empty ones
  for (std::size_t d = 0; d < ix.doc_tokens.size(); ++d)
    if (ix.doc_tokens[d] > 0) docs.push_back(d);
  if (docs.size() < 2)
    throw DataError(fmt::format("{} has {} non-empty document(s); at least 2 are needed to hold out a validation "
                                "split.", name, docs.size()));
  const std::vector<char> is_val = assign_validation_documents(docs.size(), val_fraction, seed);
  for (Part* p : {&ds.train_, &ds.val_}) p->offset = {0};
  for (std::size_t k = 0; k < docs.size(); ++k) {
    Part& p = is_val[k] ? ds.val_ : ds.train_;
    p.begin.push_back(ix.doc_begin[docs[k]]);
    p.total += ix.doc_tokens[docs[k]];
    p.offset.push_back(p.total);
  }
  return ds;
}

TokenDataset TokenDataset::open_megatron(const fs::path& prefix, int vocab_size, double val_fraction,
                                         std::uint64_t seed) {
  const fs::path idx = prefix.string() + ".idx", bin = prefix.string() + ".bin";
  for (const fs::path& f : {idx, bin})
    if (!fs::is_regular_file(f))
      throw DataError(fmt::format("Megatron dataset '{}': '{}' is missing (both PREFIX.idx and PREFIX.bin are read).",
                                  prefix.string(), f.string()));
  auto map = std::make_shared<const MappedFile>(bin);
  const MegatronIndex ix = read_megatron_index(idx, map->size());
  TokenDataset ds = from_documents(std::move(map), ix, fmt::format("Megatron dataset '{}'", prefix.string()),
                                   vocab_size, val_fraction, seed);
  ds.identity_ = fmt::format("megatron idx sha256 {} bin bytes {} sampled sha256 {}", ix.index_sha256,
                             ds.map_->size(), sampled_sha256(*ds.map_));
  return ds;
}

TokenDataset TokenDataset::open_flat(const fs::path& file, int vocab_size, double val_fraction, std::uint64_t seed,
                                     std::int64_t eos_id) {
  const std::optional<TokenCode> code = flat_token_code(file);
  check_config(code.has_value(), fmt::format("'{}' is not named as a flat token file (.u16, .uint16, .u32 or "
                                             ".uint32).", file.string()));
  if (!fs::is_regular_file(file)) throw DataError(fmt::format("Flat token file '{}' does not exist.", file.string()));
  auto map = std::make_shared<const MappedFile>(file);
  if (map->size() % code->bytes != 0)
    throw DataError(fmt::format("Flat token file '{}' has {} bytes, not a whole number of {}-byte tokens (is it "
                                "the other width?).", file.string(), map->size(), code->bytes));
  const std::int64_t tokens = map->size() / code->bytes;
  const MegatronIndex ix = flat_documents(map->data(), *code, tokens, eos_id);
  TokenDataset ds = from_documents(map, ix, fmt::format("Flat token file '{}' (data.eos_id {})", file.string(),
                                   eos_id), vocab_size, val_fraction, seed);
  ds.identity_ = fmt::format("flat {} bytes eos {} sampled sha256 {}", map->size(), eos_id, sampled_sha256(*map));
  return ds;
}

void TokenDataset::copy_tokens(Split split, std::int64_t start, std::int64_t n, std::int32_t* out) const {
  const Part& p = part(split);
  if (start < 0 || n < 0 || start + n > p.total)
    throw DataError(fmt::format("tokens [{}, {}) are outside the {} split of '{}' ({} tokens).", start, start + n,
                                split_name(split), dir_.string(), p.total));
  // The document holding `start`: the last offset <= start.
  auto k = std::size_t(std::upper_bound(p.offset.begin(), p.offset.end(), start) - p.offset.begin()) - 1;
  while (n > 0) {
    const std::int64_t within = start - p.offset[k], take = std::min(n, p.offset[k + 1] - start);
    const std::int64_t from = p.begin[k] + within;  // token index in the source
    if (!map_) {
      std::copy_n(p.owned.data() + from, take, out);  // checked against the vocabulary when read
    } else {
      for (std::int64_t i = 0; i < take; ++i) {
        const std::int64_t t = decode_token(map_->data(), token_code_, from + i);
        if (t < 0 || t >= vocab_size_)
          throw DataError(fmt::format("'{}': token {} (at byte {}) is {}, outside the model's vocabulary of {}: the "
                                      "data was tokenized for another vocab_size.", dir_.string(), from + i,
                                      (from + i) * token_bytes_, t, vocab_size_));
        out[i] = std::int32_t(t);
      }
    }
    out += take, start += take, n -= take, ++k;
  }
}

void TokenDataset::window(Split split, std::int64_t start, int S, std::int32_t* inputs, std::int32_t* targets) const {
  copy_tokens(split, start, S, inputs);
  copy_tokens(split, start + 1, S, targets);
}

void TokenDataset::sample_batch(Split split, std::uint64_t seed, std::int64_t step, std::int64_t micro_batch_index,
                                int B, int S, std::int32_t* inputs, std::int32_t* targets) const {
  check_config(B > 0 && S > 0, fmt::format("batch size and sequence length must be positive, got B={} S={}.", B, S));
  check_config(step >= 0 && micro_batch_index >= 0,
               fmt::format("step and micro-batch index must be non-negative, got {} and {}.", step, micro_batch_index));
  const std::int64_t n = num_tokens(split);
  if (n < std::int64_t(S) + 1)
    throw DataError(fmt::format("The {} split of '{}' has {} tokens, too few for one window of {} (sequence "
                                "length {} + 1).", split_name(split), dir_.string(), n, std::int64_t(S) + 1, S));
  const std::int64_t starts = n - S;  // windows [start, start + S] with start in [0, n - S)
  // One rng stream per (split, step); the index encodes (micro-batch, row).
  const std::uint64_t stream = mix64(kSampleStream + std::uint64_t(split == Split::kVal)) ^ mix64(std::uint64_t(step));
  for (int b = 0; b < B; ++b) {
    const std::uint64_t index = (std::uint64_t(micro_batch_index) << 32) | std::uint64_t(b);
    const auto start = std::min<std::int64_t>(std::int64_t(uniform01(seed, stream, index) * double(starts)), starts - 1);
    window(split, start, S, inputs + std::int64_t(b) * S, targets + std::int64_t(b) * S);
  }
}

std::int64_t TokenDataset::num_val_batches(int B, int S, std::int64_t max_batches) const {
  check_config(B > 0 && S > 0, fmt::format("batch size and sequence length must be positive, got B={} S={}.", B, S));
  const std::int64_t windows = (num_tokens(Split::kVal) - 1) / S;
  const std::int64_t batches = windows / B;
  if (batches < 1)
    throw DataError(fmt::format("The validation split of '{}' has {} tokens, too few for one batch of {} windows "
                                "of {} tokens; raise val_fraction or lower the batch size or sequence length.",
                                dir_.string(), num_tokens(Split::kVal), B, std::int64_t(S) + 1));
  return max_batches > 0 ? std::min(batches, max_batches) : batches;
}

void TokenDataset::val_batch(std::int64_t index, int B, int S, std::int64_t max_batches, std::int32_t* inputs,
                             std::int32_t* targets) const {
  const std::int64_t batches = num_val_batches(B, S, max_batches);
  check_config(index >= 0 && index < batches,
               fmt::format("validation batch index {} is outside [0, {}).", index, batches));
  const std::int64_t windows = (num_tokens(Split::kVal) - 1) / S;  // disjoint chunks of S (+1) tokens
  const std::int64_t used = batches * B;
  for (int b = 0; b < B; ++b) {
    const std::int64_t k = index * B + b;
    const std::int64_t chunk = k * windows / used;  // spread the used windows evenly
    window(Split::kVal, chunk * S, S, inputs + std::int64_t(b) * S, targets + std::int64_t(b) * S);
  }
}

}  // namespace moeflex
