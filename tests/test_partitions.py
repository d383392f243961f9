"""Partitions end to end (SPEC §10): a vendor's quota per credential. Two workers with
their own keys (``Authorization: Bearer A`` / ``Bearer B``) each get the whole quota, one
exhausted does not slow the other, the header reaches the vendor unchanged, and the raw
value is never written anywhere: Redis keys, access log, /status, /metrics."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import redis

from proxy.limiter.partitions import partition_hash
from proxy.policy.model import Partition, Policy
from proxy.telemetry.accesslog import AccessLog
from tests.conftest import client_session, vendor_policy

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

A = "Bearer sk_live_AAAA_secret_1111"
B = "Bearer sk_live_BBBB_secret_2222"
SECRETS = ("sk_live", "AAAA_secret", "BBBB_secret")


def partitioned(policy: Policy, header: str = "Authorization") -> Policy:
    vendor = dataclasses.replace(policy.vendors[0], partition=Partition(header))
    return dataclasses.replace(policy, vendors=(vendor,))


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


async def test_two_credentials_each_get_the_whole_quota_and_no_secret_is_written(
    vendor, start_proxy, redis_url
) -> None:
    stream = io.StringIO()
    access = AccessLog(stream)
    policy = partitioned(
        vendor_policy(
            vendor.url, store=redis_url, limits="[{rate: 3, per: 1h}]", on_limit="{action: hold, max_hold: 500ms}"
        )
    )
    proxy = await start_proxy(policy, access_log=access)
    async with client_session() as s:

        async def get(auth: str | None) -> int:
            headers = {} if auth is None else {"Authorization": auth}
            async with s.get("http://api.payments.example/v1/x", proxy=proxy.url, headers=headers) as r:
                await r.read()
                return r.status

        assert [await get(A) for _ in range(4)] == [200, 200, 200, 429]  # A's quota spent
        assert [await get(B) for _ in range(4)] == [200, 200, 200, 429]  # B's whole, untouched by A
        assert [await get(None) for _ in range(4)] == [200, 200, 200, 429]  # no header: the default one
        async with s.get(f"{proxy.admin_url}/status") as r:
            status_text = await r.text()
        async with s.get(f"{proxy.admin_url}/metrics") as r:
            metrics_text = await r.text()
    sent = [r["headers"].get("authorization") for r in vendor.mock.requests]
    assert sent == [A] * 3 + [B] * 3 + [None] * 3  # forwarded unchanged
    access.flush()
    logged = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["outcome"] for line in logged[:8]] == ["forwarded"] * 3 + ["deferred"] + ["forwarded"] * 3 + [
        "deferred"
    ]
    assert all(line["hold_ms"] == 0 for line in logged[4:7])  # B was never held behind A
    assert {line.get("partition") for line in logged[:4]} == {partition_hash(A)[:8]}
    assert {line.get("partition") for line in logged[8:]} == {None}
    with redis.Redis.from_url(redis_url) as c:
        stored = " ".join(k.decode() for k in c.scan_iter("*"))
        for key in c.scan_iter("*"):
            if c.type(key) == b"hash":
                stored += " ".join(f"{f!r}{v!r}" for f, v in c.hgetall(key).items())
    assert f"p:{partition_hash(A)}:state" in stored and f"p:{partition_hash(B)}:state" in stored
    assert leaks(stored) == [] and leaks(stream.getvalue()) == []
    assert leaks(status_text) == [] and leaks(metrics_text) == []
    (entry,) = json.loads(status_text)["vendors"]
    assert entry["partitions"]["seen_recently"] == 3 and entry["partitions"]["header"] == "Authorization"


async def test_a_vendor_429_blocks_only_the_credential_that_got_it(vendor, start_proxy) -> None:
    policy = partitioned(vendor_policy(vendor.url, limits="[{rate: 100, per: 1s}]", on_limit="{action: defer}"))
    proxy = await start_proxy(policy)
    vendor.mock.script(429, retry_after="30")
    async with client_session() as s:

        async def get(auth: str) -> tuple[int, str | None]:
            headers = {"Authorization": auth}
            async with s.get("http://api.payments.example/v1/x", proxy=proxy.url, headers=headers) as r:
                await r.read()
                return r.status, r.headers.get("X-Quota-Action")

        assert await get(A) == (429, None)  # the vendor's own 429
        assert await get(A) == (429, "defer")  # A blocked by the proxy now
        assert await get(B) == (200, None)  # B is another quota at the vendor: not blocked
        async with s.get(f"{proxy.admin_url}/status") as r:
            (entry,) = (await r.json())["vendors"]
    assert entry["partitions"]["blocked_now"] == 1 and entry["blocked_for_seconds"] == 0
    limiter = proxy.runtime.limiter
    assert 29 < limiter.blocked_for("payments", partition_hash(A)) <= 30
    assert limiter.blocked_for("payments", partition_hash(B)) == 0
