"""A real S3 HTTP server for tests: moto's server mode on 127.0.0.1 (any free port), emptied on start."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator


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
