"""The admin listener (SPEC §7): metric names and labels after real traffic, every
outcome from a real scenario, /healthz, /readyz on both stores, /status."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.server import ProxyServer
from proxy.telemetry.metrics import OUTCOMES
from tests.conftest import (
    RedisServer,
    Samples,
    eventually,
    free_port,
    make_policy,
    metric_samples,
    value,
    vendor_policy,
)

# SPEC §7, exactly: sample name -> (family type, label names)
SPEC_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "ratelimit_requests_total": ("counter", frozenset({"limiter", "tenant", "outcome"})),
    "ratelimit_deferred_total": ("counter", frozenset({"limiter"})),
    "ratelimit_shed_total": ("counter", frozenset({"limiter"})),
    "ratelimit_hold_seconds": ("histogram", frozenset({"limiter"})),
    "ratelimit_tokens_available": ("gauge", frozenset({"limiter"})),
    "ratelimit_store_errors_total": ("counter", frozenset()),
    "http_client_responses_total": ("counter", frozenset({"limiter", "code"})),
    "http_client_request_duration_seconds": ("histogram", frozenset({"limiter"})),
}


def two_vendor_policy(upstream: str, store: str = "memory://") -> Any:
    """payments (per-tenant behaviour chosen by tenant name) and gone (nothing listens)."""
    return make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store: {url: "$store", timeout: 500ms}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            route: /payments
            upstream: $upstream
            limits: [{rate: 100, per: 1h, burst: 100}]
            tenant_limits:
              default: [{rate: 1000, per: 1s}]
              overrides:
                slow: [{rate: 1, per: 1h, burst: 1}]
                pace: [{rate: 5, per: 1s, burst: 1}]
            on_limit: {action: hold, max_hold: 500ms}
          - name: gone
            hosts: [api.gone.example]
            route: /gone
            upstream: http://127.0.0.1:$dead
            limits: [{rate: 1000, per: 1s}]
            timeouts: {connect: 1s, read: 2s}
        """,
        store=store,
        upstream=upstream,
        dead=free_port(),
    )


