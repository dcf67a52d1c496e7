"""A real S3 HTTP server for tests: moto's server mode on 127.0.0.1 (any free port), emptied on start."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """Start the server, yield its endpoint URL, stop it. Moto keeps its buckets in process-wide state, shared
    by every server started in this process, so the server is reset to empty before it is handed out."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                               timeout=10).close()
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def moto_s3_with_test_credentials(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`moto_s3` with the tests' credentials only in the environment (LT_TEST_S3_KEY/SECRET, which specs name as
    `${...}`), and none of AWS's own variables that could leak in from the host."""
    monkeypatch.setenv("LT_TEST_S3_KEY", "testing-key")
    monkeypatch.setenv("LT_TEST_S3_SECRET", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    with moto_s3() as endpoint:
        yield endpoint
