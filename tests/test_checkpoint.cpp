// safetensors I/O and crash-safe checkpoints: bit-exact round trips, files
// composed by hand per the spec, and every refusal (truncated, corrupted,
// missing tensor, wrong shape) leaving the destination untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/safetensors.h"

namespace fs = std::filesystem;
using namespace moeflex::train;
using moeflex::append_line;  // the file helpers (core/file_io.h)
using moeflex::DataError;
using moeflex::sha256_hex;
using moeflex::WrittenFile;

namespace {

/// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            (std::string("moeflex_ckpt_") + info->test_suite_name() + "_" + info->name() + "_" +
             std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}

std::string le64(std::uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

/// Expects `fn` to throw DataError whose message contains every one of `parts`.
template <typename Fn>
void expect_data_error(Fn fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected a DataError";
  } catch (const DataError& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

/// A toy model and optimizer: owned storage plus NamedBuffer views of it.
struct Toy {
  std::vector<std::vector<float>> storage;
  std::vector<NamedBuffer> model, optimizer;

  explicit Toy(std::uint32_t seed, bool fill_random = true) {
    const std::vector<std::pair<std::string, std::vector<std::int64_t>>> params = {
        {"embed.weight", {7, 3}}, {"layers.0.attn.wq", {3, 3}}, {"layers.0.experts.w1", {4, 3, 5}}, {"norm.weight", {3}}};
    std::mt19937 rng(seed);
    auto make = [&](const std::string& name, const std::vector<std::int64_t>& shape, std::vector<NamedBuffer>& out) {
      std::int64_t n = 1;
      for (auto d : shape) n *= d;
      std::vector<float> v(static_cast<std::size_t>(n), 0.0f);
      if (fill_random)
        for (auto& x : v) {
          std::uint32_t bits = rng();
          std::memcpy(&x, &bits, 4);  // any bit pattern, NaN payloads included
        }
      storage.push_back(std::move(v));
      out.push_back(NamedBuffer{name, shape, nullptr});
    };
    storage.reserve(3 * params.size());
    for (const auto& [name, shape] : params) make(name, shape, model);
    for (const auto& [name, shape] : params) make("adam.m." + name, shape, optimizer);
    for (const auto& [name, shape] : params) make("adam.v." + name, shape, optimizer);
    for (std::size_t i = 0; i < model.size(); ++i) model[i].data = storage[i].data();
    for (std::size_t i = 0; i < optimizer.size(); ++i) optimizer[i].data = storage[model.size() + i].data();
    if (fill_random) {  // a few values that must survive bit for bit
      storage[0][0] = -0.0f;
      storage[0][1] = std::numeric_limits<float>::denorm_min();
      storage[0][2] = std::numeric_limits<float>::infinity();
    }
  }

  void fill(float value) {
    for (auto& v : storage) std::fill(v.begin(), v.end(), value);
  }
  bool bits_equal(const Toy& o) const {
    if (storage.size() != o.storage.size()) return false;
    for (std::size_t i = 0; i < storage.size(); ++i)
      if (storage[i].size() != o.storage[i].size() ||
          std::memcmp(storage[i].data(), o.storage[i].data(), storage[i].size() * sizeof(float)) != 0)
        return false;
    return true;
  }
  bool all_equal_to(float value) const {
    for (const auto& v : storage)
      for (float x : v)
        if (x != value) return false;
    return true;
  }
};

nlohmann::json sample_state(std::int64_t step) {
  return {{"step", step},
          {"rng", std::numeric_limits<std::uint64_t>::max() - 12345},
          {"lr", 0.1},
          {"data_cursor", {{"shard", 2}, {"offset", 987654321}}},
          {"note", "résumé ✓"}};
}

}  // namespace

// ---------------- safetensors ----------------

TEST(Sha256, KnownVector) {
  EXPECT_EQ(sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Safetensors, ReadsAFileComposedByHandPerTheSpec) {
  TempDir tmp;
  // Header without padding (the spec allows it) and keys out of data order.
  const std::string header =
      R"({"i":{"dtype":"I32","shape":[1,1],"data_offsets":[16,20]},)"
      R"("__metadata__":{"format":"pt","author":"hand"},)"
      R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("d":{"dtype":"F64","shape":[],"data_offsets":[8,16]},)"
      R"("e":{"dtype":"I64","shape":[0,3],"data_offsets":[20,20]}})";
  std::string bytes = le64(header.size()) + header;
  bytes += std::string("\x00\x00\x80\x3f", 4);              // 1.0f
  bytes += std::string("\x00\x00\x00\xc0", 4);              // -2.0f
  bytes += std::string("\x00\x00\x00\x00\x00\x00\xe0\x3f", 8);  // 0.5 (double)
  bytes += std::string("\xf9\xff\xff\xff", 4);              // -7 (int32)
  write_all(tmp.path() / "hand.safetensors", bytes);

  SafetensorsFile f = SafetensorsFile::open(tmp.path() / "hand.safetensors");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"w", "d", "i", "e"}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("author"), "hand");
  EXPECT_EQ(f.info("w").dtype, StDType::F32);
  EXPECT_EQ(f.info("w").shape, (std::vector<std::int64_t>{2}));
  EXPECT_EQ(f.info("d").shape, (std::vector<std::int64_t>{}));
  EXPECT_EQ(f.info("i").shape, (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(f.info("e").numel(), 0);

  float w[2] = {};
  f.read_f32("w", w, 2);
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[1], -2.0f);
  float d32 = 0;
  f.read_f32("d", &d32, 1);  // F64 -> F32
  EXPECT_EQ(d32, 0.5f);
  double w64[2] = {};
  f.read_f64("w", w64, 2);  // F32 -> F64
  EXPECT_EQ(w64[1], -2.0);
  std::int32_t i = 0;
  f.read_i32("i", &i, 1);
  EXPECT_EQ(i, -7);
  std::int64_t i64 = 0;
  f.read_i64("i", &i64, 1);
  EXPECT_EQ(i64, -7);

  expect_data_error([&] { f.read_f32("w", w, 3); }, {"'w'", "3 elements"});
  expect_data_error([&] { f.read_f32("nope", w, 2); }, {"nope", "hand.safetensors"});
  expect_data_error([&] { f.read_f32("i", w, 1); }, {"'i'", "I32"});
}

// Published checkpoints' half-precision tensors read into float: bfloat16 (the top half
// of a float) and IEEE binary16 with its subnormals, largest value and infinity.
TEST(Safetensors, ReadsBf16AndF16IntoFloat) {
  TempDir tmp;
  const std::string header = R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                             R"("h":{"dtype":"F16","shape":[5],"data_offsets":[6,16]}})";
  std::string bytes = le64(header.size()) + header;
  bytes += std::string("\x80\x3f\x00\xc0\xc9\x40", 6);  // bf16 1.0, -2.0, 6.28125 (0x40c9)
  bytes += std::string("\x00\x3c\x00\xc0\x01\x00\xff\x7b\x00\x7c", 10);  // 1, -2, 2^-24, 65504, inf
  write_all(tmp.path() / "half.safetensors", bytes);
  SafetensorsFile f = SafetensorsFile::open(tmp.path() / "half.safetensors");
  EXPECT_EQ(f.info("b").dtype, StDType::BF16);
  float b[3] = {}, h[5] = {};
  f.read_f32("b", b, 3);
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -2.0f);
  EXPECT_EQ(b[2], 6.28125f);
  f.read_f32("h", h, 5);
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[3], 65504.0f);
  EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
  double d[3];
  expect_data_error([&] { f.read_f64("b", d, 3); }, {"'b'", "BF16"});
}

