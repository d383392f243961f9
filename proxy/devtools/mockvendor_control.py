"""The mock vendor's control endpoints, ``/__mock/...``: never quota-limited, never recorded.

- ``GET /__mock/stats``: ``{"accepted", "rejected", "arrivals", "rejections", "rate",
  "burst", "tokens", "scripted", "window", "window_limit", "window_max", "in_flight",
  "max_in_flight", "token_windows"}`` (``burst`` and ``tokens`` are null with a window, the
  ``window*`` keys null without one; ``token_windows``: each token quota counted, by shape and
  currency, e.g. ``{"openai": {"tokens": {"per_minute", "window", "limit", "used",
  "tokens_window_max", "tokens_accepted", "rejected"}}}``, see ``mockvendor_tokens``).
- ``GET /__mock/requests``: recorded requests, ``[{"method", "path_qs", "headers"}]``.
- ``POST /__mock/reset``: clears counters, arrivals, recorded requests and pending
  scripts; refills the bucket and empties the token windows.
- ``POST /__mock/config`` ``{"rate": r, "burst": b, "window": w}``: a new quota (``null``
  or ``0`` rate = unlimited; ``window`` in seconds, ``null`` = a token bucket; a missing
  key keeps its value, except that ``burst`` follows a new ``rate`` when not given, and
  an unlimited vendor has no window). The bucket starts full, the window empty.
- ``POST /__mock/limit`` ``{"rate": r}``: the quota changes mid-run, as a vendor that
  lowers or raises an account's limit: the same kind (bucket or window), what it
  counted kept (a lower window limit refuses until enough requests have left it; the
  bucket keeps its tokens, capped at the new burst, ``burst`` = the rate unless given).
- ``POST /__mock/script`` ``{"status": 429, "retry_after": "2", "remaining": 3,
  "count": 1}``: the next ``count`` normal requests get that answer. Scripts queue in
  order of arrival.

``MockVendor.handle`` hands every path under ``/__mock/`` to ``control``.
"""

from __future__ import annotations

import json
from typing import Any, Final, Protocol

from aiohttp import web

__all__ = ["CONTROL_PREFIX", "JSON_TYPE", "ControlledVendor", "control", "json_response"]

CONTROL_PREFIX: Final = "/__mock/"
JSON_TYPE: Final = "application/json"


class ControlledVendor(Protocol):
    """What the control endpoints read and change of a vendor (``MockVendor``)."""

    @property
    def rate(self) -> float | None: ...

    @property
    def burst(self) -> float | None: ...

    @property
    def window(self) -> float | None: ...

    @property
    def requests(self) -> object: ...

    @property
    def scripted(self) -> int: ...

    def stats(self) -> object: ...

    def reset(self) -> None: ...

    def configure(self, rate: float | None, burst: float | None = None, window: float | None = None) -> None: ...

    def set_limit(self, rate: float, burst: float | None = None) -> None: ...

    def script(
        self,
        status: int = 429,
        retry_after: str | float | None = None,
        remaining: int | None = None,
        count: int = 1,
    ) -> None: ...


class _BadRequest(Exception):
    """A control request that cannot be served as asked."""


def json_response(status: int, payload: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type=JSON_TYPE, headers=headers)


async def control(vendor: ControlledVendor, request: web.BaseRequest, path: str) -> web.Response:
    """Answer a request under ``/__mock/`` (``path``); never quota-limited, never recorded."""
    name = path[len(CONTROL_PREFIX) :]
    method = request.method
    allowed = _CONTROL_METHODS.get(name)
    if allowed is None:
        return json_response(404, {"error": "not_found", "path": path})
    if method != allowed:
        return json_response(405, {"error": "method_not_allowed", "allow": allowed}, {"Allow": allowed})
    try:
        if name == "stats":
            return json_response(200, vendor.stats())
        if name == "requests":
            return json_response(200, vendor.requests)
        if name == "reset":
            vendor.reset()
            return json_response(200, {"ok": True})
        body = await _read_json_object(request)
        if name == "config":
            _configure_from(vendor, body)
            return json_response(200, {"ok": True, "rate": vendor.rate, "burst": vendor.burst})
        if name == "limit":
            unknown = set(body) - {"rate", "burst"}
            if unknown or "rate" not in body:
                raise _BadRequest('POST /__mock/limit takes {"rate": r} and optionally "burst"')
            rate = _get(body, "rate", (int, float), None)
            burst = _get(body, "burst", (int, float), None)
            if rate is None:
                raise _BadRequest("rate: a number of requests per second")
            vendor.set_limit(float(rate), None if burst is None else float(burst))
            return json_response(200, {"ok": True, "rate": vendor.rate, "burst": vendor.burst, "window": vendor.window})
        vendor.script(
            status=_get(body, "status", int, 429),
            retry_after=_get(body, "retry_after", (str, int, float), None),
            remaining=_get(body, "remaining", int, None),
            count=_get(body, "count", int, 1),
        )
        return json_response(200, {"ok": True, "scripted": vendor.scripted})
    except (_BadRequest, ValueError) as exc:
        return json_response(400, {"error": "bad_request", "detail": str(exc)})


def _configure_from(vendor: ControlledVendor, body: dict[str, Any]) -> None:
    unknown = set(body) - {"rate", "burst", "window"}
    if unknown:
        raise _BadRequest(f"unknown keys: {', '.join(sorted(unknown))}")
    rate = _get(body, "rate", (int, float), vendor.rate) if "rate" in body else vendor.rate
    if rate == 0:
        rate = None
    window = _get(body, "window", (int, float), None) if "window" in body else vendor.window
    if rate is None and "window" not in body:
        window = None  # an unlimited vendor counts nothing
    if "burst" in body:
        burst = _get(body, "burst", (int, float), None)
    else:
        burst = None if "rate" in body or window is not None else vendor.burst
    vendor.configure(
        None if rate is None else float(rate),
        None if burst is None else float(burst),
        None if window is None else float(window),
    )


_CONTROL_METHODS: Final[dict[str, str]] = {
    "stats": "GET",
    "requests": "GET",
    "reset": "POST",
    "config": "POST",
    "limit": "POST",
    "script": "POST",
}


async def _read_json_object(request: web.BaseRequest) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    return body


def _get(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _BadRequest(f"{key}: unexpected value {value!r}")
    return value
