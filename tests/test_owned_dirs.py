"""Directories another local user could have made, swapped or written (durable_rlm/host/owned_dirs.py),
and the reaper that judges only homes and records of its own user (activities/sandbox_reaper.py).

The report: uid 65534 made `$TMPDIR/drlm-sandboxes` first; a root worker with that TMPDIR
used it; the squatter planted a home with a copy of a live home's owner file (start time
shifted) and records of the live sandbox processes; the root reaper killed them ("REPL
process exited (code -9)"). With fs.protected_symlinks=0 (as on this kernel), a link in that
place made a 0700 directory of root's 0711, and the user read a file in it. Each attack is
reproduced here as that user (`setpriv --reuid=65534`), and each fails without its fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from durable_rlm.activities import sandbox_reaper
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox_reaper import OWNER_FILE, RECORD_SUFFIX, Owner, reap_dead
from durable_rlm.audit.timeline import episode_timeline
from durable_rlm.host.owned_dirs import UnsafeDirectory, check_owned, owned_directory
from durable_rlm.scripted import ChatRequest, Reply
from durable_rlm.settings import Settings
from durable_rlm.store.blobs import BlobStore
from durable_rlm.worker.runtime import Services, running_workers
from tests.conftest import ROOT, request_for, run_episode
from tests.worker_health import WorkerHealth

ROOT_WORKER = os.geteuid() == 0
NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
needs_root = pytest.mark.skipif(not ROOT_WORKER, reason="another local user is played by root's setpriv")


def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AS_NOBODY, *command], capture_output=True, text=True, timeout=30)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A /tmp of the test's own: sticky and writable by everyone, as `mkdir -m1777 /tmp/t`."""
    path = Path(tempfile.mkdtemp(prefix="drlm-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    sandbox_reaper.remove_tree(path)


# --- the rules, one at a time ----------------------------------------------------------------------


def test_a_missing_directory_is_made_with_its_parents_and_their_modes(tmp_path: Path) -> None:
    made = owned_directory(tmp_path / "a" / "b" / "c", mode=0o711, parents_mode=0o700)
    assert made == tmp_path / "a" / "b" / "c"
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o711
    assert stat.S_IMODE(os.lstat(tmp_path / "a").st_mode) == 0o700
    assert owned_directory(made, mode=0o700) == made  # there and ours: taken, its mode set
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700


def test_a_directory_of_ours_others_can_write_is_refused_not_repaired(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by other users"):
        owned_directory(shared)
    assert stat.S_IMODE(os.lstat(shared).st_mode) == 0o777  # nothing changed
    with pytest.raises(UnsafeDirectory, match="writable by other users"):
        check_owned(shared)


def test_a_link_of_our_own_in_its_place_leads_to_its_target_and_a_reader_refuses_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    assert owned_directory(tmp_path / "link", mode=0o700) == target  # our own link: our word
    with pytest.raises(UnsafeDirectory, match="is a link"):
        check_owned(tmp_path / "link")  # a reader takes no link at all


def test_a_link_of_our_own_on_the_way_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to("real")
    assert owned_directory(tmp_path / "via" / "inner") == tmp_path / "real" / "inner"


def test_a_parent_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="not sticky"):
        owned_directory(parent / "mine")
    parent.chmod(0o1777)  # as /tmp: nobody else may rename or remove what is ours in it
    assert owned_directory(parent / "mine").is_dir()


def test_something_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        owned_directory(tmp_path / "file")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        owned_directory(tmp_path / "file" / "below")


@needs_root
def test_a_directory_or_a_link_of_another_user_is_refused(tmp_path: Path, shared_tmp: Path) -> None:
    assert as_nobody("mkdir", str(shared_tmp / "theirs")).returncode == 0
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        owned_directory(shared_tmp / "theirs")
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        owned_directory(shared_tmp / "theirs" / "below")
    assert as_nobody("ln", "-s", str(tmp_path), str(shared_tmp / "their-link")).returncode == 0
    with pytest.raises(UnsafeDirectory, match=f"a link of uid {NOBODY}"):
        owned_directory(shared_tmp / "their-link" / "below")
    assert not (tmp_path / "below").exists()


@needs_root
def test_a_data_directory_another_user_made_is_refused(shared_tmp: Path) -> None:
    assert as_nobody("mkdir", str(shared_tmp / "data")).returncode == 0
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        Settings(data_dir=shared_tmp / "data").prepare_data_dir()


# --- the reports' attacks, as another user -----------------------------------------------------


@needs_root
def test_a_sandbox_root_another_user_made_first_is_refused(shared_tmp: Path, blob_store: BlobStore) -> None:
    squatted = shared_tmp / "drlm-sandboxes"
    assert as_nobody("mkdir", str(squatted)).returncode == 0
    with pytest.raises(UnsafeDirectory, match=f"belongs to uid {NOBODY}, not to this process"):
        ReplActivities(blob_store, "q", squatted)
    assert list(squatted.iterdir()) == []  # nothing of the worker's went in
    assert os.lstat(squatted).st_uid == NOBODY


@needs_root
def test_a_worker_whose_tmpdir_holds_another_users_sandbox_root_says_so_and_stops(
    shared_tmp: Path, temporal_address: str, session_dir: Path
) -> None:
    assert as_nobody("mkdir", str(shared_tmp / "drlm-sandboxes")).returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "DRLM_SANDBOX_DIR"))}
    env.update(
        TMPDIR=str(shared_tmp),
        TEMPORAL_ADDRESS=temporal_address,
        DRLM_DATABASE_URL=f"sqlite:///{session_dir / 'drlm.sqlite'}",
        DRLM_TASK_QUEUE=f"squatted-{uuid.uuid4().hex[:6]}",
    )
    done = subprocess.run(
        [sys.executable, str(ROOT / "worker.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"drlm-sandboxes belongs to uid {NOBODY}" in done.stderr
    assert "Remove it (it is made again), or choose another directory" in done.stderr


@needs_root
def test_a_link_where_the_sandbox_root_goes_opens_nothing_of_roots(
    shared_tmp: Path, blob_store: BlobStore
) -> None:
    """fs.protected_symlinks=0 here: root follows a link another user left in a sticky /tmp."""
    vault = Path(tempfile.mkdtemp(prefix="drlm-vault-", dir="/tmp"))
    try:
        vault.chmod(0o711)  # its parent lets everyone through, the secret itself does not
        secret = vault / "secret"
        secret.mkdir(mode=0o700)
        (secret / "key").write_text("root's secret")
        (secret / "key").chmod(0o644)
        assert as_nobody("cat", str(secret / "key")).returncode != 0
        assert as_nobody("ln", "-s", str(secret), str(shared_tmp / "drlm-sandboxes")).returncode == 0
        with pytest.raises(UnsafeDirectory, match="is a link"):
            ReplActivities(blob_store, "q", shared_tmp / "drlm-sandboxes")
        assert stat.S_IMODE(os.lstat(secret).st_mode) == 0o700
        assert as_nobody("cat", str(secret / "key")).returncode != 0
        assert list(secret.iterdir()) == [secret / "key"]
    finally:
        shutil.rmtree(vault)


@pytest.fixture(params=[True, False], ids=["hook-on", "hook-off"])
async def private_worker(
    request: pytest.FixtureRequest, client, store, session_dir: Path
) -> AsyncIterator[ReplActivities]:
    """An in-process worker with a sandbox root of its own (the shared default root is read by
    every worker on the machine, and a test must not plant forged homes where they look), its
    sandboxes' audit hook on and off."""
    root = Path(tempfile.mkdtemp(prefix="drlm-private-root-", dir="/tmp"))
    queue = f"test-{uuid.uuid4().hex[:8]}"
    settings = Settings(task_queue=queue, data_dir=session_dir, sandbox_dir=root)
    try:
        async with running_workers(Services(settings, store[0], store[1], client)) as repl:
            repl.task_queue = queue  # type: ignore[attr-defined]
            repl.config.audit_hook = request.param
            yield repl
    finally:
        sandbox_reaper.remove_tree(root)


@needs_root
async def test_the_reaper_never_kills_a_live_sandbox_on_another_users_word(
    client, private_worker: ReplActivities, scripted
) -> None:
    """A live episode's cell sleeps; a home that another user owns holds a copy of the live
    home's owner file with its start time shifted, and records of the live sandbox processes
    (its records too, owned by that user, in a home of root's). The reaper, run meanwhile,
    kills nothing and reaps neither; the cell ends as it should."""
    root: Path = private_worker.sandbox_root
    assert as_nobody("mkdir", str(root / "w-1-squatted")).returncode != 0  # the root is root's: 0711

    def script(request: ChatRequest) -> Reply | str:
        if not request.is_root:
            return request.last_user.upper()
        turns = ["```repl\nimport time\ntime.sleep(4)\nprint('alive')\n```", "FINAL(done)"]
        return turns[min(request.turn, 1)]

    health = await WorkerHealth.measure(client, private_worker, scripted)
    episode_id = f"reaped-{uuid.uuid4().hex[:8]}"
    episode = asyncio.ensure_future(
        run_episode(client, request_for(scripted(script)), private_worker.task_queue, episode_id)
    )
    live = private_worker.home.path
    for _ in range(100):  # the cell's sandbox is started and recorded
        records = list(live.glob(f"*{RECORD_SUFFIX}"))
        if len(records) >= 2:
            break
        await asyncio.sleep(0.05)
    owner = json.loads((live / OWNER_FILE).read_text())
    forged_homes = []
    # A home of the squatter's (its records root's, as copies of the live ones would be), and
    # one of root's whose records the squatter wrote: each alone must be left unjudged.
    for squatters in ({"home", OWNER_FILE}, {RECORD_SUFFIX}):
        forged = root / f"w-{owner['pid']}-{uuid.uuid4().hex[:8]}"
        forged.mkdir(mode=0o711)
        (forged / OWNER_FILE).write_text(json.dumps({**owner, "start": owner["start"] + 1}))
        for record in live.glob(f"*{RECORD_SUFFIX}"):
            shutil.copy(record, forged / record.name)
        for path in [forged, *forged.iterdir()]:
            what = "home" if path == forged else path.suffix if path.suffix == RECORD_SUFFIX else path.name
            if what in squatters:
                os.chown(path, NOBODY, NOBODY)
        forged_homes.append(forged)
    reaped = await asyncio.to_thread(reap_dead, root, 0)
    assert all(r.killed == [] for r in reaped), reaped
    result = await episode
    assert result.answer == "done", result
    cell = (await episode_timeline(client, episode_id)).iterations[0].cells[0]
    assert cell.stdout.strip() == "alive" and not cell.error, cell  # not "exited (code -9)"
    assert forged_homes[0].exists()  # another user's home: not this worker's to judge
    sandbox_reaper.remove_tree(forged_homes[0])
    if forged_homes[1].exists():
        sandbox_reaper.remove_tree(forged_homes[1])
    await health.check(client, private_worker, scripted)


def test_a_record_through_a_link_or_of_another_owner_is_not_read(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "elsewhere.proc").write_text(json.dumps({"pid": 1, "start": 1}))
    (home / f"5{RECORD_SUFFIX}").symlink_to(tmp_path / "elsewhere.proc")
    os.mkfifo(home / f"6{RECORD_SUFFIX}")
    assert sandbox_reaper._read_record(home / f"5{RECORD_SUFFIX}") is None
    assert sandbox_reaper._read_record(home / f"6{RECORD_SUFFIX}") is None  # and it did not block
    (home / OWNER_FILE).symlink_to(tmp_path / "elsewhere.proc")
    assert sandbox_reaper.read_owner(home) is None
    me = Owner.current()
    assert me is not None
    (home / f"7{RECORD_SUFFIX}").write_text(json.dumps({"pid": me.pid, "start": me.start}))
    assert sandbox_reaper._read_record(home / f"7{RECORD_SUFFIX}") == (me.pid, me.start)
