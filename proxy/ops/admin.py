"""The admin listener: /metrics, /healthz, /readyz, /status, /status/history, POST /reload,
and the live page at / (static files from admin_page/ that poll /status and
/status/history in the browser).

/status/history is the last five minutes, second by second, of what the page graphs:
counts (requests sent, held, deferred, shed, vendor 429s; telemetry/recent.py's rings),
readings sampled each second by this app and at each /status/history (tokens, requests
held, in flight: what the process knows without asking the store) and the vendor's own
signals as events (429s, blocks, drains). A page opened now draws them at once.

/readyz is what a load balancer routes on: 503 while the store is unreachable
(the proxy would only defer) and while draining for shutdown. Who may use which
endpoint (the admin token, the Host and Origin checks) is admin_access.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any, Final, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy import __version__
from proxy.deps import Deps
from proxy.limiter import BucketSpec, Limiter, StoreUnavailable
from proxy.ops.admin_access import admin_access
from proxy.policy import Policy, mask_password
from proxy.policy.model import Endpoint, Vendor, format_number
from proxy.tasks import cancel_and_wait, spawn
from proxy.telemetry.recent import HISTORY_SECONDS, Recent
from proxy.telemetry.shares import TENANTS_KEPT, TENANTS_SHOWN
from proxy.wire.refusals import REASONS

log = logging.getLogger("quota_proxy.admin")

DepsGetter = Callable[[], Deps]


class ReloadOutcome(Protocol):
    @property
    def ok(self) -> bool: ...

    def as_json(self, policy: Policy) -> dict[str, object]: ...


Reload = Callable[[str], Awaitable[ReloadOutcome]]


class AdminState:
    """What the admin endpoints read: the live deps, the listener's open tunnels, and
    whether we are serving or draining."""

    def __init__(
        self,
        deps: DepsGetter,
        tunnels_open: Callable[[str], int],
        reload: Reload | None = None,
        connections: Callable[[], dict[str, object]] | None = None,
    ) -> None:
        self.deps = deps
        self.tunnels_open = tunnels_open
        """Open blind tunnels of a vendor."""
        self.connections = connections
        """The proxy listener's connections: open, the cap, the timeouts."""
        self.reload = reload
        """Reload the policy (None when this process cannot reload: no policy file)."""
        self.serving = False
        """True once the proxy listener is bound."""
        self.draining = False


