"""Alert delivery by HTTP POST (JSON) from a background thread: retries, bounded queue, never blocks training.

The URL comes from the environment variable that `monitoring.webhook_url_env` names, the bearer token
from `monitoring.webhook_token` (a `${VAR}` reference resolved at the moment of use), so neither sits in
the spec, a log or the run dir. The standard library's urllib is enough for one POST: no new dependency.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from leantrain.errors import UserInputError
from leantrain.spec import resolve_secret

log = logging.getLogger("leantrain.observe")


class WebhookSender:
    """Queue alert payloads and POST them on a daemon thread; `send` returns at once, whatever the network."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_attempts: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        max_queue: int = 1000,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserInputError(f"alert webhook URL must start with http:// or https:// (got {url[:40]!r})")
        try:
            urllib.parse.urlsplit(url).port  # noqa: B018 - a port that is not a number raises here, not in the thread
        except ValueError as err:
            raise UserInputError(f"alert webhook URL {url[:40]!r} is not a URL: {err}") from None
        self.url = url
        self._token = token
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self.num_sent = 0
        self.num_failed = 0
        self.num_dropped = 0
        self.unusable: str | None = None  # why the URL cannot be posted to (said once); later alerts are dropped
        self._thread = threading.Thread(target=self._loop, name="leantrain-webhook", daemon=True)
        self._thread.start()

    @classmethod
    def from_monitoring(cls, monitoring: Any) -> WebhookSender | None:
        """A sender when `monitoring.webhook_url_env` names a set variable; None when no webhook is configured."""
        if not monitoring.webhook_url_env:
            return None
        url = os.environ.get(monitoring.webhook_url_env)
        if not url:
            raise UserInputError(
                f"monitoring.webhook_url_env: environment variable {monitoring.webhook_url_env} is not set"
            )
        return cls(url, token=resolve_secret(monitoring.webhook_token))

    def send(self, payload: dict[str, Any]) -> None:
        """Queue one payload; when the queue is full the oldest is dropped, so training never waits."""
        while True:
            try:
                self._queue.put_nowait(payload)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.num_dropped += 1
                except queue.Empty:
                    pass

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Deliver what is queued (up to timeout_s), then stop the thread."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                payload = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if payload is None:
                return
            if self._post(payload):
                self.num_sent += 1
            else:
                self.num_failed += 1

    def _post(self, payload: dict[str, Any]) -> bool:
        body = json.dumps(payload, default=str).encode("utf-8")
        headers = {"Content-Type": "application/json", "User-Agent": "leantrain-alerts"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        for attempt in range(self.max_attempts):
            if self.unusable is not None:
                return False
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    if 200 <= response.status < 300:
                        return True
            except urllib.error.HTTPError as err:
                if 400 <= err.code < 500 and err.code not in (408, 429):
                    return False  # the receiver refuses this payload; retrying will not change that
            except (ValueError, http.client.InvalidURL) as err:  # a URL urllib cannot post to: no retry will help
                self.unusable = f"{type(err).__name__}: {err}"
                log.error("alert webhook %s cannot be posted to (%s); alerts are not delivered to it",
                          self.url[:40], self.unusable)
                return False
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            # Exponential back-off (0.5, 1, 2 s) between attempts, none after the last; waiting on the stop event
            # lets close() cut it short.
            if attempt + 1 == self.max_attempts or self._stop.wait(self.backoff_s * 2**attempt):
                return False
        return False
