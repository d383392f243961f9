"""The one-screen text ``quota-proxy check`` prints for a valid policy.

It shows what the proxy will actually enforce, defaults filled in, so an
operator can read the effective policy rather than the YAML they meant.
Passwords in the store URL are masked and the admin token is never shown: this text
ends up in CI logs.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.policy.durations import format_duration
from proxy.policy.model import (
    ESTIMATE_PRESETS,
    Connections,
    Endpoint,
    Feedback,
    Limit,
    Meter,
    MeterEstimate,
    MeterSettle,
    Policy,
    Share,
    TenantLimits,
    Vendor,
    format_number,
)
from proxy.policy.values import mask_password
from proxy.policy.worst_case import WorstCase, beyond, doubled, worst_cases

_WIDTH = 14  # label column, so values line up


def summarize(policy: Policy) -> str:
    lines = [f"OK {policy.source}: {len(policy.vendors)} vendor(s)"]
    lines += _general(policy)
    for vendor in policy.vendors:
        lines.append("")
        lines += _vendor(vendor, policy.store.on_failure == "open")
    return "\n".join(lines) + "\n"


def _row(label: str, value: str, indent: str = "") -> str:
    return f"{indent}{label:<{_WIDTH - len(indent)}}{value}"


def _general(policy: Policy) -> list[str]:
    store, tls = policy.store, policy.tls
    on_failure = {
        "closed": "closed",
        "open": "open (store down = NO LIMITS)",
        "local": "local (store down = each replica its share, in-process)",
    }[store.on_failure]
    cooloff = format_duration(store.breaker.cooloff)
    breaker = f"breaker opens after {store.breaker.failures} failures, probes after {cooloff}"
    verify = "on" if tls.upstream_verify else "OFF (vendor certificates are NOT verified)"
    ca = f"{tls.ca_cert}, leaf validity {format_duration(tls.leaf_validity)}" if tls.ca_cert else "none"
    return [
        _row("listen", str(policy.listen)),
        _row("workers", _workers(policy)),
        _row("admin", str(policy.admin_listen)),
        _row("store", mask_password(store.url)),
        _row("", f"timeout {format_duration(store.timeout)}, on_failure {on_failure}"),
        _row("", f"key_prefix {store.key_prefix}, {breaker}"),
        *_tenant(policy),
        _row(
            "tls",
            f"upstream_verify {verify}" + (f", CA file {tls.upstream_ca_file}" if tls.upstream_ca_file else ""),
        ),
        _row("intercept CA", ca),
        _row(
            "drain",
            f"{format_duration(policy.drain_timeout)}, access_log {'on' if policy.access_log else 'off'}",
        ),
        _row("connections", _connections(policy.connections)),
        *(_row("admin access" if i == 0 else "", text) for i, text in enumerate(_admin_access(policy))),
    ]


def _connections(connections: Connections) -> str:
    return (
        f"at most {connections.max} open (then 503), request head within "
        f"{format_duration(connections.head_timeout)} (then 408), idle keep-alive "
        f"{format_duration(connections.idle_timeout)}"
    )


def _admin_access(policy: Policy) -> list[str]:
    """Who may read /status and reload (never the token itself), and which Host names the
    admin listener answers to."""
    if policy.admin_token is not None:
        token = "bearer token (admin_token) required for /status and POST /reload"
    else:
        token = "no admin_token: /status and POST /reload are open unless QUOTA_PROXY_ADMIN_TOKEN is set"
    return [token, f"Host must be an IP address or {', '.join(policy.admin_names)}"]


def _tenant(policy: Policy) -> list[str]:
    """Where the tenant comes from and which tenants get in; never a secret or a digest."""
    tenant = policy.tenant
    if tenant.from_ == "proxy_auth":
        users = ", ".join(name for name, _ in tenant.credentials)
        return [
            _row("tenant", f"from proxy credentials (Basic; 407 without): {users}"),
            _row("", f"header {tenant.header} ignored (and stripped)"),
        ]
    default = f'"{tenant.default}"' if tenant.default is not None else "none (400 without header)"
    if tenant.known_only:
        named = ", ".join(sorted(tenant.named(policy.vendors)))
        accepted = f"known only: {named} (others 400)"
    elif tenant.max_active is None:
        accepted = "any tenant, no bound on how many"
    else:
        accepted = f"any tenant; at most {tenant.max_active} not in the policy per vendor and replica at once"
    return [_row("tenant", f"header {tenant.header}, default {default}"), _row("", accepted)]


def _vendor(vendor: Vendor, fail_open: bool) -> list[str]:
    indent = "  "
    rows = [
        f"vendor {vendor.name}",
        _row("hosts", ", ".join(vendor.hosts) or "(none)", indent),
        _row("route", vendor.route or "(none)", indent),
        _row("upstream", vendor.upstream or "(the requested origin)", indent),
        _row("limits", _limits(vendor.limits) + _uncounted(vendor), indent),
        *([_row("vendor says", _limits(vendor.vendor_limit), indent)] if vendor.vendor_limit else []),
        _row("worst case", _vendor_worst_case(vendor, fail_open), indent),
        *[_row("", text, indent) for text in _beyond(vendor)],
        _row("sustained", _sustained(vendor.limits), indent),
        *[_row("meters" if i == 0 else "", text, indent) for i, text in enumerate(_meters(vendor))],
        _row("partition", _partition(vendor), indent),
        _row("concurrency", _concurrency(vendor.concurrency), indent),
    ]
    rows += [_row("endpoints" if i == 0 else "", text, indent) for i, text in enumerate(_endpoints(vendor))]
    tenants = _tenants(vendor.tenant_limits, vendor.limits)
    rows += [_row("tenants" if i == 0 else "", text, indent) for i, text in enumerate(tenants)]
    rows += [_row("share" if i == 0 else "", text, indent) for i, text in enumerate(_share(vendor.share))]
    on_limit = vendor.on_limit
    rows.append(_row("on_limit", f"{on_limit.action}, max_hold {format_duration(on_limit.max_hold)}", indent))
    rows.append(_row("feedback", _feedback(vendor.feedback), indent))
    rows.append(_row("learned", _learned(vendor.feedback), indent))
    connect = vendor.connect + (f", at most {vendor.max_tunnels} tunnels" if vendor.connect == "tunnel" else "")
    rows.append(_row("connect", connect, indent))
    rows.append(_row("answers", _answers(vendor), indent))
    rows.append(_row("", f"{_rate_limit_statuses(vendor)} (check --answers shows each answer)", indent))
    timeouts = vendor.timeouts
    rows.append(
        _row(
            "timeouts",
            f"connect {format_duration(timeouts.connect)}, read {format_duration(timeouts.read)}",
            indent,
        )
    )
    return rows


def _worst_case(cases: Iterable[WorstCase], vendor: Vendor, unit: str = "requests") -> str:
    """What a vendor counting requests (or a meter's ``unit``) in a sliding window may see
    from the whole fleet."""
    counts = [
        f"{case.requests}{f' {unit}' if i == 0 else ''} in any {_window(case.window, vendor)}"
        for i, case in enumerate(cases)
    ]
    where = f"per value of {vendor.partition.header}" if vendor.partition is not None else "fleet-wide"
    return f"at most {', '.join(counts)}, {where}" if counts else "unbounded"


def _vendor_worst_case(vendor: Vendor, fail_open: bool) -> str:
    """Counted in the vendor's cheapest requests: a class costing less than 1 sends more."""
    cheapest = min((1.0, *(endpoint.cost for endpoint in vendor.endpoints)))
    text = _worst_case(worst_cases(vendor.limits, cost=cheapest), vendor)
    return f"{text}; unbounded while the store is down (on_failure open)" if fail_open else text


def _window(seconds: float, vendor: Vendor) -> str:
    """A window as the policy wrote it (``24h``, not ``1d``), when a limit of it did."""
    meters = (lim for meter in vendor.meters for lim in meter.limits)
    endpoints = (lim for endpoint in vendor.endpoints for lim in endpoint.limits)
    for limit in (*vendor.limits, *vendor.vendor_limit, *endpoints, *meters):
        if limit.per == seconds and limit.per_text:
            return limit.per_text
    return format_duration(seconds)


def _beyond(vendor: Vendor) -> list[str]:
    """Warnings: a window in which the fleet may send more than the vendor allows (its
    ``vendor_limit``; the loader warns too), or, without one, at least twice a limit's own
    count (worst_case.doubled)."""
    if vendor.vendor_limit:
        return [
            f"WARNING: up to {worst} in any {allowed.window}, above the vendor's "
            f"{format_number(allowed.rate)}/{allowed.window} (vendor_limit)"
            for allowed, worst in beyond(vendor.limits, vendor.vendor_limit)
        ]
    return [
        f"WARNING: up to {worst} in any {limit.window}, twice {format_number(limit.rate)}/{limit.window} "
        f"(its burst {format_number(limit.burst)} comes on top): a vendor allowing "
        f"{format_number(limit.rate)} per {limit.window} would refuse the rest; "
        "set a smaller burst, or state vendor_limit"
        for limit, worst in doubled(vendor.limits)
    ]


def _sustained(limits: Iterable[Limit]) -> str:
    """The rate the buckets allow in the long run: the slowest refill, and which limit it is."""
    slowest = min(limits, key=lambda limit: limit.per_second, default=None)
    if slowest is None:
        return "unbounded"
    return f"{_rate(slowest.per_second)} in the long run ({format_number(slowest.rate)}/{slowest.window} binds)"


def _rate(per_second: float) -> str:
    for unit, seconds in (("s", 1.0), ("min", 60.0), ("h", 3600.0)):
        value = per_second * seconds
        if value >= 1 or unit == "h":
            return f"{_count(value)}/{unit}"
    raise AssertionError("unreachable")


def _count(value: float) -> str:
    """Three significant digits, but whole numbers from 1000 up: ``8.33``, ``3333``, never ``3.33e+03``."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def _partition(vendor: Vendor) -> str:
    if vendor.partition is None:
        return "none: one quota for the whole vendor"
    header = vendor.partition.header
    buckets = "global, endpoint and meter buckets" if vendor.meters else "global and endpoint buckets"
    return f"{header}: {buckets} per value (hashed), requests without it share one"


def _concurrency(cap: int | None) -> str:
    return "no cap" if cap is None else f"at most {cap} in flight, fleet-wide"


def _endpoints(vendor: Vendor) -> list[str]:
    """Each class in match order, then where the other requests go."""
    if not vendor.endpoints:
        return ["none: every request takes the vendor's buckets, cost 1"]
    rows: list[str] = []
    for endpoint in vendor.endpoints:
        rows.append(f"{endpoint.name}: {_match(endpoint)}")
        limits = f"limits {_limits(endpoint.limits)}" if endpoint.limits else "no limits of its own"
        cap = "no concurrency cap of its own" if endpoint.concurrency is None else f"concurrency {endpoint.concurrency}"
        rows.append(f"  {limits}; {cap}; cost {endpoint.cost:g}")
        if endpoint.limits or endpoint.cost != 1:
            own = endpoint.limits or vendor.limits
            cases = worst_cases(own, vendor.limits, endpoint.cost)
            rows.append(f"  {_worst_case(cases, vendor)}")
    rows.append("any other request: the vendor's buckets only, cost 1")
    return rows


def _match(endpoint: Endpoint) -> str:
    methods = ",".join(endpoint.match.methods) or "any method"
    return f"{methods} {endpoint.match.path or '(any path)'}"


def _limits(limits: Iterable[Limit]) -> str:
    return "; ".join(limit.label for limit in limits) or "(none)"


def _tenants(tenant_limits: TenantLimits, whole: tuple[Limit, ...], whose: str = "the vendor's") -> list[str]:
    """Each tenant's limits, and what it may sustain: its own slowest refill, or that of
    ``whole``, the buckets its own are nested in (``whose`` names them)."""
    rows = [f"default {_limits(tenant_limits.default)}{_tenant_sustained(tenant_limits.default, whole, whose)}"]
    rows += [
        f"{tenant}: {_limits(limits)}{_tenant_sustained(limits, whole, whose)}"
        for tenant, limits in tenant_limits.overrides
    ]
    return rows


def _tenant_sustained(limits: tuple[Limit, ...], whole: tuple[Limit, ...], whose: str) -> str:
    if not limits:
        return ""
    own = min(limit.per_second for limit in limits)
    bound = min((limit.per_second for limit in whole), default=own)
    return f"; sustained {_rate(min(own, bound))}" + (f" ({whose} quota binds)" if bound < own else "")


def _uncounted(vendor: Vendor) -> str:
    return ": requests are not counted, only its meters" if not vendor.limits and vendor.meters else ""


def _meters(vendor: Vendor) -> list[str]:
    """Each meter (SPEC §14): its buckets, what they let through in the long run and at
    worst (in the meter's own unit: tokens, points), its tenants, and how a request's cost
    is estimated and settled; nothing without ``meters``."""
    rows: list[str] = []
    for meter in vendor.meters:
        rows.append(f"{meter.name}: {_limits(meter.limits)}")
        slowest = min(meter.limits, key=lambda limit: limit.per_second)
        per_second = slowest.per_second
        rows.append(
            f"  long run {_count(per_second)}/s, {_count(per_second * 60)}/min"
            f" ({format_number(slowest.rate)}/{slowest.window} binds)"
        )
        worst = _worst_case(worst_cases(meter.limits), vendor, meter.name)
        rows.append(f"  worst case {worst}; one request at most {format_number(meter.capacity)} (the smallest burst)")
        tenants = meter.tenant_limits
        if tenants.default or tenants.overrides:
            rows += [
                f"  {'tenants ' if i == 0 else '  '}{text}"
                for i, text in enumerate(_tenants(tenants, meter.limits, "the meter's"))
            ]
        rows.append(f"  estimate {_estimate_words(meter.estimate)}")
        rows.append(f"  settle {_settle_words(meter.settle)}")
        if meter.estimate.kind in ESTIMATE_PRESETS:  # fixed and json say their own cost
            rows.append(f"  {_unread(meter)}")
    return rows


def _estimate_words(estimate: MeterEstimate) -> str:
    """A preset by its name and what it counts; the general forms in words alone."""
    if estimate.kind == "fixed":
        return f"every request costs {format_number(estimate.amount)}"
    if estimate.kind == "json":
        where = estimate.pointer or "(the whole body)"
        return f"the number at {where} in the request's JSON body, else {format_number(estimate.amount)}"
    words = {
        "openai": "prompt characters / 4, rounded up, + completion cap x n, as OpenAI admits a request",
        "anthropic_input": "input characters / 4, rounded up, as Anthropic estimates input tokens",
        "anthropic_output": "the request's max_tokens, as Anthropic estimates output tokens",
    }[estimate.kind]
    return f"{estimate.kind}: {words}"


def _settle_words(settle: MeterSettle) -> str:
    """Where the answer states the amount; without it (or with ``none``) the estimate stands."""
    if settle.kind == "none":
        return "none: the estimate stands"
    words = {
        "openai": "openai: the answer's usage.total_tokens (streamed: its usage chunk)",
        "anthropic_input": "anthropic_input: the answer's usage.input_tokens + cache_creation_input_tokens"
        " (streamed: message_start)",
        "anthropic_output": "anthropic_output: the answer's usage.output_tokens (streamed: the last message_delta)",
        "json": f"the number at {settle.pointer or '(the whole body)'} in the answer's JSON body",
        "header": f"the number in the answer's {settle.header} header",
    }[settle.kind]
    return f"{words}; without it the estimate stands"


def _unread(meter: Meter) -> str:
    if meter.default is None:
        return f"a body it cannot read (not JSON, too large) costs {format_number(meter.capacity)}, the smallest burst"
    return f"a body it cannot read (not JSON, too large) costs {format_number(meter.default)} (default)"


def _share(share: Share | None) -> list[str]:
    """The classes in priority order, where a request without a class goes, and each listed
    tenant's weight, class and fair share of its class when every listed tenant of the class
    is waiting (SPEC §13); nothing without ``share``."""
    if share is None:
        return []
    listed = [name for name, _ in share.weights]
    listed += [name for name, _ in share.tenant_class if name not in listed]
    if len(share.classes) == 1:
        rows = [f"one class, {share.classes[0]}: tenants by weight, no priorities"]
    else:
        keeps = (
            f"a lower class waiting keeps at least {_percent(share.min_share)} of the quota"
            if share.min_share > 0
            else "a lower class gets only what higher classes leave (min_share 0)"
        )
        rows = [f"classes {' > '.join(share.classes)}, highest first (X-Quota-Priority picks; unknown: 400)", keeps]
    others = "other tenants" if listed else "every tenant"
    rows.append(f"{others}: weight {format_number(share.default_weight)}, class {share.default_class}")
    if not listed:
        return rows
    classes = {name: _class_index(share, name) for name in listed}
    totals = [sum(share.weight(name) for name in listed if classes[name] == i) for i in range(len(share.classes))]
    rows.append("fair share with every listed tenant of its class waiting:")
    for name in sorted(listed, key=lambda name: classes[name]):  # by class, then as listed
        cls = share.classes[classes[name]]
        fair = _percent(share.weight(name) / totals[classes[name]])
        rows.append(f"{name}: weight {format_number(share.weight(name))}, {cls} → {fair} of {cls}")
    return rows


def _class_index(share: Share, tenant: str) -> int:
    index = share.class_of(tenant)
    assert index is not None, "a tenant's own class is always one of the classes"
    return index


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def _feedback(feedback: Feedback) -> str:
    retry = (
        f"429 without Retry-After blocks {format_duration(feedback.retry_after_default)}"
        f" (at most {format_duration(feedback.max_retry_after)})"
    )
    if feedback.remaining_header is None:
        return f"no remaining header; {retry}"
    watermark = f"drain below {feedback.low_watermark:g}" if feedback.low_watermark > 0 else "no drain"
    return f"{feedback.remaining_header} ({watermark}); {retry}"


def _learned(feedback: Feedback) -> str:
    if feedback.headers == "none":
        return "off (feedback.headers none): only 429s and the low watermark"
    return "auto: the vendor's quota headers only ever tighten these limits"


def _answers(vendor: Vendor) -> str:
    """The preset of the proxy's own answers, and what they tell an SDK (SPEC §9)."""
    ratelimit = "RateLimit fields on forwarded answers" if vendor.ratelimit_headers else "RateLimit fields on 429s only"
    name = vendor.answers.name
    return f"{name}, no SDK retry beyond {format_duration(vendor.answers_max_wait)}; {ratelimit}"


def _rate_limit_statuses(vendor: Vendor) -> str:
    """The status each rate-limit answer goes out with (a preset may change them)."""
    statuses = vendor.answers.rate_limit_statuses()
    return f"defer {statuses['defer']}, long defer {statuses['long_defer']}, shed {statuses['shed']}"


def _workers(policy: Policy) -> str:
    if policy.workers == "auto":
        if policy.store.url.startswith("memory://"):
            return "auto: 1 process on memory:// (its buckets live in one process)"
        return "auto: one process per usable CPU, one listen port (SO_REUSEPORT)"
    if policy.workers == 1:
        return "1 process"
    return f"{policy.workers} processes, one listen port (SO_REUSEPORT)"
