from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from durable_rlm.scripted import Script, ScriptedModelServer
from tests.rlms_compat.harness import Compared, compare


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """durable-rlm's data directory, shared by the module's scripts (one shared server)."""
    return tmp_path_factory.mktemp("drlm-compat")


@pytest.fixture
def differential(scripted, tmp_path: Path, data_dir: Path) -> Callable[..., Compared]:
    """differential(name, model_script, env=None): the script run on rlms and on us."""

    def run(name: str, model: Script, env: dict[str, str] | None = None) -> Compared:
        server: ScriptedModelServer = scripted(model)
        return compare(name, server, tmp_path, data_dir, env)

    return run
