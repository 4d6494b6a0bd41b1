// Megatron indexed datasets (indexed_data.h, TokenDataset::open_megatron): files
// written by Megatron-LM's own IndexedDatasetBuilder (tests/reference/megatron_uint16.*)
// and by an independent writer of the published layout (tests/reference/write_megatron.py)
// read back as the documents they hold, split as a prepared dataset splits; every
// malformed index is a DataError that names what is wrong.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/indexed_data.h"
#include "error_text.h"
#include "scratch_dir.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOEFLEX_SOURCE_DIR;
constexpr int kMaxToken = 1000;  // write_megatron.py draws ids in [1, kMaxToken]

using Documents = std::vector<std::vector<std::int32_t>>;

Documents documents_of(const fs::path& json_path) {
  std::ifstream in(json_path);
  return nlohmann::json::parse(in).at("documents").get<Documents>();
}

// Writes PREFIX.{idx,bin,json} with write_megatron.py's random documents.
fs::path write_random(const fs::path& dir, const std::string& dtype, int seed, int documents) {
  fs::create_directories(dir);
  const fs::path prefix = dir / fmt::format("{}_{}_{}", dtype, seed, documents);
  const std::string cmd = fmt::format("/usr/bin/python3 '{}' '{}' {} random {} {} {}",
                                      (kSrc / "tests" / "reference" / "write_megatron.py").string(), prefix.string(),
                                      dtype, seed, documents, kMaxToken);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return prefix;
}

std::vector<std::int32_t> split_tokens(const TokenDataset& ds, Split split) {
  std::vector<std::int32_t> out(std::size_t(ds.num_tokens(split)));
  ds.copy_tokens(split, 0, ds.num_tokens(split), out.data());
  return out;
}

// The splits a reader must give: the non-empty documents, assigned as a prepared
// dataset assigns its documents, back to back.
void expect_splits(const TokenDataset& ds, const Documents& all, double val_fraction, std::uint64_t seed) {
  Documents docs;
  for (const auto& d : all)
    if (!d.empty()) docs.push_back(d);
  const std::vector<char> is_val = assign_validation_documents(docs.size(), val_fraction, seed);
  std::vector<std::int32_t> train, val;
  for (std::size_t k = 0; k < docs.size(); ++k) (is_val[k] ? val : train).insert((is_val[k] ? val : train).end(),
                                                                                  docs[k].begin(), docs[k].end());
  ASSERT_FALSE(val.empty());
  EXPECT_EQ(split_tokens(ds, Split::kTrain), train);
  EXPECT_EQ(split_tokens(ds, Split::kVal), val);
}

std::string data_error(const std::function<void()>& f) { return test::error_text<DataError>(f); }

void write_bytes(const fs::path& path, const std::vector<char>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(b.data(), std::streamsize(b.size()));
}

}  // namespace

TEST(MegatronData, FilesWrittenByMegatronReadBackAsTheirDocuments) {
  const fs::path prefix = kSrc / "tests" / "reference" / "megatron_uint16";
  const Documents docs = documents_of(prefix.string() + ".json");
  const TokenDataset ds = TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.2, 1234);
  EXPECT_TRUE(ds.pretokenized());
  EXPECT_EQ(ds.vocab_size(), kMaxToken + 1);
  expect_splits(ds, docs, 0.2, 1234);
  const MegatronIndex ix = read_megatron_index(prefix.string() + ".idx", fs::file_size(prefix.string() + ".bin"));
  EXPECT_EQ(ix.dtype.code, 8);
  EXPECT_EQ(ix.dtype.bytes, 2);
  ASSERT_EQ(ix.doc_tokens.size(), docs.size());
  for (std::size_t d = 0; d < docs.size(); ++d) EXPECT_EQ(ix.doc_tokens[d], std::int64_t(docs[d].size())) << d;
}

TEST(MegatronData, EveryTokenWidthAndMultiSequenceDocuments) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "widths");
  for (const char* dtype : {"uint16", "int32"}) {
    const fs::path prefix = write_random(dir, dtype, 5, 30);
    const Documents docs = documents_of(prefix.string() + ".json");
    ASSERT_EQ(docs.size(), 30u);
    ASSERT_TRUE(std::any_of(docs.begin(), docs.end(), [](const auto& d) { return d.empty(); }));
    for (double val_fraction : {0.05, 0.3}) {
      SCOPED_TRACE(fmt::format("{} val_fraction {}", dtype, val_fraction));
      expect_splits(TokenDataset::open_megatron(prefix, kMaxToken + 1, val_fraction, 77), docs, val_fraction, 77);
    }
  }
}

