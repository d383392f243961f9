"""Endpoint classes (SPEC §10): their own buckets and cost, nested in the tenant's and the
vendor's, all taken in one store call; first match wins on the path the vendor is sent."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.limiter import Breaker, BucketStore, Limiter
from proxy.pipeline.match import Router
from proxy.pipeline.target import RequestTarget
from proxy.policy.model import Endpoint, EndpointMatch, Limit, OnLimit, Policy, TenantLimits, Vendor
from proxy.telemetry.accesslog import AccessLog
from tests.conftest import client_session, metric_samples, value, vendor_policy

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

PREFIX = "qp-endpoints"

SEARCH = Endpoint("search", EndpointMatch(("GET",), "/v1/*/search"), (Limit(2, 3600, 2),))
FILES = Endpoint("files", EndpointMatch((), "/v1/files*"), (Limit(20, 3600, 20),), cost=5)


def with_endpoints(policy: Policy, *endpoints: Endpoint, **changes: Any) -> Policy:
    vendor = dataclasses.replace(policy.vendors[0], endpoints=endpoints, **changes)
    return dataclasses.replace(policy, vendors=(vendor,))


# -- matching: the router ---------------------------------------------------------------


def target(path_qs: str, absolute: bool = True) -> RequestTarget:
    return RequestTarget(absolute, "http", "api.payments.example" if absolute else "", None, path_qs)


ROUTER = Router(with_endpoints(vendor_policy("http://127.0.0.1:1"), FILES, SEARCH))


def endpoint_of(path_qs: str, method: str = "GET", absolute: bool = True) -> str | None:
    e = ROUTER.match(target(path_qs, absolute), {}, method=method).endpoint
    return None if e is None else e.name


def test_the_first_matching_class_wins() -> None:
    assert endpoint_of("/v1/files/search") == "files"  # both match: files comes first
    assert endpoint_of("/v1/customers/search") == "search"
    assert endpoint_of("/v1/customers/search", "POST") is None  # search is GET only
    assert endpoint_of("/v1/files/upload", "POST") == "files"  # files: any method
    assert endpoint_of("/v1/charges") is None


def test_the_query_is_not_matched() -> None:
    assert endpoint_of("/v1/charges?next=/v1/a/search") is None  # "*" would match across the "?"
    assert endpoint_of("/v1/a/search?q=x") == "search"


def test_the_path_matched_is_the_one_sent_to_the_vendor() -> None:
    m = ROUTER.match(target("/payments/v1/a/search?q=1", absolute=False), {}, method="GET")
    assert (m.path_qs, m.endpoint) == ("/v1/a/search?q=1", SEARCH)  # the route prefix stripped
    assert endpoint_of("/payments/v1/files", absolute=False) == "files"


# -- buckets and cost: the limiter on each store ---------------------------------------------


def shop() -> Vendor:
    return Vendor(
        name="payments",
        limits=(Limit(100, 3600, 100),),
        tenant_limits=TenantLimits(default=(Limit(50, 3600, 50),)),
        endpoints=(FILES, SEARCH),
        on_limit=OnLimit("hold", 0.5),
    )


async def test_a_class_takes_its_cost_from_every_bucket_and_a_refusal_takes_nothing(store: BucketStore) -> None:
    clock = ManualClock()
    limiter = Limiter(store, clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))
    v = shop()
    b = limiter.buckets(v, "acme", FILES)
    assert [x.scope for x in b.all] == ["tenant", "endpoint", "global"]
    assert b.all[1].label == "endpoint files 20/1h burst 20"
    assert b.all[1].key == b.all[2].key == b.state_key  # endpoint buckets live in the state hash
    assert b.all[1].field == "e:files:20/3600/20"
    r = await limiter.acquire(v, "acme", 0, FILES.cost, endpoint=FILES)
    assert r.granted
    assert r.levels == pytest.approx((45, 15, 95), abs=0.01)
    for _ in range(3):
        assert (await limiter.acquire(v, "acme", 0, FILES.cost, endpoint=FILES)).granted
    refused = await limiter.acquire(v, "acme", 0, FILES.cost, endpoint=FILES)
    assert not refused.granted and refused.binding == 1  # the endpoint's bucket binds, before the vendor's
    _, levels = await limiter.peek(v, "acme", endpoint=FILES)
    assert levels == pytest.approx((30, 0, 80), abs=0.01)  # the refusal took nothing
    plain = await limiter.acquire(v, "acme", 0)  # a request of no class: tenant and global, cost 1
    assert plain.granted and plain.levels == pytest.approx((29, 79), abs=0.01)


# -- end to end: answers, metrics, access log, /status ---------------------------------------


async def test_a_class_limit_binds_before_the_vendors_and_is_named_everywhere(vendor, start_proxy) -> None:
    stream = io.StringIO()
    access = AccessLog(stream)
    policy = with_endpoints(
        vendor_policy(vendor.url, limits="[{rate: 100, per: 1h}]", on_limit="{action: defer}"), FILES, SEARCH
    )
    proxy = await start_proxy(policy, access_log=access)
    async with client_session() as s:
        statuses = []
        for path in ("/v1/a/search?q=1", "/v1/b/search", "/v1/c/search", "/v1/charges"):
            async with s.get(f"http://api.payments.example{path}", proxy=proxy.url) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert r.headers["X-Quota-Scope"] == "endpoint"
                    body = await r.json()
                    assert body["bucket"] == "endpoint search 2/1h burst 2"
        assert statuses == [200, 200, 429, 200]  # the vendor's quota is far from spent
        async with s.get(f"{proxy.admin_url}/metrics") as r:
            samples = metric_samples(await r.text())
        async with s.get(f"{proxy.admin_url}/status") as r:
            status = await r.json()
    counted = "ratelimit_endpoint_requests_total"
    assert value(samples, counted, limiter="payments", endpoint="search", outcome="forwarded") == 2
    assert value(samples, counted, limiter="payments", endpoint="search", outcome="deferred") == 1
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="forwarded") == 3
    assert not [k for k in samples if k[0] == counted and dict(k[1]).get("endpoint") not in ("search",)]
    access.flush()
    logged = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line.get("endpoint") for line in logged] == ["search", "search", "search", None]
    assert [line["outcome"] for line in logged] == ["forwarded", "forwarded", "deferred", "forwarded"]
    (entry,) = status["vendors"]
    search = next(e for e in entry["endpoints"] if e["name"] == "search")
    assert search["path"] == "/v1/*/search" and search["methods"] == ["GET"]
    assert [b["bucket"] for b in search["buckets"]] == ["endpoint search 2/1h burst 2"]
    assert search["buckets"][0]["tokens"] == pytest.approx(0.0, abs=0.01)
    assert entry["buckets"][0]["tokens"] == pytest.approx(97.0, abs=0.01)  # the vendor's: 3 forwarded


async def test_cost_is_taken_end_to_end(vendor, start_proxy) -> None:
    base = vendor_policy(vendor.url, limits="[{rate: 12, per: 1h}]", on_limit="{action: defer}")
    policy = with_endpoints(base, FILES)
    proxy = await start_proxy(policy)
    async with client_session() as s:
        statuses = []
        for path in ("/v1/files", "/v1/files/1", "/v1/files/2", "/v1/charges", "/v1/charges"):
            async with s.get(f"http://api.payments.example{path}", proxy=proxy.url) as r:
                statuses.append(r.status)
    # 12 tokens: two files (5 each) leave 2, too few for a third; a plain request costs 1.
    assert statuses == [200, 200, 429, 200, 200]
    assert vendor.mock.accepted == 4
