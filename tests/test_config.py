"""Settings from a TOML file under the environment, `drlm config`, and stores that every
process of a deployment must agree on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.converter import DataConverter

from durable_rlm.settings import SECRET_FIELDS, ConfigurationError, Settings
from durable_rlm.store.sql import StoreMismatch, agree_on_blob_store, open_store

DRLM = str(Path(sys.executable).with_name("drlm"))


def test_a_config_file_sets_what_the_environment_does_not(tmp_path: Path) -> None:
    config = tmp_path / "drlm.toml"
    config.write_text('[drlm]\ntask_queue = "from-file"\nDRLM_CAPACITY = 7\nclaim_check_threshold = 1024\n')
    settings = Settings.from_env({"DRLM_CONFIG": str(config), "DRLM_CAPACITY": "9"})
    assert (settings.task_queue, settings.capacity, settings.claim_check_threshold) == ("from-file", 9, 1024)
    assert settings.origin("task_queue") == f"config file {config}"
    assert settings.origin("capacity") == "DRLM_CAPACITY"  # the environment wins over the file
    assert settings.origin("temporal_namespace").startswith("default")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("task_queu = 'x'", "unknown setting 'task_queu'"),
        ("capacity = 0", "capacity"),
        ("capacity = [", "config file"),
    ],
)
def test_a_bad_config_file_is_a_clear_error(tmp_path: Path, text: str, problem: str) -> None:
    config = tmp_path / "drlm.toml"
    config.write_text(text)
    with pytest.raises(ConfigurationError, match=problem) as raised:
        Settings.from_env({"DRLM_CONFIG": str(config)})
    assert str(config) in str(raised.value)


def test_a_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="DRLM_CONFIG: no config file"):
        Settings.from_env({"DRLM_CONFIG": str(tmp_path / "nope.toml")})


def test_every_setting_kept_out_of_reprs_is_masked_as_a_secret() -> None:
    hidden = {name for name, field in Settings.model_fields.items() if not field.repr}
    assert hidden and hidden <= SECRET_FIELDS


def test_drlm_config_prints_every_setting_with_secrets_masked(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DRLM_", "TEMPORAL_"))}
    env.update(
        DRLM_DATA_DIR=str(tmp_path),
        DRLM_CODEC_TOKEN="s3cret-token",
        DRLM_SNAPSHOT_KEY="snapshot-signing-secret-0123456789",
        DRLM_DATABASE_URL="postgresql+psycopg://drlm:hunter2@db:5432/drlm",
    )
    out = subprocess.run([DRLM, "config", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for secret in ("s3cret-token", "hunter2", "snapshot-signing-secret"):
        assert secret not in out.stdout
    plain = subprocess.run([DRLM, "config"], env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "snapshot-signing-secret" not in plain.stdout
    shown = json.loads(out.stdout)
    assert set(shown) == set(Settings.model_fields)
    assert shown["codec_token"] == {
        "value": "***",
        "variable": "DRLM_CODEC_TOKEN",
        "chosen_by": "DRLM_CODEC_TOKEN",
    }
    assert shown["database_url"]["value"] == "postgresql+psycopg://drlm:***@db:5432/drlm"
    assert shown["task_queue"]["chosen_by"] == "default"


def test_a_process_whose_blob_store_differs_from_the_stores_is_refused(tmp_path: Path) -> None:
    engine = open_store(f"sqlite:///{tmp_path / 'shared.sqlite'}")
    agree_on_blob_store(engine, "sql")  # the first process records its choice
    agree_on_blob_store(engine, "sql")  # the same choice: fine
    with pytest.raises(StoreMismatch, match="would keep them in directory .*Use the same DRLM_BLOB_STORE"):
        agree_on_blob_store(engine, str(tmp_path / "blobs"))
    other = open_store(f"sqlite:///{tmp_path / 'other.sqlite'}")
    agree_on_blob_store(other, str(tmp_path / "blobs"))
    with pytest.raises(StoreMismatch, match="this store's blobs live in directory"):
        agree_on_blob_store(other, "sql")
    engine.dispose()
    other.dispose()


def test_temporal_tls_and_api_key_settings_are_checked_and_never_printed(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes(b"CERT")
    key.write_bytes(b"KEY")
    mtls = Settings.from_env({"TEMPORAL_TLS_CERT": str(cert), "TEMPORAL_TLS_KEY": str(key)}).temporal_tls()
    assert (mtls.client_cert, mtls.client_private_key, mtls.server_root_ca_cert) == (b"CERT", b"KEY", None)
    cloud = Settings.from_env({"TEMPORAL_API_KEY": "k-123"})
    assert cloud.temporal_tls() is not None  # an API key needs TLS
    assert Settings.from_env({}).temporal_tls() is None  # a local server: plain
    with pytest.raises(ConfigurationError, match="go together") as half:
        Settings.from_env({"TEMPORAL_TLS_CERT": str(cert), "TEMPORAL_API_KEY": "k-123"})
    assert "k-123" not in str(half.value)
    with pytest.raises(ConfigurationError, match="TEMPORAL_TLS_CA: no file at"):
        Settings.from_env({"TEMPORAL_TLS_CA": str(tmp_path / "missing.pem")})
    assert dict((f, v) for f, v, _, _ in cloud.effective())["temporal_api_key"] == "***"


async def test_a_client_with_tls_settings_reaches_no_plain_server_and_says_where(tmp_path: Path) -> None:
    """TLS settings are used for TEMPORAL_ADDRESS: against a plain server the handshake fails,
    and the error names the address and the variable (no Temporal Cloud here to succeed)."""
    from durable_rlm.server.connection import ServerUnavailable, connect_client
    from durable_rlm.worker.runtime import EmbeddedServer

    async with EmbeddedServer(tmp_path / "t.sqlite") as address:
        settings = Settings.from_env({"TEMPORAL_ADDRESS": address, "TEMPORAL_API_KEY": "k-123"})
        with pytest.raises(
            ServerUnavailable, match=f"cannot reach Temporal at {address} \\(TEMPORAL_ADDRESS\\)"
        ):
            await connect_client(address, settings, None, [])
        plain = Settings.from_env({"TEMPORAL_ADDRESS": address})
        client = await connect_client(address, plain, DataConverter.default, [])
        assert client.namespace == "default"
