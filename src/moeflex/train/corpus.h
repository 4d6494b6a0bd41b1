// Reading a text corpus (a UTF-8 file, or a folder of them) into documents.
//
// A document is the unit that the train/validation split assigns as a whole,
// and that the dataset closes with an end-of-sequence token. Each file gives
// one or more documents: a file is cut at blank lines (paragraph boundaries)
// as soon as the current document has reached `target_document_bytes`, so a
// folder of small files (the Brown corpus: ~13 KiB each) gives one document
// per file, and one large file still gives many documents to split.
// Each document is trimmed of surrounding whitespace; whitespace-only
// documents are dropped. A UTF-8 byte-order mark at the start of a file is
// removed. Everything else is kept byte for byte.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "moeflex/core/units.h"

namespace moeflex {

/// One document of a corpus: the text that is kept together in one split.
struct Document {
  std::string source;  ///< the file it came from, for messages
  std::string text;    ///< trimmed, never empty
};

/// How files are cut into documents.
struct CorpusOptions {
  /// A file is cut at the first blank line after a document reaches this size.
  Bytes target_document_bytes = 16 * kKiB;
};

/// A corpus read into memory.
struct Corpus {
  std::vector<Document> documents;
  std::vector<std::filesystem::path> files;  ///< every file read, in reading order
  std::string content_hash;                   ///< hex; changes with any file name or byte
  Bytes total_bytes = 0;                      ///< sum of the files' sizes
};

/// Bytes at the start of each file that must be NUL-free, valid UTF-8.
constexpr Bytes kTextCheckBytes = 64 * kKiB;

/// The files of a corpus: `path` itself when it is a file; when it is a folder,
/// every regular file below it (recursively) in sorted path order, skipping
/// hidden files and folders (names starting with '.').
/// Throws DataError when `path` does not exist or a folder holds no files.
std::vector<std::filesystem::path> list_corpus_files(const std::filesystem::path& path);

/// Reads the corpus at `path` into documents.
/// Throws DataError for a missing path, a file that is not UTF-8 text (a NUL
/// byte or invalid UTF-8 in its first kTextCheckBytes; the message names the
/// file and the byte offset), an unreadable file, or a corpus with no
/// non-whitespace text.
Corpus read_corpus(const std::filesystem::path& path, const CorpusOptions& options = {});

/// Hashes the corpus's file names (relative to `path`) and contents without
/// keeping them; equals read_corpus(path).content_hash.
std::string corpus_content_hash(const std::filesystem::path& path);

/// The offset of the first NUL byte or invalid UTF-8 sequence in `bytes`, or
/// -1 if there is none. A multi-byte sequence cut off by the end of `bytes` is
/// accepted when `truncated` says that the data continues past `bytes`.
/// `*reason` (if given) receives what is wrong at that offset.
std::int64_t find_non_text_byte(std::string_view bytes, bool truncated, std::string* reason = nullptr);

/// Cuts one file's text into documents as described at the top of this file.
std::vector<std::string> split_into_documents(std::string_view text, Bytes target_document_bytes);

}  // namespace moeflex
