"""The IETF ``RateLimit-Policy`` and ``RateLimit`` fields (draft-ietf-httpapi-ratelimit-headers).

One item describes one proxy bucket, as Structured Field list members::

    RateLimit-Policy: "quota-proxy-global-80-1s";q=80;w=1
    RateLimit: "quota-proxy-global-80-1s";r=7;t=1

``q`` tokens every ``w`` seconds (whole numbers, never more than the bucket grants);
``r`` whole tokens left; ``t`` seconds until the bucket is full again, rounded up. A
request is described by its tightest bucket: the fewest tokens left, then the longest
refill. The proxy's own 429s always carry its item; a forwarded answer carries it (with
``ratelimit_headers: true``) only where it is tighter than what the vendor said, beside
the vendor's own fields, which pass through unchanged (SPEC §9).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from multidict import MultiMapping

from proxy.limiter.quota_headers import field, items
from proxy.policy.model import Endpoint, Limit, Vendor
from proxy.wire.ratelimit_item import RATELIMIT, QuotaItem

_EPS = 1e-9


def _shape(limit: Limit) -> tuple[int, int]:
    """``(q, w)`` in whole numbers: the window rounded up to whole seconds, the quota in it
    rounded down, so the item never promises more than the bucket grants (0.5/1s is 1 per 2s)."""
    window = max(1, math.ceil(limit.per - _EPS))
    quota = math.floor(limit.per_second * window + _EPS)
    if quota < 1:
        window = math.ceil(1 / limit.per_second - _EPS)
        quota = 1
    return quota, window


def bucket_item(limit: Limit, scope: str, level: float) -> QuotaItem:
    """The item of one bucket holding ``level`` tokens (negative while reservations are out)."""
    quota, window = _shape(limit)
    name = f"quota-proxy-{scope}-{quota}-{window}s"
    remaining = max(0, math.floor(level + _EPS))
    reset = max(0, math.ceil((limit.burst - level) / limit.per_second - _EPS))
    return QuotaItem(name, quota, window, remaining, reset)


def request_limits(vendor: Vendor, tenant: str, endpoint: Endpoint | None = None) -> tuple[tuple[Limit, str], ...]:
    """A request's limits with their scope, in the order the store reports their levels:
    the tenant's, the endpoint class's, the vendor's global ones, then each meter's, the
    tenant's and the vendor's, scoped by the meter's name (as ``limiter.buckets.buckets_for``
    lists them)."""
    tenant_part = tuple((limit, "tenant") for limit in vendor.tenant_limits.for_tenant(tenant))
    endpoint_part = () if endpoint is None else tuple((limit, "endpoint") for limit in endpoint.limits)
    meters: tuple[tuple[Limit, str], ...] = ()
    for meter in vendor.meters:
        meters += tuple((limit, f"tenant-{meter.name}") for limit in meter.tenant_limits.for_tenant(tenant))
        meters += tuple((limit, meter.name) for limit in meter.limits)
    return tenant_part + endpoint_part + tuple((limit, "global") for limit in vendor.limits) + meters


def tightest(limits: Sequence[tuple[Limit, str]], levels: Sequence[float], index: int = -1) -> QuotaItem | None:
    """The item of bucket ``index`` (a refusal's binding bucket), else of the tightest bucket;
    None when the levels do not line up with the limits."""
    if len(limits) != len(levels) or not limits:
        return None
    if 0 <= index < len(limits):
        limit, scope = limits[index]
        return bucket_item(limit, scope, levels[index])
    items = [bucket_item(limit, scope, level) for (limit, scope), level in zip(limits, levels, strict=True)]
    return min(items, key=lambda item: (item.remaining, -item.reset))


def quota_lines(limits: Sequence[tuple[Limit, str]], levels: Sequence[float]) -> bytes:
    """The fields of the tightest bucket as lines (``Name: value\r\n``): what the straight
    path adds to a forwarded answer whose vendor sent no ``RateLimit`` of its own."""
    item = tightest(limits, levels)
    if item is None:
        return b""
    return "".join(f"{name}: {value}\r\n" for name, value in item.fields().items()).encode("latin-1")


def blocked_item(vendor: Vendor, wait: float) -> QuotaItem | None:
    """The item while nothing is granted for ``wait`` seconds (a vendor block, a dead store):
    the vendor's narrowest global limit, nothing left, usable again after the wait."""
    if not vendor.limits:
        return None
    limit = min(vendor.limits, key=lambda lim: lim.per_second)
    quota, window = _shape(limit)
    return QuotaItem(f"quota-proxy-global-{quota}-{window}s", quota, window, 0, max(1, math.ceil(wait - _EPS)))


def fields_for_forwarded(vendor_headers: MultiMapping[str], item: QuotaItem) -> dict[str, str]:
    """The fields to add to a forwarded answer: the proxy's item, unless the vendor's own
    ``RateLimit`` already says as few tokens remain (or fewer)."""
    said = vendor_remaining(vendor_headers)
    if said is not None and said <= item.remaining:
        return {}
    return item.fields()


def vendor_remaining(headers: MultiMapping[str]) -> int | None:
    """The fewest tokens any item of the vendor's ``RateLimit`` field says remain, or None."""
    found = [int(r) for _, params in items(field(headers, RATELIMIT)) if (r := params.get("r", "")).isdigit()]
    return min(found) if found else None
