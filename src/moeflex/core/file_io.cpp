// Durable files (see file_io.h): atomic writes, whole-file reads, append-only logs,
// SHA-256 checksums.
#include "moeflex/core/file_io.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <ostream>

#include "moeflex/core/error.h"

namespace moeflex {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new(), &EVP_MD_CTX_free) {
  if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1)
    throw Error("OpenSSL could not initialise a SHA-256 digest.");
}

void Sha256::update(const void* data, std::size_t size) {
  if (size > 0 && EVP_DigestUpdate(ctx_.get(), data, size) != 1)
    throw Error("OpenSSL failed while updating a SHA-256 digest.");
}

std::string Sha256::hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx_.get(), digest, &len) != 1)
    throw Error("OpenSSL failed while finishing a SHA-256 digest.");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 0xf];
  }
  return out;
}

AtomicFile::AtomicFile(fs::path path) : path_(std::move(path)) {
  static std::atomic<unsigned> counter{0};
  tmp_ = path_;
  tmp_ += fmt::format(".tmp-{}-{}", ::getpid(), counter++);
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw DataError(fmt::format("Cannot create '{}' to write '{}': {}.", tmp_.string(), path_.string(),
                                errno_text()));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t size) {
  sha_.update(data, size);
  const char* p = static_cast<const char*>(data);
  std::size_t left = size;
  while (left > 0) {
    ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw DataError(fmt::format("Writing '{}' failed after {} bytes: {}.", path_.string(), bytes_,
                                  n < 0 ? errno_text() : std::string("no progress")));
    p += n;
    left -= static_cast<std::size_t>(n);
    bytes_ += n;
  }
}

WrittenFile AtomicFile::commit() {
  if (::fsync(fd_) != 0)
    throw DataError(fmt::format("fsync of '{}' failed: {}.", tmp_.string(), errno_text()));
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw DataError(fmt::format("Closing '{}' failed: {}.", tmp_.string(), errno_text()));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw DataError(fmt::format("Renaming '{}' to '{}' failed: {}.", tmp_.string(), path_.string(),
                                errno_text()));
  committed_ = true;
  fs::path dir = path_.parent_path();
  fsync_directory(dir.empty() ? fs::path(".") : dir);
  return WrittenFile{bytes_, sha_.hex()};
}

std::string sha256_hex(const void* data, std::size_t size) {
  Sha256 sha;
  sha.update(data, size);
  return sha.hex();
}

void append_line(std::ostream& out, const fs::path& path, std::string_view line) {
  errno = 0;
  out << line << '\n';
  out.flush();
  if (!out)
    throw DataError(
        fmt::format("Cannot write '{}'{}: is the disk full? The run stops here; its checkpoints are kept, "
                    "and --resume continues it once there is room.",
                    path.string(), errno != 0 ? fmt::format(" ({})", std::strerror(errno)) : ""));
}

WrittenFile write_file_atomically(const fs::path& path, std::string_view content) {
  AtomicFile f(path);
  f.write(content.data(), content.size());
  return f.commit();
}

std::vector<char> read_file_bytes(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(fmt::format("Cannot open '{}': {}.", path.string(), errno_text()));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw DataError(fmt::format("Cannot stat '{}': {}.", path.string(), why));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(fmt::format("'{}' is not a regular file.", path.string()));
  }
  std::vector<char> bytes(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < bytes.size()) {
    ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string why = errno_text();
      ::close(fd);
      throw DataError(fmt::format("Reading '{}' failed after {} of {} bytes: {}.", path.string(), got,
                                  bytes.size(), why));
    }
    if (n == 0) break;  // shrank while we read: keep what is there
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  bytes.resize(got);
  return bytes;
}

void fsync_directory(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw DataError(fmt::format("Cannot open directory '{}' to sync it: {}.", dir.string(), errno_text()));
  int rc = ::fsync(fd);
  std::string why = rc != 0 ? errno_text() : std::string();
  ::close(fd);
  if (rc != 0) throw DataError(fmt::format("fsync of directory '{}' failed: {}.", dir.string(), why));
}

}  // namespace moeflex
