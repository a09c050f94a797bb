// The cache folder trust rule; see folder_trust.h. The messages are the ones
// users read in CacheFolderTrustError and in the wrapper's log line.
#include "folder_trust.h"

#include <dirent.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
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

// Python's stat.filemode().
std::string FileMode(mode_t mode) {
  std::string out = S_ISDIR(mode)    ? "d"
                    : S_ISLNK(mode)  ? "l"
                    : S_ISCHR(mode)  ? "c"
                    : S_ISBLK(mode)  ? "b"
                    : S_ISFIFO(mode) ? "p"
                    : S_ISSOCK(mode) ? "s"
                                     : "-";
  const char* rwx = "rwxrwxrwx";
  for (int i = 0; i < 9; ++i) {
    out += (mode & (0400 >> i)) ? rwx[i] : '-';
  }
  if (mode & S_ISUID) out[3] = (mode & S_IXUSR) ? 's' : 'S';
  if (mode & S_ISGID) out[6] = (mode & S_IXGRP) ? 's' : 'S';
  if (mode & S_ISVTX) out[9] = (mode & S_IXOTH) ? 't' : 'T';
  return out;
}

// A user's own group (named after the user, nobody else in it): a file
// writable by it is the owner's alone. A stock runtime writes entries with
// the umask, 002 under user private groups.
bool PrivateGroup(uid_t uid, gid_t gid) {
  struct passwd pw;
  struct passwd* user = nullptr;
  char pbuf[4096];
  if (getpwuid_r(uid, &pw, pbuf, sizeof(pbuf), &user) != 0 || !user) {
    return false;
  }
  struct group gr;
  struct group* group = nullptr;
  char gbuf[16384];
  if (getgrgid_r(gid, &gr, gbuf, sizeof(gbuf), &group) != 0 || !group) {
    return false;
  }
  if (user->pw_gid != gid || std::strcmp(group->gr_name, user->pw_name) != 0) {
    return false;
  }
  for (char** m = group->gr_mem; m && *m; ++m) {
    if (std::strcmp(*m, user->pw_name) != 0) return false;
  }
  return true;
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

// The rule for one file of the cache folder, `st` as stat() or fstat() gave
// it: another user's file, or one others can write, can be rewritten in
// place with their code. `group` is set to the group whose members only
// trust_shared lets write (or own) it.
EntryTrust JudgeFile(const std::string& path, const struct stat& st, uid_t me,
                     const std::set<gid_t>& my_groups, bool trust_shared,
                     std::string* group) {
  EntryTrust out;
  const bool shareable = trust_shared && my_groups.count(st.st_gid) > 0;
  // Looked up only for group-writable files: two user database queries.
  const bool private_group =
      (st.st_mode & S_IWGRP) && PrivateGroup(st.st_uid, st.st_gid);
  if (st.st_uid != 0 && st.st_uid != me &&
      !(shareable && IsMember(st.st_uid, st.st_gid))) {
    out.problem = Looks(path, st) + " is owned by " + UserName(st.st_uid) +
                  ", not by you or root: they can rewrite it with code your "
                  "jobs will run";
    out.fix = "remove it (it is not yours to trust), or have root run `chown " +
              UserName(me) + " " + path + "`";
  } else if (st.st_mode & S_IWOTH) {
    out.problem = Looks(path, st) +
                  " is writable by every user: anyone can rewrite it with "
                  "code your jobs will run";
    out.fix = "chmod go-w " + path;
  } else if ((st.st_mode & S_IWGRP) && !shareable && !private_group) {
    out.problem = Looks(path, st) + " is writable by group " +
                  GroupName(st.st_gid) +
                  ": any member can rewrite it with code your jobs will run";
    out.fix = "chmod g-w " + path;
  } else if ((st.st_uid != 0 && st.st_uid != me) ||
             ((st.st_mode & S_IWGRP) && !private_group)) {
    *group = GroupName(st.st_gid);
  }
  out.trusted = out.problem.empty();
  return out;
}

// Files in the cache folder that others can rewrite: (problem, fix), or
// false. Adds to `shared` what only trust_shared accepts.
bool EntriesProblem(const std::string& folder, uid_t me,
                    const std::set<gid_t>& my_groups, bool trust_shared,
                    std::vector<std::string>* shared, std::string* problem,
                    std::string* fix) {
  DIR* dir = opendir(folder.c_str());
  if (dir == nullptr) {
    if (errno == ENOENT || errno == ENOTDIR) return false;  // made empty later
    *problem = "cannot list " + folder + " (" + std::strerror(errno) +
               "), so who wrote its entries is unknown";
    *fix = "make " + folder + " readable by you, or use a cache folder elsewhere";
    return true;
  }
  std::vector<std::string> names;
  while (struct dirent* e = readdir(dir)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  std::vector<std::pair<std::string, std::string>> bad;
  std::set<std::string> groups;  // of entries only trust_shared accepts
  for (const std::string& name : names) {
    const std::string path = folder + (folder == "/" ? "" : "/") + name;
    struct stat st;
    // A link: what it leads to is what a runtime reading through links
    // reads; one that leads nowhere is never read.
    if (stat(path.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) continue;  // entries are plain files of the folder
    std::string group;
    EntryTrust verdict = JudgeFile(path, st, me, my_groups, trust_shared,
                                   &group);
    if (!verdict.trusted) {
      bad.emplace_back(verdict.problem, verdict.fix);
    } else if (!group.empty()) {
      groups.insert(group);
    }
  }
  if (bad.empty()) {
    if (!groups.empty()) {
      std::string list;
      for (const std::string& g : groups) list += (list.empty() ? "" : ", ") + g;
      shared->push_back("entries in " + folder +
                        " are writable by (or owned by members of) group(s) " +
                        list);
    }
    return false;
  }
  *problem = bad[0].first;
  *fix = bad[0].second;
  if (bad.size() > 1) {
    *problem += " (and " + std::to_string(bad.size() - 1) + " more entr" +
                (bad.size() == 2 ? "y" : "ies") + " like it)";
    *fix += "; the same for the others (`ls -l " + folder + "`)";
  }
  return true;
}

// What a path that is not a folder is, in words.
std::string Kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a folder";
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

FolderTrust JudgeCacheFolder(const std::string& folder_in, bool trust_shared,
                             bool judge_entries) {
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
    } else if (!S_ISDIR(st.st_mode)) {
      // Judged before any permission: the advice for a folder (chmod) would
      // change a device or a file others use, and no cache can live there.
      FolderTrust out = Untrusted(
          folder,
          path == folder
              ? Looks(path, st) + " is " + Kind(st.st_mode) +
                    ", not a folder: no cache can live there"
              : folder + " lies below " + Looks(path, st) + ", which is " +
                    Kind(st.st_mode) + ", so no folder can be made there",
          "choose a folder (created if missing), e.g. ~/xla-cache; leave " +
              path + " as it is");
      out.not_a_folder = true;
      return out;
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
  std::string problem, fix;
  if (judge_entries && EntriesProblem(folder, me, my_groups, trust_shared,
                                      &shared, &problem, &fix)) {
    return Untrusted(folder, problem, fix);
  }
  FolderTrust out;
  out.folder = folder;
  out.state = shared.empty() ? kOwnerOnly : kSharedTrusted;
  out.shared = std::move(shared);
  return out;
}

EntryTrust JudgeCacheEntry(const std::string& path, const struct stat& st,
                           bool trust_shared) {
  static const uid_t me = geteuid();
  static const std::set<gid_t>* my_groups = new std::set<gid_t>(MyGroups());
  std::string group;
  return JudgeFile(path, st, me, *my_groups, trust_shared, &group);
}

}  // namespace xlakit
