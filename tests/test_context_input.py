"""A context path that cannot be a context is one line and exit 2, and nothing starts: no
server, no episode. Each bad input a person (or a script) can hand `drlm run --context`."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.test_everyday import drlm, server_state

MB = 1024 * 1024


def _run(tmp_path: Path, *context: str, **env: str):  # noqa: ANN202
    args = [a for c in context for a in ("--context", c)]
    return drlm(tmp_path, tmp_path, "run", "count", *args, "--base-url", "http://127.0.0.1:9/v1", **env)


def _refused(out, message: str, tmp_path: Path) -> None:  # noqa: ANN001
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert server_state(tmp_path) is None  # nothing was started


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    _refused(
        _run(tmp_path, "pipe"), "is a FIFO (named pipe): a context is read from a regular file", tmp_path
    )


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_is_refused(tmp_path: Path, device: str) -> None:
    _refused(_run(tmp_path, device), f"context {device} is a character device", tmp_path)


def test_a_socket_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "sock"))
        _refused(_run(tmp_path, "sock"), "is a socket", tmp_path)


def test_a_fifo_inside_a_context_directory_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one")
    os.mkfifo(corpus / "b.txt")
    _refused(_run(tmp_path, "corpus"), "corpus/b.txt is a FIFO", tmp_path)


def test_an_empty_context_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _refused(_run(tmp_path, "empty"), "holds no file", tmp_path)


def test_a_sparse_file_larger_than_the_sandbox_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with open(tmp_path / "huge.log", "wb") as handle:
        handle.truncate(8 * 1024 * MB)  # 8 GB of holes: reading it would take minutes
    out = _run(tmp_path, "huge.log")
    _refused(out, "to load as one string in the sandbox", tmp_path)
    assert "pass it as documents (`--context DIR`" in out.stderr and "DRLM_SANDBOX_MEMORY_MB" in out.stderr


def test_a_context_measured_too_large_after_streaming_is_refused(tmp_path: Path) -> None:
    """Its lower bound fits (a string can be half its bytes); its measure, ASCII text as
    large as the file, does not: refused once streamed, before any server or episode."""
    (tmp_path / "forty.txt").write_bytes(b"0123456789abcdef\n" * (40 * MB // 17))
    out = _run(tmp_path, "forty.txt", DRLM_SANDBOX_MEMORY_MB="320")
    _refused(out, "a sandbox holds 320 MB here", tmp_path)


def test_a_large_document_of_a_corpus_is_refused_with_its_name(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "small.txt").write_text("small")
    with open(corpus / "big.txt", "wb") as handle:
        handle.truncate(4 * 1024 * MB)
    out = _run(tmp_path, "corpus")
    _refused(out, "context document big.txt", tmp_path)
    assert "split the document or raise DRLM_SANDBOX_MEMORY_MB" in out.stderr


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "growing.log"
    path.write_bytes(b"a log line that keeps coming\n" * (200 * MB // 29))
    stop = threading.Event()

    def append() -> None:
        with open(path, "ab") as handle:
            while not stop.is_set():
                handle.write(b"one more line\n")
                handle.flush()
                stop.wait(0.001)

    writer = threading.Thread(target=append)
    writer.start()
    try:
        out = _run(tmp_path, "growing.log")
    finally:
        stop.set()
        writer.join()
    _refused(out, "changed while it was read", tmp_path)


def test_a_file_that_is_not_utf8_is_refused_with_where(tmp_path: Path) -> None:
    (tmp_path / "bytes.bin").write_bytes(b"fine so far " * 1000 + b"\xff\xfe")
    _refused(_run(tmp_path, "bytes.bin"), "not UTF-8 text", tmp_path)


def test_invalid_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data.json").write_text('{"a": [1, 2,')
    _refused(_run(tmp_path, "data.json"), "is not valid JSON", tmp_path)


def test_a_directory_and_several_files_become_documents(tmp_path: Path, scripted) -> None:  # noqa: ANN001
    from durable_rlm.scripted import root_and_sub

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "one.txt").write_text("alpha\nbeta\n")
    (corpus / "two.txt").write_text("gamma\n")
    (tmp_path / "data.json").write_text('{"n": 41}')
    turns = [
        "```repl\nlines = sum(d.count(chr(10)) for d in context[:2])\n"
        "answer_text = f'{len(context)} {list(context.names)} {lines}'\n```",
        "FINAL_VAR(answer_text)",
    ]
    server = scripted(root_and_sub(turns))
    out = drlm(tmp_path, tmp_path, "run", "t", "--context", "corpus", "--base-url", server.base_url,
               "--model", "m", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["answer"] == "2 ['one.txt', 'two.txt'] 3"

    turns = ["```repl\nv = context[1]['n'] + len(context[0])\n```", "FINAL_VAR(v)"]
    server = scripted(root_and_sub(turns))
    out = drlm(tmp_path, tmp_path, "run", "t", "--context", "corpus/two.txt", "--context", "data.json",
               "--base-url", server.base_url, "--model", "m", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["answer"] == "47"
    verified = drlm(tmp_path, tmp_path, "verify", "--all", "--json")
    report = json.loads(verified.stdout)
    assert verified.returncode == 0 and report["ok"] and report["episodes"] == 2, verified.stdout
    # Each document and its index are named by the episodes' requests: gc keeps them (only
    # the local steps' start markers, named by nothing, go), and verify still finds them whole.
    time.sleep(1.5)
    swept = json.loads(drlm(tmp_path, tmp_path, "gc", "--grace", "1s", "--json").stdout)
    assert swept["histories"] == 2 and swept["removed"] > 0, swept
    after = json.loads(drlm(tmp_path, tmp_path, "verify", "--all", "--json").stdout)
    assert after["ok"] and after["checked"] == report["checked"], after


def test_drlm_gc_reports_what_it_would_remove(tmp_path: Path, scripted) -> None:  # noqa: ANN001
    from durable_rlm.scripted import root_and_sub

    (tmp_path / "notes.txt").write_text("one\ntwo\n")
    server = scripted(root_and_sub(["```repl\nn = context.count(chr(10))\n```", "FINAL_VAR(n)"]))
    run = ("run", "t", "--context", "notes.txt", "--base-url", server.base_url, "--model", "m", "--json")
    assert json.loads(drlm(tmp_path, tmp_path, *run).stdout)["answer"] == "2"
    out = drlm(tmp_path, tmp_path, "gc", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["dry_run"] and report["histories"] >= 1 and report["removed"] == 0  # all young
    assert drlm(tmp_path, tmp_path, "gc", "--grace", "soon").returncode == 2


def test_a_text_too_large_for_a_str_runs_as_a_mapped_view(tmp_path: Path, scripted) -> None:  # noqa: ANN001
    from durable_rlm.scripted import root_and_sub

    (tmp_path / "big.log").write_bytes(b"0123456789abcdef\n" * (100 * MB // 17))
    budget = {"DRLM_SANDBOX_MEMORY_MB": "320"}
    _refused(_run(tmp_path, "big.log", **budget), "a sandbox holds 320 MB here", tmp_path)
    turns = [
        "```repl\nn = context.count(chr(10))\nfirst = next(context.lines())\n"
        "r = f'{n} {len(context)} {first}'\n```",
        "FINAL_VAR(r)",
    ]
    server = scripted(root_and_sub(turns))
    run = ("run", "t", "--context", "big.log", "--context-view", "mapped", "--base-url", server.base_url)
    out = drlm(tmp_path, tmp_path, *run, "--model", "m", "--json", **budget)
    assert out.returncode == 0, out.stderr
    lines = 100 * MB // 17
    assert json.loads(out.stdout)["answer"] == f"{lines} {lines * 17} 0123456789abcdef"


def test_the_mapped_view_refuses_text_that_is_not_ascii(tmp_path: Path) -> None:
    (tmp_path / "accents.txt").write_text("café\n" * 10)
    out = drlm(tmp_path, tmp_path, "run", "t", "--context", "accents.txt", "--context-view", "mapped",
               "--base-url", "http://127.0.0.1:9/v1")  # fmt: skip
    _refused(out, "is not ASCII text: the mapped view indexes characters as bytes", tmp_path)
