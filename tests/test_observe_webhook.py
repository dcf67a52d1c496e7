"""Alert webhook: POST JSON to a local HTTP server, with the bearer token, retries, and no blocking."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from leantrain.errors import UserInputError
from leantrain.observe.alerts import engine_from_spec
from leantrain.observe.webhook import WebhookSender
from leantrain.spec.schema import MonitoringSpec


class Receiver:
    """A local HTTP server that fails the first `num_failures` requests with 503, then accepts."""

    def __init__(self, num_failures: int = 0) -> None:
        self.received: list[tuple[dict[str, Any], str | None]] = []
        self.num_requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.num_requests += 1
                if receiver.num_requests <= num_failures:
                    self.send_response(503)
                else:
                    receiver.received.append((json.loads(body), self.headers.get("Authorization")))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count:
            assert time.monotonic() < deadline, f"got {len(self.received)} of {count} posts"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver(num_failures=2)
    yield server
    server.close()


def test_posts_with_token_and_retries(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALERT_URL", receiver.url)
    monkeypatch.setenv("ALERT_TOKEN", "s3cret-token")
    sender = WebhookSender.from_monitoring(MonitoringSpec(webhook_url_env="ALERT_URL", webhook_token="${ALERT_TOKEN}"))
    assert sender is not None
    sender.backoff_s = 0.01
    sender.send({"rule": "hang", "severity": "critical", "message": "no step for 700 s"})
    receiver.wait_for(1)
    sender.close()
    payload, auth = receiver.received[0]
    assert payload["rule"] == "hang" and auth == "Bearer s3cret-token"
    assert receiver.num_requests == 3 and sender.num_sent == 1 and sender.num_failed == 0


def test_send_never_blocks_when_the_receiver_is_down() -> None:
    sender = WebhookSender("http://127.0.0.1:9/unreachable", max_attempts=2, backoff_s=0.01, timeout_s=0.5)
    start = time.perf_counter()
    for i in range(50):
        sender.send({"rule": "loss_spike", "n": i})
    assert time.perf_counter() - start < 0.5
    sender.close(timeout_s=0.1)


def test_config_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_URL", raising=False)
    assert WebhookSender.from_monitoring(MonitoringSpec()) is None
    with pytest.raises(UserInputError, match="NO_SUCH_URL"):
        WebhookSender.from_monitoring(MonitoringSpec(webhook_url_env="NO_SUCH_URL"))
    with pytest.raises(UserInputError, match="http"):
        WebhookSender("ftp://example/hook")


def test_engine_from_spec_delivers_alerts_to_file_and_webhook(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ALERT_URL", receiver.url)

    from leantrain.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml",
                     overrides=["monitoring.webhook_url_env=ALERT_URL"])
    engine = engine_from_spec(spec, run_dir=tmp_path, watchdog=False)
    for step in range(1, 7):
        engine.write({"step": step, "loss": 3.0 - 0.01 * step, "grad_norm": 1.0})
    engine.write({"step": 7, "loss": float("inf"), "grad_norm": 1.0})
    receiver.wait_for(1, timeout_s=30)
    engine.close()
    assert receiver.received[0][0]["rule"] == "nonfinite_loss"
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["rule"] == "nonfinite_loss"


def test_a_url_that_cannot_be_posted_to_is_said_once_and_the_sender_lives_on(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(UserInputError, match="80x"):
        WebhookSender("http://hooks.example:80x/alert")  # caught at start: a port that is not a number
    sender = WebhookSender("http://127.0.0.1:9/a b", backoff_s=0.01)  # http.client refuses the space: InvalidURL
    for i in range(3):
        sender.send({"rule": "hang", "n": i})
    sender.close(timeout_s=10)
    assert sender.num_failed == 3 and "InvalidURL" in (sender.unusable or "")
    assert [r.levelname for r in caplog.records if "cannot be posted to" in r.getMessage()] == ["ERROR"]


def test_retries_back_off_between_attempts_only() -> None:
    class Stop:
        def __init__(self) -> None:
            self.waits: list[float] = []
            self.stopped = False

        def wait(self, seconds: float) -> bool:
            self.waits.append(seconds)
            return False

        def is_set(self) -> bool:
            return self.stopped

        def set(self) -> None:
            self.stopped = True

    sender = WebhookSender("http://127.0.0.1:9/unreachable", max_attempts=4, backoff_s=0.5, timeout_s=2)
    stop = Stop()
    sender._stop = stop  # type: ignore[assignment]
    assert sender._post({"rule": "hang"}) is False
    assert stop.waits == [0.5, 1.0, 2.0]  # after attempts 1-3; none after the 4th
    sender.close(timeout_s=5)
