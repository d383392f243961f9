"""The live page at the admin port's ``/`` (SPEC §11), in a real headless chromium.

The proxy runs on a ManualClock, so ``/status`` holds still while the browser reads the
page: the numbers the page shows are compared with ``/status``'s exactly (the raw value
each number element carries in ``data-value``, and the text a person reads). One browser
for the module; each test opens its own tab (its own browser context: no shared storage).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import matplotlib.image
import pytest
from aiohttp import web

from proxy.clock import ManualClock
from proxy.ops.admin import PAGE_CSP, PAGE_FILES, add_page_routes
from proxy.policy.model import Share
from proxy.server import ProxyServer
from tests.conftest import Vendor, eventually, make_policy
from tests.helpers.browser import Browser, launch, open_tab, png_size

PAGE_DIR = Path(__file__).resolve().parents[1] / "proxy" / "ops" / "admin_page"
TOKEN = "page-test-admin-token"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    started = launch(tmp_path_factory.mktemp("chromium-profile"))
    yield started
    started.close()


def two_vendors(upstream: str, extra_top: str = "") -> Any:
    """payments holds (6 a minute, burst 4: the fifth request waits 10 s), search defers (its
    2/1s bucket binds now, its 60/1m one in the long run)."""
    return make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store: {url: "memory://", timeout: 250ms}
        $extra_top
        vendors:
          - name: payments
            hosts: [api.payments.example, payments-eu-west-1.internal.example.com]
            route: /payments
            upstream: $upstream
            limits: [{rate: 6, per: 1m, burst: 4}, {rate: 600000, per: 1h}]
            on_limit: {action: hold, max_hold: 60s}
          - name: search
            hosts: [api.search.example]
            route: /search
            upstream: $upstream
            limits: [{rate: 2, per: 1s, burst: 3}, {rate: 60, per: 1m}]
            on_limit: {action: defer}
        """,
        upstream=upstream,
        extra_top=extra_top,
    )


class Scenario:
    """Traffic at a frozen instant: forwarded, held (still waiting), shed by the vendor's
    quota (tenant acme), a vendor 429, deferred by the block it caused (tenant crawler)."""

    def __init__(self, proxy: ProxyServer, vendor: Vendor, clock: ManualClock, token: str | None = None) -> None:
        self.proxy, self.vendor, self.clock = proxy, vendor, clock
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession()
        self.held: list[asyncio.Future[int]] = []

    async def get(self, path: str, **headers: str) -> int:
        async with self.session.get(f"{self.proxy.url}{path}", headers=headers) as r:
            await r.read()
            return r.status

    async def status(self, path: str = "/status") -> Any:
        async with self.session.get(f"{self.proxy.admin_url}{path}", headers=self.headers) as r:
            assert r.status == 200
            return await r.json()

    async def run(self) -> None:
        for _ in range(4):
            assert await self.get("/payments/v1/charges") == 200
        self.held = [asyncio.ensure_future(self.get("/payments/v1/charges")) for _ in range(2)]
        deps = self.proxy.runtime.deps
        await eventually(lambda: deps.held.get("payments") == 2, "two payments requests held")
        shed = {"X-Tenant-Id": "acme", "X-Quota-On-Limit": "shed"}
        assert await self.get("/payments/v1/charges", **shed) == 503  # the quota is spent: shed
        self.vendor.mock.script(status=429, retry_after="30")
        assert await self.get("/search/v1/q") == 429  # the vendor's own 429: search is blocked for 30 s
        for _ in range(2):
            assert await self.get("/search/v1/q", **{"X-Tenant-Id": "crawler"}) == 429  # deferred: the block
        # One second on: the rates (over complete seconds) count what just happened; the holds
        # (10 s, 20 s) and the block (30 s) go on.
        await self.clock.advance(1.0)

    async def close(self) -> None:
        await self.clock.advance(60.0)  # the held requests leave
        assert [await h for h in self.held] == [200, 200]
        await self.session.close()


@pytest.fixture
async def scenario(vendor: Vendor, start_proxy: Any) -> AsyncIterator[Scenario]:
    clock = ManualClock()
    proxy = await start_proxy(two_vendors(vendor.url), clock=clock)
    traffic = Scenario(proxy, vendor, clock)
    await traffic.run()
    yield traffic
    await traffic.close()


