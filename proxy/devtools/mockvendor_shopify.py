"""Shopify-shaped GraphQL answers of the mock vendor: a shop's bucket of query-cost points.

    POST /admin/api/{version}/graphql.json    {"query": "...", "variables": {...}}

Shopify's GraphQL Admin API counts query cost, not requests: a shop has a bucket of
``size`` points (1,000 on a standard plan) refilling at ``restore`` points a second (50). A
query is admitted when the bucket holds its *requested* cost (Shopify computes it from the
query; the mock takes it from the mock-only header ``X-Mock-Query-Cost``, default 10), and
takes its *actual* cost (``X-Mock-Actual-Cost``, at most the requested one; default the
requested one): Shopify takes the requested cost first and gives the difference back when the
query ends, which a query answered at once makes the same. Every answer states both and the
bucket in ``extensions.cost`` (``throttleStatus``: ``maximumAvailable``,
``currentlyAvailable``, ``restoreRate``); a query the bucket cannot cover is not run and is
answered **200** with ``errors[0].extensions.code: THROTTLED`` and ``actualQueryCost: null``,
as Shopify does. The answer's data is a made-up shop.

``stats()`` (``/__mock/stats``'s ``graphql``): the bucket now, the queries run and throttled,
and the points they used (actual).
"""

from __future__ import annotations

import json
import re
from typing import Final, TypedDict

from aiohttp import web

from proxy.devtools.mockvendor_quota import Clock
from proxy.devtools.mockvendor_shapes import BadInput, json_answer
from proxy.devtools.mockvendor_tokens import Reservation

__all__ = ["ACTUAL_COST_HEADER", "QUERY_COST_HEADER", "GraphqlStats", "ShopifyShape"]

QUERY_COST_HEADER: Final = "X-Mock-Query-Cost"
ACTUAL_COST_HEADER: Final = "X-Mock-Actual-Cost"
DEFAULT_SIZE: Final = 1000.0
DEFAULT_RESTORE: Final = 50.0
_DEFAULT_COST: Final = 10
_PATH: Final = re.compile(r"/admin/api/[^/]+/graphql\.json")
_DOCS: Final = "https://shopify.dev/api/usage/rate-limits"
_REST_429: Final = "Exceeded 2 calls per second for api client. Reduce request rates to resume uninterrupted service."


class GraphqlStats(TypedDict):
    maximum_available: float
    restore_rate: float
    currently_available: float
    queries: int
    throttled: int
    points_used: int


class ShopifyShape:
    """Shopify's GraphQL Admin API, as the mock imitates it (see the module docstring)."""

    name = "shopify"
    quota_headers = "none"  # (GraphQL tells its bucket in the body, not in headers)
    meter = None

    def __init__(self, clock: Clock, size: float = DEFAULT_SIZE, restore: float = DEFAULT_RESTORE) -> None:
        self._clock = clock
        self.size, self.restore = size, restore
        self._available, self._at = size, clock()
        self.queries = self.throttled = self.points_used = 0

    def owns(self, path: str) -> bool:
        return _PATH.fullmatch(path) is not None

    def _now(self) -> float:
        now = self._clock()
        self._available = min(self.size, self._available + (now - self._at) * self.restore)
        self._at = now
        return self._available

    def _status(self) -> dict[str, float]:
        return {"maximumAvailable": self.size, "currentlyAvailable": int(self._available), "restoreRate": self.restore}

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        try:
            requested, actual = _costs(request)
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise BadInput("Invalid JSON in the request body") from None
            if not isinstance(body, dict) or not isinstance(body.get("query"), str):
                raise BadInput("Parameter Missing or Invalid: query")
        except BadInput as exc:
            return json_answer(400, {"errors": [{"message": str(exc)}]}, headers)
        available = self._now()
        cost: dict[str, object] = {"requestedQueryCost": requested}
        if requested > available:
            self.throttled += 1
            cost |= {"actualQueryCost": None, "throttleStatus": self._status()}
            error = {"message": "Throttled", "extensions": {"code": "THROTTLED", "documentation": _DOCS}}
            return json_answer(200, {"errors": [error], "extensions": {"cost": cost}}, headers)
        self._available -= actual
        self.queries += 1
        self.points_used += actual
        cost |= {"actualQueryCost": actual, "throttleStatus": self._status()}
        data = {"shop": {"name": "mock shop", "id": "gid://shopify/Shop/1"}}
        return json_answer(200, {"data": data, "extensions": {"cost": cost}}, headers)

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        """The request quota's 429 (``--rate``), as Shopify's REST 429 reads."""
        return json_answer(429, {"errors": _REST_429}, {"Retry-After": str(retry_after), **headers})

    def reset(self) -> None:
        self._available, self._at = self.size, self._clock()
        self.queries = self.throttled = self.points_used = 0

    def stats(self) -> GraphqlStats:
        self._now()
        return {
            "maximum_available": self.size,
            "restore_rate": self.restore,
            "currently_available": self._available,
            "queries": self.queries,
            "throttled": self.throttled,
            "points_used": self.points_used,
        }


def _costs(request: web.BaseRequest) -> tuple[int, int]:
    """(requested, actual) query cost, from the mock-only headers; BadInput for a bad one."""
    requested = _header_int(request, QUERY_COST_HEADER, _DEFAULT_COST)
    actual = _header_int(request, ACTUAL_COST_HEADER, requested)
    if actual > requested:
        raise BadInput(f"{ACTUAL_COST_HEADER} ({actual}) is more than {QUERY_COST_HEADER} ({requested})")
    return requested, actual


def _header_int(request: web.BaseRequest, name: str, default: int) -> int:
    raw = request.headers.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit():
        raise BadInput(f"{name} must be a whole number of points, not {raw!r}")
    return int(raw.strip())
