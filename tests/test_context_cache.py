"""The worker's read-only context cache and the sandbox's map of it: one copy per worker,
reused by a second episode and by a rebuild, out of the sandbox's reach, remade when tampered
with, in memory-backed storage when contexts are sealed at rest; every context shape rlms
takes arrives as the value it was; documents are loaded when touched."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rlm.activities.context_cache import ContextCache, check_private, owned_cache_dir
from durable_rlm.activities.repl import ReplActivities
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.store.chunks import CHUNK_BYTES
from durable_rlm.store.contexts import context_files, store_documents
from durable_rlm.store.encryption import Keyring
from tests.conftest import Episode

MB = 1024 * 1024


def _cache(host: ReplActivities) -> ContextCache:
    return host.pool.starter.contexts


def _copies(host: ReplActivities) -> int:
    """Copies made: read back from the store, or written as this process stored the context."""
    return _cache(host).made + _cache(host).adopted


async def test_two_episodes_over_one_context_share_one_copy(host: ReplActivities) -> None:
    text = ("a line of a large log, " * 50 + "\n") * (CHUNK_BYTES // 1000)  # > one chunk
    first, second = Episode(host, context=text), Episode(host, context=text)
    assert first.context == second.context and first.context.digest.startswith("sha256m:")
    assert (await first.run("print(len(context), context.count(chr(10)))")).stdout == (
        f"{len(text)} {text.count(chr(10))}\n"
    )
    assert (await second.run("print(type(context).__name__, context[:6])")).stdout == "str a line\n"
    assert _copies(host) == 1


async def test_a_context_stored_elsewhere_is_read_back_from_the_store_once(host: ReplActivities) -> None:
    from durable_rlm.store.contexts import store_text

    ref = store_text(host.blobs, "stored by another process")  # no local worker saw it go by
    first, second = Episode(host), Episode(host)
    first.context = second.context = ref
    for episode in (first, second):
        assert (await episode.run("print(context)")).stdout == "stored by another process\n"
    assert _cache(host).made == 1


async def test_a_rebuild_maps_the_same_copy(host: ReplActivities) -> None:
    episode = Episode(host, context="the context, " * 1000)
    await episode.run("x = len(context)")
    await host.pool.close_episode(episode.episode_id)  # the sandbox is gone: the next step rebuilds
    outcome = await episode.run("print(x, context[:11])")
    assert outcome.stdout == f"{len('the context, ' * 1000)} the context\n"
    assert _copies(host) == 1


async def test_the_copy_is_out_of_the_sandbox_s_reach(host: ReplActivities) -> None:
    episode = Episode(host, context="private to the worker")
    await episode.run("pass")
    copy = next(iter(_cache(host)._entries.values()))
    assert stat.S_IMODE(os.stat(copy.path).st_mode) == 0o444
    assert stat.S_IMODE(os.stat(copy.path.parent).st_mode) == 0o700
    outcome = await episode.run(
        f"try:\n    open({str(copy.path)!r}, 'r+b')\nexcept Exception as exc:\n    print(type(exc).__name__)"
    )
    assert outcome.stdout.strip() in ("PermissionError", "FileNotFoundError"), outcome


async def test_a_copy_changed_on_disk_is_made_again(host: ReplActivities) -> None:
    episode = Episode(host, context="the true context")
    await episode.run("pass")
    copy = next(iter(_cache(host)._entries.values()))
    os.chmod(copy.path, 0o644)
    copy.path.write_text("a forged context")
    await host.pool.close_episode(episode.episode_id)  # the next step starts a sandbox again
    assert (await episode.run("print(context)")).stdout == "the true context\n"
    assert _cache(host).made == 1  # read back from the store: the forged copy was not used


@pytest.mark.parametrize(
    "value",
    [
        "plain text",
        ["a", "list", "of", "strings"],
        [{"id": 1, "text": "a list of dicts"}, {"id": 2, "text": "é ü 字 😀"}],
        [{"role": "user", "content": "a list of messages"}, {"role": "assistant", "content": "ok"}],
        {"title": "a dict", "sections": [{"n": 1}, {"n": 2}]},
    ],
    ids=["str", "list-of-str", "list-of-dicts", "messages", "dict"],
)
async def test_every_context_shape_arrives_as_the_value_it_was(host: ReplActivities, value: object) -> None:
    episode = Episode(host, context=value)
    code = (
        "import hashlib, json\n"
        "digest = hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()\n"
        "print(type(context).__name__, digest)"
    )
    expected = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
    assert (await episode.run(code)).stdout == f"{type(value).__name__} {expected}\n"


async def test_documents_are_loaded_when_touched(host: ReplActivities, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("first document\n")
    (corpus / "sub" / "b.json").write_text(json.dumps({"k": [1, 2, 3]}))
    (corpus / "c.txt").write_text("x" * (CHUNK_BYTES + 3))
    (corpus / ".hidden").write_text("skipped")
    files = context_files([corpus])  # sorted, relative names, hidden files left out
    assert [name for name, _ in files] == ["a.txt", "c.txt", "sub/b.json"]
    ref, _ = store_documents(host.blobs, [files[0], files[2], files[1]])
    episode = Episode(host)
    episode.context = ref
    outcome = await episode.run(
        "print(len(context), list(context.names))\n"
        "print(repr(context[0]), context[1]['k'], len(context[-1]))\n"
        "print(sum(len(d) for d in context[::2]), 'first document' in context[0])"
    )
    assert outcome.error is None, outcome.error
    assert outcome.stdout.splitlines() == [
        "3 ['a.txt', 'sub/b.json', 'c.txt']",
        f"'first document\\n' [1, 2, 3] {CHUNK_BYTES + 3}",
        f"{15 + CHUNK_BYTES + 3} True",
    ]
    assert "documents" in (await episode.run("print(repr(context)[:40])")).stdout


async def test_sealed_contexts_are_cached_only_in_memory(tmp_path: Path, sandboxes: Path) -> None:
    keyring = Keyring.parse("k=" + base64.b64encode(os.urandom(32)).decode())
    blobs = BlobStore(DirectoryBackend(tmp_path / "blobs"), keyring=keyring)
    host = ReplActivities(blobs, "queue-sealed", sandboxes, memory_mb=1024)
    try:
        episode = Episode(host, context="a sealed secret context")
        assert (await episode.run("print(context)")).stdout == "a sealed secret context\n"
        directory = _cache(host).directory
        assert str(directory).startswith("/dev/shm/")
    finally:
        await host.close_all()
    assert not directory.exists()  # gone with the worker


def test_a_cache_directory_that_is_not_the_worker_s_own_is_refused(tmp_path: Path) -> None:
    open_one = tmp_path / "open"
    open_one.mkdir(mode=0o777)
    os.chmod(open_one, 0o777)
    with pytest.raises(OSError, match="writable by other users"):
        check_private(open_one)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    with pytest.raises(OSError, match="open to others"):
        check_private(readable)
    link = tmp_path / "link"
    link.symlink_to(owned_cache_dir(False, tmp_path))
    with pytest.raises(OSError, match="is a link"):
        check_private(link)
    theirs = owned_cache_dir(False, tmp_path)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(OSError, match="belongs to uid 65534"):
        check_private(theirs)
    with pytest.raises(OSError, match="not memory-backed"):
        owned_cache_dir(True, tmp_path)


async def test_a_context_too_large_for_this_worker_s_sandbox_ends_the_step_with_the_reason(
    tmp_path: Path, sandboxes: Path
) -> None:
    """A client elsewhere checked the budget at best; this worker's sandboxes are smaller."""
    from temporalio.exceptions import ApplicationError

    blobs = BlobStore(DirectoryBackend(tmp_path / "blobs"))
    host = ReplActivities(blobs, "queue-small", sandboxes, memory_mb=300)
    try:
        episode = Episode(host, context="0123456789abcdef\n" * (30 * MB // 17))
        with pytest.raises(ApplicationError, match="needs .* MB to load as one string") as caught:
            await episode.run("print(len(context))")
        assert caught.value.non_retryable and "a sandbox holds 300 MB" in str(caught.value)
    finally:
        await host.close_all()


@settings(max_examples=300)
@given(
    text=st.text(alphabet="ab\n", max_size=80), sub=st.sampled_from(["a", "ab", "aa", "aba", "\n", "b\na"])
)
def test_the_mapped_view_answers_as_the_str_would(text: str, sub: str) -> None:
    from durable_rlm.activities.sandbox import contexts

    with tempfile.NamedTemporaryFile("w", delete=False) as handle:
        handle.write(text)
    try:
        original, contexts.WINDOW = contexts.WINDOW, 7  # windows far smaller than the text
        view = contexts.MappedText(os.open(handle.name, os.O_RDONLY))
        assert (len(view), view[:], view[::-1], view[3:17:2]) == (len(text), text, text[::-1], text[3:17:2])
        assert (view.count(sub), view.find(sub), view.rfind(sub), sub in view) == (
            text.count(sub), text.find(sub), text.rfind(sub), sub in text,
        )  # fmt: skip
        assert list(view.lines()) == text.splitlines()
    finally:
        contexts.WINDOW = original
        os.unlink(handle.name)
