#include "moeflex/train/corpus.h"

#include <algorithm>
#include <fmt/format.h>
#include <fstream>
#include <system_error>

#include "moeflex/core/error.h"

namespace moeflex {
namespace fs = std::filesystem;

namespace {

bool is_hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string_view trim(std::string_view s) {
  std::size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}

// 64-bit FNV-1a, finalised through mix64-like avalanche. Only detects change,
// so it need not be cryptographic; two lanes with different offsets give 128 bits.
class ContentHasher {
 public:
  void update(std::string_view bytes) {
    for (unsigned char c : bytes) {
      a_ = (a_ ^ c) * 0x100000001B3ull;
      b_ = (b_ ^ c) * 0x100000001B3ull + 0x9E3779B97F4A7C15ull;
    }
  }
  // Length-prefixed, so ("ab","c") and ("a","bc") differ.
  void update_field(std::string_view bytes) {
    const std::uint64_t n = bytes.size();
    update(std::string_view(reinterpret_cast<const char*>(&n), sizeof n));
    update(bytes);
  }
  std::string hex() const { return fmt::format("{:016x}{:016x}", avalanche(a_), avalanche(b_)); }

 private:
  static std::uint64_t avalanche(std::uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t a_ = 0xCBF29CE484222325ull;
  std::uint64_t b_ = 0x84222325CBF29CE4ull;
};

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw DataError(fmt::format("Cannot open corpus file '{}' for reading.", file.string()));
  std::string data;
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  if (!ec) data.reserve(size);
  data.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw DataError(fmt::format("Reading corpus file '{}' failed.", file.string()));
  return data;
}

void check_text(const fs::path& file, std::string_view data) {
  const bool truncated = Bytes(data.size()) > kTextCheckBytes;
  const std::string_view head = data.substr(0, std::size_t(std::min<Bytes>(Bytes(data.size()), kTextCheckBytes)));
  std::string reason;
  const std::int64_t at = find_non_text_byte(head, truncated, &reason);
  if (at >= 0)
    throw DataError(fmt::format("Corpus file '{}' is not UTF-8 text: {} at byte offset {}. "
                                "Pass only text files (or a folder of them) as the corpus.",
                                file.string(), reason, at));
}

std::string relative_name(const fs::path& root, const fs::path& file) {
  if (file == root) return file.filename().string();
  return file.lexically_relative(root).generic_string();
}

}  // namespace

std::int64_t find_non_text_byte(std::string_view s, bool truncated, std::string* reason) {
  auto fail = [&](std::size_t at, const char* why) -> std::int64_t {
    if (reason) *reason = why;
    return std::int64_t(at);
  };
  const auto* u = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = u[i];
    if (c == 0) return fail(i, "a NUL byte");
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    std::uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07;
    else return fail(i, "an invalid UTF-8 lead byte");
    int k = 1;
    for (; k < len && i + k < n; ++k) {
      if ((u[i + k] & 0xC0) != 0x80) return fail(i, "an incomplete UTF-8 sequence");
      cp = (cp << 6) | (u[i + k] & 0x3F);
    }
    if (k < len) {  // cut off by the end of the data
      if (truncated) return -1;
      return fail(i, "an incomplete UTF-8 sequence at the end of the file");
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return fail(i, "an overlong UTF-8 encoding");
    if (cp >= 0xD800 && cp <= 0xDFFF) return fail(i, "a UTF-8 encoded surrogate");
    if (cp > 0x10FFFF) return fail(i, "a code point above U+10FFFF");
    i += std::size_t(len);
  }
  return -1;
}

std::vector<std::string> split_into_documents(std::string_view text, Bytes target_document_bytes) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
  std::vector<std::string> docs;
  auto emit = [&](std::string_view piece) {
    const std::string_view t = trim(piece);
    if (!t.empty()) docs.emplace_back(t);
  };
  std::size_t doc_begin = 0, line_begin = 0;
  bool previous_line_blank = false;
  while (line_begin < text.size()) {
    std::size_t line_end = text.find('\n', line_begin);
    line_end = line_end == std::string_view::npos ? text.size() : line_end + 1;
    const bool blank = trim(text.substr(line_begin, line_end - line_begin)).empty();
    // A paragraph starts here: cut if the document so far is large enough.
    if (!blank && previous_line_blank && Bytes(line_begin - doc_begin) >= target_document_bytes) {
      emit(text.substr(doc_begin, line_begin - doc_begin));
      doc_begin = line_begin;
    }
    previous_line_blank = blank;
    line_begin = line_end;
  }
  emit(text.substr(doc_begin));
  return docs;
}

std::vector<fs::path> list_corpus_files(const fs::path& path) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (ec || !fs::exists(status))
    throw DataError(fmt::format("Corpus path '{}' does not exist.", path.string()));
  if (fs::is_regular_file(status)) return {path};
  if (!fs::is_directory(status))
    throw DataError(fmt::format("Corpus path '{}' is neither a regular file nor a folder.", path.string()));

  std::vector<fs::path> files;
  fs::recursive_directory_iterator it(path, fs::directory_options::none, ec), end;
  if (ec) throw DataError(fmt::format("Cannot list corpus folder '{}': {}.", path.string(), ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) throw DataError(fmt::format("Cannot list corpus folder '{}': {}.", path.string(), ec.message()));
    if (is_hidden(it->path())) {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) files.push_back(it->path());
  }
  if (files.empty())
    throw DataError(fmt::format("Corpus folder '{}' holds no (non-hidden) files; the corpus is empty.",
                                path.string()));
  std::sort(files.begin(), files.end(),
            [](const fs::path& a, const fs::path& b) { return a.generic_string() < b.generic_string(); });
  return files;
}

Corpus read_corpus(const fs::path& path, const CorpusOptions& options) {
  if (options.target_document_bytes <= 0)
    throw ConfigError(fmt::format("target_document_bytes must be positive, got {}.", options.target_document_bytes));
  Corpus corpus;
  corpus.files = list_corpus_files(path);
  ContentHasher hasher;
  for (const fs::path& file : corpus.files) {
    const std::string data = read_file(file);
    check_text(file, data);
    hasher.update_field(relative_name(path, file));
    hasher.update_field(data);
    corpus.total_bytes += Bytes(data.size());
    for (std::string& text : split_into_documents(data, options.target_document_bytes))
      corpus.documents.push_back(Document{file.string(), std::move(text)});
  }
  corpus.content_hash = hasher.hex();
  if (corpus.documents.empty())
    throw DataError(fmt::format("Corpus '{}' is empty: its {} file(s) ({} bytes) hold no non-whitespace text.",
                                path.string(), corpus.files.size(), corpus.total_bytes));
  return corpus;
}

std::string corpus_content_hash(const fs::path& path) {
  ContentHasher hasher;
  for (const fs::path& file : list_corpus_files(path)) {
    hasher.update_field(relative_name(path, file));
    hasher.update_field(read_file(file));
  }
  return hasher.hex();
}

}  // namespace moeflex
