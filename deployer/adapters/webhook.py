"""Decision notifications over HTTP webhooks, delivered off the controller's loop.

``send`` only puts one delivery per URL on a bounded queue (a full queue drops it and counts
``dropped``); one background thread POSTs them in order, each with a timeout and retries with
doubling backoff (deployer/notify.py says which failures are retried). A receiver that hangs
or fails therefore delays other notices, never a tick.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from deployer import notify
from deployer.notify import Format, Notice

log = logging.getLogger("rtrl.deployer.notify")

SENT, FAILED, DROPPED = "sent", "failed", "dropped"


def post(url: str, data: bytes, headers: dict[str, str], timeout_s: float) -> int | None:
    """POST ``data``; the HTTP status, or None when no answer came (refused, timed out)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a webhook URL must be http(s), not {_host(url)}")
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")  # noqa: S310 (checked above)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (checked above)
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


class WebhookNotifier:
    """:class:`deployer.notify.NotifyPort` posting to ``urls``; ``count(result)`` is called
    once per delivery and URL with sent | failed | dropped."""

    def __init__(
        self, urls: Sequence[str], fmt: Format = "json", secret: bytes | None = None,
        timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 1.0, queue_size: int = 100,
        count: Callable[[str], None] = lambda result: None,
        poster: Callable[[str, bytes, dict[str, str], float], int | None] = post,
    ) -> None:
        self.urls, self.fmt, self.secret = tuple(urls), fmt, secret
        self.timeout_s, self.retries, self.backoff = timeout_s, retries, backoff_s
        self.count, self.poster = count, poster
        self.queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the port
    def send(self, notice: Notice) -> None:
        data = notify.body(notice, self.fmt)
        self._start()
        for url in self.urls:
            try:
                self.queue.put_nowait((url, data))
            except queue.Full:
                self.count(DROPPED)
                log.warning("notification queue full: %s to %s dropped", notice.canary_id, _host(url))

    # ------------------------------------------------------------------ delivery
    def headers(self, data: bytes) -> dict[str, str]:
        out = {"Content-Type": "application/json", "User-Agent": "rtrl-deployer"}
        if self.secret:
            out[notify.SIGNATURE_HEADER] = notify.signature(self.secret, data)
        return out

    def deliver(self, url: str, data: bytes) -> bool:
        """One delivery with its retries; True when a 2xx answered."""
        attempt = 0
        while True:
            status = self.poster(url, data, self.headers(data), self.timeout_s)
            if status is not None and 200 <= status < 300:
                self.count(SENT)
                return True
            attempt += 1
            if attempt > self.retries or not notify.retryable(status) or self._stop.is_set():
                self.count(FAILED)
                log.warning("notification to %s failed after %d attempt(s): %s", _host(url), attempt,
                            f"HTTP {status}" if status is not None else "no answer")
                return False
            self._stop.wait(notify.backoff_s(attempt, self.backoff))

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self.deliver(*item)
            except Exception:  # a bug here must not kill the thread silently
                log.exception("notification delivery crashed")
                self.count(FAILED)
            finally:
                self.queue.task_done()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rtrl-notify", daemon=True)
                self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued within ``timeout_s`` (retries then stop waiting), then stop."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # a later send starts a fresh sender
            self._thread = None
            self._stop = threading.Event()


def _host(url: str) -> str:
    """A URL's scheme and host only: webhook URLs often carry their secret in the path."""
    parts = url.split("/")
    return "/".join(parts[:3]) if len(parts) >= 3 else "?"
