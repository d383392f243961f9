"""Tenant ids sprayed by a worker cannot grow the store without bound (issue 9).

Tenant ids are not authenticated with ``from: header``: each new one made new store
keys (its buckets, its deferral queue), 100,000 tenants 100,001 keys, enough to fill a
bounded Redis into the fail-closed state. ``tenant.known_only`` accepts only the
policy's tenants; ``tenant.max_active`` bounds how many other tenants a vendor tracks
at once on a replica (the rest are deferred until a seat frees up).
"""

from __future__ import annotations

import asyncio

import aiohttp

from proxy.policy import Policy
from tests.conftest import RedisServer, Vendor, vendor_policy

SPRAYED = 200
VENDOR_URL = "http://api.payments.example"


def keys(server: RedisServer) -> int:
    with server.client() as c:
        return int(c.dbsize())


def policy(vendor: Vendor, store: str, tenant: str) -> Policy:
    """Vendor ``payments``, whose tenants each have a bucket (``acme`` its own), with ``tenant: {TENANT}``."""
    return vendor_policy(
        vendor.url,
        store=store,
        tenant_limits="tenant_limits: {default: [{rate: 10, per: 1m}], overrides: {acme: [{rate: 10, per: 1m}]}}",
        extra_top=f"tenant: {{{tenant}}}",
    )


async def spray(proxy_url: str) -> list[int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=20)) as s:

        async def one(i: int) -> int:
            headers = {"X-Tenant-Id": f"sprayed-{i}", "X-Quota-On-Limit": "defer"}
            async with s.get(f"{VENDOR_URL}/v1", proxy=proxy_url, headers=headers) as r:
                await r.read()
                return r.status

        return list(await asyncio.gather(*(one(i) for i in range(SPRAYED))))


async def test_sprayed_tenant_ids_are_bounded_by_max_active(vendor, redis_server, redis_url, start_proxy) -> None:
    proxy = await start_proxy(policy(vendor, redis_url, "max_active: 20"))
    statuses = await spray(proxy.url)
    print(f"{SPRAYED} sprayed tenants with max_active 20: {keys(redis_server)} keys")
    assert statuses.count(200) == 20 and statuses.count(429) == SPRAYED - 20, statuses
    assert keys(redis_server) <= 20 + 1  # 20 tenants' buckets and the vendor's state
    assert len(vendor.mock.requests) == 20

    async with aiohttp.ClientSession() as s:
        # A tenant the policy names never needs a seat.
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers={"X-Tenant-Id": "acme"}) as r:
            assert r.status == 200
        # The 21st new tenant is told when a seat frees up, in words and headers.
        headers = {"X-Tenant-Id": "one-more", "X-Quota-On-Limit": "defer"}
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers=headers) as r:
            assert r.status == 429
            body = await r.json()
            assert r.headers["X-Quota-Action"] == "defer" and r.headers["X-Quota-Scope"] == "tenants"
            assert body["message"].startswith(
                "payments has no room for another tenant (tenant.max_active 20 reached); retry in"
            ), body
            assert 55 <= body["retry_after"] <= 63  # the first seat frees once its keys have expired
        # A tenant already seated keeps its seat.
        seated = f"sprayed-{statuses.index(200)}"
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers={"X-Tenant-Id": seated}) as r:
            assert r.status == 200


async def test_known_only_refuses_tenants_the_policy_does_not_name(
    vendor, redis_server, redis_url, start_proxy
) -> None:
    proxy = await start_proxy(policy(vendor, redis_url, "known_only: true"))
    statuses = await spray(proxy.url)
    assert set(statuses) == {400}
    assert keys(redis_server) == 0
    async with aiohttp.ClientSession() as s:
        for tenant, status in (("acme", 200), (None, 200), ("globex", 400)):
            headers = {"X-Tenant-Id": tenant} if tenant else {}
            async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers=headers) as r:
                assert r.status == status, tenant
                if status == 400:
                    body = await r.json()
                    assert body["error"]["code"] == "unknown_tenant"
                    assert r.headers["x-should-retry"] == "false"
                    assert "'globex'" in body["message"] and "tenant.known_only" in body["message"]
    assert [r["headers"].get("x-tenant-id") for r in vendor.mock.requests] == [None, None]  # stripped
