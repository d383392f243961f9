"""What /status and /metrics tell about a shared quota (SPEC §13, ``share:``): each class's
and each weighted tenant's recent rate against its fair share, counted per request by
``Tally.shared`` into a bounded share book (telemetry/shares.py), and how ``run --workers N``
merges the workers' books.

The request path's hook is driven directly (``Tally.shared``), on a ManualClock: every
figure below is exact."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.clock import ManualClock
from proxy.ops.workers_admin import merge_status
from proxy.pipeline.accounting import Tally
from proxy.policy.model import Policy, Share
from proxy.quota.sizing import Sizing
from proxy.server import ProxyServer
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.recent import Recent
from proxy.telemetry.shares import CLASSES_KEPT, TENANTS_KEPT, TENANTS_SHOWN, WINDOW_SECONDS, ShareBook
from tests.conftest import Vendor, make_policy

SHARE = Share(
    weights=(("acme", 4.0), ("beta", 2.0)),
    default_weight=1.0,
    classes=("checkout", "batch"),
    default_class="batch",
    tenant_class=(("acme", "checkout"),),
    min_share=0.1,
)
CHECKOUT, BATCH = 0, 1


def tally(clock: ManualClock, registry: CollectorRegistry | None = None) -> tuple[Tally, Recent]:
    recent = Recent(clock)
    metrics = Metrics(registry if registry is not None else CollectorRegistry())
    return Tally("stripe", metrics, recent, Sizing(), clock), recent


def play(t: Tally, klass: int, tenant: str, outcome: str, times: int, cost: float = 1.0) -> None:
    for _ in range(times):
        t.shared(SHARE, klass, tenant, outcome, cost)


def contention(t: Tally) -> None:
    """One second of a busy quota: checkout's acme (weight 4) and beta (2) both waiting,
    batch's gamma and delta (1 each) waiting behind them, and a request that failed."""
    play(t, CHECKOUT, "acme", "forwarded", 30)
    play(t, CHECKOUT, "acme", "held", 10)
    play(t, CHECKOUT, "beta", "forwarded", 10)
    play(t, CHECKOUT, "beta", "deferred", 20)
    play(t, BATCH, "gamma", "forwarded", 4, cost=2.0)  # an endpoint class costing 2
    play(t, BATCH, "gamma", "shed", 5)
    play(t, BATCH, "delta", "deferred", 30)
    play(t, BATCH, "delta", "error", 3)  # neither granted nor waiting: only counted


# -- the book ---------------------------------------------------------------------------------------


def test_rates_shares_and_fair_shares_by_class_and_tenant() -> None:
    clock = ManualClock()
    t, recent = tally(clock)
    contention(t)
    clock._now += 1.0  # the rates are over complete seconds
    doc = recent.share_book("stripe").status(SHARE)
    assert doc["window_seconds"] == WINDOW_SECONDS == 10
    assert doc["granted_per_second"] == 5.8  # (40 + 10 + 4 * 2) tokens in 10 s
    assert doc["min_share"] == 0.1
    assert doc["classes"] == [
        {
            "name": "checkout",
            "granted_per_second": 5.0,
            "waiting": True,
            "refused_per_second": 2.0,
            "share": round(5.0 / 5.8, 3),
            "min_share": None,  # the highest class: nothing to guarantee it
            "active_tenants": 2,
            "active_weight": 6.0,
        },
        {
            "name": "batch",
            "granted_per_second": 0.8,
            "waiting": True,
            "refused_per_second": 3.5,
            "share": round(0.8 / 5.8, 3),
            "min_share": 0.1,
            "active_tenants": 2,  # delta was granted nothing: active all the same
            "active_weight": 2.0,
        },
    ]
    assert doc["active_tenants"] == 4
    # Most active first (granted + refused); fair = class rate * weight / the class's active weights.
    assert doc["tenants"] == [
        {
            "tenant": "acme",
            "class": "checkout",
            "weight": 4.0,
            "granted_per_second": 4.0,
            "waiting": True,  # held
            "refused_per_second": 0.0,
            "fair_per_second": round(5.0 * 4 / 6, 3),
            "ratio": round(4.0 / (5.0 * 4 / 6), 3),
        },
        {
            "tenant": "beta",
            "class": "checkout",
            "weight": 2.0,
            "granted_per_second": 1.0,
            "waiting": True,
            "refused_per_second": 2.0,
            "fair_per_second": round(5.0 * 2 / 6, 3),
            "ratio": round(1.0 / (5.0 * 2 / 6), 3),
        },
        {
            "tenant": "delta",
            "class": "batch",
            "weight": 1.0,
            "granted_per_second": 0.0,
            "waiting": True,
            "refused_per_second": 3.0,
            "fair_per_second": 0.4,
            "ratio": 0.0,
        },
        {
            "tenant": "gamma",
            "class": "batch",
            "weight": 1.0,
            "granted_per_second": 0.8,
            "waiting": True,
            "refused_per_second": 0.5,
            "fair_per_second": 0.4,
            "ratio": 2.0,
        },
    ]
    assert recent.share_book("stripe").status(SHARE, shown=1)["tenants"][0]["tenant"] == "acme"