async def get(s: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with s.get(url, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def admin_json(s: aiohttp.ClientSession, proxy: ProxyServer, path: str) -> tuple[int, Any]:
    async with s.get(f"{proxy.admin_url}{path}") as r:
        assert r.content_type == "application/json"
        return r.status, await r.json()


async def scrape(s: aiohttp.ClientSession, proxy: ProxyServer) -> tuple[dict[str, Any], Samples]:
    async with s.get(f"{proxy.admin_url}/metrics") as r:
        assert r.status == 200
        assert r.content_type == "text/plain"
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = metric_samples(text)
    return families, samples


# -- /metrics --------------------------------------------------------------------------


async def test_metrics_names_labels_and_every_outcome_from_real_traffic(vendor: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(two_vendor_policy(vendor.url))
    pay = f"{proxy.url}/payments/v1/charges"
    async with aiohttp.ClientSession() as s:
        # forwarded
        status, _, _ = await get(s, pay, **{"X-Tenant-Id": "acme"})
        assert status == 200
        # held: a burst of one refilling at 5/s; three at once cannot all go now
        pace = await asyncio.gather(*(get(s, pay, **{"X-Tenant-Id": "pace"}) for _ in range(3)))
        assert [p[0] for p in pace] == [200, 200, 200]
        # deferred and shed: a tenant whose one token an hour is spent
        assert (await get(s, pay, **{"X-Tenant-Id": "slow"}))[0] == 200
        status, headers, body = await get(s, pay, **{"X-Tenant-Id": "slow", "X-Quota-On-Limit": "defer"})
        assert status == 429 and headers["X-Quota-Action"] == "defer" and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["action"] == "defer"
        status, headers, body = await get(s, pay, **{"X-Tenant-Id": "slow", "X-Quota-On-Limit": "shed"})
        assert status == 503 and headers["X-Quota-Action"] == "shed"
        assert json.loads(body)["action"] == "shed"
        # denied: a host in no vendor, and a malformed X-Quota header
        async with s.get("http://unknown.example/x", proxy=proxy.url) as r:
            assert r.status == 403 and r.headers["X-Quota-Action"] == "deny"
        status, _, _ = await get(s, pay, **{"X-Tenant-Id": "acme", "X-Quota-On-Limit": "sometimes"})
        assert status == 400
        # error: the vendor cannot be reached
        status, _, _ = await get(s, f"{proxy.url}/gone/v1/x")
        assert status == 502

        families, samples = await scrape(s, proxy)

    # Every SPEC name, with exactly its labels.
    by_name: dict[str, list[tuple[frozenset[tuple[str, str]], float]]] = {}
    for (name, labels), v in samples.items():
        by_name.setdefault(name, []).append((labels, v))
    for name, (kind, label_names) in SPEC_METRICS.items():
        family = families.get(name.removesuffix("_total"))
        assert family is not None, f"no metric family for {name}"
        assert family.type == kind, (name, family.type)
        shown = [name + "_bucket", name + "_count", name + "_sum"] if kind == "histogram" else [name]
        for sample_name in shown:
            assert by_name.get(sample_name), f"{sample_name} missing from /metrics"
            for labels, _ in by_name[sample_name]:
                keys = {k for k, _ in labels} - ({"le"} if sample_name.endswith("_bucket") else set())
                assert keys == label_names, (sample_name, keys)

    # Each outcome from its own scenario, counted under its vendor and tenant.
    req = "ratelimit_requests_total"
    assert value(samples, req, limiter="payments", tenant="acme", outcome="forwarded") == 1
    held = value(samples, req, limiter="payments", tenant="pace", outcome="held")
    assert held >= 1
    assert held + value(samples, req, limiter="payments", tenant="pace", outcome="forwarded") == 3
    assert value(samples, req, limiter="payments", tenant="slow", outcome="forwarded") == 1
    assert value(samples, req, limiter="payments", tenant="slow", outcome="deferred") == 1
    assert value(samples, req, limiter="payments", tenant="slow", outcome="shed") == 1
    assert value(samples, req, limiter="payments", tenant="acme", outcome="denied") == 1
    assert sum(v for labels, v in by_name[req] if ("outcome", "denied") in labels) == 2
    assert value(samples, req, limiter="gone", tenant="default", outcome="error") == 1
    seen = {dict(labels)["outcome"] for labels, v in by_name[req] if v > 0}
    assert seen == set(OUTCOMES)
    assert sum(v for _, v in by_name[req]) == 10  # every request counted exactly once

    assert value(samples, "ratelimit_deferred_total", limiter="payments") == 1
    assert value(samples, "ratelimit_shed_total", limiter="payments") == 1
    assert value(samples, "ratelimit_hold_seconds_count", limiter="payments") == held
    assert 0 < value(samples, "ratelimit_hold_seconds_sum", limiter="payments") <= 0.5 * held
    assert value(samples, "ratelimit_hold_seconds_bucket", limiter="payments", le="+Inf") == held
    assert value(samples, "ratelimit_store_errors_total") == 0
    # 5 grants from the global bucket of 100 an hour.
    assert value(samples, "ratelimit_tokens_available", limiter="payments") == pytest.approx(95, abs=0.5)
    assert value(samples, "ratelimit_tokens_available", limiter="gone") == pytest.approx(1000)
    assert value(samples, "http_client_responses_total", limiter="payments", code="200") == 5
    assert value(samples, "http_client_request_duration_seconds_count", limiter="payments") == 5
    assert value(samples, "http_client_request_duration_seconds_sum", limiter="payments") > 0
    # A 502 of our own is no vendor response: the vendor that was never reached has only the
    # zero series declared at start (so its first 429 shows as an increase).
    gone = {
        labels: v
        for (name, labels), v in samples.items()
        if name == "http_client_responses_total" and ("limiter", "gone") in labels
    }
    assert gone == {frozenset({("limiter", "gone"), ("code", "429")}): 0.0}


async def test_vendor_status_codes_are_labelled(vendor: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s:
        for path in ("/status/201", "/status/404", "/status/404"):
            assert (await get(s, f"{proxy.url}/payments{path}"))[0] == int(path.rsplit("/", 1)[1])
        _, samples = await scrape(s, proxy)
    assert value(samples, "http_client_responses_total", limiter="payments", code="201") == 1
    assert value(samples, "http_client_responses_total", limiter="payments", code="404") == 2
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="forwarded") == 3


# -- /healthz and /readyz --------------------------------------------------------------


async def test_healthz_and_readyz_on_the_memory_store(vendor: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s:
        status, body = await admin_json(s, proxy, "/healthz")
        assert status == 200 and body["status"] == "ok"
        status, body = await admin_json(s, proxy, "/readyz")
        assert status == 200 and body["vendors"] == ["payments"]


async def test_readyz_follows_redis(own_redis: RedisServer, vendor: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, store=own_redis.url))
    async with aiohttp.ClientSession() as s:
        status, _ = await admin_json(s, proxy, "/readyz")
        assert status == 200
        own_redis.kill()
        started = time.monotonic()
        status, body = await admin_json(s, proxy, "/readyz")
        assert status == 503, body
        assert "store" in body["status"]
        assert time.monotonic() - started < 2.0
        status, body = await admin_json(s, proxy, "/healthz")
        assert status == 200  # alive, just not ready
        # /status still answers, and says what is wrong.
        status, body = await admin_json(s, proxy, "/status")
        assert status == 200
        (entry,) = body["vendors"]
        assert entry["buckets"] is None and entry["store_error"]

        own_redis.start()

        async def ready() -> bool:
            return (await admin_json(s, proxy, "/readyz"))[0] == 200

        await eventually(ready, "/readyz after Redis came back")
        assert (await get(s, f"{proxy.url}/payments/v1/x"))[0] == 200


@pytest.mark.parametrize("refusal", ["read-only replica", "out of memory", "writes paused"])
async def test_readyz_follows_whether_the_store_can_grant(
    own_redis: RedisServer, vendor: Any, start_proxy: Any, refusal: str
) -> None:
    """Redis answering PING but refusing (or stalling) the script's writes defers every
    request: a load balancer must stop routing here, so /readyz says 503 too."""
    proxy = await start_proxy(vendor_policy(vendor.url, store=own_redis.url, on_limit="{action: defer}"))
    async with aiohttp.ClientSession() as s:
        assert (await admin_json(s, proxy, "/readyz"))[0] == 200
        with own_redis.client() as c:
            if refusal == "read-only replica":
                c.replicaof("127.0.0.1", free_port())  # a master that is not there: stays read-only
            elif refusal == "out of memory":
                c.config_set("maxmemory-policy", "noeviction")
                c.config_set("maxmemory", 1)
            else:
                c.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
            assert c.ping()  # what a PING-only check sees
        status, _, _ = await get(s, f"{proxy.url}/payments/v1/x")
        assert status == 429  # every request deferred...
        status, body = await admin_json(s, proxy, "/readyz")
        assert status == 503, body  # ...so not ready
        assert "store" in body["status"]
        with own_redis.client() as c:
            if refusal == "read-only replica":
                c.replicaof("NO", "ONE")
            elif refusal == "out of memory":
                c.config_set("maxmemory", 0)
            else:
                c.execute_command("CLIENT", "UNPAUSE")

        async def ready() -> bool:
            return (await admin_json(s, proxy, "/readyz"))[0] == 200

        await eventually(ready, "/readyz once the store grants again")


async def test_readyz_on_a_shared_redis(redis_url: str, vendor: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, store=redis_url))
    async with aiohttp.ClientSession() as s:
        status, body = await admin_json(s, proxy, "/readyz")
        assert status == 200 and body["status"] == "ready"


# -- /status ---------------------------------------------------------------------------


async def test_status_lists_buckets_breaker_rates_and_holds(redis_url: str, vendor: Any, start_proxy: Any) -> None:
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits="[{rate: 2, per: 1s, burst: 1}, {rate: 100, per: 1h, burst: 100}]",
        tenant_limits="tenant_limits: {default: [{rate: 50, per: 1s, burst: 50}]}",
        on_limit="{action: hold, max_hold: 2s}",
    )
    proxy = await start_proxy(policy)
    async with aiohttp.ClientSession() as s:
        status, body = await admin_json(s, proxy, "/status")
        assert status == 200
        assert body["store"]["breaker"] == "closed"
        (entry,) = body["vendors"]
        assert entry["name"] == "payments"
        assert [b["tokens"] for b in entry["buckets"]] == [1, 100]  # untouched: full
        assert entry["held_now"] == 0

        assert (await get(s, f"{proxy.url}/payments/v1/a"))[0] == 200
        held = asyncio.ensure_future(get(s, f"{proxy.url}/payments/v1/b"))  # waits ~0.5 s for its token

        async def holding() -> bool:
            return (await admin_json(s, proxy, "/status"))[1]["vendors"][0]["held_now"] == 1

        await eventually(holding, "/status showing the held request")
        _, body = await admin_json(s, proxy, "/status")
        (entry,) = body["vendors"]
        per_second, per_hour = entry["buckets"]
        assert per_second["tokens"] < 0  # reserved by the held request
        assert per_hour["tokens"] == pytest.approx(98, abs=0.1)
        assert entry["tokens_available"] == per_second["tokens"]
        assert {"bucket", "key", "rate_per_second", "burst", "tokens"} <= set(per_second)
        assert per_second["rate_per_second"] == 2 and per_second["burst"] == 1
        assert "{payments}" in per_second["key"]

        assert (await held)[0] == 200
        _, body = await admin_json(s, proxy, "/status")
        assert body["vendors"][0]["held_now"] == 0

        deferred = await get(s, f"{proxy.url}/payments/v1/c", **{"X-Quota-On-Limit": "defer"})
        assert deferred[0] == 429

        async def rates_shown() -> bool:
            recent = (await admin_json(s, proxy, "/status"))[1]["vendors"][0]["recent"]
            return bool(recent["forwarded_per_second"] > 0 and recent["held_per_second"] > 0)

        await eventually(rates_shown, "recent rates over the last complete seconds")
        _, body = await admin_json(s, proxy, "/status")
        recent = body["vendors"][0]["recent"]
        assert recent["deferred_last_minute"] == 1
        assert recent["vendor_429_last_minute"] == 0
        assert recent["forwarded_per_second"] == pytest.approx(2 / recent["window_seconds"])
        assert recent["held_per_second"] == pytest.approx(1 / recent["window_seconds"])
