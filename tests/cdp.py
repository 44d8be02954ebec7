"""Headless Chromium driven over its DevTools pipe (``--remote-debugging-pipe``): load a page, wait until
its web fonts are in (``document.fonts.ready``), evaluate, take a screenshot. ``--screenshot`` alone may
capture a page before a web font is decoded, and ``--virtual-time-budget`` can fail font loads on a busy
machine; this waits for what the page itself says is ready."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path


class Browser:
    def __init__(self, chromium: str, profile: Path, env: dict | None = None, width: int = 1280, height: int = 2000):
        cmd_r, cmd_w = os.pipe()  # we write commands, Chromium reads them on fd 3
        out_r, out_w = os.pipe()  # Chromium writes replies and events on fd 4

        def fds():
            os.dup2(cmd_r, 3)
            os.dup2(out_w, 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4, cmd_r, out_w), preexec_fn=fds, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._w, self._r = os.fdopen(cmd_w, "wb", buffering=0), os.fdopen(out_r, "rb", buffering=0)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = self._r.read(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, **params):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        self._w.write(json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read())

    def evaluate(self, expression: str):
        """The value of `expression` (a promise is awaited)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path, clip: list[float] | None = None) -> Path:
        params: dict = {"format": "png", "captureBeyondViewport": True}
        if clip:
            left, top, right, bottom = clip
            params["clip"] = {"x": left, "y": top, "width": right - left, "height": bottom - top, "scale": 1}
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", session=True, **params)["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
