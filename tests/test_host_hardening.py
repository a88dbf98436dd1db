"""A worker that hostile sandbox output cannot hurt: its memory stays flat whatever a cell
prints or sends, every field it takes is cut to a size, and frames nobody asked for break
only that sandbox (rebuilt from the log for the next cell).

With the audit hook off, a cell can write straight to the sandbox's channel: what a sandbox
whose code was changed by a cell could send.
"""

from __future__ import annotations

import resource
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from durable_rlm.activities.repl import ReplActivities
from durable_rlm.store.blobs import BlobStore
from durable_rlm.workflows import defaults
from tests.conftest import Episode

CAP = defaults.SANDBOX_FIELD_CHARS


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture
async def unhooked(blob_store: BlobStore, sandboxes: Path) -> AsyncIterator[ReplActivities]:
    repl = ReplActivities(blob_store, "queue-hostile", sandboxes, memory_mb=2048, audit_hook=False)
    yield repl
    await repl.close_all()


# Writes raw frames to every pipe the sandbox holds: its channel to the worker among them.
FORGE = """
import json, os, stat, struct, sys
SEQ = next(m._SEQ[0] for m in list(sys.modules.values()) if hasattr(m, '_SEQ') and hasattr(m, 'read_frame'))
def forge(message, times=1):
    body = json.dumps({**message, 'seq': SEQ}).encode()
    frame = struct.pack('>I', len(body)) + body
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode) and os.get_blocking(fd) is not None:
                for _ in range(times):
                    os.write(fd, frame)
        except OSError:
            pass
"""


async def test_a_cell_printing_a_gigabyte_leaves_the_worker_flat(host: ReplActivities) -> None:
    before = peak_rss_mb()
    outcome = await Episode(host, cell_timeout_s=60).run(
        "chunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    print(chunk)"
    )
    assert outcome.status == "completed" and outcome.error is None
    assert len(outcome.stdout) < 1_100_000 and "more characters truncated" in outcome.stdout[-100:]
    assert peak_rss_mb() - before < 64


async def test_huge_errors_and_answers_are_cut_by_the_sandbox(host: ReplActivities) -> None:
    episode = Episode(host)
    outcome = await episode.run("raise ValueError('e' * 30_000_000)")
    assert outcome.error is not None and len(outcome.error) < CAP + 200
    assert "more characters truncated" in outcome.error
    outcome = await episode.run("answer = {'content': 'a' * 30_000_000, 'ready': True}")
    assert outcome.answer is not None and len(outcome.answer) < CAP + 200


async def test_a_forged_frame_with_huge_fields_is_cut_by_the_worker(unhooked: ReplActivities) -> None:
    episode = Episode(unhooked)
    outcome = await episode.run(
        FORGE + "forge({'op': 'done', 'status': 'ok', 'stdout': 's' * 5_000_000, 'error': 'e' * 5_000_000,"
        " 'answer': 'a' * 5_000_000, 'submitted': {'answer': 'b' * 5_000_000},"
        " 'variables': {('v' * 1000): 'x' * 100_000 for _ in range(1)}})\n"
        "import time\ntime.sleep(1)"
    )
    for text in (outcome.stdout, outcome.answer):
        assert text is not None and len(text) <= CAP + 1_100 and "cut by the worker" in text
    assert (
        outcome.error is not None
        and len(outcome.error) <= CAP + 1_200
        and "cut by the worker" in outcome.error
    )
    assert outcome.submitted is None and "SUBMIT outputs of" in (outcome.error or "")
    assert all(len(k) <= defaults.VARIABLE_CHARS and len(v) <= 300 for k, v in outcome.variables.items())


async def test_a_frame_without_the_request_number_ends_only_its_cell(unhooked: ReplActivities) -> None:
    episode = Episode(unhooked)
    await episode.run("kept = 41")
    stale = FORGE.replace("'seq': SEQ", "'seq': SEQ - 1")
    outcome = await episode.run(
        stale + "forge({'op': 'done', 'status': 'ok', 'answer': 'FORGED'})\nimport time\ntime.sleep(1)"
    )
    assert outcome.answer is None and outcome.cell_status == "killed"
    assert "out of turn" in (outcome.error or "")
    assert (await episode.run("print(kept + 1)")).stdout == "42\n"


async def test_a_flood_of_unasked_frames_breaks_only_that_sandbox(unhooked: ReplActivities) -> None:
    episode = Episode(unhooked)
    await episode.run("kept = 41")
    before = peak_rss_mb()
    first = await episode.run(
        FORGE + "forge({'op': 'done', 'status': 'ok', 'stdout': 'forged ' + 'p' * 100_000}, times=2_000)\n"
    )
    # The first frame was taken for the cell's end (it carried the request's number, as the
    # sandbox's own code would); the rest waited in a bounded queue and in the sandbox's
    # blocked pipe, not in the worker's memory.
    assert first.stdout.startswith("forged")
    assert peak_rss_mb() - before < 64
    # It spoke unasked: not trusted with the next cell. Its rebuild re-runs the flooding cell,
    # which floods again: the step fails as a sandbox failure (the workflow records the cell
    # as lost and goes on), and the worker is as it was.
    # (Or, when the next step starts before the queued frames show, that step meets them:
    # the cell is killed as out of turn.)
    try:
        after = await episode.run("print(kept + 1)")
    except ApplicationError as failed:
        assert "out of turn" in str(failed)
    else:
        assert after.cell_status == "killed" and "out of turn" in (after.error or "")
    assert peak_rss_mb() - before < 64
