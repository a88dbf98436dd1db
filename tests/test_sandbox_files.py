"""The worker's file operations on a sandbox's directory, against what a hostile sandbox
leaves there: links, FIFOs, hard links, files that grow, trees of any depth. (Through real
episodes: tests/test_host_protocol.py.)"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from durable_rlm.host import files as sandbox_files
from durable_rlm.host.files import (
    SandboxFileRefused,
    read_sandbox_file,
    remove_sandbox_tree,
    sandbox_file_tail,
    write_sandbox_file,
)


@pytest.fixture
def box(tmp_path: Path) -> Path:
    directory = tmp_path / "sandbox"
    directory.mkdir()
    return directory


def test_a_regular_file_of_its_own_is_read_whole(box: Path) -> None:
    (box / "snap").write_bytes(b"s" * 5_000)
    assert read_sandbox_file(box, "snap", 5_000, os.getuid()) == b"s" * 5_000


def test_a_symlink_is_never_followed(box: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"the worker's")
    (box / "snap").symlink_to(secret)
    with pytest.raises(OSError) as refused:
        read_sandbox_file(box, "snap", 1_000, None)
    assert refused.value.errno == errno.ELOOP


def test_a_fifo_is_refused_without_waiting_for_a_writer(box: Path) -> None:
    os.mkfifo(box / "snap")
    with pytest.raises(SandboxFileRefused, match="not a regular file"):
        read_sandbox_file(box, "snap", 1_000, None)


def test_a_hard_link_to_another_file_is_refused(box: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not the sandbox's")
    os.link(elsewhere, box / "snap")
    with pytest.raises(SandboxFileRefused, match="2 links"):
        read_sandbox_file(box, "snap", 1_000, None)


def test_a_file_of_another_uid_is_refused(box: Path) -> None:
    (box / "snap").write_bytes(b"x")
    with pytest.raises(SandboxFileRefused, match="belongs to uid"):
        read_sandbox_file(box, "snap", 1_000, os.getuid() + 1)


def test_a_file_over_the_limit_is_refused(box: Path) -> None:
    (box / "snap").write_bytes(b"x" * 1_001)
    with pytest.raises(SandboxFileRefused, match="over the 1,000-byte limit"):
        read_sandbox_file(box, "snap", 1_000, None)


def test_a_file_whose_size_says_less_is_read_only_to_the_limit() -> None:
    """fstat's size is not the bound: /proc's files say 0 and hold more (as a file still
    being written holds more than fstat saw); the read stops one byte past the limit."""
    with pytest.raises(SandboxFileRefused, match="grew past the 100-byte limit"):
        read_sandbox_file(Path(f"/proc/{os.getpid()}"), "maps", 100, None)


def test_a_name_is_one_component(box: Path) -> None:
    with pytest.raises(SandboxFileRefused):
        read_sandbox_file(box, "../etc", 1_000, None)


def test_a_tail_of_a_fifo_is_empty_not_a_wait(box: Path) -> None:
    os.mkfifo(box / "sandbox.err")
    assert sandbox_file_tail(box, "sandbox.err") == ""
    (box / "other.err").write_text("e" * 10_000 + "the end")
    assert sandbox_file_tail(box, "other.err", 7) == "the end"


def test_a_file_is_written_only_where_nothing_is(box: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    (box / "snap").symlink_to(target)
    with pytest.raises(FileExistsError):
        write_sandbox_file(box, "snap", b"overwritten", None)
    assert target.read_bytes() == b"kept"
    write_sandbox_file(box, "fresh", b"data", None)
    assert (box / "fresh").read_bytes() == b"data"


def test_a_tree_of_any_depth_is_removed_without_following_links(box: Path, tmp_path: Path) -> None:
    """20,000 directories deep: shutil.rmtree recursed a descriptor per level (and past
    Python's recursion limit); links out of the tree are removed, their targets kept."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_text("kept")
    (box / "link").symlink_to(outside)
    os.mkfifo(box / "fifo")
    fd = os.open(box, os.O_RDONLY)
    for _ in range(20_000):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.symlink(outside, "deep-link", dir_fd=fd)
    os.close(fd)
    assert remove_sandbox_tree(box)
    assert not box.exists() and (outside / "kept").read_text() == "kept"


def _removed_as(uid: int, top: Path) -> subprocess.CompletedProcess[str]:
    """remove_sandbox_tree(top) in a process of `uid` (a worker that is not root): the
    module alone (standard library only) under the system Python, which that user can run."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python the unprivileged user can run")
    module = top.parent / "files_copy.py"
    shutil.copy(sandbox_files.__file__, module)
    module.chmod(0o644)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('files', {str(module)!r})\n"
        "files = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(files)\n"
        "from pathlib import Path\n"
        f"sys.exit(0 if files.remove_sandbox_tree(Path({str(top)!r})) else 3)\n"
    )
    return subprocess.run(
        [python, "-I", "-B", "-c", script], user=uid, group=uid, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")
def test_a_worker_that_is_not_root_removes_what_its_sandbox_made_read_only() -> None:
    """A worker running as one uid shares it with its sandboxes: a cell may leave a
    directory read-only (0o500), unreadable (0o000), or the sandbox's own top read-only.
    The removal gives write and search back on each directory it enters (the standard
    library fallback in sandbox_reaper.py did; this one once left such trees behind)."""
    nobody = 65534
    parent = Path(tempfile.mkdtemp(prefix="drlm-files-", dir="/tmp"))
    try:
        parent.chmod(0o777)
        top = parent / "sandbox"
        (top / "made" / "deeper").mkdir(parents=True)
        (top / "made" / "deeper" / "out.txt").write_text("written by a cell")
        (top / "hidden" / "inside").mkdir(parents=True)
        (top / "hidden" / "inside" / "f").write_text("x")
        (top / "made" / "deeper" / "out.txt").chmod(0o000)
        for path in [top, *top.rglob("*")]:
            os.chown(path, nobody, nobody)
        (top / "made").chmod(0o500)
        (top / "hidden" / "inside").chmod(0o000)
        (top / "hidden").chmod(0o500)
        top.chmod(0o500)
        done = _removed_as(nobody, top)
        assert done.returncode == 0, done.stderr
        assert not top.exists()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_reaper_removes_a_deep_tree_and_never_follows_a_link(tmp_path: Path) -> None:
    """A dead worker's sandbox home may hold what a hostile cell left: a tree deeper than
    Python's recursion limit, a link out of it. The reaper removes the tree, not the target."""
    from durable_rlm.activities import sandbox_reaper

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the sandbox's")
    home = tmp_path / "home"
    home.mkdir()
    (home / "link").symlink_to(outside)
    fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1_500):  # deeper than PATH_MAX allows by name: made a level at a time
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    assert sandbox_reaper.remove_tree(home)
    assert not home.exists() and (outside / "keep.txt").read_text() == "not the sandbox's"