TEST(Safetensors, WriterOutputFollowsTheSpecByteForByte) {
  TempDir tmp;
  const float a[3] = {1.5f, -0.0f, 3.25f};
  const std::int64_t b[2] = {-1, 1LL << 40};
  const double c = 2.0;
  SafetensorsWriter w;
  w.add("a", StDType::F32, {3}, a);
  w.add("b", StDType::I64, {2, 1}, b);
  w.add("c", StDType::F64, {}, &c);
  WrittenFile wf = w.write(tmp.path() / "out.safetensors", {{"format", "pt"}});

  const std::string bytes = read_all(tmp.path() / "out.safetensors");
  ASSERT_EQ(static_cast<std::int64_t>(bytes.size()), wf.bytes);
  EXPECT_EQ(wf.sha256, sha256_hex(bytes.data(), bytes.size()));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "data buffer should be 8-byte aligned";
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["a"]["dtype"], "F32");
  EXPECT_EQ(header["a"]["shape"], nlohmann::json({3}));
  EXPECT_EQ(header["a"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(header["b"]["dtype"], "I64");
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json({12, 28}));
  EXPECT_EQ(header["c"]["shape"], nlohmann::json::array());
  EXPECT_EQ(header["c"]["data_offsets"], nlohmann::json({28, 36}));
  const std::string data = bytes.substr(8 + n);
  ASSERT_EQ(data.size(), 36u);
  EXPECT_EQ(std::memcmp(data.data(), a, 12), 0);
  EXPECT_EQ(std::memcmp(data.data() + 12, b, 16), 0);
  EXPECT_EQ(std::memcmp(data.data() + 28, &c, 8), 0);
  // No temporary file left beside it.
  int files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, TruncatedFileIsRefused) {
  TempDir tmp;
  std::vector<float> v(100, 1.0f);
  SafetensorsWriter w;
  w.add("x", StDType::F32, {10, 10}, v.data());
  w.write(tmp.path() / "t.safetensors");
  const std::string bytes = read_all(tmp.path() / "t.safetensors");
  for (std::size_t keep : {bytes.size() - 1, bytes.size() - 200, std::size_t{20}, std::size_t{5}}) {
    write_all(tmp.path() / "cut.safetensors", bytes.substr(0, keep));
    expect_data_error([&] { SafetensorsFile::open(tmp.path() / "cut.safetensors"); },
                      {"truncated", "cut.safetensors"});
  }
}

