// Corpus reading, the tokenizer, dataset preparation and batch sampling, on a
// small generated corpus in a temporary folder.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/train/corpus.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/tokenizer.h"

namespace fs = std::filesystem;
using namespace moeflex;

namespace {

constexpr int kVocab = 512;

void write_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(bool(out)) << path;
}

// English-like text: sentences over a few hundred made-up and real words.
std::string generated_document(std::uint64_t seed, int index, int paragraphs) {
  static const char* const kOnsets[] = {"b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
                                        "st", "tr", "pl", "gr", "sh", "ch", "th"};
  static const char* const kVowels[] = {"a", "e", "i", "o", "u", "ea", "ou", "ai"};
  static const char* const kCodas[] = {"", "n", "r", "s", "t", "nd", "ll", "ng", "ck"};
  static const char* const kFunction[] = {"the", "a", "of", "and", "to", "in", "that", "was", "he", "she", "it",
                                          "with", "for", "on", "by", "said", "had", "not", "but", "they"};
  Rng rng(seed, std::uint64_t(index));
  auto pick = [&](std::size_t n) { return std::size_t(rng.uniform() * double(n)); };
  auto word = [&] {
    if (rng.uniform() < 0.45) return std::string(kFunction[pick(std::size(kFunction))]);
    std::string w;
    const int syllables = 1 + int(pick(3));
    for (int s = 0; s < syllables; ++s)
      w += std::string(kOnsets[pick(std::size(kOnsets))]) + kVowels[pick(std::size(kVowels))] +
           kCodas[pick(std::size(kCodas))];
    return w;
  };
  std::string text = fmt::format("Document number {}.\n\n", index);
  for (int p = 0; p < paragraphs; ++p) {
    const int sentences = 3 + int(pick(4));
    for (int s = 0; s < sentences; ++s) {
      std::string sentence = word();
      sentence[0] = char(std::toupper(static_cast<unsigned char>(sentence[0])));
      const int words = 5 + int(pick(12));
      for (int w = 1; w < words; ++w) sentence += (rng.uniform() < 0.08 ? ", " : " ") + word();
      sentence += rng.uniform() < 0.1 ? "?" : ".";
      text += (s ? " " : "") + sentence;
    }
    text += "\n\n";
  }
  return text;
}

// A split's tokens, its documents back to back.
std::vector<std::int32_t> split_tokens(const TokenDataset& ds, Split split) {
  std::vector<std::int32_t> out(std::size_t(ds.num_tokens(split)));
  ds.copy_tokens(split, 0, ds.num_tokens(split), out.data());
  return out;
}

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() / fmt::format("moeflex_test_data_{}_{}", ::getpid(), info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // ~300 KB in 40 files, some in a subfolder, plus hidden files to be skipped.
  fs::path make_corpus(const std::string& name = "corpus", int files = 40) {
    const fs::path dir = root_ / name;
    for (int i = 0; i < files; ++i) {
      const fs::path file = i % 4 == 3 ? dir / "sub" / fmt::format("doc{:02d}.txt", i) : dir / fmt::format("doc{:02d}.txt", i);
      write_file(file, generated_document(7, i, 12));
    }
    write_file(dir / ".hidden_binary", std::string("\0\1\2\3", 4));
    write_file(dir / ".git" / "objects", std::string("\0\0\0", 3));
    return dir;
  }
  static std::vector<std::string> texts(const Corpus& c) {
    std::vector<std::string> out;
    for (const Document& d : c.documents) out.push_back(d.text);
    return out;
  }
  template <class F>
  static std::string error_message(F&& f) {
    try {
      f();
    } catch (const DataError& e) {
      return e.what();
    }
    return "<no DataError thrown>";
  }
  static LogFn quiet(std::vector<std::string>* lines) {
    return [lines](const std::string& l) { lines->push_back(l); };
  }

  fs::path root_;
};

TEST_F(DataTest, CorpusReadsFilesInSortedOrderAndSkipsHidden) {
  const fs::path dir = make_corpus();
  const Corpus c = read_corpus(dir);
  ASSERT_EQ(c.files.size(), 40u);
  EXPECT_TRUE(std::is_sorted(c.files.begin(), c.files.end(),
                             [](const fs::path& a, const fs::path& b) { return a.generic_string() < b.generic_string(); }));
  EXPECT_EQ(c.documents.size(), 40u);  // each file (~8 KB) is below the 16 KiB target: one document
  EXPECT_EQ(c.documents.front().text.rfind("Document number 0.", 0), 0u);
  EXPECT_EQ(c.content_hash, corpus_content_hash(dir));
  // Any byte change changes the hash.
  write_file(dir / "doc00.txt", generated_document(7, 0, 12) + "x");
  EXPECT_NE(corpus_content_hash(dir), c.content_hash);
}