# -- what the page shows, read from the DOM ----------------------------------------------------

READ_PAGE = """(() => {
  const root = document.documentElement;
  const visible = (e) => {
    const b = e.getBoundingClientRect();
    return b.width > 0 && b.height > 0 && b.left >= 0 && b.right <= innerWidth + 0.5
      && getComputedStyle(e).visibility === "visible";
  };
  const texts = (node, selector) => [...node.querySelectorAll(selector)].map((e) => e.textContent);
  const out = {state: root.dataset.state, renders: Number(root.dataset.renders || 0),
               scrollWidth: root.scrollWidth, innerWidth: innerWidth, vendors: {},
               tokenForm: visible(document.getElementById("token-form")),
               tokenProblem: document.getElementById("token-problem").textContent,
               breaker: document.getElementById("store-breaker").textContent,
               breakerLabel: document.getElementById("store-breaker").previousElementSibling.textContent};
  for (const card of document.querySelectorAll("[data-vendor]")) {
    const box = card.getBoundingClientRect();
    const fields = {};
    for (const f of card.querySelectorAll("[data-field]")) {
      (fields[f.dataset.field] ||= []).push({value: f.dataset.value ?? null, text: f.textContent, visible: visible(f),
                                             lines: f.getClientRects().length});
    }
    const charts = {};
    for (const plot of card.querySelectorAll("[data-chart]")) {
      const series = {};
      for (const line of plot.querySelectorAll("polyline[data-series]")) {
        series[line.dataset.series] = {points: line.getAttribute("points").trim().split(/\\s+/).length,
                                       max: Number(line.dataset.max)};
      }
      const axes = {};
      for (const t of plot.querySelectorAll(".axis-title")) axes[t.dataset.axis] = t.textContent;
      charts[plot.dataset.chart] = {
        series, axes, ticks: texts(plot, "text.tick"), ref: !!plot.querySelector("line.ref"),
        legend: texts(plot.parentElement, "ul.legend li"), visible: visible(plot.querySelector("svg")),
        events: [...plot.querySelectorAll("g.event")].map((g) => ({kinds: g.dataset.kind, text: g.textContent}))};
    }
    const buckets = [...card.querySelectorAll("ul.buckets li")].map(
      (li) => ({bucket: li.dataset.bucket, binds: li.dataset.binds, text: li.textContent}));
    const binds = {};
    for (const b of card.querySelectorAll("[data-field^=binds_]")) {
      binds[b.dataset.field] = {bucket: b.dataset.bucket, text: b.textContent};
    }
    const reasons = {};
    for (const row of card.querySelectorAll("tr[data-reason]")) {
      reasons[row.dataset.reason] = {text: row.cells[0].textContent, deferred: Number(row.cells[1].textContent),
                                     shed: Number(row.cells[2].textContent)};
    }
    const tenants = [...card.querySelectorAll("li[data-tenant]")].map(
      (li) => ({tenant: li.dataset.tenant, text: li.textContent}));
    const events = [...card.querySelectorAll("ul.events li")].map(
      (li) => ({kinds: li.dataset.event, text: li.textContent}));
    const generic = {};
    for (const g of card.querySelectorAll(".generic")) generic[g.dataset.kind] = g.innerText;
    out.vendors[card.dataset.vendor] = {left: box.left, top: box.top, right: box.right, fields, charts, buckets, binds,
                                        reasons, tenants, events, generic};
  }
  return out;
})()"""


def rendered_when(condition: str) -> str:
    """A promise resolving (to the page as READ_PAGE reads it) at the first render, the one
    already done included, after which ``condition`` (a JS expression) holds."""
    return f"""new Promise((resolve) => {{
      const ok = () => document.documentElement.dataset.renders && ({condition});
      const done = () => resolve({READ_PAGE});
      if (ok()) return done();
      document.addEventListener("qp-render", function seen() {{
        if (ok()) {{ document.removeEventListener("qp-render", seen); done(); }}
      }});
    }})"""


