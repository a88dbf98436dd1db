from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from durable_rlm.scripted import Script, ScriptedModelServer
from tests.dspy_compat.harness import Compared, compare


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """durable-rlm's data directory, shared by the module's programs (one shared server)."""
    return tmp_path_factory.mktemp("drlm-dspy")


@pytest.fixture
def differential(scripted, tmp_path: Path, data_dir: Path) -> Callable[[str, Script], Compared]:
    """differential(name, model_script): the program run on DSPy's RLM and on ours."""

    def run(name: str, model: Script) -> Compared:
        server: ScriptedModelServer = scripted(model)
        return compare(name, server, tmp_path, data_dir)

    return run