TEST(Safetensors, CorruptHeadersAreRefused) {
  TempDir tmp;
  auto file_with = [&](const std::string& header, std::size_t data_bytes) {
    write_all(tmp.path() / "c.safetensors", le64(header.size()) + header + std::string(data_bytes, '\0'));
    return tmp.path() / "c.safetensors";
  };
  auto refused = [&](const std::string& header, std::size_t data_bytes, const std::vector<std::string>& parts) {
    const fs::path p = file_with(header, data_bytes);
    expect_data_error([&] { SafetensorsFile::open(p); }, parts);
  };
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12, {"overlap"});
  refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, {"gap"});
  refused(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, {"'a'", "12 bytes"});
  refused(R"({"a":{"dtype":"BOOL","shape":[8],"data_offsets":[0,8]}})", 8, {"'a'", "BOOL"});
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12, {"corrupt", "12 bytes"});
  refused(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, {"'a'", "shape"});
  refused(R"({"a":{"dtype":"F32","shape":[2]}})", 8, {"'a'", "data_offsets"});
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, {"JSON"});
  refused(R"(["a"])", 0, {"'{'"});
  refused(R"({"__metadata__":{"k":1}})", 0, {"metadata"});
  // A header length beyond the file or absurdly large.
  write_all(tmp.path() / "c.safetensors", le64(1ULL << 62) + "{}");
  expect_data_error([&] { SafetensorsFile::open(tmp.path() / "c.safetensors"); }, {"corrupt", "header length"});
  write_all(tmp.path() / "c.safetensors", le64(1000) + "{}");
  expect_data_error([&] { SafetensorsFile::open(tmp.path() / "c.safetensors"); }, {"truncated", "1000"});
  expect_data_error([&] { SafetensorsFile::open(tmp.path() / "missing.safetensors"); }, {"missing.safetensors"});
}

// ---------------- checkpoints ----------------