def shown(x: float | None) -> str:
    """The page's number format (ui.js ``fmt``): integers whole, else 2, 1 or 0 decimals."""
    if x is None:
        return "—"
    if float(x).is_integer():
        return str(int(x))
    digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    text = f"{x:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def expected(vendor: dict[str, Any]) -> dict[str, float | None]:
    """What each vendor card must show, straight from its /status entry."""
    recent = vendor["recent"]
    tightest = min(vendor["buckets"], key=lambda b: b["tokens"])
    out: dict[str, float | None] = {
        "rate": recent["forwarded_per_second"],
        "quota": vendor["sizing"]["configured_rate_per_second"],
        "tokens": vendor["tokens_available"],
        "burst": tightest["burst"],
        "held": vendor["held_now"],
        "held_rate": recent["held_per_second"],
        "deferred": recent["deferred_per_second"],
        "deferred_minute": recent["deferred_last_minute"],
        "shed": recent["shed_per_second"],
        "vendor_429": recent["vendor_429_last_minute"],
    }
    if vendor["blocked_for_seconds"]:
        out["blocked"] = vendor["blocked_for_seconds"]
    concurrency = vendor.get("concurrency")
    if concurrency is None:
        out["inflight"] = None  # no such figure in /status: shown as a dash
    else:
        out["inflight"] = concurrency["inflight"]
        if concurrency["cap"] is not None:  # no cap: the page says "no cap", no figure
            out["inflight_cap"] = concurrency["cap"]
    return out


def assert_page_shows(page: dict[str, Any], status: dict[str, Any]) -> None:
    assert page["state"] == "live", page
    assert list(page["vendors"]) == [v["name"] for v in status["vendors"]]
    for vendor in status["vendors"]:
        fields = page["vendors"][vendor["name"]]["fields"]
        for name, value in expected(vendor).items():
            (element,) = fields[name]
            assert (None if element["value"] == "" else float(element["value"])) == value, (vendor["name"], name)
            assert element["text"] == shown(value), (vendor["name"], name, element)
            assert element["visible"] and element["lines"] == 1, (vendor["name"], name, element)  # not broken
        tokens = [b["tokens"] for b in vendor["buckets"]]
        assert [float(e["value"]) for e in fields["bucket_tokens"]] == tokens
        assert all(e["visible"] and e["lines"] == 1 for e in fields["bucket_tokens"]), fields["bucket_tokens"]


def assert_sane_png(png: bytes, width: int, height: int) -> None:
    """A screenshot of the page as styled: its size, text drawn, white cards on the grey page."""
    assert png_size(png) == (width, height)
    assert len(png) < 4_000_000, len(png)
    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
    assert pixels.shape[:2] == (height, width)
    rgb = (pixels[..., :3] * 255).round().astype(int)

    def share(colour: tuple[int, int, int], within: int) -> float:
        return float((abs(rgb - colour) <= within).all(axis=-1).mean())

    assert len({tuple(p) for p in rgb.reshape(-1, 3)[::7]}) > 50  # text antialiased: not a blank canvas
    assert share((27, 31, 36), 40) > 0.003  # the ink
    assert share((246, 247, 249), 1) > 0.05 and share((255, 255, 255), 1) > 0.2  # ui.css applied


async def stand_in(aiohttp_server: Any, status: dict[str, Any], past: dict[str, Any]) -> Any:
    """The page's files, and a /status and /status/history that answer ``status`` and
    ``past`` as given (what a test made of a real proxy's answers)."""

    async def extended(request: web.Request) -> web.Response:
        return web.json_response(status)

    async def history(request: web.Request) -> web.Response:
        return web.json_response(past)

    app = web.Application()
    add_page_routes(app)
    app.router.add_get("/status", extended)
    app.router.add_get("/status/history", history)
    return await aiohttp_server(app)


# -- the tests --------------------------------------------------------------------------------------


