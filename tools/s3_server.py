"""A real S3-compatible server (moto in server mode, the ``dev`` extra) on 127.0.0.1, for tests and the recovery matrix.

moto keeps its objects in the server process: ``stop()`` then ``start()`` is an outage that loses every object
(an endpoint down with its data kept is :class:`tools.s3_proxy.S3FaultProxy` in front of it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from memstore.testing import free_ports, wait_for

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment a store (s3fs, botocore) needs to use the S3 endpoint at ``endpoint`` (``http://IP:PORT``)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


class MotoServer:
    """moto in server mode on 127.0.0.1; stoppable and restartable on its port (empty again after a restart)."""

    def __init__(self, workdir: Path) -> None:
        (self.port,) = free_ports(1)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = s3_env(self.endpoint)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                            region_name="us-east-1")  # fmt: skip

    def start(self, bucket: str = "ckpt") -> None:
        with open(self.workdir / "moto.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode}: see {self.workdir / 'moto.log'}")
            try:
                self.client().list_buckets()
                return True
            except Exception:
                return False

        wait_for(up, timeout=60, what="moto S3 server")
        self.client().create_bucket(Bucket=bucket)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