ADMIN = web.AppKey("admin", AdminState)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body, indent=2) + "\n", status=status, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    deps = request.app[ADMIN].deps()
    return web.Response(body=generate_latest(deps.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[ADMIN]
    if state.draining:
        return _json({"status": "draining"}, 503)
    if not state.serving:
        return _json({"status": "starting"}, 503)
    deps = state.deps()
    try:
        async with asyncio.timeout(max(deps.policy.store.timeout * 4, 0.25)):
            await deps.limiter.ping(deps.policy.vendors)
    except (StoreUnavailable, TimeoutError) as exc:
        detail = str(exc) or type(exc).__name__
        if deps.limiter.serves_without_store():  # on_failure: local, its share known: still grants
            return _json({"status": "degraded", "detail": f"store unavailable ({detail}): local shares"})
        return _json({"status": "store unavailable", "detail": detail}, 503)
    return _json({"status": "ready", "vendors": [v.name for v in deps.policy.vendors]})


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def _fill(level: float, burst: float) -> float | None:
    """How full a bucket is, 0 to 1 (a level below zero, reserved by holds: 0)."""
    if not math.isfinite(level) or burst <= 0:
        return None
    return round(min(max(level / burst, 0.0), 1.0), 4)


def _buckets(specs: tuple[BucketSpec, ...], levels: tuple[float, ...]) -> list[dict[str, Any]]:
    return [
        {
            "bucket": b.label,
            "key": b.ident,
            "rate_per_second": b.rate,
            "burst": b.burst,
            "tokens": _finite(level),
            "fill": _fill(level, b.burst),
        }
        for b, level in zip(specs, levels, strict=True)
    ]


def _quota(vendor: Vendor, buckets: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Which of the vendor's global limits binds: in the long run the one with the slowest
    refill (the policy's; ``limit`` as ``check`` names it, e.g. ``4000/1m``), now the bucket
    nearest empty, the one with the fewest tokens (the store's levels; None without them).
    That bucket ``binds`` only when it holds less than a request's token: a full one limits
    nothing yet."""
    slowest = min(vendor.limits, key=lambda lim: lim.per_second, default=None)
    long_run = None
    if slowest is not None:
        long_run = {
            "bucket": f"global {slowest.label}",
            "rate_per_second": round(slowest.per_second, 6),
            "limit": f"{format_number(slowest.rate)}/{slowest.window}",
        }
    now = None
    filled = [b for b in buckets or () if b["fill"] is not None]
    if filled:
        nearest = min(filled, key=lambda b: (b["tokens"], b["fill"]))
        now = {key: nearest[key] for key in ("bucket", "tokens", "burst", "fill")}
        now["binds"] = nearest["tokens"] < 1
    return {"long_run": long_run, "now": now}


TOP_TENANTS: Final = 5
"""Tenants /status lists as refused most in the last minute, per vendor."""


def _refusals(recent: Recent, vendor: str) -> dict[str, Any]:
    """The last minute's deferrals and sheds by reason, and the tenants refused most."""
    return {
        "window_seconds": 60,
        "by_reason": {
            reason: {outcome: recent.total(vendor, f"{outcome}:{reason}") for outcome in ("deferred", "shed")}
            for reason in REASONS
        },
        "top_tenants": recent.top_tenants(vendor, TOP_TENANTS),
    }


def share_tenants(request: web.Request) -> int:
    """How many tenants /status lists per vendor with ``share:``: ``?share_tenants=N`` (``all``:
    every one followed), else ``TENANTS_SHOWN``."""
    asked = request.query.get("share_tenants", "")
    if asked == "all":
        return TENANTS_KEPT
    return min(int(asked), TENANTS_KEPT) if asked.isdigit() else TENANTS_SHOWN


async def _endpoint(limiter: Limiter, vendor: Vendor, endpoint: Endpoint) -> dict[str, Any]:
    """An endpoint class and its buckets' levels (of the default partition), as the store says now."""
    entry: dict[str, Any] = {
        "name": endpoint.name,
        "methods": list(endpoint.match.methods),
        "path": endpoint.match.path,
        "cost": endpoint.cost,
        "concurrency": endpoint.concurrency,
    }
    if not endpoint.limits:
        entry["buckets"] = []
        return entry
    try:
        b, levels = await limiter.peek(vendor, endpoint=endpoint)
        entry["buckets"] = _buckets(b.endpoint_part, levels[: b.endpoint_count])
    except StoreUnavailable as exc:
        entry["buckets"] = None
        entry["store_error"] = str(exc)
    return entry


async def _meters(limiter: Limiter, vendor: Vendor) -> list[dict[str, Any]]:
    """Each meter (SPEC §14): its forms, limits and long-run rate, and its vendor-side
    buckets' levels (of the default partition) as the store says now."""
    try:
        specs, levels = await limiter.peek_meters(vendor)
        error = None
    except StoreUnavailable as exc:
        specs, levels, error = (), (), str(exc)
    out, at = [], 0
    for meter in vendor.meters:
        e, s = meter.estimate, meter.settle
        entry: dict[str, Any] = {
            "name": meter.name,
            "estimate": e.kind
            if e.kind not in ("fixed", "json")
            else {e.kind: e.amount if e.kind == "fixed" else e.pointer},
            "settle": s.kind if s.kind not in ("json", "header") else {s.kind: s.pointer or s.header},
            "limits": [
                {"rate": lim.rate, "per": lim.per, "burst": lim.burst, "rate_per_second": lim.per_second}
                for lim in meter.limits
            ],
            "long_run_per_second": round(min(lim.per_second for lim in meter.limits), 6),
        }
        mine = slice(at, at + len(meter.limits))  # (peek_meters: meter by meter, a bucket per limit)
        at = mine.stop
        entry["buckets"] = None if error else _buckets(specs[mine], levels[mine])
        if error:
            entry["store_error"] = error
        out.append(entry)
    return out


def _partitions(limiter: Limiter, vendor: Vendor) -> dict[str, Any] | None:
    """How many partitions this replica has seen lately and how many are blocked: counts
    only, never a value (they are credentials)."""
    if vendor.partition is None:
        return None
    return {
        "header": vendor.partition.header,
        "seen_recently": limiter.partitions.count(vendor.name),
        "window_seconds": limiter.partitions.window,
        "blocked_now": limiter.partitions_blocked(vendor.name),
    }


async def status(request: web.Request) -> web.Response:
    state = request.app[ADMIN]
    deps = state.deps()
    limiter = deps.limiter
    shown = share_tenants(request)
    vendors: list[dict[str, Any]] = []
    for vendor in deps.policy.vendors:
        entry: dict[str, Any] = {
            "name": vendor.name,
            "hosts": list(vendor.hosts),
            "route": vendor.route,
            "upstream": vendor.upstream,
            "on_limit": {"action": vendor.on_limit.action, "max_hold": vendor.on_limit.max_hold},
            "connect": vendor.connect,
            # What its workers get for a defer, a long defer and a shed (a preset may answer 403 or 409).
            "answers": {"preset": vendor.answers.name, "status": vendor.answers.rate_limit_statuses()},
        }
        entry["requests_by_mode"] = {
            mode: deps.metrics.mode_total(vendor.name, mode) for mode in ("plain", "intercept", "tunnel")
        }
        if vendor.connect == "tunnel":
            entry["tunnels"] = {"open": request.app[ADMIN].tunnels_open(vendor.name), "max": vendor.max_tunnels}
        try:
            buckets, levels = await limiter.peek(vendor)
            entry["buckets"] = _buckets(buckets.all, levels)
            entry["tokens_available"] = _finite(min(levels)) if levels else None
        except StoreUnavailable as exc:
            entry["buckets"] = None
            entry["store_error"] = str(exc)
        entry["quota"] = _quota(vendor, entry["buckets"])
        if vendor.endpoints:
            entry["endpoints"] = [await _endpoint(limiter, vendor, e) for e in vendor.endpoints]
        if vendor.meters:
            entry["meters"] = await _meters(limiter, vendor)
        if vendor.partition is not None:
            entry["partitions"] = _partitions(limiter, vendor)
        if limiter.local is not None:
            entry["local_buckets"] = await limiter.local.levels(vendor)
        recent = deps.recent
        entry["limits"] = [
            {"rate": lim.rate, "per": lim.per, "burst": lim.burst, "rate_per_second": lim.per_second}
            for lim in vendor.limits
        ]
        entry["breaker"] = limiter.breaker.state
        # feedback.headers: auto — what the vendor's quota headers taught (this replica's view).
        entry["learned"] = limiter.learned_status(vendor) if vendor.feedback.headers == "auto" else None
        latency = deps.sizing.latency(vendor.name)
        entry["sizing"] = {
            "configured_rate_per_second": deps.sizing.rate(vendor),
            "upstream_latency_seconds": None if latency is None else round(latency, 4),
            "recommended_concurrency": deps.sizing.recommended_concurrency(vendor),
        }
        entry["held_now"] = deps.held.get(vendor.name, 0)
        entry["concurrency"] = await deps.concurrency.status(vendor)
        blocked = limiter.blocked_for(vendor.name)
        entry["blocked_for_seconds"] = round(blocked, 3)
        entry["blocked_until"] = (
            datetime.fromtimestamp(time.time() + blocked, UTC).isoformat(timespec="milliseconds") if blocked else None
        )
        entry["recent"] = {
            "window_seconds": 10,
            "forwarded_per_second": recent.rate(vendor.name, "forwarded") + recent.rate(vendor.name, "held"),
            "held_per_second": recent.rate(vendor.name, "held"),
            "deferred_per_second": recent.rate(vendor.name, "deferred"),
            "shed_per_second": recent.rate(vendor.name, "shed"),
            "vendor_429_last_minute": recent.total(vendor.name, "vendor_429"),
            "deferred_last_minute": recent.total(vendor.name, "deferred"),
            "shed_last_minute": recent.total(vendor.name, "shed"),
            "vendor_blocks_last_minute": recent.total(vendor.name, "vendor_block"),
            "drains_last_minute": recent.total(vendor.name, "drain"),
        }
        entry["refusals"] = _refusals(recent, vendor.name)
        if vendor.share is not None:  # SPEC §13: how the quota was divided, the last 10 s
            entry["share"] = recent.share_book(vendor.name).status(vendor.share, shown)
        vendors.append(entry)
    return _json(
        {
            "version": __version__,
            "policy": deps.policy.source,
            "store": {
                "url": mask_password(deps.policy.store.url),
                "on_failure": deps.policy.store.on_failure,
                "breaker": limiter.breaker.state,
                "degraded": None if limiter.local is None else limiter.local.status(),
            },
            **({"connections": state.connections()} if state.connections is not None else {}),
            "vendors": vendors,
        }
    )


HISTORY_SERIES: Final = ("forwarded", "held", "deferred", "shed", "vendor_429")
"""The per-second series of /status/history (``forwarded`` counts the held too: every
request sent to the vendor, as ``recent.forwarded_per_second`` does)."""


def _ago(seconds: float) -> str:
    return datetime.fromtimestamp(time.time() - seconds, UTC).isoformat(timespec="milliseconds")


GAUGES: Final = ("tokens", "held_now", "inflight")
"""The readings of /status/history, sampled once a second (``sample_gauges``): the scarcest
global bucket's tokens (``tokens_available``), requests held here, requests in flight
fleet-wide (vendors with a concurrency cap)."""


def sample_gauges(deps: Deps) -> None:
    """This second's readings, from what this process knows without asking the store: the
    last store answer's levels extrapolated by refill, its own holds, the last lease count."""
    recent = deps.recent
    for vendor in deps.policy.vendors:
        tokens = deps.limiter.tokens_available(vendor)
        recent.gauge(vendor.name, "tokens", None if tokens is None else _finite(tokens))
        recent.gauge(vendor.name, "held_now", deps.held.get(vendor.name, 0))
        inflight = deps.concurrency.inflight_seen(vendor) if vendor.concurrency is not None else None
        recent.gauge(vendor.name, "inflight", inflight)


async def _sampling(state: AdminState) -> None:
    """``sample_gauges`` at each whole second, until cancelled. Paced by real time, not by
    the proxy's clock (the same one in production; a test's hand-moved clock is left alone:
    a reading is also taken at each /status/history)."""
    while True:
        try:
            sample_gauges(state.deps())
        except Exception:  # a bug here must not end the history
            log.exception("sampling the live page's readings failed")
        await asyncio.sleep(1.0 - time.monotonic() % 1.0)


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    task = spawn(_sampling(app[ADMIN]), name="admin-history-sampler")
    yield
    await cancel_and_wait(task)


def vendor_history(recent: Recent, vendor: str) -> dict[str, Any]:
    """One vendor's last ``HISTORY_SECONDS``: counts and readings per second, and its events."""
    series = {name: recent.series(vendor, name) for name in HISTORY_SERIES}
    series["forwarded"] = [a + b for a, b in zip(series["forwarded"], series["held"], strict=True)]
    gauges = {name: recent.gauge_series(vendor, name) for name in GAUGES}
    events = []
    for ago, event in recent.events(vendor):
        item: dict[str, Any] = {"kind": event.kind, "seconds_ago": round(ago, 3), "at": _ago(ago)}
        if event.seconds is not None:
            item["seconds"] = round(event.seconds, 3)
        events.append(item)
    return {"name": vendor, "series": series, "gauges": gauges, "events": events}


async def history(request: web.Request) -> web.Response:
    """GET /status/history: the last five minutes of what the live page graphs, per second."""
    deps = request.app[ADMIN].deps()
    sample_gauges(deps)  # the newest reading: now
    return _json(
        {
            "version": __version__,
            "seconds": HISTORY_SECONDS,
            "step_seconds": 1,
            "now": _ago(0.0),
            "vendors": [vendor_history(deps.recent, v.name) for v in deps.policy.vendors],
        }
    )


async def reload(request: web.Request) -> web.Response:
    state = request.app[ADMIN]
    if state.reload is None:
        return _json({"result": "failure", "errors": ["this process was not started with a policy file"]}, 501)
    outcome = await state.reload("POST /reload")
    return _json(outcome.as_json(state.deps().policy), 200 if outcome.ok else 400)


PAGE_FILES: Final = {"/": "index.html", "/ui.js": "ui.js", "/ui.css": "ui.css"}
"""The live page's routes and their files in proxy/ops/admin_page/ (package data)."""
_PAGE_TYPES: Final = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
PAGE_CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""No inline script or style, nothing from elsewhere, no framing: the page only reads /status
and /status/history."""


def add_page_routes(app: web.Application) -> None:
    """GET /, /ui.js and /ui.css: the live page."""
    for path, name in PAGE_FILES.items():
        app.router.add_get(path, _page_file(name))


def _page_file(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    # Static and free of data, so served without the admin token (the page asks for it when
    # /status answers 401); the Host check still applies, as for every admin path.
    body = files("proxy.ops").joinpath("admin_page", name).read_bytes()
    content_type = _PAGE_TYPES[name[name.rindex(".") :]]
    headers = {
        "Content-Security-Policy": PAGE_CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)

    return serve


def admin_app(state: AdminState) -> web.Application:
    app = web.Application(middlewares=[admin_access(lambda: state.deps().policy)])
    app[ADMIN] = state
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/status/history", history)
    app.router.add_post("/reload", reload)
    add_page_routes(app)
    app.cleanup_ctx.append(_sampler)
    return app