async def test_page_shows_the_numbers_status_gives_and_follows_them(
    scenario: Scenario, browser: Browser, tmp_path: Path
) -> None:
    async with open_tab(browser) as tab:
        await tab.viewport(1280, 900)
        await tab.goto(f"{scenario.proxy.admin_url}/?every=0.25")
        page = await tab.evaluate(rendered_when("true"))
        status = await scenario.status()
        payments, search = status["vendors"]
        # The scenario, as /status tells it (so the comparison below compares something).
        assert payments["held_now"] == 2 and payments["recent"]["forwarded_per_second"] == pytest.approx(0.4)
        assert payments["tokens_available"] < 0
        assert search["recent"]["vendor_429_last_minute"] == 1 and search["recent"]["deferred_last_minute"] == 2
        assert search["blocked_for_seconds"] == pytest.approx(29)
        assert_page_shows(page, status)
        assert page["scrollWidth"] <= page["innerWidth"]
        png = await tab.screenshot()
        assert_sane_png(png, 1280, 900)
        (tmp_path / "wide.png").write_bytes(png)

        # It polls by itself: one more deferral shows up, and the graphs grow a point a poll.
        assert await scenario.get("/search/v1/q") == 429
        status = await scenario.status()
        assert status["vendors"][1]["recent"]["deferred_last_minute"] == 3
        page = await tab.evaluate(
            rendered_when(
                'document.querySelector(\'[data-vendor="search"] [data-field="deferred_minute"]\').textContent === "3"'
            )
        )
        assert_page_shows(page, status)
        assert page["renders"] >= 2
        # The graphs are the proxy's five minutes (5-second averages), whatever the tab has seen.
        assert page["vendors"]["payments"]["charts"]["requests"]["series"]["forwarded"]["points"] == 60
        assert page["vendors"]["search"]["reasons"]["vendor_block"]["deferred"] == 3
        assert tab.problems == []  # no console error, no CSP violation, no failed load


async def test_page_on_a_phone_is_one_column_without_sideways_scrolling(scenario: Scenario, browser: Browser) -> None:
    async with open_tab(browser) as tab:
        await tab.viewport(390, 844, mobile=True, scale=2)
        await tab.goto(f"{scenario.proxy.admin_url}/")
        page = await tab.evaluate(rendered_when("true"))
        assert_page_shows(page, await scenario.status())
        assert page["innerWidth"] == 390
        assert page["scrollWidth"] <= page["innerWidth"], page["scrollWidth"]
        payments, search = page["vendors"].values()
        assert payments["left"] == search["left"] and search["top"] > payments["top"]  # stacked
        assert payments["right"] <= 390
        assert_sane_png(await tab.screenshot(), 780, 1688)
        assert tab.problems == []


async def test_page_asks_for_the_admin_token_and_keeps_it_in_the_tab(
    vendor: Vendor, start_proxy: Any, browser: Browser
) -> None:
    clock = ManualClock()
    proxy = await start_proxy(two_vendors(vendor.url, f"admin_token: {TOKEN}"), clock=clock)
    traffic = Scenario(proxy, vendor, clock, TOKEN)
    await traffic.run()
    try:
        async with open_tab(browser) as tab:
            await tab.viewport(800, 700)
            await tab.goto(f"{proxy.admin_url}/")  # the page itself needs no token
            page = await tab.evaluate(rendered_when('document.documentElement.dataset.state === "token"'))
            assert page["tokenForm"] and page["vendors"] == {} and page["tokenProblem"] == ""

            await tab.type_text("not-the-token")  # the field has the focus
            page = await tab.evaluate(rendered_when(f"Number(document.documentElement.dataset.renders) >= {2}"))
            assert page["state"] == "token" and page["tokenForm"]
            assert page["tokenProblem"] == "That token was refused."

            await tab.type_text(TOKEN)
            page = await tab.evaluate(rendered_when('document.documentElement.dataset.state === "live"'))
            assert not page["tokenForm"]
            assert_page_shows(page, await traffic.status())
            assert await tab.evaluate('sessionStorage.getItem("quota-proxy.admin-token")') == TOKEN

            await tab.goto(f"{proxy.admin_url}/")  # a reload in the same tab asks no more
            page = await tab.evaluate(rendered_when("true"))
            assert page["state"] == "live" and not page["tokenForm"]
            # The browser reports each 401 as a failed load; nothing else went wrong.
            assert tab.problems and all("401" in p for p in tab.problems), tab.problems
    finally:
        await traffic.close()


