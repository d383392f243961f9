"""Which endpoint class of its vendor a request belongs to (SPEC §10): first match wins.

Globs are compiled once per vendor object (a reload builds new ``Vendor`` objects), so
matching a request is a method check and one regex match per class tried.
"""

from __future__ import annotations

import fnmatch
import re

from proxy.policy.model import Endpoint, Vendor

_Compiled = tuple[tuple[Endpoint, frozenset[str], re.Pattern[str] | None], ...]
_cache: dict[int, tuple[Vendor, _Compiled]] = {}  # id(vendor) -> (vendor, compiled); keeps the vendor alive
_CACHE_MAX = 256  # vendors of a few policy generations


def _compiled(vendor: Vendor) -> _Compiled:
    hit = _cache.get(id(vendor))
    if hit is not None and hit[0] is vendor:
        return hit[1]
    compiled = tuple(
        (
            e,
            frozenset(e.match.methods),
            None if e.match.path is None else re.compile(fnmatch.translate(e.match.path)),
        )
        for e in vendor.endpoints
    )
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[id(vendor)] = (vendor, compiled)
    return compiled


def endpoint_for(vendor: Vendor, method: str, path: str) -> Endpoint | None:
    """The first of ``vendor.endpoints`` whose methods and path glob both accept the
    request (``path`` without the query), or None (also when the vendor has none)."""
    if not vendor.endpoints:
        return None
    for endpoint, methods, glob in _compiled(vendor):
        if methods and method not in methods:
            continue
        if glob is not None and glob.match(path) is None:
            continue
        return endpoint
    return None
