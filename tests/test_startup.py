"""Start-up: what a process imports before it needs it
(docs/architecture/decisions.md#start-up-pays-only-for-what-it-uses). Pinned by what is in
`sys.modules`, not by timings (those are bench/startup.py's): a provider's client library is
imported when that provider is first used, never by importing the API or the worker side;
temporalio and SQLAlchemy when an episode runs, not when the API is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROVIDERS = ("openai", "anthropic")
RUNTIME = ("temporalio", "sqlalchemy")


def imported_after(code: str, watched: tuple[str, ...] = PROVIDERS) -> set[str]:
    probe = code + f"\nimport sys\nprint(' '.join(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    [
        "from durable_rlm import DurableRLM",
        "import durable_rlm.api, durable_rlm.worker.runtime, durable_rlm.cli",
        "import durable_rlm.activities.llm, durable_rlm.activities.model_errors,"
        " durable_rlm.activities.extraction",
    ],
)
def test_no_provider_library_is_imported_before_it_is_used(code: str) -> None:
    assert imported_after(code) == set()


@pytest.mark.parametrize(("provider", "imported"), [("openai", set()), ("anthropic", {"anthropic"})])
def test_a_provider_s_client_imports_its_library_alone(provider: str, imported: set[str]) -> None:
    """An OpenAI-compatible endpoint is called over plain HTTP: no library at all
    (docs/architecture/decisions.md#a-workers-model-calls-are-plain-http)."""
    code = (
        "from durable_rlm.activities.llm import ModelActivities\n"
        "from durable_rlm.store.blobs import BlobStore, DirectoryBackend\n"
        "from durable_rlm.workflows.models import ModelSettings\n"
        "import tempfile\n"
        "keys = {'OPENAI_API_KEY': 'k', 'ANTHROPIC_API_KEY': 'k'}\n"
        "models = ModelActivities(BlobStore(DirectoryBackend(tempfile.mkdtemp())), keys)\n"
        f"models._client(ModelSettings(model='m', provider={provider!r}, base_url='http://127.0.0.1:9/v1'))"
    )
    assert imported_after(code) == imported


def test_a_call_to_an_openai_compatible_model_imports_no_provider_library() -> None:
    code = (
        "import asyncio, tempfile\n"
        "from durable_rlm.activities.llm import ModelActivities\n"
        "from durable_rlm.scripted import ScriptedModelServer\n"
        "from durable_rlm.store.blobs import BlobStore, DirectoryBackend\n"
        "from durable_rlm.workflows.models import Message, ModelSettings\n"
        "models = ModelActivities(BlobStore(DirectoryBackend(tempfile.mkdtemp())), {'OPENAI_API_KEY': 'k'})\n"
        "with ScriptedModelServer(lambda request: 'pong') as server:\n"
        "    settings = ModelSettings(model='m', base_url=server.base_url)\n"
        "    done = asyncio.run(models.complete(settings, [Message(role='user', content='ping')]))\n"
        "assert done.text == 'pong', done\n"
    )
    assert imported_after(code) == set()


@pytest.mark.parametrize("code", ["import durable_rlm", "from durable_rlm import RLM, DurableRLM"])
def test_importing_the_api_imports_neither_the_runtime_nor_a_provider(code: str) -> None:
    assert imported_after(code, RUNTIME + PROVIDERS) == set()


WORKER_SIDE = ("sqlalchemy", "temporalio.worker", "durable_rlm.worker.runtime", "durable_rlm.activities.llm")


def test_api_objects_are_made_in_a_fresh_process_without_a_provider_library() -> None:
    """What the API imports late is there when an object is made (no name left unbound); and
    making one checks the request without the worker side, which the first episode imports
    while the shared server starts beside it (durable_rlm/server/embedded.py `acquire_early`)."""
    code = (
        "from durable_rlm import RLM, DurableRLM\n"
        "DurableRLM('gpt-x', base_url='http://127.0.0.1:9/v1', max_iterations=3)\n"
        "kwargs = {'model_name': 'gpt-x', 'base_url': 'http://127.0.0.1:9/v1', 'api_key': 'k'}\n"
        "RLM(backend='openai', backend_kwargs=kwargs, max_iterations=3)"
    )
    assert imported_after(code, PROVIDERS + WORKER_SIDE) == set()


def test_drlm_list_reads_the_store_without_temporalio(tmp_path: Path) -> None:
    """`drlm list` answers from the audit store; the SDK (its Runtime) is for --refresh, and
    the timeline models for `drlm show`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "DRLM_"))}
    env["DRLM_DATA_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "durable_rlm.cli", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no episodes in the audit store yet" in out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "durable_rlm.audit.readonly" in imported  # the probe sees imports
    assert not {"temporalio", "sqlalchemy"} & imported  # no store file: nothing opened
    assert "durable_rlm.audit.timeline" not in imported


def test_the_runtime_s_objects_are_frozen_at_exit_not_before() -> None:
    """gc.freeze at exit: the interpreter's last collection does not walk the runtime's
    objects; before exit nothing is frozen (the user's own objects stay collectable)."""
    code = (
        "import atexit, gc\n"
        # Registered first, so it runs last (atexit is LIFO): it sees what exit froze.
        "atexit.register(lambda: print('exit', gc.get_freeze_count(), flush=True))\n"
        "from durable_rlm import DurableRLM\n"
        "DurableRLM('gpt-x', base_url='http://127.0.0.1:9/v1')\n"
        "DurableRLM('gpt-x', base_url='http://127.0.0.1:9/v1')\n"
        "print('working', gc.get_freeze_count(), flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    counts = dict(line.split() for line in out.stdout.splitlines())
    assert counts["working"] == "0"  # nothing frozen while the process works
    assert int(counts["exit"]) > 50_000  # temporalio, pydantic's models, SQLAlchemy: frozen at exit


def test_showing_a_kept_timeline_imports_no_temporalio() -> None:
    """`drlm show` of an ended episode reads its timeline from the store: the timeline's
    models and renderer, never the SDK (it is ~0.1 s of a 0.35 s budget; hoisting the
    history's event types once made show 0.68 s)."""
    code = "from durable_rlm.audit import readonly\nfrom durable_rlm.audit.timeline import Timeline, render"
    assert imported_after(code, ("temporalio",)) == set()