async def test_page_renders_endpoints_concurrency_and_learned_limits_when_status_has_them(
    scenario: Scenario, browser: Browser, aiohttp_server: Any
) -> None:
    """Fields /status gains with SPEC §10 (endpoint classes, concurrency caps, learned limits):
    today's real /status, extended with them, served beside the page's own routes."""
    status = await scenario.status()
    payments = status["vendors"][0]
    payments["concurrency"] = {"cap": 5, "inflight": 3, "held_for_slot": 2}
    payments["endpoints"] = [
        {"name": "search", "tokens_available": 1.5, "concurrency": {"cap": 2, "inflight": 1}},
        {"name": "files", "cost": 5, "tokens_available": None},
    ]
    payments["learned"] = {"rate_per_second": 0.07, "remaining": 12, "source": "x-ratelimit"}

    past = await scenario.status("/status/history")

    server = await stand_in(aiohttp_server, status, past)
    async with open_tab(browser) as tab:
        await tab.viewport(1000, 900)
        await tab.goto(str(server.make_url("/")))
        page = await tab.evaluate(rendered_when("true"))
        assert_page_shows(page, status)
        card = page["vendors"]["payments"]
        assert card["fields"]["held_for_slot"][0]["text"] == "2"
        assert card["generic"]["endpoints"].split("\n") == [
            "ENDPOINTS",
            "search",
            "tokens_available",
            "1.5",
            "concurrency.cap",
            "2",
            "concurrency.inflight",
            "1",
            "files",
            "cost",
            "5",
        ]
        assert "rate_per_second\n0.07" in card["generic"]["learned"]
        assert "source\nx-ratelimit" in card["generic"]["learned"]
        assert "endpoints" not in page["vendors"]["search"]["generic"]
        assert tab.problems == []