def test_a_tenant_alone_gets_its_whole_class_and_an_idle_one_is_not_shown() -> None:
    clock = ManualClock()
    book = ShareBook(clock)
    for _ in range(20):
        book.add("batch", "solo", "forwarded")
    clock._now += 1.0
    doc = book.status(SHARE)
    checkout, batch = doc["classes"]
    assert checkout == {
        "name": "checkout",
        "granted_per_second": 0.0,
        "waiting": False,
        "refused_per_second": 0.0,
        "share": 0.0,
        "min_share": None,
        "active_tenants": 0,
        "active_weight": 0.0,
    }
    assert batch["share"] == 1.0 and batch["waiting"] is False and batch["min_share"] == 0.1
    (solo,) = doc["tenants"]
    assert solo["fair_per_second"] == solo["granted_per_second"] == 2.0 and solo["ratio"] == 1.0
    assert solo["weight"] == 1.0  # unlisted: the default weight


def test_nothing_granted_yet() -> None:
    doc = ShareBook(ManualClock()).status(SHARE)
    assert doc["granted_per_second"] == 0.0 and doc["tenants"] == [] and doc["active_tenants"] == 0
    assert [c["share"] for c in doc["classes"]] == [None, None]  # no share of nothing
    assert [c["name"] for c in doc["classes"]] == ["checkout", "batch"]


def test_the_window_is_the_last_ten_complete_seconds() -> None:
    clock = ManualClock(1000.5)
    book = ShareBook(clock)
    book.add("checkout", "acme", "forwarded", 3.0)
    book.add("batch", "gamma", "deferred")

    def figures() -> tuple[float, float, bool, list[str]]:
        doc = book.status(SHARE)
        checkout, batch = doc["classes"]
        return (
            checkout["granted_per_second"],
            batch["refused_per_second"],
            batch["waiting"],
            [t["tenant"] for t in doc["tenants"]],
        )

    assert figures() == (0.0, 0.0, False, [])  # this second is not over yet
    clock._now = 1001.0
    assert figures() == (0.3, 0.1, True, ["acme", "gamma"])
    clock._now = 1010.99  # the tenth second after it
    assert figures() == (0.3, 0.1, True, ["acme", "gamma"])
    clock._now = 1011.0
    assert figures() == (0.0, 0.0, False, [])  # out of the window: idle, not listed
    # A slot comes round again after the ring's length: it starts from zero, not from the old count.
    clock._now = 1000.0 + 11 * 3 + 0.5
    book.add("checkout", "acme", "forwarded")
    clock._now += 1.0
    assert figures()[0] == 0.1
    # Every second for 25 s, n tokens in the n-th: the window holds the last ten.
    for n in range(1, 26):
        clock._now += 1.0
        book.add("checkout", "acme", "forwarded", float(n))
    clock._now += 1.0
    assert figures()[0] == sum(range(16, 26)) / 10


