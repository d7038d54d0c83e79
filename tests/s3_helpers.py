"""A real S3-compatible server for the tests (moto in server mode, a separate process on 127.0.0.1)
and fault injection through botocore's `before-send` event, which can answer a request instead of
the server: a 503 SlowDown, or a connection reset.

Faults in another process (the driver under test): set S3_FAULTS=<spec> in its environment and
start it through a wrapper that calls install_faults_from_env() before anything talks to S3.
spec = "<kind>:<first>:<count>[:<operation>[:<url part>]]": requests number first .. first+count-1
(counted from 1 over the matching requests of the process) get the fault; kind is "slowdown", "reset"
or "kill" (SIGKILL of the whole process, e.g. in the middle of a checkpoint upload); operation, e.g.
"PutObject", and a substring of the URL limit the matching requests (default: all). Several specs
are separated by commas.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

FAULTS_ENV = "S3_FAULTS"
# Distinctive fake credentials: the tests grep every output for them.
ACCESS_KEY = "AKIAI12TESTKEYDONTLOG"
SECRET_KEY = "i12-secret-Zq8x/never+in+logs"


class MotoServer:
    """`moto_server` on 127.0.0.1 as a child process; stop() ends it."""

    def __init__(self, log_path: Path, env: dict | None = None):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)  # moto logs every request it serves here (the tests count GETs)
        self._log = open(log_path, "wb")
        command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: see {log_path}") from None
                time.sleep(0.2)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()


def s3_env(server: MotoServer, tmp_path: Path) -> dict:
    """Environment for boto3 talking to the server: fake credentials, no ~/.aws files, few attempts."""
    return {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"), "AWS_MAX_ATTEMPTS": "4",
            "AWS_EC2_METADATA_DISABLED": "true"}


def make_bucket(server: MotoServer, name: str):
    import boto3
    client = boto3.client("s3", endpoint_url=server.url, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return client


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def _slowdown(request):
    from botocore.awsrequest import AWSResponse
    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
    return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Body(body))


def _reset(request):
    from botocore.exceptions import ConnectionClosedError
    raise ConnectionClosedError(endpoint_url=request.url)


def _kill(request):
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjector:
    """Answers the matching requests first .. first+count-1 with a fault; counts what it answered."""

    def __init__(self, kind: str, first: int, count: int, operation: str | None = None, url_part: str = ""):
        self.answer = {"slowdown": _slowdown, "reset": _reset, "kill": _kill}[kind]
        self.first, self.count, self.operation, self.url_part = first, count, operation, url_part
        self.seen = self.injected = 0
        self._lock = threading.Lock()

    def __call__(self, request, event_name, **_):
        if (self.operation and not event_name.endswith(f".{self.operation}")) or self.url_part not in request.url:
            return None
        with self._lock:
            self.seen += 1
            hit = self.first <= self.seen < self.first + self.count
            self.injected += hit
        return self.answer(request) if hit else None


def _events(client):
    """The event system of a client, or of boto3's default session (which clients made later copy)."""
    import boto3
    if client is not None:
        return client.meta.events
    if boto3.DEFAULT_SESSION is None:
        boto3.setup_default_session()
    return boto3.DEFAULT_SESSION.events


def install_faults(spec: str, client=None) -> FaultInjector:
    """Register a FaultInjector on `client`, or on boto3's default session for clients made later
    (storage.make_client's)."""
    kind, first, count, *where = spec.split(":")
    injector = FaultInjector(kind, int(first), int(count), *where)
    injector.events = _events(client)
    injector.events.register("before-send.s3", injector)
    return injector


def remove_faults(injector: FaultInjector) -> None:
    injector.events.unregister("before-send.s3", injector)


def install_faults_from_env() -> list:
    return [install_faults(spec) for spec in os.environ.get(FAULTS_ENV, "").split(",") if spec]
