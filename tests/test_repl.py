"""The REPL host and its sandbox process, driven directly (no Temporal needed)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.activities.sandbox_processes import SandboxUids
from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore, SqlBackend
from durable_rlm.store.sql import open_store
from durable_rlm.workflows.models import (
    CallAnswer,
    ExecuteCellInput,
    ResumeCellInput,
)
from tests.conftest import Episode


async def test_variables_persist_across_cells(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("x = 20")
    outcome = await episode.run("x += 1\nprint(x * 2)")
    assert outcome.stdout == "42\n"
    assert outcome.error is None


async def test_context_is_a_variable(host: ReplActivities) -> None:
    episode = Episode(host, context="alpha beta gamma")
    outcome = await episode.run("print(len(context.split()), context[:5])")
    assert outcome.stdout == "3 alpha\n"


async def test_json_context_keeps_its_structure(host: ReplActivities) -> None:
    episode = Episode(host, context={"docs": [1, 2, 3]})
    assert (await episode.run("sum(context['docs'])")).stdout == "6\n"


async def test_trailing_expression_is_echoed(host: ReplActivities) -> None:
    assert (await Episode(host).run("1 + 1")).stdout == "2\n"


async def test_exceptions_become_the_cell_error(host: ReplActivities) -> None:
    outcome = await Episode(host).run("y = 1\nraise ValueError('bad input')")
    assert outcome.error is not None
    assert "ValueError: bad input" in outcome.error
    assert "<cell 1>" in outcome.error


async def test_syntax_errors_are_reported(host: ReplActivities) -> None:
    outcome = await Episode(host).run("def broken(:\n  pass")
    assert "SyntaxError" in (outcome.error or "")


async def test_stderr_is_captured(host: ReplActivities) -> None:
    outcome = await Episode(host).run("import sys\nprint('warn', file=sys.stderr)")
    assert outcome.stderr == "warn\n"


async def test_output_is_kept_up_to_the_stored_limit_as_it_is_printed(host: ReplActivities) -> None:
    outcome = await Episode(host, truncation=100, stored=100).run("print('x' * 100_000)")
    assert outcome.stdout.startswith("x" * 100)
    assert "99901 more characters truncated" in outcome.stdout
    assert len(outcome.stdout) < 200


async def test_llm_query_suspends_the_cell_and_resumes_with_the_answer(host: ReplActivities) -> None:
    episode = Episode(host)
    first = await host.execute_cell(
        ExecuteCellInput(
            sandbox=episode.ref(), iteration=1, cell_index=1, code="r = llm_query('hi')\nprint(r)"
        )
    )
    assert first.status == "suspended"
    assert [r.prompt for r in first.requests] == ["hi"]
    episode.head, episode.cells = first.log_head, 1
    done = await host.resume_cell(
        ResumeCellInput(
            sandbox=episode.ref(),
            cell_index=1,
            answers=[
                CallAnswer(call_index=0, prompt_digest=first.requests[0].prompt_digest, ok=True, text="hello")
            ],
        )
    )
    assert done.status == "completed"
    assert done.stdout == "hello\n"


async def test_llm_query_batched_asks_for_all_prompts_at_once(host: ReplActivities) -> None:
    episode = Episode(host)
    outcome = await episode.run("print(llm_query_batched(['a', 'b', 'c']))")
    assert outcome.stdout == "['A', 'B', 'C']\n"


async def test_failed_sub_call_raises_in_llm_query_and_marks_batched_entries(host: ReplActivities) -> None:
    episode = Episode(host)
    episode.cells = 1
    out = await host.execute_cell(
        ExecuteCellInput(
            sandbox=episode.ref(),
            iteration=1,
            cell_index=1,
            code=(
                "print(llm_query_batched(['a']))\n"
                "try:\n    llm_query('b')\nexcept RuntimeError as e:\n    print(e)"
            ),
        )
    )
    episode.head = out.log_head
    out = await host.resume_cell(
        ResumeCellInput(
            sandbox=episode.ref(),
            cell_index=1,
            answers=[
                CallAnswer(
                    call_index=0, prompt_digest=out.requests[0].prompt_digest, ok=False, text="HTTP 500"
                )
            ],
        )
    )
    episode.head = out.log_head
    out = await host.resume_cell(
        ResumeCellInput(
            sandbox=episode.ref(),
            cell_index=1,
            answers=[
                CallAnswer(
                    call_index=1, prompt_digest=out.requests[0].prompt_digest, ok=False, text="HTTP 503"
                )
            ],
        )
    )
    assert out.stdout == "['Error: HTTP 500']\nllm_query failed: HTTP 503\n"


async def test_llm_query_rejects_non_string_prompts(host: ReplActivities) -> None:
    outcome = await Episode(host).run("llm_query(42)")
    assert "TypeError" in (outcome.error or "")


async def test_answer_dict_ends_the_cell_with_an_answer(host: ReplActivities) -> None:
    outcome = await Episode(host).run("answer['content'] = 6 * 7\nanswer['ready'] = True")
    assert outcome.answer == "42"


@pytest.mark.parametrize(
    ("cells", "answers", "printed"),
    [
        # A flag an earlier cell left set is not an answer again (rlms: the assignment counts).
        (["answer['content'] = 'x'\nanswer['ready'] = 1", "print(answer['ready'])"], ["x", None], "1\n"),
        # The content as it is when `ready` is set, as in rlms.
        (["answer['ready'] = True\nanswer['content'] = 'late'"], [""], ""),
        # A rebound plain dict that is ready answers, and is an answer dict again afterwards.
        (["answer = {'content': 7, 'ready': True}", "answer['ready'] = 1"], ["7", "7"], ""),
        # Set, then the cell fails: the answer still counts (rlms's too).
        (["answer['content'] = 'x'\nanswer['ready'] = True\n1 / 0"], ["x"], ""),
        # Only an assignment to answer["ready"] is seen, as in rlms.
        (["answer.update(content='u', ready=True)"], [None], ""),
    ],
)
async def test_an_answer_counts_when_a_cell_sets_ready_as_in_rlms(
    host: ReplActivities, cells: list[str], answers: list[str | None], printed: str
) -> None:
    episode = Episode(host)
    outcomes = [await episode.run(code) for code in cells]
    assert [o.answer for o in outcomes] == answers
    assert outcomes[-1].stdout == printed


@pytest.mark.parametrize(("rlms", "printed"), [(False, "42\n"), (True, "{'content': '', 'ready': False}\n")])
async def test_answer_bound_to_another_value_is_the_model_s_own_variable_except_in_rlms(
    host: ReplActivities, rlms: bool, printed: str
) -> None:
    """`answer = 6 * 7` then `FINAL_VAR(answer)` is an answer of ours; rlms 0.1.3 puts its
    scaffold back after each cell, so there the name is an empty answer dict again."""
    episode = Episode(host, rlms=rlms)
    assert (await episode.run("answer = 6 * 7")).answer is None
    assert (await episode.run("print(answer)")).stdout == printed


async def test_an_rlms_repl_binds_context_0_and_puts_context_and_history_back(host: ReplActivities) -> None:
    episode = Episode(host, context="alpha beta", rlms=True)
    await episode.run("history_0 = [{'role': 'user', 'content': 'q'}]\ncontext = 'mine'\nhistory = []")
    outcome = await episode.run("print(context is context_0, context, history is history_0)")
    assert outcome.stdout == "True alpha beta True\n"
    plain = Episode(host, context="alpha beta")
    await plain.run("context = 'mine'")
    assert (await plain.run("print(context, 'context_0' in globals())")).stdout == "mine False\n"


async def test_a_failed_llm_query_is_an_error_string_in_an_rlms_repl(host: ReplActivities) -> None:
    episode = Episode(host, rlms=True)
    out = await host.execute_cell(
        ExecuteCellInput(
            sandbox=episode.ref(), iteration=1, cell_index=1, code="r = llm_query('x')\nprint(r)"
        )
    )
    assert out.status == "suspended"
    episode.head = out.log_head
    (asked,) = out.requests
    failed = CallAnswer(
        call_index=asked.call_index, prompt_digest=asked.prompt_digest, ok=False, text="HTTP 503"
    )
    done = await host.resume_cell(ResumeCellInput(sandbox=episode.ref(), cell_index=1, answers=[failed]))
    assert done.stdout == "Error: HTTP 503\n" and done.error is None


async def test_show_vars_lists_user_variables(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("alpha = 1\nbeta = 'b'")
    outcome = await episode.run("SHOW_VARS()")
    assert "alpha: int" in outcome.stdout and "beta: str" in outcome.stdout
    assert "llm_query" not in outcome.stdout


async def test_read_variable_for_final_var(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("result = {'a': 1}")
    assert await episode.read("result") == "{'a': 1}"
    assert await episode.read("missing") is None
    assert await episode.read("llm_query") is None


async def test_a_looping_cell_is_interrupted_and_the_namespace_survives(host: ReplActivities) -> None:
    episode = Episode(host, cell_timeout_s=1.0)
    await episode.run("kept = 'yes'")
    outcome = await episode.run("while True:\n    pass")
    assert "time limit" in (outcome.error or "")
    assert (await episode.run("print(kept)")).stdout == "yes\n"


async def test_a_cell_that_swallows_its_interrupt_is_killed_and_state_rebuilt(host: ReplActivities) -> None:
    episode = Episode(host, cell_timeout_s=1.0)
    await episode.run("kept = 41")
    outcome = await episode.run(
        "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass"
    )
    assert "did not stop" in (outcome.error or "")
    assert (await episode.run("print(kept + 1)")).stdout == "42\n"


async def test_os_exit_in_a_cell_loses_only_that_cell(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("kept = 'still here'")
    outcome = await episode.run("import os\nos._exit(9)")
    assert "exited" in (outcome.error or "")
    assert (await episode.run("print(kept)")).stdout == "still here\n"


async def test_exit_is_refused(host: ReplActivities) -> None:
    episode = Episode(host)
    outcome = await episode.run("exit()")
    assert "not allowed" in (outcome.error or "")
    assert (await episode.run("print('alive')")).stdout == "alive\n"


async def test_another_worker_rebuilds_the_repl_from_the_log_without_model_calls(
    blob_store: BlobStore, sandboxes: Path
) -> None:
    first = ReplActivities(blob_store, "queue-a", sandboxes / "a")
    second = ReplActivities(blob_store, "queue-b", sandboxes / "b")
    try:
        episode = Episode(first)
        await episode.run("import random\nnoise = random.random()\nr = llm_query('q1')")
        await episode.run("both = llm_query_batched(['q2', 'q3'])\nprint(noise)")
        noise = (await episode.run("print(noise)")).stdout

        episode.host = second  # the first worker is gone; the second has no sandbox
        asked: list[str] = []

        def must_not_be_called(prompt: str) -> str:
            asked.append(prompt)
            return "live"

        outcome = await episode.run("print(r, both, noise)", answer=must_not_be_called)
        assert outcome.stdout == f"Q1 ['Q2', 'Q3'] {noise.strip()}\n"
        assert outcome.rebuilt is True
        assert outcome.divergences == []
        assert asked == []
        assert outcome.worker_queue == "queue-b"
    finally:
        await first.close_all()
        await second.close_all()


async def test_rebuild_mid_cell_resumes_at_the_pending_call(blob_store: BlobStore, sandboxes: Path) -> None:
    first = ReplActivities(blob_store, "queue-a", sandboxes / "a")
    second = ReplActivities(blob_store, "queue-b", sandboxes / "b")
    try:
        episode = Episode(first)
        episode.cells = 1
        code = "a = llm_query('one')\nb = llm_query('two')\nprint(a + b)"
        out = await first.execute_cell(
            ExecuteCellInput(sandbox=episode.ref(), iteration=1, cell_index=1, code=code)
        )
        episode.head = out.log_head
        out = await first.resume_cell(
            ResumeCellInput(
                sandbox=episode.ref(),
                cell_index=1,
                answers=[
                    CallAnswer(call_index=0, prompt_digest=out.requests[0].prompt_digest, ok=True, text="1")
                ],
            )
        )
        assert out.status == "suspended" and out.requests[0].prompt == "two"
        episode.head = out.log_head
        await first.close_all()  # the worker dies while the cell waits for 'two'

        done = await second.resume_cell(
            ResumeCellInput(
                sandbox=episode.ref(),
                cell_index=1,
                answers=[
                    CallAnswer(call_index=1, prompt_digest=out.requests[0].prompt_digest, ok=True, text="2")
                ],
            )
        )
        assert done.status == "completed"
        assert done.stdout == "12\n"
        assert done.rebuilt is True
    finally:
        await second.close_all()


async def test_a_stale_head_forces_a_rebuild_instead_of_running_on_wrong_state(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("n = 1")
    before = episode.head
    await episode.run("n = 100")
    episode.head = before  # the workflow never accepted the second cell (e.g. it was retried)
    outcome = await episode.run("print(n)")
    assert outcome.stdout == "1\n"
    assert outcome.rebuilt is True


# --- isolation --------------------------------------------------------------------------------


async def test_cells_do_not_see_worker_credentials(
    host: ReplActivities, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-of-the-worker")
    outcome = await Episode(host).run(
        "import os\nprint(sorted(os.environ))\nprint(os.environ.get('OPENAI_API_KEY'))"
    )
    assert "sk-secret" not in outcome.stdout
    assert outcome.stdout.endswith("None\n")


# Each layer is tested where it alone decides: the audit hook's refusals say "sandbox:";
# with the hook off (`bare`), the namespace, the uid and the rlimits must still hold.


@pytest.fixture
async def bare(blob_store: BlobStore, sandboxes: Path) -> AsyncIterator[ReplActivities]:
    """A host whose sandboxes run without the audit hook and without their private root: the
    uid, the network namespace and the limits, each alone (tests/test_escape.py attacks the
    whole kernel side)."""
    repl = ReplActivities(
        blob_store, "queue-bare", sandboxes, memory_mb=1024, audit_hook=False, filesystem=False
    )
    yield repl
    await repl.close_all()


@pytest.fixture
def listener() -> Iterator[int]:
    """A port that accepts connections on the worker's loopback."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


