// The cache folder trust rule; see folder_trust.h. The messages are the ones
// users read in CacheFolderTrustError and in the wrapper's log line.
#include "folder_trust.h"

#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

namespace xlakit {
namespace {

std::string UserName(uid_t uid) {
  struct passwd pw;
  struct passwd* found = nullptr;
  char buf[4096];
  if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found) {
    return found->pw_name;
  }
  return "uid " + std::to_string(uid);
}

std::string GroupName(gid_t gid) {
  struct group gr;
  struct group* found = nullptr;
  char buf[16384];
  if (getgrgid_r(gid, &gr, buf, sizeof(buf), &found) == 0 && found) {
    return found->gr_name;
  }
  return "gid " + std::to_string(gid);
}

// Whether user `uid` is a member of group `gid` (primary or listed).
bool IsMember(uid_t uid, gid_t gid) {
  struct passwd pw;
  struct passwd* user = nullptr;
  char pbuf[4096];
  if (getpwuid_r(uid, &pw, pbuf, sizeof(pbuf), &user) != 0 || !user) {
    return false;
  }
  if (user->pw_gid == gid) return true;
  struct group gr;
  struct group* group = nullptr;
  char gbuf[16384];
  if (getgrgid_r(gid, &gr, gbuf, sizeof(gbuf), &group) != 0 || !group) {
    return false;
  }
  for (char** m = group->gr_mem; m && *m; ++m) {
    if (std::strcmp(*m, user->pw_name) == 0) return true;
  }
  return false;
}

std::set<gid_t> MyGroups() {
  std::set<gid_t> out = {getegid()};
  int n = getgroups(0, nullptr);
  if (n > 0) {
    std::vector<gid_t> groups(static_cast<size_t>(n));
    n = getgroups(n, groups.data());
    for (int i = 0; i < n; ++i) out.insert(groups[static_cast<size_t>(i)]);
  }
  return out;
}

// Python's stat.filemode(), for the types a folder on the way can have.
std::string FileMode(mode_t mode) {
  std::string out = S_ISDIR(mode) ? "d" : S_ISLNK(mode) ? "l" : "-";
  const char* rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; ++i) {
    out += (mode & (0400 >> i)) ? rwx[i] : '-';
  }
  if (mode & S_ISUID) out[3] = (mode & S_IXUSR) ? 's' : 'S';
  if (mode & S_ISGID) out[6] = (mode & S_IXGRP) ? 's' : 'S';
  if (mode & S_ISVTX) out[9] = (mode & S_IXOTH) ? 't' : 'T';
  return out;
}

std::string Looks(const std::string& path, const struct stat& st) {
  char octal[8];
  std::snprintf(octal, sizeof(octal), "%04o",
                static_cast<unsigned>(st.st_mode & 07777));
  return path + " (owner " + UserName(st.st_uid) + ", group " +
         GroupName(st.st_gid) + ", mode " + FileMode(st.st_mode) + " " +
         octal + ")";
}

std::string ShareHint(gid_t gid) {
  return "or, if every member of group " + GroupName(gid) +
         " may put code into your jobs, pass trust_shared=True (or export "
         "XLAKIT_CACHE_TRUST_SHARED=1)";
}

std::string Parent(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
}

FolderTrust Untrusted(const std::string& folder, std::string problem,
                      std::string fix) {
  FolderTrust out;
  out.folder = folder;
  out.state = kUntrusted;
  out.problem = std::move(problem);
  out.fix = std::move(fix);
  return out;
}

}  // namespace

std::string ResolvePath(const std::string& folder) {
  std::string abs = folder;
  if (abs.empty() || abs[0] != '/') {
    char cwd[PATH_MAX];
    abs = std::string(getcwd(cwd, sizeof(cwd)) ? cwd : "/") + "/" + abs;
  }
  std::vector<std::string> parts;
  for (size_t i = 0; i < abs.size();) {
    size_t j = abs.find('/', i);
    if (j == std::string::npos) j = abs.size();
    if (j > i) parts.push_back(abs.substr(i, j - i));
    i = j + 1;
  }
  // The longest prefix that exists, resolved by the OS; the rest normalized.
  for (size_t n = parts.size() + 1; n-- > 0;) {
    std::string prefix;
    for (size_t k = 0; k < n; ++k) prefix += "/" + parts[k];
    if (prefix.empty()) prefix = "/";
    char* real = realpath(prefix.c_str(), nullptr);
    if (real == nullptr) continue;
    std::string out = real;
    std::free(real);
    for (size_t k = n; k < parts.size(); ++k) {
      if (parts[k] == ".") continue;
      if (parts[k] == "..") {
        out = Parent(out);
        continue;
      }
      out += (out == "/" ? "" : "/") + parts[k];
    }
    return out;
  }
  return abs;
}

