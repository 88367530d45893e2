"""Headless Chromium driven over the DevTools protocol on a pipe (no extra packages).

``--remote-debugging-pipe`` makes Chromium read NUL-terminated JSON commands from fd 3
and write replies and events to fd 4; a reader thread collects the replies. Every call
waits a bounded time, and :meth:`Browser.close` always ends the process it started.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

# Debian's chromium (scripts/test.sh installs it where it is missing and it may).
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")


class CDPError(RuntimeError):
    """Chromium answered a command with an error, or did not answer in time."""


class Browser:
    """``with Browser() as b: b.navigate(url); b.evaluate("1 + 1")``."""

    def __init__(self, width: int = 1200, height: int = 900, timeout_s: float = 20.0) -> None:
        self._timeout = timeout_s
        # Chromium's helper processes can still write the profile for a moment after the
        # browser process exits; close() retries, and never fails a test on leftover files.
        self._profile = tempfile.TemporaryDirectory(prefix="mesh-chromium-",
                                                    ignore_cleanup_errors=True)
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Copies above 10, so moving them onto fds 3 and 4 in the child cannot clobber one.
        high_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        high_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
        os.close(to_child_r)
        os.close(from_child_w)

        def onto_3_and_4() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        argv = [
            str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--remote-debugging-pipe",
            f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, pass_fds=(3, 4), preexec_fn=onto_3_and_4,
        )
        os.close(high_r)
        os.close(high_w)
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = ""
        try:
            targets = self.call("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            self.session = self.call(
                "Target.attachToTarget", targetId=page["targetId"], flatten=True
            )["sessionId"]
            self.call("Page.enable", session=True)
            self.call("Runtime.enable", session=True)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        box = self._replies.get(msg["id"])
                    if box is not None:
                        box.put(msg)

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply's ``result``."""
        cid = next(self._ids)
        box: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._replies[cid] = box
        msg: dict[str, Any] = {"id": cid, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        try:
            reply = box.get(timeout=self._timeout)
        except queue.Empty:
            raise CDPError(f"{method}: no reply within {self._timeout:g} s") from None
        finally:
            with self._lock:
                self._replies.pop(cid, None)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (promises awaited)."""
        r = self.call(
            "Runtime.evaluate", session=True, expression=expression,
            returnByValue=True, awaitPromise=True,
        )
        if "exceptionDetails" in r:
            raise CDPError(f"page threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except CDPError:
                value = None  # the page may be navigating
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"page never satisfied {expression!r} in {timeout_s:g} s")
            time.sleep(0.1)

    def screenshot(self, path: Path, width: int, height: int) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride", session=True,
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        for _ in range(20):  # helper processes may still be writing the profile
            shutil.rmtree(self._profile.name, ignore_errors=True)
            if not os.path.exists(self._profile.name):
                break
            time.sleep(0.1)
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
