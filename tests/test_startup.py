"""Start-up: what a process imports before it needs it (issue 36). Pinned by what is in
`sys.modules`, not by timings (those are bench/'s): a provider's client library is imported
when that provider is first used, never by importing the API or the worker side."""

from __future__ import annotations

import subprocess
import sys

import pytest


def imported_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint(' '.join(m for m in ('openai', 'anthropic') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    [
        "from durable_rlm import DurableRLM",
        "import durable_rlm.api, durable_rlm.runtime, durable_rlm.cli",
        "import activities.llm, activities.model_errors, activities.extraction",
    ],
)
def test_no_provider_library_is_imported_before_it_is_used(code: str) -> None:
    assert imported_after(code) == set()


def test_a_provider_s_client_imports_its_library_alone() -> None:
    code = (
        "from activities.llm import ModelActivities\n"
        "from durable_rlm.blobs import BlobStore, DirectoryBackend\n"
        "from workflows.models import ModelSettings\n"
        "import tempfile\n"
        "models = ModelActivities(BlobStore(DirectoryBackend(tempfile.mkdtemp())), {'OPENAI_API_KEY': 'k'})\n"
        "models._client(ModelSettings(model='gpt-x', base_url='http://127.0.0.1:9/v1'))"
    )
    assert imported_after(code) == {"openai"}
