"""What /status and /status/history tell the live page (issue 26 item 4): refusals by reason
and by tenant (bounded), the quota that binds, the vendor's 429s, blocks and drains as
events, five minutes of history kept by the proxy; and how ``run --workers N`` merges them.

The proxy runs on a ManualClock: each scenario happens at instants the test chooses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.clock import ManualClock
from proxy.ops.admin import TOP_TENANTS
from proxy.ops.workers_admin import merge_history, merge_status
from proxy.server import ProxyServer
from proxy.telemetry.recent import EVENTS_KEPT, HISTORY_SECONDS, TENANTS_KEPT, Recent, RefusedTenants
from proxy.wire.refusals import REASONS, Limited, StoreDown
from tests.conftest import Vendor, eventually, make_policy
from tests.helpers.stores import FlakyStore

TOKEN = "status-test-admin-token"


def policy(upstream: str, extra_top: str = "") -> Any:
    """api: a global bucket of 2 refilling 1/s (and 4000 a minute), tenant slow's 1 an hour,
    an endpoint class of 1 an hour, a drain below 5 remaining; capped: one request in flight."""
    return make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store: {url: "memory://", timeout: 250ms}
        $extra_top
        vendors:
          - name: api
            hosts: [api.example]
            route: /api
            upstream: $upstream
            limits: [{rate: 1, per: 1s, burst: 2}, {rate: 4000, per: 1m}]
            tenant_limits:
              overrides:
                slow: [{rate: 1, per: 1h, burst: 1}]
            endpoints:
              - name: search
                match: {path: /v1/search}
                limits: [{rate: 1, per: 1h, burst: 1}]
            feedback: {low_watermark: 5}
            on_limit: {action: defer}
          - name: capped
            hosts: [capped.example]
            route: /capped
            upstream: $upstream
            limits: [{rate: 1000, per: 1s}]
            concurrency: 1
            on_limit: {action: shed}
        """,
        upstream=upstream,
        extra_top=extra_top,
    )


class Admin:
    def __init__(self, proxy: ProxyServer, headers: dict[str, str] | None = None) -> None:
        self.proxy = proxy
        self.headers = headers or {}
        self.session = aiohttp.ClientSession()

    async def get(self, path: str, tenant: str = "default") -> int:
        async with self.session.get(f"{self.proxy.url}{path}", headers={"X-Tenant-Id": tenant}) as r:
            await r.read()
            return r.status

    async def admin(self, path: str) -> Any:
        async with self.session.get(f"{self.proxy.admin_url}{path}", headers=self.headers) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    async def vendor(self, name: str, path: str = "/status") -> Any:
        (entry,) = [v for v in (await self.admin(path))["vendors"] if v["name"] == name]
        return entry


@pytest.fixture
async def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def api(vendor: Vendor, start_proxy: Any, clock: ManualClock) -> AsyncIterator[Admin]:
    admin = Admin(await start_proxy(policy(vendor.url), clock=clock))
    yield admin
    await admin.session.close()


def by_reason(**counts: tuple[int, int]) -> dict[str, dict[str, int]]:
    """Every reason, (deferred, shed) as given, else none."""
    return {r: dict(zip(("deferred", "shed"), counts.get(r, (0, 0)), strict=True)) for r in REASONS}


# -- refusals by reason ---------------------------------------------------------------------------


