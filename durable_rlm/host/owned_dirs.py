"""Directories of this user's own: made fresh, or refused when another user could have made
them, could swap them, or could write in them.

A worker keeps what its safety rests on in directories: its sandbox root (the homes whose
records say which processes a reaper may kill), its data directory (the store, the snapshot
key), its liveness ledger. A directory another local user made first, under a shared /tmp,
gives that user all of it: a user who made `$TMPDIR/drlm-sandboxes` before a root worker did
planted a home with forged process records, and the root reaper killed live sandboxes of
other episodes; a link in its place made a root worker open a 0700 directory of root's to
everyone. So every such directory goes through `owned_directory`:

- the path to it is walked one name at a time, and no link is followed unless root or this
  user owns it; every directory on the way is owned by root or this user and, if others may
  write in it, sticky (as /tmp is: nobody else can rename or remove what is ours in it);
- the directory itself is made now (with its missing parents), or, when it is there, it must
  be a directory (not a link), owned by this user, and writable by nobody else: else it is
  refused (`UnsafeDirectory`), never repaired, for what another user put in it stays there;
- its mode is then set through a descriptor opened without following links.

Standard library only, and no other module of the package: anything may use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_LINKS = 40
"""Links followed on one path (the kernel's own limit is 40 too)."""


class UnsafeDirectory(PermissionError):
    """A directory this process would use that another user made, could swap or could write."""


def owned_directory(path: str | os.PathLike[str], mode: int = 0o700, parents_mode: int = 0o700) -> Path:
    """`path` as a directory of this user's own, with `mode`; missing parents are made with
    `parents_mode`. Returns its real path (through the links it was allowed to follow).
    Raises UnsafeDirectory when the path or the directory is not safe to use, with what is
    wrong and what to do, and OSError for the rest (a read-only filesystem, say)."""
    real, missing = _walk(os.path.abspath(os.fspath(path)))
    if not missing:
        _check_leaf(real, os.lstat(real), path)
    for index, name in enumerate(missing):
        real = os.path.join(real, name)
        leaf = index == len(missing) - 1
        try:
            os.mkdir(real, 0o700)
        except FileExistsError:  # made meanwhile, by someone: judged as if it had been there
            info = os.lstat(real)
            if leaf:
                _check_leaf(real, info, path)
            else:
                _check_on_the_way(real, info)
                continue  # not made here: its mode is its maker's
        if not leaf:
            _set_mode(real, parents_mode)
    _set_mode(real, mode)
    return Path(real)


def check_owned(path: str | os.PathLike[str]) -> os.stat_result:
    """The status of an existing directory that must be this user's own (not a link, owned
    by this user, writable by nobody else), for a reader that did not make it."""
    info = os.lstat(path)
    _check_leaf(os.fspath(path), info, path)
    return info


def _walk(path: str) -> tuple[str, list[str]]:
    """(the real path of the longest prefix of `path` that exists, the names missing after
    it), every directory and link on the way to it checked (itself is left to the caller)."""
    pending = _names(path)
    real = "/"
    _check_on_the_way(real, os.lstat(real))
    links = 0
    while pending:
        name = pending.pop(0)
        if name == "..":
            real = os.path.dirname(real)
            continue
        candidate = os.path.join(real, name)
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            rest = os.path.normpath(os.path.join(name, *pending))
            if rest.startswith(".."):
                raise UnsafeDirectory(
                    f"{path}: a link on the way leads out of a directory that is not there"
                ) from None
            return real, _names(rest)
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (0, os.geteuid()):
                raise UnsafeDirectory(
                    f"{candidate} is a link of uid {info.st_uid}, another user's: {path} is not "
                    "followed through it"
                )
            links += 1
            if links > MAX_LINKS:
                raise UnsafeDirectory(f"{path}: more than {MAX_LINKS} links on the way")
            target = os.readlink(candidate)
            if target.startswith("/"):
                real = "/"
            pending[:0] = _names(target)
            continue
        if pending:
            _check_on_the_way(candidate, info)
        real = candidate  # the last name is the caller's to judge, by the stricter rule
    return real, []


def _names(path: str) -> list[str]:
    return [name for name in path.split("/") if name not in ("", ".")]


def _check_on_the_way(path: str, info: os.stat_result) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if info.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectory(
            f"{path} belongs to uid {info.st_uid}: another user could rename or replace what is made in it"
        )
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{path} is writable by other users and not sticky (mode {stat.filemode(info.st_mode)}): "
            "they could rename or replace what is made in it"
        )


def _check_leaf(path: str, info: os.stat_result, asked: str | os.PathLike[str]) -> None:
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise UnsafeDirectory(f"{asked} is {kind}: remove it, and it is made again as a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{asked} belongs to uid {info.st_uid}, not to this process (uid {os.geteuid()}): another "
            "user may have made it first, to plant or read what goes in it. Remove it (it is made "
            "again), or choose another directory"
        )
    if info.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{asked} is writable by other users (mode {stat.filemode(info.st_mode)}): what they may "
            "have put in it cannot be told from ours. Remove it (it is made again), or choose another"
        )


def _set_mode(path: str, mode: int) -> None:
    """chmod through a descriptor opened without following a link: the directory checked is
    the one changed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UnsafeDirectory(f"{path} belongs to uid {info.st_uid}, not to this process")
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
