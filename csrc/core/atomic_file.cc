// Atomic file replacement; see atomic_file.h.
#include "atomic_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace xlakit {
namespace {

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::string DirName(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

constexpr size_t kMaxHostChars = 64;
constexpr size_t kRandomHexDigits = 16;

bool IsNameChar(char c) {
  return c != '/' && static_cast<unsigned char>(c) >= 0x20;
}

bool AllOf(std::string_view s, const char* allowed) {
  return !s.empty() && s.find_first_not_of(allowed) == std::string_view::npos;
}

// The host name as a file-name part: at most kMaxHostChars characters, '/'
// and control characters replaced.
std::string HostPart() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "unknown-host";
  }
  std::string out(name, strnlen(name, kMaxHostChars));
  for (char& c : out) {
    if (!IsNameChar(c)) c = '_';
  }
  return out;
}

std::string RandomHex() {
  // From the OS on every call: cache writes are rare, and a per-process
  // stream would need a lock. getrandom(2) itself, not std::random_device,
  // which can throw, and in a static libstdc++ needs glibc 2.36
  // (arc4random): the PJRT wrapper must load on older hosts. Should the
  // kernel not answer, time, pid and a counter still keep writers apart
  // together with the host and pid in the name.
  uint64_t bits = 0;
  if (getrandom(&bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    static std::atomic<uint64_t> fallback{0};
    bits = static_cast<uint64_t>(std::chrono::steady_clock::now()
                                     .time_since_epoch()
                                     .count()) ^
           (static_cast<uint64_t>(::getpid()) << 40) ^ fallback.fetch_add(1);
  }
  char buf[kRandomHexDigits + 1];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(bits));
  return buf;
}

// Owner read-write; group read too when the folder lets its group read and
// search it (what xlakit creates for a shared cache, trust_shared). Never
// more: an entry is code the jobs run.
mode_t EntryModeFor(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0 &&
      (st.st_mode & (S_IRGRP | S_IXGRP)) == (S_IRGRP | S_IXGRP)) {
    return 0640;
  }
  return 0600;
}

}  // namespace

std::string TempPathFor(const std::string& path) {
  static std::atomic<unsigned long> counter{0};
  static const std::string host = HostPart();
  std::string base = path.substr(
      path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  return DirName(path) + "/" + kTempPrefix + base + "." + host + "." +
         std::to_string(::getpid()) + "." +
         std::to_string(counter.fetch_add(1)) + "." + RandomHex();
}

std::string TempFileTarget(std::string_view name) {
  std::string_view prefix(kTempPrefix);
  if (name.substr(0, prefix.size()) != prefix) return "";
  name.remove_prefix(prefix.size());
  // TempPathFor's fields from the right: random bits, counter, pid.
  std::string_view fields[3];
  for (std::string_view& field : fields) {
    size_t dot = name.rfind('.');
    if (dot == std::string_view::npos) return "";
    field = name.substr(dot + 1);
    name = name.substr(0, dot);
  }
  if (fields[0].size() != kRandomHexDigits ||
      !AllOf(fields[0], "0123456789abcdef") ||
      !AllOf(fields[1], "0123456789") || !AllOf(fields[2], "0123456789")) {
    return "";
  }
  // What is left is <base>.<host>; the base ends at its first dot.
  size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos) return "";
  std::string_view host = name.substr(dot + 1);
  if (host.empty() || host.size() > kMaxHostChars) return "";
  for (char c : name) {
    if (!IsNameChar(c)) return "";
  }
  return std::string(name.substr(0, dot));
}

std::string WriteFileAtomic(const std::string& path, std::string_view data) {
  std::string dir = DirName(path);
  std::string tmp = TempPathFor(path);
  mode_t mode = EntryModeFor(dir);
  // O_EXCL | O_NOFOLLOW: a file or link someone put at the name is never
  // written through.
  int fd = ::open(tmp.c_str(),
                  O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return Errno("cannot create", tmp);
  // The umask only ever removes bits, and may remove the group's read bit
  // the folder asks for: set the mode exactly.
  if (::fchmod(fd, mode) != 0) {
    std::string error = Errno("cannot set the mode of", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return error;
  }
  const char* p = data.data();
  size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string error = Errno("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return error;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  // Without fsync a crash after rename can leave a named, empty file.
  int synced = ::fsync(fd);
  int closed = ::close(fd);
  if (synced != 0 || closed != 0) {
    std::string error = Errno("cannot flush", tmp);
    ::unlink(tmp.c_str());
    return error;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string error = Errno("cannot rename onto", path);
    ::unlink(tmp.c_str());
    return error;
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    // Best effort: some filesystems refuse fsync on a directory; the entry
    // itself is already complete either way.
    ::fsync(dfd);
    ::close(dfd);
  }
  return "";
}

std::string ReadWholeFile(const std::string& path, std::string* data) {
  data->clear();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return Errno("cannot open", path);
  struct stat st;
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    data->reserve(static_cast<size_t>(st.st_size));
  }
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      std::string error = Errno("cannot read", path);
      ::close(fd);
      data->clear();
      return error;
    }
    if (n == 0) break;
    data->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return "";
}

std::string RemoveFile(const std::string& path) {
  if (::unlink(path.c_str()) == 0 || errno == ENOENT) return "";
  return Errno("cannot remove", path);
}

}  // namespace xlakit