async def test_refusals_are_counted_by_reason_and_tenant(api: Admin, vendor: Vendor, clock: ManualClock) -> None:
    assert await api.get("/api/v1/x", "slow") == 200
    assert await api.get("/api/v1/x", "slow") == 429  # its own 1 an hour: tenant
    assert await api.get("/api/v1/search", "acme") == 200  # the global bucket's last token
    assert await api.get("/api/v1/search", "acme") == 429  # the class's 1 an hour waits longest: endpoint
    assert await api.get("/api/v1/x", "acme") == 429  # global
    await clock.advance(10.0)  # full again
    vendor.mock.script(status=200, remaining=1)
    assert await api.get("/api/v1/x", "beta") == 200  # 1 left, below low_watermark 5: drained
    assert await api.get("/api/v1/x", "beta") == 429  # the global buckets refilling: drain
    await clock.advance(10.0)
    vendor.mock.script(status=429, retry_after="30")
    assert await api.get("/api/v1/x", "beta") == 429  # the vendor's own: a block of 30 s
    for _ in range(3):
        assert await api.get("/api/v1/x", "beta") == 429  # vendor_block
    await clock.advance(1.0)

    entry = await api.vendor("api")
    refusals = entry["refusals"]
    assert refusals["window_seconds"] == 60
    assert refusals["by_reason"] == by_reason(
        tenant=(1, 0), endpoint=(1, 0), **{"global": (1, 0)}, drain=(1, 0), vendor_block=(3, 0)
    )
    assert refusals["top_tenants"] == [
        {"tenant": "beta", "refused": 4, "reason": "vendor_block"},
        {"tenant": "acme", "refused": 2, "reason": "global"},
        {"tenant": "slow", "refused": 1, "reason": "tenant"},
    ]
    recent = entry["recent"]
    assert (recent["deferred_last_minute"], recent["shed_last_minute"]) == (7, 0)
    assert (recent["vendor_429_last_minute"], recent["vendor_blocks_last_minute"], recent["drains_last_minute"]) == (
        1,
        1,
        1,
    )

    # A minute on, the counts are gone; the tenants' too.
    await clock.advance(61.0)
    refusals = (await api.vendor("api"))["refusals"]
    assert refusals["by_reason"] == by_reason() and refusals["top_tenants"] == []


async def test_concurrency_sheds_and_store_failures_have_their_reasons(
    vendor: Vendor, start_proxy: Any, clock: ManualClock
) -> None:
    store = FlakyStore(clock)
    admin = Admin(await start_proxy(policy(vendor.url), clock=clock, store=store))
    try:
        busy = asyncio.ensure_future(admin.get("/capped/delay/300"))
        deps = admin.proxy.runtime.deps
        await eventually(lambda: vendor.mock.in_flight == 1, "one request in flight at capped")
        assert await admin.get("/capped/v1/x", "batch") == 503  # the cap of 1: shed
        assert await busy == 200
        store.fail = True
        assert await admin.get("/api/v1/x", "acme") == 429  # store unavailable, on_failure closed
        store.fail = False
        await clock.advance(1.0)
        capped = (await admin.vendor("capped"))["refusals"]
        assert capped["by_reason"] == by_reason(concurrency=(0, 1))
        assert capped["top_tenants"] == [{"tenant": "batch", "refused": 1, "reason": "concurrency"}]
        api = (await admin.vendor("api"))["refusals"]
        assert api["by_reason"] == by_reason(store_unavailable=(1, 0))
        assert deps.recent.top_tenants("api") == [{"tenant": "acme", "refused": 1, "reason": "store_unavailable"}]
    finally:
        await admin.session.close()


def test_every_deferral_and_shed_has_a_reason() -> None:
    assert Limited("defer", 1.0, "tenant", "b").reason == "tenant"
    assert Limited("defer", 1.0, "tenants", "tenant.max_active 5 reached").reason == "tenant"
    assert Limited("shed", 1.0, "concurrency", "b").reason == "concurrency"
    assert Limited("defer", 1.0, "tunnels", "max_tunnels 2 reached").reason == "concurrency"
    assert Limited("defer", 1.0, "endpoint", "b").reason == "endpoint"
    assert Limited("defer", 1.0, "global", "b").reason == "global"
    assert Limited("defer", 1.0, "global", "b", reason="vendor_block").reason == "vendor_block"
    assert StoreDown(1.0, "store unavailable").reason == "store_unavailable"
    assert set(REASONS) == {"tenant", "global", "endpoint", "concurrency", "vendor_block", "drain", "store_unavailable"}


async def test_forwarded_requests_are_not_counted_as_refusals(api: Admin) -> None:
    """Only refusals are counted by reason and tenant: the forwarded request (the straight
    path) adds nothing to those counts."""
    for tenant in ("a", "b"):
        assert await api.get("/api/v1/x", tenant) == 200
    recent = api.proxy.runtime.deps.recent
    assert recent.top_tenants("api") == []
    assert not [event for (_, event) in recent._rings if ":" in event]
    assert recent.events("api") == []


# -- the top tenants: bounded ---------------------------------------------------------------------