TEST_F(DataTest, LargeFileIsCutAtBlankLines) {
  std::string text;
  for (int p = 0; p < 100; ++p) text += std::string(999, char('a' + p % 26)) + "\n\n";
  const auto docs = split_into_documents(text, 4000);
  ASSERT_EQ(docs.size(), 25u);  // 4 paragraphs (4004 bytes) per document
  for (const auto& d : docs) {
    EXPECT_EQ(d.size(), 4 * 999 + 3 * 2u);
    EXPECT_NE(d.back(), '\n');
  }
  EXPECT_EQ(split_into_documents("\xEF\xBB\xBF  one line \n", 10), std::vector<std::string>{"one line"});
  EXPECT_TRUE(split_into_documents(" \n\t\n", 10).empty());
}

TEST_F(DataTest, MissingPathIsAClearError) {
  const fs::path missing = root_ / "no_such_corpus";
  const std::string msg = error_message([&] { read_corpus(missing); });
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  const std::string msg2 = error_message([&] { prepare_dataset(missing, root_ / "out", kVocab); });
  EXPECT_NE(msg2.find(missing.string()), std::string::npos) << msg2;
}

TEST_F(DataTest, EmptyCorpusIsAClearError) {
  const fs::path empty = root_ / "empty";
  fs::create_directories(empty);
  std::string msg = error_message([&] { read_corpus(empty); });
  EXPECT_NE(msg.find(empty.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;

  write_file(empty / "blank.txt", "  \n\n\t \n");
  write_file(empty / ".hidden.txt", "hidden text is not read");
  msg = error_message([&] { read_corpus(empty); });
  EXPECT_NE(msg.find(empty.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("no non-whitespace text"), std::string::npos) << msg;
}

TEST_F(DataTest, BinaryFileIsAClearError) {
  const fs::path dir = make_corpus("corpus", 3);
  std::string bytes = "Some text first.";
  bytes += std::string("\0\x01\x02", 3);
  const fs::path bin = dir / "model.bin";
  write_file(bin, bytes);
  std::string msg = error_message([&] { read_corpus(dir); });
  EXPECT_NE(msg.find(bin.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("NUL byte at byte offset 16"), std::string::npos) << msg;

  write_file(bin, "caf\xC3\xA9 ok, then \xFF bad");  // valid é, invalid 0xFF at offset 15
  msg = error_message([&] { read_corpus(dir); });
  EXPECT_NE(msg.find(bin.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 15"), std::string::npos) << msg;

  // Only the first 64 KiB are checked, and a sequence cut by that limit is fine.
  std::string big(std::size_t(kTextCheckBytes) - 1, 'a');
  big += "\xC3\xA9 and later \xFF";
  write_file(bin, big);
  EXPECT_NO_THROW(read_corpus(dir));
}

TEST_F(DataTest, Utf8Validator) {
  EXPECT_EQ(find_non_text_byte("plain ascii\n", false), -1);
  EXPECT_EQ(find_non_text_byte("\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80", false), -1);
  EXPECT_EQ(find_non_text_byte("ab\xC0\xAF", false), 2);          // overlong '/'
  EXPECT_EQ(find_non_text_byte("ab\xED\xA0\x80", false), 2);      // surrogate
  EXPECT_EQ(find_non_text_byte("abc\xE6\x97", false), 3);         // cut at end of file
  EXPECT_EQ(find_non_text_byte("abc\xE6\x97", true), -1);         // cut by the check window
  EXPECT_EQ(find_non_text_byte("a\xE6" "b", true), 1);            // bad continuation
}

TEST_F(DataTest, TokenizerRoundTripsText) {
  const Corpus c = read_corpus(make_corpus());
  const std::string prefix = (root_ / "tok").string();
  Tokenizer::train(texts(c), prefix, kVocab);
  const Tokenizer t = Tokenizer::load(prefix + ".model");
  EXPECT_EQ(t.vocab_size(), kVocab);
  EXPECT_EQ(t.unk_id(), 0);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.id_to_piece(t.newline_id()), "<0x0A>");

  const std::vector<std::string> samples = {
      "The jury said it was not the case.",
      "",
      "  two leading spaces, two trailing  ",
      "multi\n\nline\ttext\n",
      "\n\nstarts with newlines",
      "a\r\nwindows line",
      "digits 1234567890 and symbols ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
      "UPPER lower MiXeD qqqqzzzz xylophone",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC",  // not in the corpus: byte fallback
  };
  for (const std::string& s : samples) {
    const std::vector<std::int32_t> ids = t.encode(s);
    EXPECT_EQ(t.decode(ids), s) << "sample: " << s;
    for (std::int32_t id : ids) {
      EXPECT_NE(id, t.unk_id()) << s;
      EXPECT_NE(id, t.eos_id()) << s;
    }
  }
  // Every generated document round-trips, and merges make it shorter than bytes.
  std::size_t bytes = 0, tokens = 0;
  for (const Document& d : c.documents) {
    const auto ids = t.encode(d.text);
    ASSERT_EQ(t.decode(ids), d.text);
    bytes += d.text.size();
    tokens += ids.size();
  }
  EXPECT_GT(double(bytes) / double(tokens), 2.0);
  // eos decodes to nothing; out-of-range ids are refused.
  std::vector<std::int32_t> ids = t.encode("end");
  ids.push_back(t.eos_id());
  EXPECT_EQ(t.decode(ids), "end");
  const std::vector<std::int32_t> bad = {kVocab};
  EXPECT_THROW(t.decode(bad), DataError);

  // Training is deterministic: the same input gives a byte-identical model.
  const std::string prefix2 = (root_ / "tok2").string();
  Tokenizer::train(texts(c), prefix2, kVocab);
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(slurp(prefix + ".model"), slurp(prefix2 + ".model"));
}

TEST_F(DataTest, TokenizerVocabTooLargeIsAClearError) {
  const std::vector<std::string> docs = {"A tiny corpus.", "Another tiny line of text."};
  const std::string msg = error_message([&] { Tokenizer::train(docs, (root_ / "tok").string(), 4096); });
  EXPECT_NE(msg.find("vocab_size 4096"), std::string::npos) << msg;
  EXPECT_NE(msg.find("smaller vocab_size"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(root_ / "tok.model"));
  EXPECT_THROW(Tokenizer::train(docs, (root_ / "tok").string(), 100), ConfigError);
  // Too small for the corpus's characters plus the 256 byte pieces.
  const Corpus c = read_corpus(make_corpus("corpus", 4));
  const std::string small = error_message([&] { Tokenizer::train(texts(c), (root_ / "tok").string(), 280); });
  EXPECT_NE(small.find("vocab_size 280"), std::string::npos) << small;
  EXPECT_NE(small.find("larger vocab_size"), std::string::npos) << small;
  const std::string missing = (root_ / "none.model").string();
  EXPECT_NE(error_message([&] { Tokenizer::load(missing); }).find(missing), std::string::npos);
}

TEST_F(DataTest, PrepareSplitsDocumentsDisjointly) {
  const fs::path corpus = make_corpus();
  const fs::path out = root_ / "ds";
  std::vector<std::string> log;
  const DatasetInfo info = prepare_dataset(corpus, out, kVocab, 0.2, 42, quiet(&log));
  EXPECT_FALSE(info.reused);
  EXPECT_EQ(info.train_documents + info.val_documents, 40);
  EXPECT_GE(info.val_documents, 1);
  EXPECT_GE(info.train_documents, 20);
  for (const char* f : {"tokenizer.model", "tokenizer.vocab", "train_000.bin", "val_000.bin", "dataset.json"})
    EXPECT_TRUE(fs::exists(out / f)) << f;
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << "leftover " << e.path();

  const TokenDataset ds = TokenDataset::open(out);
  EXPECT_EQ(ds.num_tokens(Split::kTrain), info.train_tokens);
  EXPECT_EQ(ds.num_tokens(Split::kVal), info.val_tokens);
  const Tokenizer t = Tokenizer::load((out / "tokenizer.model").string());

  // Decoding each split and cutting at eos gives back whole documents, each in
  // exactly one split.
  auto documents_of = [&](Split split) {
    std::multiset<std::string> docs;
    std::vector<std::int32_t> cur;
    for (std::int32_t id : split_tokens(ds, split)) {
      if (id == t.eos_id()) {
        docs.insert(t.decode(cur));
        cur.clear();
      } else {
        cur.push_back(id);
      }
    }
    EXPECT_TRUE(cur.empty()) << split_name(split) << " does not end with eos";
    return docs;
  };
  const auto train = documents_of(Split::kTrain), val = documents_of(Split::kVal);
  EXPECT_EQ(std::int64_t(train.size()), info.train_documents);
  EXPECT_EQ(std::int64_t(val.size()), info.val_documents);
  for (const std::string& d : val) EXPECT_EQ(train.count(d), 0u);
  std::multiset<std::string> all(train.begin(), train.end());
  all.insert(val.begin(), val.end());
  const auto original = texts(read_corpus(corpus));
  EXPECT_EQ(all, std::multiset<std::string>(original.begin(), original.end()));

  // A single small file still gives both splits (files are cut more finely).
  const fs::path single = root_ / "single.txt";
  write_file(single, generated_document(3, 0, 60));
  const DatasetInfo one = prepare_dataset(single, root_ / "ds_single", 400, 0.05, 1, quiet(&log));
  EXPECT_GE(one.val_documents, 1);
  EXPECT_GE(one.train_documents, 10);
}

TEST_F(DataTest, BatchesAreDeterministicAndShifted) {
  const fs::path out = root_ / "ds";
  std::vector<std::string> log;
  prepare_dataset(make_corpus(), out, kVocab, 0.1, 1, quiet(&log));
  const TokenDataset ds = TokenDataset::open(out);
  constexpr int B = 4, S = 32;
  std::vector<std::int32_t> in1(B * S), tg1(B * S), in2(B * S), tg2(B * S);

  ds.sample_batch(Split::kTrain, 7, 10, 2, B, S, in1.data(), tg1.data());
  const TokenDataset reopened = TokenDataset::open(out);  // a resumed run
  reopened.sample_batch(Split::kTrain, 7, 10, 2, B, S, in2.data(), tg2.data());
  EXPECT_EQ(in1, in2);
  EXPECT_EQ(tg1, tg2);
  reopened.sample_batch(Split::kTrain, 7, 11, 2, B, S, in2.data(), tg2.data());
  EXPECT_NE(in1, in2);
  reopened.sample_batch(Split::kTrain, 7, 10, 3, B, S, in2.data(), tg2.data());
  EXPECT_NE(in1, in2);
  reopened.sample_batch(Split::kTrain, 8, 10, 2, B, S, in2.data(), tg2.data());
  EXPECT_NE(in1, in2);

  // Targets are the inputs shifted by one, and each row is a real window.
  const std::vector<std::int32_t> toks = split_tokens(ds, Split::kTrain);
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s + 1 < S; ++s) EXPECT_EQ(tg1[b * S + s], in1[b * S + s + 1]);
    std::vector<std::int32_t> window(in1.begin() + b * S, in1.begin() + (b + 1) * S);
    window.push_back(tg1[b * S + S - 1]);
    EXPECT_NE(std::search(toks.begin(), toks.end(), window.begin(), window.end()), toks.end()) << "row " << b;
  }
  // The rows of many batches cover the split roughly uniformly.
  std::int64_t first_half = 0, total = 0;
  for (int step = 0; step < 200; ++step) {
    ds.sample_batch(Split::kTrain, 7, step, 0, B, S, in2.data(), tg2.data());
    for (int b = 0; b < B; ++b) {
      const auto pos = std::search(toks.begin(), toks.end(), in2.begin() + b * S, in2.begin() + (b + 1) * S);
      first_half += (pos - toks.begin()) < std::ptrdiff_t(toks.size() / 2);
      ++total;
    }
  }
  EXPECT_NEAR(double(first_half) / double(total), 0.5, 0.1);

  // Validation batches: a fixed set, the same on every call.
  const std::int64_t nb = ds.num_val_batches(B, S, 3);
  EXPECT_GE(nb, 1);
  EXPECT_LE(nb, 3);
  std::set<std::vector<std::int32_t>> rows;
  for (std::int64_t i = 0; i < nb; ++i) {
    ds.val_batch(i, B, S, 3, in1.data(), tg1.data());
    reopened.val_batch(i, B, S, 3, in2.data(), tg2.data());
    EXPECT_EQ(in1, in2);
    EXPECT_EQ(tg1, tg2);
    for (int b = 0; b < B; ++b) {
      for (int s = 0; s + 1 < S; ++s) EXPECT_EQ(tg1[b * S + s], in1[b * S + s + 1]);
      rows.emplace(in1.begin() + b * S, in1.begin() + (b + 1) * S);
    }
  }
  EXPECT_EQ(std::int64_t(rows.size()), nb * B);  // distinct windows
  EXPECT_THROW(ds.num_val_batches(B, int(ds.num_tokens(Split::kVal)), 0), DataError);
  EXPECT_THROW(ds.sample_batch(Split::kVal, 1, 0, 0, 1, int(ds.num_tokens(Split::kVal)), in1.data(), tg1.data()),
               DataError);
}

TEST_F(DataTest, PrepareReusesAMatchingDataset) {
  const fs::path corpus = make_corpus();
  const fs::path out = root_ / "ds";
  std::vector<std::string> log;
  const DatasetInfo first = prepare_dataset(corpus, out, kVocab, 0.05, 1, quiet(&log));
  const auto stamp = fs::last_write_time(out / "train_000.bin");

  log.clear();
  const DatasetInfo again = prepare_dataset(corpus, out, kVocab, 0.05, 1, quiet(&log));
  EXPECT_TRUE(again.reused);
  EXPECT_EQ(again.train_tokens, first.train_tokens);
  EXPECT_EQ(again.val_tokens, first.val_tokens);
  EXPECT_EQ(again.corpus_hash, first.corpus_hash);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("reusing"), std::string::npos) << log[0];
  EXPECT_EQ(fs::last_write_time(out / "train_000.bin"), stamp);

  // Another vocabulary size, or a changed corpus, rebuilds.
  log.clear();
  EXPECT_FALSE(prepare_dataset(corpus, out, kVocab + 64, 0.05, 1, quiet(&log)).reused);
  EXPECT_NE(log.front().find("vocab_size"), std::string::npos) << log.front();
  write_file(corpus / "extra.txt", generated_document(9, 99, 5));
  log.clear();
  const DatasetInfo changed = prepare_dataset(corpus, out, kVocab + 64, 0.05, 1, quiet(&log));
  EXPECT_FALSE(changed.reused);
  EXPECT_NE(changed.corpus_hash, first.corpus_hash);
  EXPECT_NE(log.front().find("corpus_hash"), std::string::npos) << log.front();
  EXPECT_EQ(changed.train_documents + changed.val_documents, 41);
}

TEST_F(DataTest, TruncatedShardIsAClearError) {
  const fs::path out = root_ / "ds";
  std::vector<std::string> log;
  const DatasetInfo info = prepare_dataset(make_corpus(), out, kVocab, 0.05, 1, quiet(&log));
  const fs::path shard = out / "train_000.bin";
  const auto size = fs::file_size(shard);
  ASSERT_EQ(size, std::uintmax_t(kShardHeaderBytes + 2 * info.train_tokens));  // uint16 tokens
  fs::resize_file(shard, size - 10);
  std::string msg = error_message([&] { TokenDataset::open(out); });
  EXPECT_NE(msg.find(shard.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("expected {} bytes", size)), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("found {} bytes", size - 10)), std::string::npos) << msg;

  fs::resize_file(shard, 7);
  msg = error_message([&] { TokenDataset::open(out); });
  EXPECT_NE(msg.find(shard.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;

  write_file(shard, std::string(64, 'x'));
  msg = error_message([&] { TokenDataset::open(out); });
  EXPECT_NE(msg.find(shard.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;

  // A damaged dataset is not reused: preparing again repairs it.
  log.clear();
  EXPECT_FALSE(prepare_dataset(root_ / "corpus", out, kVocab, 0.05, 1, quiet(&log)).reused);
  EXPECT_NO_THROW(TokenDataset::open(out));

  // A shard round-trips with int32 tokens too (vocabularies above 65536).
  const std::vector<std::int32_t> big = {0, 70000, 5, 99999};
  write_token_shard(root_ / "big.bin", big, 100000);
  EXPECT_EQ(read_token_shard(root_ / "big.bin", 100000), big);
  EXPECT_EQ(fs::file_size(root_ / "big.bin"), std::uintmax_t(kShardHeaderBytes + 16));
}

}  // namespace