TEST(Checkpoint, RoundTripIsBitExact) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 42, saved.model, saved.optimizer, sample_state(42));

  auto latest = latest_checkpoint(tmp.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, tmp.path() / "checkpoints" / "step_00000042");
  EXPECT_EQ(checkpoint_step(*latest), 42);

  Toy loaded(2, /*fill_random=*/false);
  nlohmann::json state = load_checkpoint(*latest, loaded.model, loaded.optimizer);
  EXPECT_TRUE(loaded.bits_equal(saved));
  EXPECT_EQ(state, sample_state(42));
  EXPECT_EQ(state["rng"].get<std::uint64_t>(), std::numeric_limits<std::uint64_t>::max() - 12345);

  // The manifest records exact sizes and checksums of the files beside it.
  nlohmann::json m = nlohmann::json::parse(read_all(*latest / "manifest.json"));
  EXPECT_EQ(m["format"], "moeflex-checkpoint");
  EXPECT_EQ(m["version"], 1);
  EXPECT_EQ(m["step"], 42);
  for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string bytes = read_all(*latest / name);
    EXPECT_EQ(m["files"][name]["bytes"].get<std::int64_t>(), static_cast<std::int64_t>(bytes.size()));
    EXPECT_EQ(m["files"][name]["sha256"], sha256_hex(bytes.data(), bytes.size()));
  }
  // model.safetensors is a plain safetensors file.
  SafetensorsFile f = SafetensorsFile::open(*latest / "model.safetensors");
  EXPECT_EQ(f.names().size(), saved.model.size());
  EXPECT_EQ(f.info("layers.0.experts.w1").shape, (std::vector<std::int64_t>{4, 3, 5}));
  EXPECT_EQ(f.metadata().at("format"), "pt");

  // Weights alone, for `generate`: from the directory or from the file.
  Toy weights(3, false);
  load_model_weights(*latest, weights.model);
  EXPECT_EQ(std::memcmp(weights.storage[2].data(), saved.storage[2].data(), saved.storage[2].size() * 4), 0);
  Toy weights2(3, false);
  load_model_weights(*latest / "model.safetensors", weights2.model);
  EXPECT_EQ(std::memcmp(weights2.storage[0].data(), saved.storage[0].data(), saved.storage[0].size() * 4), 0);
}

TEST(Checkpoint, TruncatedFileIsRefusedAndBuffersUntouched) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 5, saved.model, saved.optimizer, sample_state(5));
  const fs::path dir = checkpoint_dir(tmp.path(), 5);
  const auto size = fs::file_size(dir / "model.safetensors");
  fs::resize_file(dir / "model.safetensors", size - 10);

  Toy dst(2, false);
  dst.fill(7.0f);
  expect_data_error([&] { load_checkpoint(dir, dst.model, dst.optimizer); }, {"truncated", "model.safetensors"});
  EXPECT_TRUE(dst.all_equal_to(7.0f));
  expect_data_error([&] { load_model_weights(dir, dst.model); }, {"truncated"});
  EXPECT_TRUE(dst.all_equal_to(7.0f));
  // Its recorded size no longer matches, so it is not offered for resuming.
  EXPECT_FALSE(latest_checkpoint(tmp.path()).has_value());
}

TEST(Checkpoint, FlippedByteIsRefusedByChecksumAndBuffersUntouched) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 5, saved.model, saved.optimizer, sample_state(5));
  const fs::path dir = checkpoint_dir(tmp.path(), 5);
  std::string bytes = read_all(dir / "model.safetensors");
  bytes[bytes.size() - 3] ^= 0x10;  // inside the data: still a well-formed file
  write_all(dir / "model.safetensors", bytes);
  EXPECT_NO_THROW(SafetensorsFile::open(dir / "model.safetensors"));

  Toy dst(2, false);
  dst.fill(7.0f);
  expect_data_error([&] { load_checkpoint(dir, dst.model, dst.optimizer); },
                    {"corrupt", "model.safetensors", "SHA-256"});
  EXPECT_TRUE(dst.all_equal_to(7.0f));
  expect_data_error([&] { load_model_weights(dir / "model.safetensors", dst.model); }, {"corrupt"});
  EXPECT_TRUE(dst.all_equal_to(7.0f));
}

TEST(Checkpoint, CorruptOptimizerLeavesModelBuffersUntouched) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 5, saved.model, saved.optimizer, sample_state(5));
  const fs::path dir = checkpoint_dir(tmp.path(), 5);
  std::string bytes = read_all(dir / "optimizer.safetensors");
  bytes.back() ^= 0x01;
  write_all(dir / "optimizer.safetensors", bytes);

  Toy dst(2, false);
  dst.fill(-3.0f);
  expect_data_error([&] { load_checkpoint(dir, dst.model, dst.optimizer); }, {"corrupt", "optimizer.safetensors"});
  EXPECT_TRUE(dst.all_equal_to(-3.0f));

  fs::remove(dir / "optimizer.safetensors");
  expect_data_error([&] { load_checkpoint(dir, dst.model, dst.optimizer); }, {"missing", "optimizer.safetensors"});
  EXPECT_TRUE(dst.all_equal_to(-3.0f));
}