TEST(MegatronData, APrefixIsNamedByEitherFileOrItself) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "prefix");
  const fs::path prefix = write_random(dir, "uint16", 1, 8);
  for (const std::string& name : {prefix.string(), prefix.string() + ".idx", prefix.string() + ".bin"})
    EXPECT_EQ(megatron_prefix(name), prefix) << name;
  EXPECT_EQ(megatron_prefix(dir), std::nullopt) << "a folder is a text corpus";
  EXPECT_EQ(megatron_prefix(prefix.string() + ".json"), std::nullopt);
  fs::remove(prefix.string() + ".bin");
  EXPECT_NE(data_error([&] { TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.1, 1); }).find("is missing"),
            std::string::npos);
}

TEST(MegatronData, WindowsAreRealDeterministicAndCrossDocumentEnds) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "windows");
  const fs::path prefix = write_random(dir, "int32", 9, 40);
  const TokenDataset ds = TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.1, 3);
  const std::vector<std::int32_t> train = split_tokens(ds, Split::kTrain);
  constexpr int B = 4, S = 48;  // longer than most documents: windows cross their ends
  std::vector<std::int32_t> in1(B * S), tg1(B * S), in2(B * S), tg2(B * S);
  ds.sample_batch(Split::kTrain, 7, 10, 2, B, S, in1.data(), tg1.data());
  ds.sample_batch(Split::kTrain, 7, 10, 2, B, S, in2.data(), tg2.data());
  EXPECT_EQ(in1, in2);
  EXPECT_EQ(tg1, tg2);
  for (int b = 0; b < B; ++b) {
    std::vector<std::int32_t> window(in1.begin() + b * S, in1.begin() + (b + 1) * S);
    window.push_back(tg1[b * S + S - 1]);
    for (int s = 0; s + 1 < S; ++s) EXPECT_EQ(tg1[b * S + s], in1[b * S + s + 1]);
    EXPECT_NE(std::search(train.begin(), train.end(), window.begin(), window.end()), train.end()) << "row " << b;
  }
  const std::int64_t batches = ds.num_val_batches(1, 16, 0);
  EXPECT_EQ(batches, (ds.num_tokens(Split::kVal) - 1) / 16);
  std::vector<std::int32_t> vin(16), vtg(16), val = split_tokens(ds, Split::kVal);
  ds.val_batch(batches - 1, 1, 16, 0, vin.data(), vtg.data());
  EXPECT_TRUE(std::equal(vin.begin(), vin.end(), val.begin() + (batches - 1) * 16));
}

TEST(MegatronData, ATokenOutsideTheVocabularyIsNamed) {
  const fs::path prefix = kSrc / "tests" / "reference" / "megatron_uint16";
  const Documents docs = documents_of(prefix.string() + ".json");
  std::int32_t top = 0;
  for (const auto& d : docs) top = std::max(top, *std::max_element(d.begin(), d.end()));
  const TokenDataset ds = TokenDataset::open_megatron(prefix, top, 0.2, 1234);  // ids must be < top
  const std::string e1 = data_error([&] {
    split_tokens(ds, Split::kTrain);
    split_tokens(ds, Split::kVal);
  });
  EXPECT_NE(e1.find(fmt::format("is {}, outside the model's vocabulary of {}", top, top)), std::string::npos) << e1;
  EXPECT_NE(e1.find("megatron_uint16.bin"), std::string::npos) << e1;
}