def test_memory_is_bounded_under_sprayed_tenants() -> None:
    clock = ManualClock()
    registry = CollectorRegistry()
    t, recent = tally(clock, registry)
    rng = random.Random(7)
    for i in range(20_000):
        t.shared(SHARE, rng.randrange(2), f"spray-{i}", rng.choice(("forwarded", "deferred", "held", "shed")))
        if i % 200 == 0:
            t.shared(SHARE, CHECKOUT, "steady", "forwarded")  # before TENANTS_KEPT new ones came
        if i % 1000 == 999:
            clock._now += 1.0
    book = recent.share_book("stripe")
    assert len(book) == TENANTS_KEPT
    assert len(book._classes) == 2
    doc = book.status(SHARE)
    assert doc["active_tenants"] <= TENANTS_KEPT and len(doc["tenants"]) == TENANTS_SHOWN
    assert ("steady", "checkout") in book._tenants  # a steady tenant stays through the spray
    assert len(book.status(SHARE, shown=10_000)["tenants"]) == doc["active_tenants"]
    # The metric's labels are the policy's classes, whatever the tenants.
    series = {
        (s.labels["class"], s.labels["outcome"])
        for m in registry.collect()
        if m.name == "ratelimit_class_requests"
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert {klass for klass, _ in series} == {"checkout", "batch"}
    # Classes renamed by reload after reload: bounded too.
    for n in range(3 * CLASSES_KEPT):
        book.add(f"class-{n}", "acme", "forwarded")
    assert len(book._classes) == CLASSES_KEPT


def test_the_least_recent_tenant_makes_room() -> None:
    book = ShareBook(ManualClock(), kept=3)
    for tenant in ("a", "b", "c"):
        book.add("batch", tenant, "forwarded")
    book.add("batch", "a", "forwarded")  # a is the most recent now
    book.add("batch", "d", "forwarded")  # b makes room
    assert list(book._tenants) == [("c", "batch"), ("a", "batch"), ("d", "batch")]
    book.add("checkout", "a", "forwarded")  # a tenant in another class is another pair
    assert list(book._tenants) == [("a", "batch"), ("d", "batch"), ("a", "checkout")]


def test_tally_counts_each_request_by_class_and_outcome() -> None:
    clock = ManualClock()
    registry = CollectorRegistry()
    t, _ = tally(clock, registry)
    contention(t)

    def counted(klass: str, outcome: str) -> float | None:
        labels = {"limiter": "stripe", "class": klass, "outcome": outcome}
        return registry.get_sample_value("ratelimit_class_requests_total", labels)

    assert counted("checkout", "forwarded") == 40  # requests, not tokens
    assert counted("checkout", "held") == 10
    assert counted("checkout", "deferred") == 20
    assert counted("batch", "forwarded") == 4
    assert counted("batch", "shed") == 5
    assert counted("batch", "deferred") == 30
    assert counted("batch", "error") == 3
    assert counted("checkout", "shed") is None


# -- /status ----------------------------------------------------------------------------------------


def shared_policy(upstream: str) -> Policy:
    """stripe shares its quota (SHARE); plain does not."""
    policy = make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store: {url: "memory://", timeout: 250ms}
        vendors:
          - name: stripe
            hosts: [api.stripe.example]
            route: /stripe
            upstream: $upstream
            limits: [{rate: 100, per: 1s, burst: 20}]
            on_limit: {action: defer}
          - name: plain
            hosts: [api.plain.example]
            route: /plain
            upstream: $upstream
            limits: [{rate: 10, per: 1s}]
        """,
        upstream=upstream,
    )
    stripe, plain = policy.vendors
    return dataclasses.replace(policy, vendors=(dataclasses.replace(stripe, share=SHARE), plain))


@pytest.fixture
async def proxy(vendor: Vendor, start_proxy: Any, clock: ManualClock) -> AsyncIterator[ProxyServer]:
    yield await start_proxy(shared_policy(vendor.url), clock=clock)


async def status(proxy: ProxyServer, query: str = "") -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/status{query}") as r:
        assert r.status == 200, await r.text()
        body: dict[str, Any] = await r.json()
        return body


async def test_status_shows_each_class_and_tenant_against_its_fair_share(
    proxy: ProxyServer, clock: ManualClock
) -> None:
    doc = await status(proxy)
    stripe, plain = doc["vendors"]
    assert "share" not in plain
    assert stripe["share"]["tenants"] == [] and [c["name"] for c in stripe["share"]["classes"]] == ["checkout", "batch"]

    contention(proxy.runtime.deps.tally("stripe"))
    expected = ShareBook(clock)  # the same calls, on a book of its own
    for name, tenant, outcome, times, cost in CONTENTION:
        for _ in range(times):
            expected.add(name, tenant, outcome, cost)
    await clock.advance(1.0)
    stripe = (await status(proxy))["vendors"][0]
    assert stripe["share"] == expected.status(SHARE)
    assert stripe["share"]["classes"][0]["granted_per_second"] == 5.0

    # Many tenants: the most active 20 by default, more when asked, all of them with "all".
    t = proxy.runtime.deps.tally("stripe")
    for n in range(30):
        play(t, BATCH, f"t{n:02}", "forwarded", n + 40)
    await clock.advance(1.0)
    share = (await status(proxy))["vendors"][0]["share"]
    assert len(share["tenants"]) == TENANTS_SHOWN and share["active_tenants"] == 34
    assert [x["tenant"] for x in share["tenants"][:3]] == ["t29", "t28", "t27"]
    assert len((await status(proxy, "?share_tenants=25"))["vendors"][0]["share"]["tenants"]) == 25
    assert len((await status(proxy, "?share_tenants=all"))["vendors"][0]["share"]["tenants"]) == 34
    assert len((await status(proxy, "?share_tenants=junk"))["vendors"][0]["share"]["tenants"]) == TENANTS_SHOWN

    # Ten seconds later, nothing is left in the window.
    await clock.advance(float(WINDOW_SECONDS))
    share = (await status(proxy))["vendors"][0]["share"]
    assert share["tenants"] == [] and share["granted_per_second"] == 0.0


CONTENTION = [
    ("checkout", "acme", "forwarded", 30, 1.0),
    ("checkout", "acme", "held", 10, 1.0),
    ("checkout", "beta", "forwarded", 10, 1.0),
    ("checkout", "beta", "deferred", 20, 1.0),
    ("batch", "gamma", "forwarded", 4, 2.0),
    ("batch", "gamma", "shed", 5, 1.0),
    ("batch", "delta", "deferred", 30, 1.0),
    ("batch", "delta", "error", 3, 1.0),
]
"""``contention`` as the book's calls."""


async def test_metrics_expose_the_class_counter(proxy: ProxyServer) -> None:
    play(proxy.runtime.deps.tally("stripe"), CHECKOUT, "acme", "held", 2)
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        text = await r.text()
    assert 'ratelimit_class_requests_total{class="checkout",limiter="stripe",outcome="held"} 2.0' in text


# -- run --workers N ------------------------------------------------------------------------------


def worker_doc(book: ShareBook, shown: int) -> dict[str, Any]:
    return {
        "store": {"breaker": "closed"},
        "vendors": [
            {
                "name": "stripe",
                "requests_by_mode": {"plain": 1},
                "held_now": 0,
                "breaker": "closed",
                "blocked_for_seconds": 0,
                "learned": None,
                "recent": {"window_seconds": 10},
                "share": book.status(SHARE, shown),
            }
        ],
    }


def test_workers_merge_sums_the_rates_and_computes_fair_shares_again() -> None:
    """Two workers' books, each with part of the traffic, merge into what one book with all
    of it says: rates summed, a tenant seen by both counted once in its class's weights."""
    clock = ManualClock()
    one, two, whole = ShareBook(clock), ShareBook(clock), ShareBook(clock)
    rng = random.Random(3)
    for name, tenant, outcome, times, cost in CONTENTION + [("batch", f"t{n}", "forwarded", n, 1.0) for n in range(30)]:
        for _ in range(times):
            rng.choice((one, two)).add(name, tenant, outcome, cost)
            whole.add(name, tenant, outcome, cost)
    clock._now += 1.0
    merged = merge_status([worker_doc(one, TENANTS_KEPT), worker_doc(two, TENANTS_KEPT)])
    (stripe,) = merged["vendors"]
    assert stripe["share"] == whole.status(SHARE)
    assert len(stripe["share"]["tenants"]) == TENANTS_SHOWN and stripe["share"]["active_tenants"] == 33
    wider = merge_status([worker_doc(one, TENANTS_KEPT), worker_doc(two, TENANTS_KEPT)], shown=TENANTS_KEPT)
    assert wider["vendors"][0]["share"] == whole.status(SHARE, TENANTS_KEPT)
    # One worker alone: its own figures, the list cut to what was asked.
    alone = merge_status([worker_doc(one, TENANTS_KEPT)])["vendors"][0]["share"]
    assert alone == one.status(SHARE)


def test_workers_merge_ignores_a_class_the_first_worker_does_not_have() -> None:
    clock = ManualClock()
    one, two = ShareBook(clock), ShareBook(clock)
    one.add("checkout", "acme", "forwarded")
    two.add("checkout", "acme", "forwarded")
    two.add("bulk", "zed", "forwarded")  # a policy being reloaded: another class
    clock._now += 1.0
    other = dataclasses.replace(SHARE, classes=("checkout", "bulk"), default_class="bulk")
    first, second = worker_doc(one, TENANTS_KEPT), worker_doc(two, TENANTS_KEPT)
    second["vendors"][0]["share"] = two.status(other, TENANTS_KEPT)
    share = merge_status([first, second])["vendors"][0]["share"]
    assert [c["name"] for c in share["classes"]] == ["checkout", "batch"]
    assert [(t["tenant"], t["granted_per_second"]) for t in share["tenants"]] == [("acme", 0.2)]
    assert share["granted_per_second"] == 0.2