TEST(Checkpoint, ShapeMismatchAndMissingTensorNameTheTensor) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 5, saved.model, saved.optimizer, sample_state(5));
  const fs::path dir = checkpoint_dir(tmp.path(), 5);

  Toy dst(2, false);
  dst.fill(1.0f);
  // Same element count, other shape: still refused, and nothing written.
  dst.optimizer.back().shape = {3, 1};
  expect_data_error([&] { load_checkpoint(dir, dst.model, dst.optimizer); },
                    {"adam.v.norm.weight", "[3]", "[3, 1]"});
  EXPECT_TRUE(dst.all_equal_to(1.0f));

  Toy dst2(2, false);
  dst2.fill(1.0f);
  dst2.model[1].name = "layers.0.attn.wk";
  expect_data_error([&] { load_checkpoint(dir, dst2.model, dst2.optimizer); },
                    {"layers.0.attn.wk", "model.safetensors"});
  EXPECT_TRUE(dst2.all_equal_to(1.0f));

  // A tensor the model does not have means another configuration.
  Toy dst3(2, false);
  dst3.model.pop_back();
  expect_data_error([&] { load_checkpoint(dir, dst3.model, dst3.optimizer); }, {"norm.weight", "does not have"});
}

TEST(Checkpoint, KeepLastRotatesOldCheckpoints) {
  TempDir tmp;
  Toy saved(1);
  for (std::int64_t step = 1; step <= 5; ++step)
    save_checkpoint(tmp.path(), step * 100, saved.model, saved.optimizer, sample_state(step), /*keep_last=*/2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path() / "checkpoints")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000400", "step_00000500"}));
  EXPECT_EQ(*latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 500));

  // The one just written survives even when it is not the newest.
  save_checkpoint(tmp.path(), 50, saved.model, saved.optimizer, sample_state(0), /*keep_last=*/1);
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 50) / "manifest.json"));
}

TEST(Checkpoint, LeftoverTmpAndManifestlessDirsAreIgnored) {
  TempDir tmp;
  Toy saved(1);
  EXPECT_FALSE(latest_checkpoint(tmp.path()).has_value());
  save_checkpoint(tmp.path(), 5, saved.model, saved.optimizer, sample_state(5));
  const fs::path ckpts = tmp.path() / "checkpoints";
  // A crash mid-save of step 9: complete-looking files in step_00000009.tmp.
  fs::copy(checkpoint_dir(tmp.path(), 5), ckpts / "step_00000009.tmp");
  // A directory without a manifest and one whose manifest is garbage.
  fs::create_directories(ckpts / "step_00000008");
  write_all(ckpts / "step_00000008" / "model.safetensors", "junk");
  fs::copy(checkpoint_dir(tmp.path(), 5), ckpts / "step_00000007");
  write_all(ckpts / "step_00000007" / "manifest.json", "{\"format\": \"moeflex-checkpoint\", ");
  // A manifest copied from another step does not match its directory.
  fs::copy(checkpoint_dir(tmp.path(), 5), ckpts / "step_00000006");

  EXPECT_EQ(*latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 5));
  expect_data_error([&] { read_checkpoint_manifest(ckpts / "step_00000008"); }, {"manifest.json"});
  expect_data_error([&] { read_checkpoint_manifest(ckpts / "step_00000007"); }, {"manifest.json", "JSON"});

  // Saving step 9 now replaces the stale .tmp and publishes a real checkpoint.
  save_checkpoint(tmp.path(), 9, saved.model, saved.optimizer, sample_state(9), /*keep_last=*/0);
  EXPECT_FALSE(fs::exists(ckpts / "step_00000009.tmp"));
  EXPECT_EQ(*latest_checkpoint(tmp.path()), checkpoint_dir(tmp.path(), 9));
}

TEST(Checkpoint, ResavingAStepReplacesItWhole) {
  TempDir tmp;
  Toy first(1), second(2);
  save_checkpoint(tmp.path(), 3, first.model, first.optimizer, sample_state(1));
  save_checkpoint(tmp.path(), 3, second.model, second.optimizer, sample_state(2));
  int dirs = 0;
  for (const auto& e : fs::directory_iterator(tmp.path() / "checkpoints")) {
    ++dirs;
    EXPECT_EQ(e.path().filename(), "step_00000003");
  }
  EXPECT_EQ(dirs, 1);
  Toy dst(3, false);
  nlohmann::json state = load_checkpoint(checkpoint_dir(tmp.path(), 3), dst.model, dst.optimizer);
  EXPECT_TRUE(dst.bits_equal(second));
  EXPECT_EQ(state, sample_state(2));
}