FolderTrust JudgeCacheFolder(const std::string& folder_in, bool trust_shared) {
  const std::string folder = ResolvePath(folder_in);
  const uid_t me = geteuid();
  const std::set<gid_t> my_groups = MyGroups();
  std::vector<std::string> shared;
  std::string path = folder;
  while (true) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      if (errno != ENOENT && errno != ENOTDIR) {
        return Untrusted(folder,
                         "cannot inspect " + path + " (" +
                             std::strerror(errno) +
                             "), so who can write it is unknown",
                         "make " + path +
                             " searchable by you, or use a cache folder "
                             "elsewhere");
      }
      // xlakit creates it, owner-only (or fails to, under a file, and says so).
    } else {
      const bool is_cache = path == folder;
      const bool mine = my_groups.count(st.st_gid) > 0;
      const bool shareable = trust_shared && mine;
      const std::string hint = mine ? ShareHint(st.st_gid) : "";
      if (st.st_uid != 0 && st.st_uid != me) {
        if (!(shareable && IsMember(st.st_uid, st.st_gid))) {
          return Untrusted(
              folder,
              Looks(path, st) + " is owned by " + UserName(st.st_uid) +
                  ", not by you or root: they can change it and put code "
                  "into your jobs",
              "use a folder you own (mkdir -m 700 <folder>), or have root "
              "run `chown " +
                  UserName(me) + " " + path + "`" +
                  (hint.empty() ? "" : "; " + hint));
        }
        shared.push_back(path + " is owned by " + UserName(st.st_uid) +
                         " of group " + GroupName(st.st_gid));
      }
      // Sticky stops others removing or renaming what is not theirs, so it
      // protects the path through a folder above the cache, never the entries
      // created in the cache folder itself.
      const bool sticky_above = (st.st_mode & S_ISVTX) && !is_cache;
      if ((st.st_mode & S_IWOTH) && !sticky_above) {
        std::string fix;
        if (!is_cache) {
          fix = "chmod o-w " + path + " (or chmod +t " + path +
                ", if others must create folders in it)";
        } else if (st.st_mode & S_ISVTX) {
          // Sticky and open to all: a scratch folder such as /tmp, which
          // others use; closing it would break their work.
          fix = "use a folder of your own inside it (mkdir -m 700 " +
                (path == "/" ? std::string() : path) + "/" + UserName(me) +
                "-xla-cache), or chmod 700 " + path + " if nobody else uses it";
        } else {
          fix = "chmod 700 " + path;
        }
        std::string why = (st.st_mode & S_ISVTX)
                              ? " (its sticky bit does not stop others adding "
                                "entries)"
                              : "";
        return Untrusted(folder,
                         Looks(path, st) + " is writable by every user" + why +
                             ": anyone can put an executable into your cache "
                             "that your jobs will run",
                         fix);
      }
      if ((st.st_mode & S_IWGRP) && !sticky_above) {
        if (!shareable) {
          return Untrusted(
              folder,
              Looks(path, st) + " is writable by group " +
                  GroupName(st.st_gid) +
                  ": any member can put an executable into your cache that "
                  "your jobs will run",
              "chmod g-w " + path + (hint.empty() ? "" : ", " + hint));
        }
        shared.push_back(path + " is writable by group " +
                         GroupName(st.st_gid));
      }
    }
    if (path == "/") break;
    path = Parent(path);
  }
  FolderTrust out;
  out.folder = folder;
  out.state = shared.empty() ? kOwnerOnly : kSharedTrusted;
  out.shared = std::move(shared);
  return out;
}

}  // namespace xlakit