async def test_top_tenants_are_a_few_of_a_bounded_count(api: Admin) -> None:
    """A spray of tenant ids keeps ``TENANTS_KEPT`` counted per vendor; the one refused
    most stays counted through it; /status lists ``TOP_TENANTS``."""
    assert await api.get("/api/v1/x", "slow") == 200
    for _ in range(5):
        assert await api.get("/api/v1/x", "slow") == 429
    for i in range(3 * TENANTS_KEPT):  # the global bucket is empty after two: all refused
        assert await api.get("/api/v1/x", f"spray-{i}") in (200, 429)
    entry = await api.vendor("api")
    top = entry["refusals"]["top_tenants"]
    assert len(top) == TOP_TENANTS == 5
    assert top[0] == {"tenant": "slow", "refused": 5, "reason": "tenant"}
    assert all(t["refused"] == 1 for t in top[1:])
    assert len(api.proxy.runtime.deps.recent._tenants["api"]) == TENANTS_KEPT


def test_refused_tenants_keep_the_most_refused_and_forget_the_stale() -> None:
    tenants = RefusedTenants(kept=3)
    for _ in range(4):
        tenants.add("heavy", "tenant", 100)
    tenants.add("two", "global", 100)
    tenants.add("two", "global", 101)
    for i in range(10):  # each newcomer takes the least refused place (the last newcomer's)
        tenants.add(f"once-{i}", "global", 102)
    assert len(tenants) == 3
    assert tenants.top(102, 5) == [
        {"tenant": "heavy", "refused": 4, "reason": "tenant"},
        {"tenant": "two", "refused": 2, "reason": "global"},
        {"tenant": "once-9", "refused": 1, "reason": "global"},
    ]
    assert tenants.top(102, 1) == [{"tenant": "heavy", "refused": 4, "reason": "tenant"}]
    # Refused no more for a minute: out of the top, and the first to make room.
    tenants.add("late", "endpoint", 161)
    assert tenants.top(161, 5) == [{"tenant": "late", "refused": 1, "reason": "endpoint"}]
    assert len(tenants) == 3


# -- the binding quota ----------------------------------------------------------------------------


async def test_status_says_which_limit_binds_now_and_in_the_long_run(api: Admin, clock: ManualClock) -> None:
    entry = await api.vendor("api")
    quota = entry["quota"]
    # 1/s refills slower than 4000/1m (66.7/s): it binds in the long run.
    assert quota["long_run"] == {"bucket": "global 1/1s burst 2", "rate_per_second": 1.0, "limit": "1/1s"}
    per_second, per_minute = entry["buckets"]
    assert (per_second["fill"], per_minute["fill"]) == (1.0, 1.0)
    # Full, it binds nothing yet: a request now would be granted.
    assert quota["now"] == {"bucket": "global 1/1s burst 2", "tokens": 2.0, "burst": 2.0, "fill": 1.0, "binds": False}
    assert await api.get("/api/v1/x") == 200
    entry = await api.vendor("api")
    per_second, per_minute = entry["buckets"]
    assert per_second["tokens"] == 1 and per_second["fill"] == 0.5
    assert per_minute["tokens"] == 3999 and per_minute["fill"] == pytest.approx(3999 / 4000, abs=1e-4)
    assert entry["quota"]["now"] == {
        "bucket": "global 1/1s burst 2",
        "tokens": 1.0,
        "burst": 2.0,
        "fill": 0.5,
        "binds": False,
    }
    assert await api.get("/api/v1/x") == 200  # its last token: the next request must wait for it
    entry = await api.vendor("api")
    assert entry["quota"]["now"]["tokens"] == 0 and entry["quota"]["now"]["binds"] is True


async def test_the_bucket_with_fewest_tokens_binds_now(vendor: Vendor, start_proxy: Any, clock: ManualClock) -> None:
    """80/1s burst 20 and 4000/1m burst 25: the minute's bucket binds in the long run
    (66.7/s), the second's now (it has the fewer tokens, though it is the fuller)."""
    proxy = await start_proxy(
        make_policy(
            """
            version: 1
            listen: 127.0.0.1:0
            admin_listen: 127.0.0.1:0
            access_log: false
            store: {url: "memory://"}
            vendors:
              - name: llm
                hosts: [llm.example]
                route: /llm
                upstream: $upstream
                limits: [{rate: 80, per: 1s, burst: 20}, {rate: 4000, per: 1m, burst: 25}]
            """,
            upstream=vendor.url,
        ),
        clock=clock,
    )
    admin = Admin(proxy)
    try:
        for _ in range(19):
            assert await admin.get("/llm/v1/x") == 200
        await clock.advance(0.15)  # 1 + 12 tokens of 20 (65%); 6 + 10 of 25 (64%)
        entry = await admin.vendor("llm")
        quota = entry["quota"]
        assert quota["long_run"] == {
            "bucket": "global 4000/1m burst 25",
            "rate_per_second": pytest.approx(66.666667),
            "limit": "4000/1m",
        }
        assert [b["tokens"] for b in entry["buckets"]] == [pytest.approx(13.0), pytest.approx(16.0)]
        assert [b["fill"] for b in entry["buckets"]] == [0.65, 0.64]
        assert quota["now"] == {
            "bucket": "global 80/1s burst 20",
            "tokens": 13.0,
            "burst": 20.0,
            "fill": 0.65,
            "binds": False,
        }
    finally:
        await admin.session.close()


