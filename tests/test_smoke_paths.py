"""Quick checks of the request path with an in-process proxy and mock vendor."""

from __future__ import annotations

import aiohttp
from yarl import URL

from tests.conftest import vendor_policy


async def test_absolute_form_forwarded_and_headers_stripped(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with (
        aiohttp.ClientSession() as s,
        s.get(
            URL("http://api.payments.example/v1/charges?x=%2F", encoded=True),
            proxy=proxy.url,
            headers={
                "X-Tenant-Id": "acme",
                "X-Quota-On-Limit": "defer",
                "Connection": "keep-alive, X-Secret",
                "X-Secret": "hop",
                "X-Kept": "yes",
            },
        ) as r,
    ):
        assert r.status == 200
        body = await r.json()
    assert body["path"] == "/v1/charges"
    (seen,) = vendor.mock.requests
    assert seen["path_qs"] == "/v1/charges?x=%2F"
    assert seen["headers"]["x-kept"] == "yes"
    for gone in ("x-tenant-id", "x-quota-on-limit", "x-secret", "connection", "proxy-connection"):
        assert gone not in seen["headers"]
