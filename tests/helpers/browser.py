"""A real headless browser (Debian's ``chromium``) driven over the Chrome DevTools Protocol.

One browser process per test module (start-up is the cost); each test opens its own tab
over its own DevTools websocket, in its own event loop. Missing ``chromium`` fails the
test: scripts/test installs it.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import itertools
import json
import os
import shutil
import struct
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

_READY_PREFIX = "DevTools listening on "


@dataclass
class Browser:
    process: subprocess.Popen[str]
    ws_url: str
    """The browser target's DevTools websocket."""
    log: collections.deque[str]
    """chromium's last stderr lines, for failure messages."""
    drain: threading.Thread

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.drain.join(timeout=10)  # EOF once every chromium process has gone
        if self.process.stderr is not None:
            self.process.stderr.close()


def launch(profile: Path) -> Browser:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is missing: scripts/test installs Debian's chromium package (apt-get install chromium)"
    argv = [
        binary,
        "--headless",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--no-proxy-server",  # the page is on loopback; never through the environment's proxy
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--mute-audio",
        "about:blank",
    ]
    if os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # chromium refuses root with its sandbox (CI containers)
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    log: collections.deque[str] = collections.deque(maxlen=40)
    # A browser that never says where it listens is killed, which ends the readline below.
    watchdog = threading.Timer(30.0, process.kill)
    watchdog.start()
    try:
        for line in process.stderr:
            log.append(line.rstrip())
            if line.startswith(_READY_PREFIX):
                ws_url = line[len(_READY_PREFIX) :].strip()
                break
        else:
            process.wait(timeout=10)
            raise AssertionError("chromium exited before listening:\n" + "\n".join(log))
    finally:
        watchdog.cancel()
    stderr = process.stderr

    def drain() -> None:  # keep its stderr pipe from filling (and blocking it)
        for line in stderr:
            log.append(line.rstrip())

    drainer = threading.Thread(target=drain, name="chromium-stderr", daemon=True)
    drainer.start()
    return Browser(process, ws_url, log, drainer)


class CdpError(Exception):
    pass


@dataclass
class Tab:
    """One page of the browser, attached in flat mode over one websocket."""

    ws: aiohttp.ClientWebSocketResponse
    session: str
    pending: dict[int, asyncio.Future[Any]]
    ids: itertools.count[int]
    problems: list[str] = field(default_factory=list)
    """Console errors, uncaught exceptions, CSP violations, failed loads seen by the page."""
    loads: asyncio.Queue[None] = field(default_factory=asyncio.Queue)

    async def send(self, method: str, **params: Any) -> Any:
        return await _call(self.ws, self.pending, self.ids, method, params, self.session)

    async def goto(self, url: str) -> None:
        while not self.loads.empty():
            self.loads.get_nowait()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise CdpError(f"{url}: {result['errorText']}")
        async with asyncio.timeout(10):
            await self.loads.get()

    async def evaluate(self, expression: str, timeout: float = 10.0) -> Any:
        """Run ``expression`` in the page (awaiting it if it is a promise); its value as JSON."""
        async with asyncio.timeout(timeout):
            result = await self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    async def viewport(self, width: int, height: int, *, mobile: bool = False, scale: float = 1.0) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=scale, mobile=mobile
        )

    async def screenshot(self) -> bytes:
        result = await self.send("Page.captureScreenshot", format="png")
        return base64.b64decode(result["data"])

    async def type_text(self, text: str) -> None:
        """Type into the focused element, then press Enter (a form's implicit submission)."""
        await self.send("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            await self.send(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
                **({"text": "\r"} if kind == "keyDown" else {}),
            )


async def _call(
    ws: aiohttp.ClientWebSocketResponse,
    pending: dict[int, asyncio.Future[Any]],
    ids: itertools.count[int],
    method: str,
    params: dict[str, Any],
    session: str | None = None,
) -> Any:
    msg_id = next(ids)
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    pending[msg_id] = fut
    message: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
    if session is not None:
        message["sessionId"] = session
    await ws.send_str(json.dumps(message))
    async with asyncio.timeout(15):
        return await fut


@asynccontextmanager
async def open_tab(browser: Browser) -> AsyncIterator[Tab]:
    """A fresh tab (its own browser context: no storage shared with other tests)."""
    pending: dict[int, asyncio.Future[Any]] = {}
    ids = itertools.count(1)
    tab: Tab | None = None
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(browser.ws_url, max_msg_size=0, autoping=True) as ws,
    ):

        async def read() -> None:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                data = json.loads(msg.data)
                if "id" in data:
                    fut = pending.pop(data["id"], None)
                    if fut is not None and not fut.done():
                        if "error" in data:
                            fut.set_exception(CdpError(f"{data['error']}"))
                        else:
                            fut.set_result(data.get("result", {}))
                elif tab is not None and data.get("sessionId") == tab.session:
                    _on_event(tab, data["method"], data.get("params", {}))
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(CdpError("the DevTools connection closed:\n" + "\n".join(browser.log)))

        async def browser_call(method: str, **params: Any) -> Any:
            return await _call(ws, pending, ids, method, params)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            context = (await browser_call("Target.createBrowserContext"))["browserContextId"]
            created = await browser_call("Target.createTarget", url="about:blank", browserContextId=context)
            session = (await browser_call("Target.attachToTarget", targetId=created["targetId"], flatten=True))[
                "sessionId"
            ]
            tab = Tab(ws, session, pending, ids)
            for domain in ("Page", "Runtime", "Log"):
                await tab.send(f"{domain}.enable")
            yield tab
            await browser_call("Target.disposeBrowserContext", browserContextId=context)  # closes its tab
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


def _on_event(tab: Tab, method: str, params: dict[str, Any]) -> None:
    if method == "Page.loadEventFired":
        tab.loads.put_nowait(None)
    elif method == "Runtime.exceptionThrown":
        details = params["exceptionDetails"]
        tab.problems.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
    elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
        tab.problems.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
    elif method == "Log.entryAdded" and params["entry"].get("level") in ("error", "warning"):
        entry = params["entry"]
        tab.problems.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())


# -- PNG -------------------------------------------------------------------------------------------


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's header (and proof that it is one)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]
    length, kind = struct.unpack(">I4s", png[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", png[16:24])
    return width, height
