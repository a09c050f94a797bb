// Atomic file replacement; see atomic_file.h.
#include "atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

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

// The host name as a file-name part: at most 64 characters, '/' and
// control characters replaced.
std::string HostPart() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "unknown-host";
  }
  std::string out(name, strnlen(name, 64));
  for (char& c : out) {
    if (c == '/' || static_cast<unsigned char>(c) < 0x20) c = '_';
  }
  return out;
}

std::string RandomHex() {
  // From the OS on every call (getrandom): cache writes are rare, and a
  // per-process stream would need a lock.
  std::random_device rd;
  uint64_t bits = (static_cast<uint64_t>(rd()) << 32) | rd();
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx",
                static_cast<unsigned long long>(bits));
  return buf;
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

std::string WriteFileAtomic(const std::string& path, std::string_view data) {
  std::string dir = DirName(path);
  std::string tmp = TempPathFor(path);
  // 0666: the kernel applies the umask, as for any file the process creates.
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return Errno("cannot create", tmp);
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

}  // namespace xlakit