# -- /status/history ------------------------------------------------------------------------------


async def test_history_holds_five_minutes_of_counts_readings_and_events(
    api: Admin, vendor: Vendor, clock: ManualClock
) -> None:
    assert await api.get("/api/v1/x", "a") == 200
    assert await api.get("/api/v1/x", "a") == 200
    assert await api.get("/api/v1/x", "a") == 429  # global
    await clock.advance(5.0)
    vendor.mock.script(status=429, retry_after="20")
    assert await api.get("/api/v1/x", "a") == 429  # the vendor's 429: a block
    await clock.advance(25.0)  # the block is over
    vendor.mock.script(status=429, retry_after="0")  # a 429 that asks no wait: a drain
    assert await api.get("/api/v1/x", "a") == 429
    await clock.advance(2.0)

    doc = await api.admin("/status/history")
    assert (doc["seconds"], doc["step_seconds"]) == (HISTORY_SECONDS, 1)
    assert [v["name"] for v in doc["vendors"]] == ["api", "capped"]
    entry = doc["vendors"][0]
    series = entry["series"]
    assert set(series) == {"forwarded", "held", "deferred", "shed", "vendor_429"}
    assert all(len(values) == HISTORY_SECONDS for values in series.values())
    # series[-k]: the second that began k seconds ago (the last one ended less than a second ago).
    nonzero = {name: {-i + len(v): n for i, n in enumerate(v) if n} for name, v in series.items()}
    assert nonzero == {
        "forwarded": {32: 2, 27: 1, 2: 1},  # the requests the vendor answered 429 were sent to it
        "held": {},
        "deferred": {32: 1},
        "shed": {},
        "vendor_429": {27: 1, 2: 1},
    }
    # Readings: taken each (real) second by the admin side and at each /status/history, so
    # on this hand-moved clock at its start and now. gauges[-k]: read k - 1 seconds ago.
    gauges = entry["gauges"]
    assert set(gauges) == {"tokens", "held_now", "inflight"}
    assert all(len(values) == HISTORY_SECONDS for values in gauges.values())
    assert gauges["held_now"][-1] == 0 and gauges["held_now"][-33] == 0  # now, and at the start
    assert gauges["held_now"][-34] is None  # before the proxy started
    assert gauges["tokens"][-33] is None  # at the start, before any store answer
    assert gauges["tokens"][-1] == pytest.approx(api.proxy.runtime.deps.limiter.tokens_available(api_vendor(api)))
    assert gauges["inflight"][-1] is None  # no concurrency cap
    assert doc["vendors"][1]["gauges"]["inflight"][-1] == 0
    # Events: what the vendor said, when, in order.
    events = entry["events"]
    assert [(e["kind"], e["seconds_ago"], e.get("seconds")) for e in events] == [
        ("vendor_429", 27.0, None),
        ("vendor_block", 27.0, 20.0),
        ("vendor_429", 2.0, None),
        ("drain", 2.0, None),
    ]
    assert all(e["at"].endswith("+00:00") for e in events)

    # Five minutes on, all of it has left the window.
    await clock.advance(HISTORY_SECONDS + 1.0)
    entry = await api.vendor("api", "/status/history")
    assert all(sum(values) == 0 for values in entry["series"].values())
    assert entry["events"] == []
    assert entry["gauges"]["tokens"][-1] == 2.0  # sampled all along: full again


def api_vendor(admin: Admin) -> Any:
    return admin.proxy.runtime.policy.vendors[0]


