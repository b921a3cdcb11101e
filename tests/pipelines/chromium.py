"""Headless Chromium driven over the DevTools protocol (CDP), for tests that look at the Dagster UI.

`chromium --screenshot` renders a page after a fixed time budget and cannot click; the UI's metadata plots sit
behind a "Plots" toggle. This drives one browser over its DevTools websocket (`websockets`, already installed
with the project's lock): navigate, wait until the page shows given texts, click an element by its text,
read the page's text, capture a PNG. The browser listens on 127.0.0.1 only (Chromium's default debugging
address) and is stopped by its process id.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

LISTENING = re.compile(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)")


class Browser:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(self, executable: str, *, width: int = 1600, height: int = 1000) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="rlake-chromium-")
        self.proc = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile.name}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        port = self._port(deadline=time.time() + 60)
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(p for p in pages if p["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=30)
        self._id = 0
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _port(self, deadline: float) -> int:
        seen = []
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            found = LISTENING.search(line)
            if found:
                return int(found.group(2))
        self.close()
        raise RuntimeError(f"chromium did not open its DevTools port: {''.join(seen)[-2000:]}")

    def call(self, method: str, **params) -> dict:
        """One CDP command; returns its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=120))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str, *, wait_for: tuple[str, ...] = (), timeout_s: float = 90) -> str:
        """Navigate to `url` and wait until its text shows every string of `wait_for` and no "Loading";
        returns the text."""
        self.call("Page.navigate", url=url)
        return self.wait_for(wait_for, timeout_s=timeout_s)

    def wait_for(self, texts: tuple[str, ...], *, absent: tuple[str, ...] = ("Loading",), timeout_s: float = 90) -> str:
        deadline, text = time.time() + timeout_s, ""
        while time.time() < deadline:
            text = self.text()
            if all(t in text for t in texts) and not any(t in text for t in absent):
                time.sleep(1.0)  # let charts and fonts finish drawing
                return self.text()
            time.sleep(0.5)
        missing = [t for t in texts if t not in text]
        raise AssertionError(f"the page never showed {missing} without {absent}; it shows: {text[:1500]!r}")

    def click(self, label: str) -> None:
        """Click the first button or link whose visible text is exactly `label`."""
        clicked = self.evaluate(
            "(() => { const els = [...document.querySelectorAll('button, a, [role=button], [role=tab]')];"
            f" const el = els.find(e => e.innerText && e.innerText.trim() === {json.dumps(label)});"
            " if (!el) return false; el.click(); return true; })()"
        )
        if not clicked:
            raise AssertionError(f"no button or link labelled {label!r} on the page")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        self.profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
