"""Who can put an entry into a persistent cache folder, judged before any entry is trusted.

A cache entry is code the job runs (machine code on the CPU client, a
program on a TPU). Whoever can write the cache folder, or replace it by
writing any folder above it, can make every later job run theirs; the
envelope's checksum proves an entry intact, not who wrote it. The rule is
ssh's StrictModes, applied from the cache folder up to `/`: every folder is
owned by root or by the user, and no other user can write it. A folder above
the cache may be writable by others only when it is sticky (`/tmp`): nobody
else can then rename or remove what the user owns in it. The cache folder
itself never may: a sticky bit stops removals, not new entries. The files
already in the cache folder are judged too (a link by what it leads to): an
entry another user owns, or others can write, can be rewritten in place with
their code, whoever owns the folder (a file writable by the owner's private
group, as a stock runtime writes under umask 002, counts as the owner's).

`trust_shared` is for teams that share a cache on purpose: a folder writable
by a group the user belongs to, or owned by a member of it, is accepted (and
the caller logs it). Writable by every user stays refused.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

OWNER_ONLY, SHARED_TRUSTED, UNTRUSTED = "owner-only", "shared-trusted", "untrusted"
_SHARE_HINT = "or, if every member of group {group} may put code into your jobs, pass trust_shared=True " \
              "(or export XLAKIT_CACHE_TRUST_SHARED=1)"


@dataclass(frozen=True)
class FolderTrust:
    """The verdict on a cache folder: `state` is owner-only, shared-trusted or untrusted."""

    folder: Path
    state: str
    problem: str | None = None  # names the folder at fault, its owner and mode
    fix: str | None = None
    shared: tuple[str, ...] = ()  # what only trust_shared made acceptable

    @property
    def trusted(self) -> bool:
        return self.state != UNTRUSTED

    def describe(self) -> str:
        if self.state == UNTRUSTED:
            return f"untrusted: {self.problem}; fix: {self.fix}"
        if self.state == SHARED_TRUSTED:
            return f"shared-trusted ({'; '.join(self.shared)})"
        return "owner-only (nobody but you and root can put an entry into it)"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def _is_member(uid: int, gid: int) -> bool:
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def _private_group(uid: int, gid: int) -> bool:
    """A user's own group (named after the user, nobody else in it): group-writable is owner-only.

    A stock runtime writes entries with the umask, 002 under user private groups.
    """
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _looks(path: Path, st: os.stat_result) -> str:
    return (f"{path} (owner {_user(st.st_uid)}, group {_group(st.st_gid)}, mode "
            f"{stat.filemode(st.st_mode)} {stat.S_IMODE(st.st_mode):04o})")


def judge(folder: str | os.PathLike, *, trust_shared: bool = False) -> FolderTrust:
    """Whether entries in `folder` can only come from the user (and root), and if not, the fix.

    `folder` need not exist: the folders xlakit would create are owner-only,
    so the nearest existing one is judged as a folder above the cache. Links
    on the way are resolved first.
    """
    folder = Path(folder).resolve()  # judge the folders the entries really are in, not a link's
    me = os.geteuid()
    my_groups = set(os.getgroups()) | {os.getegid()}
    shared: list[str] = []

    def untrusted(problem: str, fix: str) -> FolderTrust:
        return FolderTrust(folder, UNTRUSTED, problem, fix)

    for path in (folder, *folder.parents):
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # xlakit creates it, owner-only (or fails to, under a file, and says so)
        except OSError as e:
            return untrusted(f"cannot inspect {path} ({e.strerror}), so who can write it is unknown",
                             f"make {path} searchable by you, or use a cache folder elsewhere")
        is_cache = path == folder
        mode = st.st_mode
        shareable = trust_shared and st.st_gid in my_groups
        hint = _SHARE_HINT.format(group=_group(st.st_gid)) if st.st_gid in my_groups else ""
        if st.st_uid not in (0, me):
            if not (shareable and _is_member(st.st_uid, st.st_gid)):
                return untrusted(f"{_looks(path, st)} is owned by {_user(st.st_uid)}, not by you or root: they can "
                                 "change it and put code into your jobs",
                                 f"use a folder you own (mkdir -m 700 <folder>), or have root run "
                                 f"`chown {_user(me)} {path}`" + (f"; {hint}" if hint else ""))
            shared.append(f"{path} is owned by {_user(st.st_uid)} of group {_group(st.st_gid)}")
        # Sticky stops others removing or renaming what is not theirs, so it protects the path
        # through a folder above the cache, never the entries created in the cache folder itself.
        sticky_above = bool(mode & stat.S_ISVTX) and not is_cache
        if mode & stat.S_IWOTH and not sticky_above:
            fix = (f"chmod 700 {path}" if is_cache else
                   f"chmod o-w {path} (or chmod +t {path}, if others must create folders in it)")
            why = " (its sticky bit does not stop others adding entries)" if mode & stat.S_ISVTX else ""
            return untrusted(f"{_looks(path, st)} is writable by every user{why}: anyone can put an executable "
                             "into your cache that your jobs will run", fix)
        if mode & stat.S_IWGRP and not sticky_above:
            if not shareable:
                fix = f"chmod g-w {path}" + (f", {hint}" if hint else "")
                return untrusted(f"{_looks(path, st)} is writable by group {_group(st.st_gid)}: any member can put "
                                 "an executable into your cache that your jobs will run", fix)
            shared.append(f"{path} is writable by group {_group(st.st_gid)}")
    entries = _entries_problem(folder, me, my_groups, trust_shared, shared)
    if entries is not None:
        return untrusted(*entries)
    if shared:
        return FolderTrust(folder, SHARED_TRUSTED, shared=tuple(shared))
    return FolderTrust(folder, OWNER_ONLY)


def _entries_problem(folder: Path, me: int, my_groups: set[int], trust_shared: bool,
                     shared: list[str]) -> tuple[str, str] | None:
    """(problem, fix) for files in the cache folder that others can rewrite; adds to `shared` what
    only trust_shared accepts."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None  # not made yet: xlakit makes it empty, owner-only
    except OSError as e:
        return (f"cannot list {folder} ({e.strerror}), so who wrote its entries is unknown",
                f"make {folder} readable by you, or use a cache folder elsewhere")
    bad: list[tuple[str, str]] = []
    groups: set[str] = set()  # of entries only trust_shared accepts
    for name in names:
        path = folder / name
        try:
            st = os.stat(path)  # a link: what it leads to is what the runtime reads
        except OSError:
            continue  # gone meanwhile, or a dangling link: nothing is read through it
        if stat.S_ISDIR(st.st_mode):
            continue  # the runtime reads plain files in the folder, never below it
        shareable = trust_shared and st.st_gid in my_groups
        if st.st_uid not in (0, me) and not (shareable and _is_member(st.st_uid, st.st_gid)):
            bad.append((f"{_looks(path, st)} is owned by {_user(st.st_uid)}, not by you or root: they can rewrite "
                        "it with code your jobs will run",
                        f"remove it (it is not yours to trust), or have root run `chown {_user(me)} {path}`"))
        elif st.st_mode & stat.S_IWOTH:
            bad.append((f"{_looks(path, st)} is writable by every user: anyone can rewrite it with code your "
                        "jobs will run", f"chmod go-w {path}"))
        elif st.st_mode & stat.S_IWGRP and not shareable and not _private_group(st.st_uid, st.st_gid):
            bad.append((f"{_looks(path, st)} is writable by group {_group(st.st_gid)}: any member can rewrite "
                        "it with code your jobs will run", f"chmod g-w {path}"))
        elif st.st_uid not in (0, me) or (st.st_mode & stat.S_IWGRP and not _private_group(st.st_uid, st.st_gid)):
            groups.add(_group(st.st_gid))
    if groups and not bad:
        shared.append(f"entries in {folder} are writable by (or owned by members of) group(s) "
                      f"{', '.join(sorted(groups))}")
    if not bad:
        return None
    problem, fix = bad[0]
    more = f" (and {len(bad) - 1} more entr{'y' if len(bad) == 2 else 'ies'} like it)" if len(bad) > 1 else ""
    return problem + more, fix + (f"; the same for the others (`ls -l {folder}`)" if more else "")