TEST(MegatronData, AMalformedIndexIsAClearError) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "malformed");
  const fs::path good = write_random(dir, "uint16", 2, 6);
  const std::vector<char> idx = read_file_bytes(good.string() + ".idx");
  const std::vector<char> bin = read_file_bytes(good.string() + ".bin");
  std::uint64_t seqs = 0;
  std::memcpy(&seqs, idx.data() + 18, 8);  // the header's sequence count
  const std::size_t lengths = 34, pointers = lengths + 4 * seqs, doc_indices = pointers + 8 * seqs;
  struct Case {
    const char* what;
    std::function<void(std::vector<char>&, std::vector<char>&)> edit;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"short", [](auto& i, auto&) { i.resize(20); }, "shorter than the 34-byte header"},
      {"magic", [](auto& i, auto&) { i[0] = 'X'; }, "no MMIDIDX magic"},
      {"version", [](auto& i, auto&) { i[9] = 2; }, "version 2"},
      {"float dtype", [](auto& i, auto&) { i[17] = 7; }, "dtype code 7 is not an integer token type"},
      {"truncated", [](auto& i, auto&) { i.resize(i.size() - 8); }, "document entries take"},
      {"lengths", [&](auto& i, auto&) { i[lengths + 3] = char(0x80); }, "has length -"},
      {"pointers", [&](auto& i, auto&) { i[pointers + 8] ^= 2; }, "sequence 1 starts at byte"},
      {"bin size", [](auto&, auto& b) { b.push_back(0); }, "its .bin holds"},
      {"first document", [&](auto& i, auto&) { i[doc_indices] = 1; }, "document entry 0 is 1"},
      {"last document", [](auto& i, auto&) { i[i.size() - 8] = char(i[i.size() - 8] - 1); },
       "must rise from 0 to the sequence count"},
  };
  for (const Case& c : cases) {
    std::vector<char> i = idx, b = bin;
    c.edit(i, b);
    const fs::path prefix = dir / c.what;
    write_bytes(prefix.string() + ".idx", i);
    write_bytes(prefix.string() + ".bin", b);
    const std::string e = data_error([&] { TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.1, 1); });
    EXPECT_NE(e.find(c.says), std::string::npos) << c.what << ": " << e;
    EXPECT_NE(e.find(prefix.string() + ".idx"), std::string::npos) << c.what << ": " << e;
  }
}

TEST(MegatronData, FewerThanTwoNonEmptyDocumentsCannotBeSplit) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "few");
  const fs::path prefix = write_random(dir, "uint16", 3, 2);  // document 1 is the empty one
  const std::string e = data_error([&] { TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.1, 1); });
  EXPECT_NE(e.find("has 1 non-empty document(s)"), std::string::npos) << e;
}

namespace {

// Writes `docs` back to back as little-endian unsigned tokens of `bytes` each.
void write_flat(const fs::path& path, const Documents& docs, int bytes) {
  std::vector<char> b;
  for (const auto& d : docs)
    for (std::int32_t t : d) {
      const auto u = std::uint32_t(t);
      for (int k = 0; k < bytes; ++k) b.push_back(char((u >> (8 * k)) & 0xFF));
    }
  write_bytes(path, b);
}

// `n` random documents of 1 to 60 tokens in [0, top), each closed by `eos` (the last
// one too, unless `open_end`; none when eos < 0).
Documents random_documents(int n, std::int32_t top, std::int32_t eos, bool open_end, std::uint32_t seed) {
  Documents docs;
  std::uint32_t x = seed * 2654435761u + 1;
  auto next = [&] { return x = x * 1664525u + 1013904223u; };
  for (int d = 0; d < n; ++d) {
    std::vector<std::int32_t> doc(1 + next() % 60);
    for (auto& t : doc) do t = std::int32_t(next() % std::uint32_t(top)); while (t == eos);
    if (eos >= 0 && !(open_end && d + 1 == n)) doc.push_back(eos);
    docs.push_back(doc);
  }
  return docs;
}

}  // namespace

TEST(FlatTokens, DocumentsEndAfterTheirEosInEitherWidth) {
  const fs::path dir = test::scratch_dir("moeflex_flat_", "widths");
  fs::create_directories(dir);
  for (const auto& [name, bytes, top] : {std::tuple{"a.u16", 2, 60000}, std::tuple{"b.uint32", 4, 200000}}) {
    SCOPED_TRACE(name);
    for (bool open_end : {false, true}) {
      const Documents docs = random_documents(40, top, 7, open_end, bytes);
      write_flat(dir / name, docs, bytes);
      const TokenDataset ds = TokenDataset::open_flat(dir / name, top, 0.1, 99, 7);
      EXPECT_TRUE(ds.pretokenized());
      expect_splits(ds, docs, 0.1, 99);
      const std::vector<std::int32_t> all = split_tokens(ds, Split::kTrain);
      EXPECT_GT(*std::max_element(all.begin(), all.end()), 65535 * (bytes == 4)) << "ids above 16 bits survive";
    }
  }
}