def connect(port: int) -> str:
    return f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))"


async def test_the_audit_hook_refuses_sockets(host: ReplActivities, listener: int) -> None:
    outcome = await Episode(host).run(connect(listener))
    assert "PermissionError: sandbox: socket.__new__ is not allowed" in (outcome.error or "")


async def test_the_network_namespace_alone_stops_connections(bare: ReplActivities, listener: int) -> None:
    outcome = await Episode(bare).run(connect(listener))
    assert "OSError: [Errno 101] Network is unreachable" in (outcome.error or "")


async def test_cells_cannot_read_files_outside_the_sandbox(
    host: ReplActivities, blob_store: BlobStore
) -> None:
    digest = blob_store.put_text("secret blob")
    secret = blob_store.backend._path(digest)  # type: ignore[attr-defined]
    outcome = await Episode(host).run(f"print(open({str(secret)!r}).read())")
    assert f"sandbox: access to {str(secret)!r} is not allowed" in (outcome.error or "")
    outcome = await Episode(host).run(f"import os\nprint(os.listdir({str(Path.cwd())!r}))")
    assert "sandbox: os.listdir of" in (outcome.error or "")


async def test_cells_can_use_files_in_their_own_directory(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("open('notes.txt', 'w').write('kept')")
    assert (await episode.run("print(open('notes.txt').read())")).stdout == "kept\n"


async def test_the_file_barrier_stops_writes_the_uid_would_allow(host: ReplActivities) -> None:
    open_dir = Path(tempfile.mkdtemp(prefix="drlm-world-writable-", dir="/tmp"))
    open_dir.chmod(0o777)  # anyone, the sandbox's uid included, may write here
    try:
        target = open_dir / "escape.txt"
        outcome = await Episode(host).run(f"open({str(target)!r}, 'w').write('x')")
        assert f"sandbox: access to {str(target)!r} is not allowed" in (outcome.error or "")
        assert not target.exists()
        outcome = await Episode(host).run(f"import os\nos.mkdir({str(open_dir / 'd')!r})")
        assert "sandbox: os.mkdir outside the sandbox is not allowed" in (outcome.error or "")
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop happens when the worker is root")
async def test_the_uid_alone_stops_reads_writes_and_signals(bare: ReplActivities, tmp_path: Path) -> None:
    episode = Episode(bare)
    outcome = await episode.run(f"open({str(tmp_path / 'escape.txt')!r}, 'w')")
    assert "PermissionError: [Errno 13] Permission denied" in (outcome.error or "")
    assert "PermissionError: [Errno 13]" in ((await episode.run("open('/etc/shadow').read()")).error or "")
    outcome = await episode.run(f"import os\nos.kill({os.getpid()}, 0)")
    # Refused by the uid, or (its PID namespace) the worker is not even there to be named.
    error = outcome.error or ""
    assert "[Errno 1] Operation not permitted" in error or "[Errno 3] No such process" in error
    uid, gid, groups = (
        await episode.run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    ).stdout.split(maxsplit=2)
    assert uid == gid and int(uid) >= SandboxUids.FIRST and groups.strip() == "[]"


async def test_the_audit_hook_refuses_processes_signals_and_ctypes(host: ReplActivities) -> None:
    episode = Episode(host)
    outcome = await episode.run("import subprocess\nsubprocess.run(['id'])")
    assert "sandbox: subprocess.Popen is not allowed" in (outcome.error or "")
    outcome = await episode.run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert "sandbox: os.kill is not allowed" in (outcome.error or "")
    outcome = await episode.run("import ctypes\nctypes.CDLL(None)")
    assert "sandbox: ctypes.dlopen is not allowed" in (outcome.error or "")


async def test_a_memory_bomb_is_a_cell_error(host: ReplActivities) -> None:
    episode = Episode(host)
    outcome = await episode.run("x = bytearray(4 * 1024 ** 3)")
    assert "MemoryError" in (outcome.error or "")
    assert (await episode.run("print('alive')")).stdout == "alive\n"


async def test_each_sandbox_has_a_uid_of_its_own_when_the_worker_is_root(host: ReplActivities) -> None:
    first, second = Episode(host), Episode(host)
    uids = [int((await e.run("import os\nprint(os.getuid())")).stdout) for e in (first, second)]
    if os.geteuid() == 0:
        assert uids[0] != uids[1] and min(uids) >= SandboxUids.FIRST
    else:
        assert uids == [os.getuid()] * 2


def test_an_unreachable_sandbox_root_is_a_clear_error(tmp_path: Path, blob_store: BlobStore) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root drops the sandbox to another user")
    with pytest.raises(ValueError, match="not traversable"):
        ReplActivities(blob_store, "q", tmp_path / "sandboxes")


async def test_the_sandbox_reports_every_layer_it_put_in_place(
    host: ReplActivities, bare: ReplActivities
) -> None:
    layers = await host.probe()
    assert layers["network"] in ("netns", "userns+netns")
    assert layers["filesystem"].startswith("private root")
    assert layers["rlimits"] == (
        "address space 1024 MB, files 256 MB, no core, 256 open files, CPU 3600 s, "
        + ("64 processes" if os.geteuid() == 0 else "processes not limited (shared uid)")
    )
    assert layers["death_signal"] == "SIGKILL on worker death"
    assert layers["seccomp"] == (
        "49 calls refused, AF_NETLINK/AF_PACKET/AF_VSOCK sockets refused, namespaces in clone refused"
    )
    assert layers["ipc_pid"] == "ipc+pid"
    assert layers["audit_hook"] == "on"
    if os.geteuid() == 0:
        assert int(layers["uid"].removeprefix("uid ")) >= SandboxUids.FIRST
    else:
        assert layers["uid"] == f"uid {os.geteuid()} (worker not root: no drop)"
    assert (await bare.probe())["audit_hook"] == "off"


# --- lifecycle and errors told as they are -----------------------------------------------------


async def test_an_idle_sandbox_is_reaped_and_rebuilt_on_the_next_step(
    blob_store: BlobStore, sandboxes: Path
) -> None:
    host = ReplActivities(blob_store, "q", sandboxes, memory_mb=1024, idle_s=0.2)
    try:
        episode = Episode(host)
        await episode.run("kept = 41")
        assert await host.reap_idle() == 0  # just used
        await asyncio.sleep(0.4)
        assert await host.reap_idle() == 1
        assert host.live_episodes() == []
        outcome = await episode.run("print(kept + 1)")
        assert (outcome.stdout, outcome.rebuilt) == ("42\n", True)
    finally:
        await host.close_all()


async def test_a_rebuild_that_asks_a_different_question_is_counted_as_a_divergence(
    host: ReplActivities,
) -> None:
    episode = Episode(host)
    await episode.run("import time\nfirst = llm_query(str(time.time_ns()))")  # not repeatable
    await host.close_all()
    outcome = await episode.run("print(first.isdigit())")
    assert outcome.rebuilt and outcome.stdout == "True\n"
    (divergence,) = outcome.divergences
    assert divergence == "cell 1 call 0: the llm_query call differs from the recorded one"


async def test_an_oversize_frame_is_reported_as_such(blob_store: BlobStore, sandboxes: Path) -> None:
    host = ReplActivities(blob_store, "q", sandboxes, memory_mb=1024, max_frame_bytes=100_000)
    try:
        episode = Episode(host)
        await episode.run("kept = 1")
        outcome = await episode.run("llm_query('x' * 200_000)")
        assert outcome.error.startswith("the sandbox sent a 200,0")
        assert "-byte frame, over the 100,000-byte limit during this cell" in outcome.error
        assert (await episode.run("print(kept)")).stdout == "1\n"
    finally:
        await host.close_all()


async def test_a_forged_frame_breaks_only_its_own_cell(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("kept = 1")
    forge = "out = llm_query.__self__.calls.channel_out\nout.write(b'\\x00\\x00\\x00\\x05hello')\nout.flush()"
    outcome = await episode.run(forge)
    assert outcome.error.startswith("the sandbox sent a malformed frame")
    assert (await episode.run("print(kept)")).stdout == "1\n"


async def test_a_failed_variable_read_says_why(host: ReplActivities) -> None:
    episode = Episode(host)
    await episode.run("import os\nclass Bomb:\n    def __str__(self):\n        os._exit(3)\nv = Bomb()")
    with pytest.raises(ApplicationError, match=r"reading 'v' failed: the REPL process exited \(code 3\)"):
        await episode.read("v")


async def test_a_step_stores_its_log_entries_and_outputs_in_one_transaction(tmp_path, sandboxes) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 'blobs.sqlite'}")
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda conn: commits.append(1))
    host = ReplActivities(BlobStore(SqlBackend(engine)), "q", sandboxes, memory_mb=1024)
    try:
        episode = Episode(host)
        await episode.run("x = 1")
        commits.clear()
        outcome = await episode.run("y = llm_query('p')\nprint(y, x)")  # execute, then resume
        assert outcome.stdout == "P 1\n"
        assert len(commits) == 2  # one per step: started, answered, ended, output, answer text
        fresh = BlobStore(SqlBackend(engine))  # every entry is stored, not only cached
        log = chains.read_cell_log(fresh, episode.head)
        assert [c.status for c in log.cells] == ["ok", "ok"]
        assert [fresh.get_text(a.text) for a in log.cells[1].answers] == ["P"]
    finally:
        await host.close_all()