def test_recent_memory_is_bounded() -> None:
    clock = ManualClock()
    recent = Recent(clock)
    for _ in range(3 * EVENTS_KEPT):
        recent.event("api", "vendor_429")
    assert len(recent.events("api")) == EVENTS_KEPT
    for reason in REASONS:
        for outcome in ("deferred", "shed"):
            recent.add("api", f"{outcome}:{reason}")
    assert {r.size for (_, e), r in recent._rings.items() if ":" in e} == {60}  # a minute, not five
    assert recent._rings[("api", "vendor_429")].size == HISTORY_SECONDS
    assert recent.series("api", "vendor_429")[-1] == 0 and recent.total("api", "vendor_429") == 3 * EVENTS_KEPT


async def test_history_needs_the_admin_token(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url, f"admin_token: {TOKEN}"))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{proxy.admin_url}/status/history") as r:
            assert r.status == 401
        async with s.get(f"{proxy.admin_url}/status/history", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and [v["name"] for v in (await r.json())["vendors"]] == ["api", "capped"]


# -- run --workers N: the merge -------------------------------------------------------------------


def status_doc(deferred: int, tenants: list[tuple[str, int, str]]) -> dict[str, Any]:
    return {
        "store": {"breaker": "closed"},
        "vendors": [
            {
                "name": "api",
                "requests_by_mode": {"plain": 1},
                "held_now": 0,
                "breaker": "closed",
                "blocked_for_seconds": 0,
                "learned": None,
                "recent": {"window_seconds": 10, "deferred_last_minute": deferred, "drains_last_minute": 1},
                "refusals": {
                    "window_seconds": 60,
                    "by_reason": by_reason(tenant=(deferred, 1)),
                    "top_tenants": [{"tenant": t, "refused": n, "reason": r} for t, n, r in tenants],
                },
            }
        ],
    }


def test_merged_status_sums_refusals_and_ranks_the_tenants_again() -> None:
    one = status_doc(3, [("a", 5, "tenant"), ("b", 1, "global")])
    two = status_doc(4, [("b", 6, "vendor_block"), ("c", 2, "tenant"), ("d", 1, "tenant"), ("e", 1, "x")])
    two["vendors"][0]["refusals"]["top_tenants"].append({"tenant": "f", "refused": 1, "reason": "drain"})
    (vendor,) = merge_status([one, two])["vendors"]
    assert vendor["recent"]["deferred_last_minute"] == 7 and vendor["recent"]["drains_last_minute"] == 2
    assert vendor["refusals"]["by_reason"] == by_reason(tenant=(7, 2))
    assert vendor["refusals"]["top_tenants"] == [
        {"tenant": "b", "refused": 7, "reason": "vendor_block"},
        {"tenant": "a", "refused": 5, "reason": "tenant"},
        {"tenant": "c", "refused": 2, "reason": "tenant"},
        {"tenant": "d", "refused": 1, "reason": "tenant"},
        {"tenant": "e", "refused": 1, "reason": "x"},
    ]
    assert len(vendor["refusals"]["top_tenants"]) == TOP_TENANTS


def test_merged_history_sums_counts_combines_readings_and_interleaves_events() -> None:
    def doc(counts: list[int], held: list[int | None], tokens: list[float | None], events: list[float]) -> Any:
        return {
            "seconds": 4,
            "vendors": [
                {
                    "name": "api",
                    "series": {"forwarded": counts, "deferred": [0, 0, 0, 1]},
                    "gauges": {"held_now": held, "tokens": tokens, "inflight": [None] * 4},
                    "events": [{"kind": "vendor_429", "seconds_ago": ago} for ago in events],
                }
            ],
        }

    merged = merge_history(
        [
            doc([1, 2, 3, 4], [0, 1, None, 2], [5.0, 4.0, None, 1.5], [30.0, 2.0]),
            doc([0, 1, 0, 1], [1, 1, 1, None], [4.5, 4.5, 3.0, 2.0], [10.0]),
        ]
    )
    (vendor,) = merged["vendors"]
    assert vendor["series"] == {"forwarded": [1, 3, 3, 5], "deferred": [0, 0, 0, 2]}
    assert vendor["gauges"]["held_now"] == [1, 2, 1, 2]  # each worker's own holds: summed
    assert vendor["gauges"]["tokens"] == [5.0, 4.5, 3.0, 2.0]  # the store's figure: the highest
    assert vendor["gauges"]["inflight"] == [None] * 4
    assert [e["seconds_ago"] for e in vendor["events"]] == [30.0, 10.0, 2.0]