async def test_page_files_are_static_strict_and_self_contained(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(two_vendors(vendor.url, f"admin_token: {TOKEN}"))
    types = {"/": "text/html", "/ui.js": "text/javascript", "/ui.css": "text/css"}
    async with aiohttp.ClientSession() as s:
        for path, name in PAGE_FILES.items():
            async with s.get(f"{proxy.admin_url}{path}") as r:  # no token: the files hold no data
                assert r.status == 200, path
                assert r.content_type == types[path] and r.charset == "utf-8"
                assert r.headers["Content-Security-Policy"] == PAGE_CSP
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                assert await r.read() == (PAGE_DIR / name).read_bytes()
            async with s.get(f"{proxy.admin_url}{path}", headers={"Host": "rebound.example"}) as r:
                assert r.status == 421, path  # the Host check covers the page too (DNS rebinding)
        async with s.get(f"{proxy.admin_url}/status") as r:
            assert r.status == 401  # what the page asks the token for
    assert "'unsafe-inline'" not in PAGE_CSP and "script-src 'self';" in PAGE_CSP

    html = (PAGE_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert sorted(refs) == ["data:,", "ui.css", "ui.js"]  # nothing from the net
    assert "<script>" not in html and "style=" not in html  # no inline script or style (CSP)
    js = (PAGE_DIR / "ui.js").read_text()
    assert re.findall(r"https?://[^\"']*", js) == ["http://www.w3.org/2000/svg"]  # a namespace, not a fetch
    assert ".innerHTML" not in js and ".outerHTML" not in js and "eval(" not in js
    assert re.findall(r'fetch\("([^"]*)"', js) == ["status", "status/history"]
    css = (PAGE_DIR / "ui.css").read_text()
    assert "url(" not in css and "@import" not in css


def five_second_peak(values: list[int]) -> float:
    """The highest 5-second average of per-second counts, as the requests graph bins them
    (the newest bin ending now)."""
    return max(sum(values[end - 5 : end]) / 5 for end in range(len(values), 4, -5))


async def test_page_explains_what_it_shows(scenario: Scenario, browser: Browser) -> None:
    """A new user's questions, answered on the page: which breaker, which limit binds, why
    requests were refused and whose, what the vendor said and when, what the axes mean, and
    what happened before the page was opened (drawn at the first render)."""
    async with open_tab(browser) as tab:
        await tab.viewport(1280, 900)
        await tab.goto(f"{scenario.proxy.admin_url}/")
        page = await tab.evaluate(rendered_when("true"))
        status = await scenario.status()
        past = await scenario.status("/status/history")
        assert page["renders"] == 1  # all of it on the first render: nothing was seen in this tab before
        assert await tab.evaluate("Object.keys(sessionStorage)") == []

        # The breaker is labelled and its state explained.
        assert page["breakerLabel"] == "store circuit breaker"
        assert page["breaker"] == "closed (normal)"

        payments, search = (page["vendors"][name] for name in ("payments", "search"))
        by_name = {v["name"]: v for v in status["vendors"]}
        # Every bucket with its rate; the slowest refill binds in the long run, the fewest tokens now.
        for name, card in (("payments", payments), ("search", search)):
            vendor = by_name[name]
            quota = vendor["quota"]
            assert [b["bucket"] for b in card["buckets"]] == [b["bucket"] for b in vendor["buckets"]]
            for shown_bucket, bucket in zip(card["buckets"], vendor["buckets"], strict=True):
                assert f"refills {shown(bucket['rate_per_second'])}/s" in shown_bucket["text"], shown_bucket
                assert f"{shown(round(bucket['fill'] * 100, 1))}% full" in shown_bucket["text"], shown_bucket
            binds = {b["bucket"]: b["binds"].split() for b in card["buckets"]}
            assert "long_run" in binds[quota["long_run"]["bucket"]] and "now" in binds[quota["now"]["bucket"]]
            assert card["binds"]["binds_long_run"]["bucket"] == quota["long_run"]["bucket"]
            assert card["binds"]["binds_now"]["bucket"] == quota["now"]["bucket"]
        assert by_name["search"]["quota"]["long_run"] == {
            "bucket": "global 60/1m burst 60",
            "rate_per_second": 1.0,
            "limit": "60/1m",
        }
        assert by_name["search"]["quota"]["now"]["bucket"] == "global 2/1s burst 3"  # blocked: the fewest tokens
        long_run = next(b for b in search["buckets"] if b["bucket"] == "global 60/1m burst 60")
        assert "binds in the long run: 1/s" in long_run["text"]
        assert "In the long run 60/1m burst 60 binds: 1/s" in search["binds"]["binds_long_run"]["text"]

        # Refusals by reason (two reasons, both actions) and the tenants refused.
        assert payments["reasons"] == {
            "global": {"text": payments["reasons"]["global"]["text"], "deferred": 0, "shed": 1}
        }
        assert payments["reasons"]["global"]["text"].startswith("vendor quota")
        assert search["reasons"]["vendor_block"]["deferred"] == 2
        assert search["reasons"]["vendor_block"]["text"].startswith("vendor block")
        assert [t["tenant"] for t in payments["tenants"]] == ["acme"]
        assert search["tenants"] == [{"tenant": "crawler", "text": "crawler 2 refused (last: vendor block)"}]

        # The vendor's 429 (and the block it caused) on the timeline, with a label and a time.
        requests = search["charts"]["requests"]
        (event,) = requests["events"]
        assert event["kinds"] == "vendor_429 vendor_block"
        assert event["text"].startswith("vendor 429 · blocked 30 s ")
        assert re.search(r"\d{1,2}:\d{2}:\d{2}", event["text"])
        ((kinds, text),) = [(e["kinds"], e["text"]) for e in search["events"]]
        assert kinds == "vendor_429 vendor_block" and "s ago) vendor 429 · blocked 30 s" in text
        assert payments["charts"]["requests"]["events"] == [] and payments["events"] == []

        # Axes with units, a legend, on every graph.
        for card in (payments, search):
            assert set(card["charts"]) == {"requests", "tokens", "waiting"}
            for name, chart in card["charts"].items():
                assert chart["axes"] == {"x": "seconds ago", "y": UNITS[name]}, name
                assert chart["ticks"][-1] == "now" or "now" in chart["ticks"], chart["ticks"]
                assert len(chart["legend"]) >= len(chart["series"]) >= 1, chart
                assert chart["visible"], name
        assert "300" in requests["ticks"] and "long-run quota 1/s, bound by 60/1m" in requests["legend"]
        assert {"sent to the vendor", "deferred (429)", "shed (503)"} <= set(requests["legend"])

        # What happened before the page was opened is drawn at once, from the proxy's history.
        for name, card in (("payments", payments), ("search", search)):
            (history,) = [v for v in past["vendors"] if v["name"] == name]
            series = card["charts"]["requests"]["series"]
            for key in ("forwarded", "deferred", "shed"):
                assert series[key]["points"] == 60, (name, key)
                assert series[key]["max"] == pytest.approx(five_second_peak(history["series"][key])), (name, key)
        assert payments["charts"]["requests"]["series"]["forwarded"]["max"] == pytest.approx(4 / 5)
        assert search["charts"]["requests"]["series"]["deferred"]["max"] == pytest.approx(2 / 5)
        assert payments["charts"]["waiting"]["series"]["held"]["max"] == 2  # the two held requests, sampled
        assert tab.problems == []


UNITS = {"requests": "requests/s", "tokens": "tokens", "waiting": "requests"}


async def test_page_explains_an_open_breaker_and_a_store_it_cannot_ask(
    scenario: Scenario, browser: Browser, aiohttp_server: Any
) -> None:
    """The store failing: the breaker's state says what it means, the quota what is known
    without the store (the policy's limits, which binds in the long run)."""
    status = await scenario.status()
    past = await scenario.status("/status/history")
    status["store"]["breaker"] = "open"
    payments = status["vendors"][0]
    payments.update(breaker="open", buckets=None, tokens_available=None, store_error="ConnectionError: refused")
    payments["quota"]["now"] = None

    server = await stand_in(aiohttp_server, status, past)
    async with open_tab(browser) as tab:
        await tab.viewport(1000, 900)
        await tab.goto(str(server.make_url("/")))
        page = await tab.evaluate(rendered_when("true"))
        assert page["breaker"] == "open (store failing)"
        title = await tab.evaluate('document.querySelector("[data-field=store_breaker]").title')
        assert "on_failure decides" in title
        card = page["vendors"]["payments"]
        assert card["fields"]["breaker"][0]["text"] == "store circuit breaker open"
        assert card["buckets"] == [] and "binds_now" not in card["binds"]
        assert card["binds"]["binds_long_run"]["bucket"] == "global 6/1m burst 4"
        quota = await tab.evaluate('document.querySelector("[data-vendor=payments] [data-part=quota]").innerText')
        assert "levels unknown" in quota and "(0.1/s)" in quota
        assert "tokens" not in card["charts"]  # no buckets to draw
        assert tab.problems == []


def test_page_routes_and_files_agree() -> None:
    assert sorted(PAGE_FILES.values()) == sorted(p.name for p in PAGE_DIR.iterdir())


READ_SHARE = """(() => {
  const out = {};
  for (const card of document.querySelectorAll("[data-vendor]")) {
    const part = card.querySelector('[data-part="share"]');
    if (!part) continue;
    const value = (row, name) => {
      const f = row.querySelector(`[data-field="${name}"]`);
      return f ? {value: f.dataset.value, text: f.textContent} : null;
    };
    const box = part.getBoundingClientRect();
    out[card.dataset.vendor] = {
      title: part.querySelector("h4").textContent,
      within: box.left >= card.getBoundingClientRect().left && box.right <= card.getBoundingClientRect().right + 0.5,
      classes: [...part.querySelectorAll("table.classes tbody tr")].map((r) => ({
        name: r.dataset.class, text: r.cells[0].textContent, rate: value(r, "share_class_rate"),
        share: value(r, "share_class_share"), min: value(r, "share_class_min"), minText: r.cells[3].textContent})),
      subtitle: (part.querySelector(".sub-title") || {}).textContent || null,
      tenants: [...part.querySelectorAll("table.tenants tbody tr")].map((r) => ({
        tenant: r.dataset.shareTenant, klass: r.dataset.class, text: r.cells[0].textContent,
        rate: value(r, "share_tenant_rate"), fair: value(r, "share_tenant_fair"), ratio: value(r, "share_tenant_ratio"),
        meter: r.querySelector("meter") ? Number(r.querySelector("meter").value) : null})),
    };
  }
  return out;
})()"""


def percent(x: float) -> str:
    """The page's percentages (ui.js ``pct``): one decimal at most."""
    return f"{shown(round(x * 1000) / 10)}%"


async def test_page_shows_a_shared_quota_by_class_and_tenant_against_fair_shares(
    vendor: Vendor, start_proxy: Any, browser: Browser
) -> None:
    """A vendor with ``share:`` (SPEC §13): its classes' rates and parts of the quota, and its
    tenants' rates against their fair shares, as /status gives them; none for the others."""
    share = Share(
        weights=(("acme", 4.0),),
        classes=("checkout", "batch"),
        default_class="batch",
        tenant_class=(("acme", "checkout"),),
        min_share=0.1,
    )
    policy = two_vendors(vendor.url)
    payments, search = policy.vendors
    policy = dataclasses.replace(policy, vendors=(dataclasses.replace(payments, share=share), search))
    clock = ManualClock()
    proxy = await start_proxy(policy, clock=clock)
    tally = proxy.runtime.deps.tally("payments")
    for tenant, klass, outcome, times in (
        ("acme", 0, "forwarded", 42),
        ("beta", 0, "forwarded", 8),
        ("beta", 0, "deferred", 5),
        ("gamma", 1, "forwarded", 5),
        ("delta", 1, "shed", 8),
    ):
        for _ in range(times):
            tally.shared(share, klass, tenant, outcome)
    await clock.advance(1.0)
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/status") as r:
        status = await r.json()
    expected = status["vendors"][0]["share"]
    assert expected["classes"][1]["share"] == round(0.5 / 5.5, 3) and expected["tenants"][0]["tenant"] == "acme"

    async with open_tab(browser) as tab:
        await tab.viewport(390, 844, mobile=True, scale=2)  # the narrowest: the tables stay in the card
        await tab.goto(f"{proxy.admin_url}/")
        page = await tab.evaluate(rendered_when("true"))
        assert_page_shows(page, status)
        assert page["scrollWidth"] <= page["innerWidth"]
        shares = await tab.evaluate(READ_SHARE)
        assert list(shares) == ["payments"]  # search shares nothing: no section
        card = shares["payments"]
        assert card["title"] == "Sharing the quota, last 10 s" and card["within"]
        assert [c["name"] for c in card["classes"]] == ["checkout", "batch"]
        for row, c in zip(card["classes"], expected["classes"], strict=True):
            assert float(row["rate"]["value"]) == c["granted_per_second"]
            assert row["rate"]["text"] == shown(c["granted_per_second"])
            assert float(row["share"]["value"]) == c["share"] and row["share"]["text"] == percent(c["share"])
            assert ("waiting" in row["text"]) == c["waiting"]
        assert card["classes"][0]["min"] is None and card["classes"][0]["minText"] == "—"
        assert card["classes"][1]["min"]["text"] == "10%"
        assert [(t["tenant"], t["klass"]) for t in card["tenants"]] == [
            (t["tenant"], t["class"]) for t in expected["tenants"]
        ]
        for row, t in zip(card["tenants"], expected["tenants"], strict=True):
            assert float(row["rate"]["value"]) == t["granted_per_second"]
            assert float(row["fair"]["value"]) == t["fair_per_second"] and row["fair"]["text"] == shown(
                t["fair_per_second"]
            )
            if t["ratio"] is None:
                assert row["ratio"]["text"] == "—" and row["meter"] is None
            else:
                assert row["ratio"]["text"] == percent(t["ratio"])
                assert row["meter"] == pytest.approx(min(t["ratio"], 1.0))
            assert f"weight {shown(t['weight'])}" in row["text"] and ("waiting" in row["text"]) == t["waiting"]
        beta = next(row for row in card["tenants"] if row["tenant"] == "beta")
        assert beta["ratio"]["text"] == "80%" and "waiting" in beta["text"]  # 0.8/s of a fair 1/s, deferred
        assert tab.problems == []
