"""The worker's file operations on paths a sandbox can write: each trusts no name, type,
size or depth the sandbox chose.

A sandbox owns its directory; a cell that changed the sandbox's own code (its modules are
reachable from `sys.modules`) can leave anything there in place of what the host expects:
a symlink to a file only root may read, a symlink to /dev/zero, a FIFO no one writes to, a
hard link to another file, a file that keeps growing, or a tree a hundred thousand
directories deep. So the host never follows a link there, opens nothing but a regular file
the sandbox itself owns (without blocking: a FIFO opened O_NONBLOCK returns at once and is
refused by its type), reads at most a cap, and removes a tree without recursion and with
two descriptors open at most.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 1 << 20


class SandboxFileRefused(OSError):
    """A file in a sandbox's directory is not what the host will read: the message says why."""


def read_sandbox_file(directory: Path, name: str, limit: int, owner: int | None) -> bytes:
    """The bytes of the regular file `name` (one path component) in `directory`, at most
    `limit` of them. Refused: a symlink (O_NOFOLLOW), anything but a regular file (checked
    on the open descriptor, so nothing can be swapped in between), a file with another link
    (a hard link to a file elsewhere), one not owned by `owner` (the sandbox's uid, when it
    has its own), and one larger than `limit` (however it grows while read)."""
    if not name or "/" in name or name in (".", ".."):
        raise SandboxFileRefused(f"{name!r} is not a file name")
    fd = _open_in(directory, name)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SandboxFileRefused(f"{name} is not a regular file ({_kind(info.st_mode)})")
        if info.st_nlink != 1:
            raise SandboxFileRefused(f"{name} has {info.st_nlink} links (a hard link to another file)")
        if owner is not None and info.st_uid != owner:
            raise SandboxFileRefused(f"{name} belongs to uid {info.st_uid}, not the sandbox's")
        if info.st_size > limit:
            raise SandboxFileRefused(f"{name} holds {info.st_size:,} bytes, over the {limit:,}-byte limit")
        data = bytearray()
        while True:
            chunk = os.read(fd, min(_CHUNK, limit + 1 - len(data)))
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > limit:
                raise SandboxFileRefused(f"{name} grew past the {limit:,}-byte limit while it was read")
    finally:
        os.close(fd)


def sandbox_file_tail(directory: Path, name: str, chars: int = 2_000) -> str:
    """The end of a text file the sandbox wrote (its stderr), or "" when it is not a
    regular file of its own: for error messages only."""
    try:
        fd = _open_in(directory, name)
    except OSError:
        return ""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        os.lseek(fd, max(0, info.st_size - 4 * chars), os.SEEK_SET)
        return os.read(fd, 4 * chars).decode("utf-8", errors="replace")[-chars:]
    except OSError:
        return ""
    finally:
        os.close(fd)


def write_sandbox_file(directory: Path, name: str, data: bytes, owner: int | None) -> None:
    """Create `name` in `directory` with `data`, readable by the sandbox's uid; never
    through a link or over a file that is already there."""
    dir_fd = os.open(directory, _DIRECTORY)
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
    finally:
        os.close(dir_fd)
    try:
        if owner is not None:
            os.fchown(fd, owner, owner)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:_CHUNK]) :]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            _unlink_in(directory, name)
        raise
    os.close(fd)


def remove_sandbox_tree(top: Path) -> bool:
    """Remove a sandbox's directory and everything in it, after its processes are gone.

    Iterative, never recursive, with five descriptors open at most: each subdirectory's
    entries are moved up into `top` (a rename) before it is removed, so any depth costs
    one rename per entry (shutil.rmtree recurses, holding a descriptor per level: a deep
    tree ran the worker out of both). Links are removed, never followed. A directory the
    sandbox made unreadable or read-only is given search and write back as it is entered (a
    worker that is not root shares its sandboxes' uid). True when nothing is left."""
    try:
        top_fd = _open_directory_at(os.open(top.parent, _DIRECTORY), top.name, close_dir=True)
    except FileNotFoundError:
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(top)  # a symlink or a file where the directory was
        return not os.path.lexists(top)
    hoisted = 0
    try:
        while True:
            seen = progress = False
            with os.scandir(top_fd) as listing:  # streamed: a million names are not a list
                for entry in listing:
                    seen = True
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            os.unlink(entry.name, dir_fd=top_fd)
                            progress = True
                            continue
                        with contextlib.suppress(OSError):
                            os.rmdir(entry.name, dir_fd=top_fd)
                            progress = True
                            continue
                        sub = _open_directory_at(top_fd, entry.name)
                        try:
                            with os.scandir(sub) as children:
                                for child in children:
                                    hoisted += 1
                                    _hoist(sub, child, top_fd, f".drlm-rm-{hoisted}")
                                    progress = True
                        finally:
                            os.close(sub)
                        os.rmdir(entry.name, dir_fd=top_fd)
                    except OSError:
                        continue  # the next pass sees what is left
            if not seen or not progress:
                break
    finally:
        os.close(top_fd)
    with contextlib.suppress(OSError):
        os.rmdir(top)
    return not os.path.lexists(top)


def _open_in(directory: Path, name: str) -> int:
    dir_fd = os.open(directory, _DIRECTORY)
    try:
        return os.open(name, _READ, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _unlink_in(directory: Path, name: str) -> None:
    dir_fd = os.open(directory, _DIRECTORY)
    try:
        os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _hoist(dir_fd: int, entry: os.DirEntry[str], top_fd: int, name: str) -> None:
    """Move one entry of a directory up into the tree's top. A directory moved to another
    parent needs write on itself (its `..` changes): one a cell made read-only gets it back."""
    try:
        os.rename(entry.name, name, src_dir_fd=dir_fd, dst_dir_fd=top_fd)
    except PermissionError:
        if not entry.is_dir(follow_symlinks=False):
            raise
        os.close(_open_directory_at(dir_fd, entry.name))
        os.rename(entry.name, name, src_dir_fd=dir_fd, dst_dir_fd=top_fd)


def _open_directory_at(dir_fd: int, name: str, close_dir: bool = False) -> int:
    """A directory of a sandbox's tree, opened to be emptied: never through a link, and
    with write and search given back (a cell may have made it 0o500 or 0o000 as this
    worker's uid; root needs neither, and a directory of another user's stays as it is)."""
    try:
        try:
            fd = os.open(name, _DIRECTORY, dir_fd=dir_fd)
        except PermissionError:
            # Mode 000: no process of the sandbox is left to swap the entry, and O_NOFOLLOW
            # above refused a link, so chmod reaches the directory.
            if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                raise
            os.chmod(name, 0o700, dir_fd=dir_fd)
            fd = os.open(name, _DIRECTORY, dir_fd=dir_fd)
    finally:
        if close_dir:
            os.close(dir_fd)
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_mode & 0o300 != 0o300:
            os.fchmod(fd, 0o700)  # the descriptor, not the name: nothing to swap
    return fd


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return kind
    return "not a file"