TEST(FlatTokens, WithoutAnEosIdTheFileIsCutIntoEqualPieces) {
  const fs::path dir = test::scratch_dir("moeflex_flat_", "pieces");
  fs::create_directories(dir);
  Documents one = random_documents(30, 1000, -1, true, 3);  // no eos in the file
  std::vector<std::int32_t> flat;
  for (const auto& d : one) flat.insert(flat.end(), d.begin(), d.end());
  write_flat(dir / "t.u16", {flat}, 2);
  const std::int64_t n = std::int64_t(flat.size());
  const MegatronIndex ix = flat_documents(reinterpret_cast<const std::byte*>(read_file_bytes(dir / "t.u16").data()),
                                          *flat_token_code(dir / "t.u16"), n, -1);
  ASSERT_EQ(std::int64_t(ix.doc_tokens.size()), kFlatPieces);
  Documents pieces;
  for (std::int64_t k = 0; k < kFlatPieces; ++k) {
    EXPECT_EQ(ix.doc_begin[k], n * k / kFlatPieces);
    EXPECT_LE(std::abs(ix.doc_tokens[k] - n / kFlatPieces), 1);
    pieces.emplace_back(flat.begin() + ix.doc_begin[k], flat.begin() + ix.doc_begin[k] + ix.doc_tokens[k]);
  }
  expect_splits(TokenDataset::open_flat(dir / "t.u16", 1000, 0.05, 5, -1), pieces, 0.05, 5);
}

TEST(FlatTokens, BadFilesAreClearErrors) {
  const fs::path dir = test::scratch_dir("moeflex_flat_", "bad");
  fs::create_directories(dir);
  EXPECT_EQ(flat_token_code(dir / "x.bin"), std::nullopt);
  EXPECT_EQ(flat_token_code(dir / "x.u32")->code, kUint32Code);
  write_bytes(dir / "odd.u32", std::vector<char>(4 * 50 + 2, 1));
  EXPECT_NE(data_error([&] { TokenDataset::open_flat(dir / "odd.u32", 1000, 0.1, 1, -1); })
                .find("has 202 bytes, not a whole number of 4-byte tokens"),
            std::string::npos);
  EXPECT_NE(data_error([&] { TokenDataset::open_flat(dir / "none.u16", 1000, 0.1, 1, -1); }).find("does not exist"),
            std::string::npos);
  write_flat(dir / "one.u16", random_documents(1, 1000, 7, false, 1), 2);
  EXPECT_NE(data_error([&] { TokenDataset::open_flat(dir / "one.u16", 1000, 0.1, 1, 7); })
                .find("has 1 non-empty document(s)"),
            std::string::npos);
  write_flat(dir / "big.u16", random_documents(20, 5000, 7, false, 2), 2);
  const TokenDataset ds = TokenDataset::open_flat(dir / "big.u16", 1000, 0.1, 1, 7);  // ids up to 4999
  const std::string e = data_error([&] {
    split_tokens(ds, Split::kTrain);
    split_tokens(ds, Split::kVal);
  });
  EXPECT_NE(e.find("outside the model's vocabulary of 1000"), std::string::npos) << e;
  EXPECT_NE(e.find("big.u16"), std::string::npos) << e;
}

// What a resume compares: a .bin changed in place (same size, same index) or a flat
// file with another end-of-document id is another dataset.
TEST(TokenIdentity, ChangesWithTheTokensNotOnlyTheSizes) {
  const fs::path dir = test::scratch_dir("moeflex_megatron_", "identity");
  const fs::path prefix = write_random(dir, "uint16", 3, 12);
  const std::string before = TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.2, 1).identity();
  EXPECT_EQ(TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.2, 1).identity(), before);
  std::vector<char> bin = read_file_bytes(prefix.string() + ".bin");
  bin[bin.size() - 2] = char(bin[bin.size() - 2] ^ 1);  // the last token, one bit
  write_bytes(prefix.string() + ".bin", bin);
  EXPECT_NE(TokenDataset::open_megatron(prefix, kMaxToken + 1, 0.2, 1).identity(), before);
  write_flat(dir / "t.u16", random_documents(20, 1000, 7, false, 4), 2);
  EXPECT_NE(TokenDataset::open_flat(dir / "t.u16", 1000, 0.1, 1, 7).identity(),
            TokenDataset::open_flat(dir / "t.u16", 1000, 0.1, 1, -1).identity());
}