async def test_a_rebuild_replays_finished_cells_in_batches_with_their_answers(
    host: ReplActivities, monkeypatch: pytest.MonkeyPatch
) -> None:
    import durable_rlm.activities.repl_rebuild as rebuild_module

    monkeypatch.setattr(rebuild_module, "REPLAY_BATCH_CELLS", 3)  # 8 cells: batches of 3, 3, 2
    episode = Episode(host)
    await episode.run("total = 0")
    for i in range(6):
        await episode.run(f"total += len(llm_query_batched(['a{i}', 'bb{i}']))")
    await episode.run("import random\nrolled = random.random()")
    before = (await episode.run("print(total, rolled)")).stdout
    await host.close_all()
    outcome = await episode.run("print(total, rolled)")
    assert (outcome.stdout, outcome.rebuilt, outcome.divergences) == (before, True, [])
    # A rebuilt cell that asks more than the log answered is a divergence, in a batch too:
    # one call before the deadline (the first run), two after it (the rebuild).
    deadline = time.time() + 1.0
    await episode.run(
        f"import time\nextra = [llm_query(str(i)) for i in range(1 if time.time() < {deadline} else 2)]"
    )
    await asyncio.sleep(max(0.0, deadline - time.time()) + 0.5)
    await host.close_all()
    outcome = await episode.run("print('extra' in globals())")
    assert outcome.stdout == "False\n"  # the unanswered call raised in the rebuilt cell
    assert outcome.divergences == ["cell 11 call 1: no recorded result"]
