// Atomic file replacement; see atomic_file.h.
#include "atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
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

}  // namespace

std::string WriteFileAtomic(const std::string& path, std::string_view data) {
  static std::atomic<unsigned long> counter{0};
  std::string dir = DirName(path);
  std::string base = path.substr(
      path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  // pid + counter: unique across concurrent writers in and across processes.
  std::string tmp = dir + "/" + kTempPrefix + base + "." +
                    std::to_string(::getpid()) + "." +
                    std::to_string(counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
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
