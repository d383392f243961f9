"""The mock vendor's Shopify GraphQL shape: a shop's bucket of query-cost points, a query run
when the bucket holds its requested cost and taking its actual one, a THROTTLED answer (a
200) otherwise, the bucket stated in every answer's ``extensions.cost.throttleStatus``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_shopify import ACTUAL_COST_HEADER, QUERY_COST_HEADER
from proxy.limiter.quota_headers import SHOPIFY, read_body_quota
from tests.helpers.meter_samples import SHOPIFY_THROTTLED_JSON

GRAPHQL = "/admin/api/2025-01/graphql.json"
QUERY = {"query": "{ shop { name } }"}


async def ask(client: Any, requested: int, actual: int | None = None) -> dict[str, Any]:
    headers = {QUERY_COST_HEADER: str(requested)}
    if actual is not None:
        headers[ACTUAL_COST_HEADER] = str(actual)
    r = await client.post(GRAPHQL, json=QUERY, headers=headers)
    assert r.status == 200, await r.text()
    return dict(await r.json())


async def test_a_query_takes_its_actual_cost_and_a_query_the_bucket_cannot_cover_is_throttled(
    aiohttp_client: Any,
) -> None:
    clock = ManualClock()
    vendor = MockVendor(rate=None, clock=clock.monotonic, graphql_points=100, graphql_restore=10)
    client = await aiohttp_client(vendor.app())
    first = await ask(client, 80, 30)
    assert first["data"]["shop"]["name"]
    assert first["extensions"]["cost"] == {
        "requestedQueryCost": 80,
        "actualQueryCost": 30,
        "throttleStatus": {"maximumAvailable": 100, "currentlyAvailable": 70, "restoreRate": 10},
    }
    throttled = await ask(client, 80)  # 70 available: not run
    assert throttled["errors"][0]["extensions"]["code"] == "THROTTLED" and "data" not in throttled
    assert throttled["extensions"]["cost"]["actualQueryCost"] is None
    assert throttled.keys() == read_shape(SHOPIFY_THROTTLED_JSON)  # as Shopify words it
    await clock.advance(1.0)  # 80 again
    assert (await ask(client, 80))["extensions"]["cost"]["throttleStatus"]["currentlyAvailable"] == 0
    stats = vendor.stats()["graphql"]
    assert (stats["queries"], stats["throttled"], stats["points_used"]) == (2, 1, 110)
    # What the proxy reads of it (feedback.headers: auto): the shop's bucket.
    (report,) = read_body_quota(throttled).values()
    assert set(read_body_quota(throttled)) == {SHOPIFY} and (report.size, report.restore) == (100, 10)


def read_shape(raw: bytes) -> set[str]:
    return set(json.loads(raw))


@pytest.mark.parametrize(
    ("headers", "said"),
    [
        ({QUERY_COST_HEADER: "ten"}, "whole number"),
        ({QUERY_COST_HEADER: "10", ACTUAL_COST_HEADER: "11"}, "more than"),
    ],
)
async def test_bad_mock_costs_are_a_400(aiohttp_client: Any, headers: dict[str, str], said: str) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    r = await client.post(GRAPHQL, json=QUERY, headers=headers)
    assert r.status == 400 and said in (await r.json())["errors"][0]["message"]
    r = await client.post(GRAPHQL, data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status == 400
