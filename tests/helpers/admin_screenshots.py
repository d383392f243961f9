"""Screenshots of the live page for the docs: ``docs/admin-page.png`` (a desktop browser,
1280 wide) and ``docs/admin-page-phone.png`` (a phone, 390 wide).

Three vendors behind an in-process proxy on a clock moved by hand, so five minutes of traffic
take seconds and the page shows the proxy's own five-minute history at once: ``search``
(a tenant over its own limit, a vendor 429 that blocks it for 20 s), ``payments`` (holds,
a surge deferred by its global quota, two limits of which the slower binds in the long
run) and ``llm`` (sheds; the vendor's remaining quota falls below ``low_watermark``: a drain).

Rerun (needs Debian's ``chromium``)::

    .venv/bin/python -m tests.helpers.admin_screenshots            # writes docs/*.png
    .venv/bin/python -m tests.helpers.admin_screenshots --out /tmp # elsewhere
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from proxy.app import Runtime
from proxy.clock import ManualClock
from proxy.devtools.mockvendor import MockVendor
from proxy.ops.admin import sample_gauges
from proxy.policy.loader import parse_policy
from proxy.server import ProxyServer
from tests.helpers.browser import Browser, launch, open_tab

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 300
STEPS = 5
"""Steps per simulated second: the requests of a second are spread over them."""

POLICY = """
version: 1
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
access_log: false
store: {{url: "memory://"}}
vendors:
  - name: search
    hosts: [api.search.example]
    route: /search
    upstream: {search}
    limits: [{{rate: 8, per: 1s, burst: 8}}]
    tenant_limits:
      overrides:
        crawler: [{{rate: 1, per: 1s, burst: 2}}]
    on_limit: {{action: defer}}
  - name: payments
    hosts: [api.payments.example]
    route: /payments
    upstream: {payments}
    limits: [{{rate: 20, per: 1s, burst: 10}}, {{rate: 900, per: 1m}}]
    on_limit: {{action: hold, max_hold: 1s}}
  - name: llm
    hosts: [api.llm.example]
    route: /llm
    upstream: {llm}
    limits: [{{rate: 90, per: 1m, burst: 6}}]
    concurrency: 4
    feedback: {{low_watermark: 5}}
    on_limit: {{action: shed}}
"""


def payments_rate(ago: int) -> int:
    """Requests a second: 12, with a surge to 26 between 170 and 110 s ago, 18 at the end."""
    if 110 <= ago < 170:
        return 26
    return 18 if ago < 25 else 12


def search_rate(ago: int) -> tuple[int, int]:
    """(requests of tenant acme, of crawler) a second."""
    return (4 if ago % 3 else 3), (3 if ago < 200 else 1)


def llm_rate(ago: int) -> tuple[int, int]:
    """(alice, bob) a second."""
    return (1, 1 if ago % 2 else 0) if ago >= 30 else (2, 1)


async def serve(mock: MockVendor) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(mock.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def traffic(proxy: ProxyServer, clock: ManualClock, mocks: dict[str, MockVendor]) -> None:
    """Five minutes of it, the clock moved by hand, the requests of each second spread over it."""
    pending: set[asyncio.Task[int]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def get(path: str, tenant: str) -> int:
            async with session.get(f"{proxy.url}{path}", headers={"X-Tenant-Id": tenant}) as r:
                await r.read()
                return r.status

        for ago in range(SECONDS, 0, -1):
            if ago == 40:
                mocks["search"].script(status=429, retry_after="20")  # the next search request
            if ago == 50:
                mocks["llm"].script(status=200, remaining=2)  # below low_watermark: a drain
            acme, crawler = search_rate(ago)
            alice, bob = llm_rate(ago)
            calls: list[tuple[str, str]] = [("/payments/v1/charges", "shop")] * payments_rate(ago)
            calls += [("/search/v1/q", "acme")] * acme + [("/search/v1/q", "crawler")] * crawler
            calls += [("/llm/v1/complete", "alice")] * alice + [("/llm/v1/complete", "bob")] * bob
            for step in range(STEPS):
                for path, tenant in calls[step::STEPS]:
                    task = asyncio.ensure_future(get(path, tenant))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await asyncio.sleep(0.01)  # let them reach the vendor (or a hold)
                await clock.advance(1 / STEPS)
            sample_gauges(proxy.runtime.deps)  # (the admin side reads them each real second)
        await clock.advance(0.5)
        await asyncio.sleep(0.05)
        for task in list(pending):  # still held: let them go
            task.cancel()


async def shoot(out: Path) -> None:
    clock = ManualClock()
    mocks = {name: MockVendor(rate=None) for name in ("search", "payments", "llm")}
    served = [await serve(mock) for mock in mocks.values()]
    urls = dict(zip(mocks, (url for _, url in served), strict=True))
    policy = parse_policy(POLICY.format(**urls), "screenshot-policy.yaml", base_dir=ROOT)
    proxy = ProxyServer(Runtime(policy, clock=clock), policy.listen, policy.admin_listen)
    await proxy.start()
    try:
        await traffic(proxy, clock, mocks)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:
            browser = launch(Path(profile))
            try:
                url = f"{proxy.admin_url}/?every=60"  # (the clock stands still: nothing to follow)
                await page(browser, url, out / "admin-page.png", 1280, FIRST_ROW, 1.0, False)
                await page(browser, url, out / "admin-page-phone.png", 390, "1500", 2.0, True)
            finally:
                browser.close()
    finally:
        await proxy.stop()
        for runner, _ in served:
            await runner.cleanup()


FIRST_ROW = """Math.ceil(Math.max(...[...document.querySelectorAll("[data-vendor]")].slice(0, 2)
  .map((card) => card.getBoundingClientRect().bottom))) + 12"""
"""The desktop shot's height: down to the first row of vendor cards (two side by side)."""


async def page(browser: Browser, url: str, path: Path, width: int, height: str, scale: float, mobile: bool) -> None:
    """A screenshot of the page at ``width`` CSS pixels, ``height`` (a JS expression) high."""
    async with open_tab(browser) as tab:
        await tab.viewport(width, 900, mobile=mobile, scale=scale)
        await tab.goto(url)
        await tab.evaluate(_rendered())
        await tab.viewport(width, int(await tab.evaluate(height)), mobile=mobile, scale=scale)
        await tab.evaluate("new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
        path.write_bytes(await tab.screenshot())
        assert tab.problems == [], tab.problems
        print(f"wrote {path} ({width} wide)")


def _rendered() -> str:
    return """new Promise((resolve) => {
      const ok = () => document.documentElement.dataset.state === "live";
      if (ok()) return resolve(true);
      document.addEventListener("qp-render", () => ok() && resolve(true));
    })"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="directory for the two PNGs (default: docs/)")
    args = parser.parse_args(argv)
    asyncio.run(shoot(args.out))


if __name__ == "__main__":
    main()