TEST(Checkpoint, EmptyOptimizerAndBadBuffers) {
  TempDir tmp;
  Toy saved(1);
  save_checkpoint(tmp.path(), 0, saved.model, {}, nlohmann::json::object());
  Toy dst(2, false);
  EXPECT_EQ(load_checkpoint(checkpoint_dir(tmp.path(), 0), dst.model, {}), nlohmann::json::object());
  EXPECT_EQ(std::memcmp(dst.storage[0].data(), saved.storage[0].data(), saved.storage[0].size() * 4), 0);

  std::vector<NamedBuffer> dup = {saved.model[0], saved.model[0]};
  EXPECT_THROW(save_checkpoint(tmp.path(), 1, dup, {}, {}), moeflex::Error);
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 1)));
}

// A run's rank count comes from its rank folders, named exactly rank<5 digits>; a gap
// in them is refused naming the missing one (a resume would otherwise be told the
// wrong rank count).
TEST(Checkpoint, RankFoldersCountOnlyByTheirExactNamesAndWithoutGaps) {
  TempDir tmp;
  EXPECT_EQ(run_rank_count(tmp.path()), 0);
  for (const char* d : {"rank_notes", "rankings", "rank000001", "rank0000x", "rank00000"})
    fs::create_directories(tmp.path() / d);
  std::ofstream(tmp.path() / "rank00001") << "a file, not a folder";
  EXPECT_TRUE(is_rank_folder_name("rank00000"));
  EXPECT_FALSE(is_rank_folder_name("rank0000x"));
  EXPECT_FALSE(is_rank_folder_name("rank000001"));
  EXPECT_EQ(run_rank_count(tmp.path()), 1);
  fs::create_directories(tmp.path() / rank_folder_name(3));
  try {
    run_rank_count(tmp.path());
    ADD_FAILURE() << "a gap was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("has rank folders up to rank00003 but no rank00001"), std::string::npos)
        << e.what();
  }
}

// A run's logs are appended line by line; a write that fails (a full disk: /dev/full)
// is an error naming the file, never a torn or missing line.
TEST(Files, AFailedAppendIsAnErrorNamingTheFile) {
  TempDir tmp;
  {
    std::ofstream ok(tmp.path() / "metrics.jsonl", std::ios::app);
    append_line(ok, tmp.path() / "metrics.jsonl", "{\"step\": 1}");
  }
  EXPECT_EQ(read_all(tmp.path() / "metrics.jsonl"), "{\"step\": 1}\n");
  std::ofstream full("/dev/full");
  if (!full) GTEST_SKIP() << "no /dev/full here";
  try {
    append_line(full, "/dev/full", std::string(1 << 16, 'x'));
    ADD_FAILURE() << "a write to a full device passed";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("Cannot write '/dev/full' (No space left on device)"), std::string::npos)
        << e.what();
  }
}

// Ranks save with keep_last = 0 and rotate once all have saved: a save keeps every
// older step, and rotate_checkpoints keeps the newest keep_last, never keep_step.
TEST(Checkpoint, SavingWithoutRotationKeepsOlderStepsUntilRotated) {
  TempDir tmp;
  Toy saved(1);
  for (std::int64_t step : {2, 4, 6})
    save_checkpoint(tmp.path(), step, saved.model, saved.optimizer, sample_state(step), 0);
  for (std::int64_t step : {2, 4, 6}) EXPECT_TRUE(checkpoint_complete(checkpoint_dir(tmp.path(), step), step)) << step;
  EXPECT_FALSE(checkpoint_complete(checkpoint_dir(tmp.path(), 4), 6));  // another step's
  rotate_checkpoints(tmp.path(), 4, 2);                                 // keep step 4 and the newest other one
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 4)));
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 6)));
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 2)));
  rotate_checkpoints(tmp.path(), 4, 1);
  EXPECT_TRUE(fs::exists(checkpoint_dir(tmp.path(), 4)));
  EXPECT_FALSE(fs::exists(checkpoint_dir(tmp.path(), 6)));
}
