"""The policy as the running proxy uses it: frozen, typed, validated once by the loader.

Every field has the default an operator gets when the YAML leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.names import format_authority, ip_or_none
from proxy.policy.errors import ConfigError
from proxy.policy.presets import GENERIC, AnswerPreset

Action = Literal["hold", "defer", "shed"]
ConnectMode = Literal["intercept", "tunnel", "deny"]
FailureMode = Literal["closed", "open", "local"]
TenantFrom = Literal["header", "proxy_auth"]
HeaderFeedback = Literal["auto", "none"]
EstimateKind = Literal["openai", "anthropic_input", "anthropic_output", "fixed", "json"]
SettleKind = Literal["openai", "anthropic_input", "anthropic_output", "json", "header", "none"]
Workers = int | Literal["auto"]

ACTIONS: tuple[Action, ...] = ("hold", "defer", "shed")
CONNECT_MODES: tuple[ConnectMode, ...] = ("intercept", "tunnel", "deny")
FAILURE_MODES: tuple[FailureMode, ...] = ("closed", "open", "local")
TENANT_FROM: tuple[TenantFrom, ...] = ("header", "proxy_auth")
HEADER_FEEDBACK: tuple[HeaderFeedback, ...] = ("auto", "none")
ESTIMATE_PRESETS: tuple[EstimateKind, ...] = ("openai", "anthropic_input", "anthropic_output")
SETTLE_PRESETS: tuple[SettleKind, ...] = ("openai", "anthropic_input", "anthropic_output")


@dataclass(frozen=True, slots=True)
class Address:
    """A listen address; port 0 asks the OS for a free port."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_authority(self.host, self.port)


@dataclass(frozen=True, slots=True)
class Limit:
    """One token bucket: ``rate`` tokens every ``per`` seconds, holding at most ``burst``."""

    rate: float
    per: float
    burst: float
    per_text: str = field(default="", compare=False)
    """``per`` as the policy wrote it (``24h``, not ``1d``), for what ``check`` prints; "" = canonical."""

    @property
    def per_second(self) -> float:
        """Refill speed in tokens per second."""
        return self.rate / self.per

    @property
    def label(self) -> str:
        """Short human form, e.g. ``80/1s burst 40``."""
        return f"{format_number(self.rate)}/{self.window} burst {format_number(self.burst)}"

    @property
    def window(self) -> str:
        """``per`` as written (``24h``), else its shortest form."""
        return self.per_text or _duration(self.per)

    @property
    def key(self) -> str:
        """The part of a store key that names this limit; a changed limit gets a fresh bucket."""
        return f"{format_number(self.rate)}/{format_number(self.per)}/{format_number(self.burst)}"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant buckets, nested inside the vendor's global buckets."""

    default: tuple[Limit, ...] = ()
    overrides: tuple[tuple[str, tuple[Limit, ...]], ...] = ()
    """(tenant, limits) pairs, in file order; tenant names are unique."""

    def for_tenant(self, tenant: str) -> tuple[Limit, ...]:
        for name, limits in self.overrides:
            if name == tenant:
                return limits
        return self.default


@dataclass(frozen=True, slots=True)
class OnLimit:
    """What happens when a bucket is empty."""

    action: Action = "hold"
    max_hold: float = 0.5
    """Seconds; hold only when the wait is at most this, else defer."""


@dataclass(frozen=True, slots=True)
class Wish:
    """The effective on-limit choice for one request: the vendor's ``OnLimit`` as the worker's
    ``X-Quota-On-Limit`` and ``X-Quota-Max-Hold`` change it (``pipeline.decide.request_wish``).
    Here, below every layer that acts on it (quota's concurrency holds, the request pipeline)."""

    action: Action
    max_hold: float

    @property
    def max_wait(self) -> float:
        """How long the store may make this request wait for a reservation."""
        return self.max_hold if self.action == "hold" else 0.0


@dataclass(frozen=True, slots=True)
class Feedback:
    """How the vendor's own answers feed back into the shared buckets."""

    remaining_header: str | None = "X-RateLimit-Remaining"
    low_watermark: float = 0
    """Remaining below this drains the global buckets; 0 disables the drain."""
    retry_after_default: float = 10.0
    """Seconds to block after a vendor 429 that carries no usable Retry-After."""
    max_retry_after: float = 300.0
    """Longest block a vendor's Retry-After can impose, in seconds: longer blocks stop the
    whole fleet, so the cap is minutes and a capped block is logged."""
    headers: HeaderFeedback = "none"
    """``auto``: learn the vendor's limits from its own quota headers (SPEC §10, learned
    limits), only ever tightening the policy's; ``none``: only 429s and ``low_watermark``."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Upstream timeouts, seconds."""

    connect: float = 5.0
    read: float = 30.0
    """Longest silence while waiting for the vendor's response headers or body."""


@dataclass(frozen=True, slots=True)
class EndpointMatch:
    """Which requests belong to an endpoint class: every given condition must hold."""

    methods: tuple[str, ...] = ()
    """Upper-case request methods; empty: any method."""
    path: str | None = None
    """A glob (``*``, ``?``, ``[...]``; ``*`` crosses ``/``) on the path the vendor is sent,
    without the query; None: any path."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A class of a vendor's requests with quotas of its own (SPEC §10), nested inside
    the vendor's (and the tenant's) buckets."""

    name: str
    """Policy-defined, unique per vendor: the ``endpoint`` label in metrics and the access log."""
    match: EndpointMatch = field(default_factory=EndpointMatch)
    limits: tuple[Limit, ...] = ()
    concurrency: int | None = None
    """Requests of this class in flight at once, fleet-wide; None: no cap of its own."""
    cost: float = 1.0
    """Tokens a request of this class takes from every bucket it touches."""


@dataclass(frozen=True, slots=True)
class MeterEstimate:
    """How a metered request's cost is estimated before it goes (SPEC §14)."""

    kind: EstimateKind
    """A preset (the vendor's own admission rule), ``fixed`` or ``json``."""
    amount: float = 0.0
    """``fixed``: the cost of every request; ``json``: the cost when the pointer finds no
    non-negative number."""
    pointer: str = ""
    """``json``: an RFC 6901 pointer into the request's JSON body."""


@dataclass(frozen=True, slots=True)
class MeterSettle:
    """Where the vendor's answer says what a metered request really cost (SPEC §14)."""

    kind: SettleKind = "none"
    """A preset (the vendor's ``usage``, streamed or not), ``json``, ``header``, or ``none``
    (the estimate stands)."""
    pointer: str = ""
    """``json``: an RFC 6901 pointer into the answer's JSON body."""
    header: str = ""
    """``header``: the answer header holding the amount."""


@dataclass(frozen=True, slots=True)
class Meter:
    """A currency the vendor counts besides requests (LLM tokens, query-cost points): its
    own buckets, taken at each request's estimated cost with the request's other buckets,
    and settled from the answer (SPEC §14)."""

    name: str
    """Unique per vendor: the ``meter`` label in metrics and part of its store keys."""
    limits: tuple[Limit, ...]
    estimate: MeterEstimate
    settle: MeterSettle = field(default_factory=MeterSettle)
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    default: float | None = None
    """What a request whose body cannot be read for the estimate (not JSON, or too large)
    costs; None: the most its buckets can ever hold (the smallest burst)."""

    @property
    def capacity(self) -> float:
        """The most one request can ever take: the smallest burst of its buckets."""
        return min(lim.burst for lim in self.limits)


@dataclass(frozen=True, slots=True)
class Partition:
    """The vendor's quota is per value of a request header (a credential, an account)."""

    header: str
    """Requests without it share one default partition. The value is hashed for keys and
    never stored or logged; the header is forwarded unchanged."""


@dataclass(frozen=True, slots=True)
class Share:
    """How a vendor's global buckets are divided among whoever is waiting (SPEC §13):
    work-conserving, by tenant weight within a priority class, classes in order."""

    weights: tuple[tuple[str, float], ...] = ()
    """Per tenant (``weights:`` less its ``default`` key); unlisted tenants get ``default_weight``."""
    default_weight: float = 1.0
    classes: tuple[str, ...] = ("default",)
    """Priority order, highest first (``classes:``; one class named ``default`` without it)."""
    default_class: str = "default"
    """A request's class when neither ``X-Quota-Priority`` nor ``tenant_class`` names one
    (the lowest class when the YAML leaves it out)."""
    tenant_class: tuple[tuple[str, str], ...] = ()
    """A tenant's class when its request names none."""
    min_share: float = 0.1
    """Fraction of the quota a lower class with requests waiting always receives."""

    def weight(self, tenant: str) -> float:
        for name, weight in self.weights:
            if name == tenant:
                return weight
        return self.default_weight

    def class_of(self, tenant: str, asked: str | None = None) -> int | None:
        """The index in ``classes`` of a request's class: ``asked`` (X-Quota-Priority, as
        sent), else the tenant's, else ``default_class``; None when ``asked`` names no class."""
        if asked is not None:
            return self.classes.index(asked) if asked in self.classes else None
        name = self.default_class
        for who, cls in self.tenant_class:
            if who == tenant:
                name = cls
                break
        return self.classes.index(name)


@dataclass(frozen=True, slots=True)
class Vendor:
    name: str
    """The ``limiter`` label in metrics and the namespace of its store keys."""
    hosts: tuple[str, ...] = ()
    """Lower-case host names, optionally ``host:port``; without a port any port matches."""
    route: str | None = None
    """Path prefix for origin-form requests, e.g. ``/payments-api``; needs ``upstream``."""
    upstream: str | None = None
    """Origin to send to (``scheme://host[:port]``, no path); None = the requested origin."""
    limits: tuple[Limit, ...] = ()
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)
    on_limit: OnLimit = field(default_factory=OnLimit)
    feedback: Feedback = field(default_factory=Feedback)
    connect: ConnectMode = "deny"
    """Resolved by the loader: ``intercept`` when ``tls.ca_cert`` is set, else ``deny``, unless given."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_tunnels: int = 100
    """Concurrent ``connect: tunnel`` connections allowed for this vendor."""
    answers: AnswerPreset = GENERIC
    """How the proxy's own answers for this vendor are written (SPEC §9): a preset's status
    codes, retry headers and JSON body per kind of answer, as its official SDK reads them."""
    vendor_limit: tuple[Limit, ...] = ()
    """What the vendor itself allows, as the policy states it (``check`` only): a warning
    when the fleet's worst case in one of its windows is more (bursts are ignored: a vendor
    counts requests in a window)."""
    answers_max_wait: float = 60.0
    """Seconds; a defer whose retry hint is longer tells the SDK not to retry (the job is
    re-enqueued instead of blocking a worker), the wait still readable."""
    ratelimit_headers: bool = False
    """Add the IETF ``RateLimit-Policy`` / ``RateLimit`` fields to forwarded responses."""
    endpoints: tuple[Endpoint, ...] = ()
    """Endpoint classes, first match wins; a request matching none takes only the
    vendor's (and tenant's) buckets, at cost 1."""
    concurrency: int | None = None
    """Requests in flight to this vendor at once, fleet-wide (leases); None: no cap."""
    partition: Partition | None = None
    """Keep the global and endpoint buckets per value of a request header; None: one quota."""
    share: Share | None = None
    """Divide the global buckets among waiting tenants and classes (SPEC §13); None: first come."""
    meters: tuple[Meter, ...] = ()
    """Currencies the vendor counts besides requests (SPEC §14), in file order."""


@dataclass(frozen=True, slots=True)
class Breaker:
    """Circuit breaker around the store."""

    failures: int = 3
    """Consecutive store failures that open the breaker."""
    cooloff: float = 1.0
    """Seconds the breaker stays open before one probe is let through."""


@dataclass(frozen=True, slots=True)
class StoreSettings:
    url: str = "memory://"
    timeout: float = 0.05
    """Seconds allowed for one store call."""
    on_failure: FailureMode = "closed"
    """closed: store down = every request deferred; open: forwarded unlimited; local: each
    replica enforces its share of every limit in-process (SPEC §12, degraded mode)."""
    key_prefix: str = "quota-proxy"
    breaker: Breaker = field(default_factory=Breaker)


@dataclass(frozen=True, slots=True)
class TenantSettings:
    header: str = "X-Tenant-Id"
    """Names the tenant with ``from_ = "header"``; stripped before forwarding either way."""
    default: str | None = "default"
    """Tenant when the header is absent; None means such a request gets 400."""
    from_: TenantFrom = "header"
    """Where the tenant comes from (YAML ``from``): the tenant header, or the worker's
    proxy credentials (``Proxy-Authorization: Basic``, checked against ``credentials``)."""
    credentials: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    """(tenant, SHA-256 digest of its secret) pairs, for ``from_ = "proxy_auth"``."""
    known_only: bool = False
    """Accept only the tenants the policy names (the default and every vendor's overrides);
    another tenant in the header gets 400."""
    max_active: int | None = 10_000
    """Other tenants (not named in the policy) a vendor tracks at once on one replica: a new
    one beyond it is deferred until a seat frees up. None: no bound."""

    def named(self, vendors: tuple[Vendor, ...]) -> frozenset[str]:
        """The tenants the policy names: the default, every vendor's and every meter's
        overrides, share weights and classes (SPEC §13), every credential."""
        names = {tenant for vendor in vendors for tenant, _ in vendor.tenant_limits.overrides}
        for vendor in vendors:
            names.update(tenant for meter in vendor.meters for tenant, _ in meter.tenant_limits.overrides)
            if vendor.share is not None:
                names.update(tenant for tenant, _ in vendor.share.weights)
                names.update(tenant for tenant, _ in vendor.share.tenant_class)
        names.update(tenant for tenant, _ in self.credentials)
        if self.default is not None:
            names.add(self.default)
        return frozenset(names)


@dataclass(frozen=True, slots=True)
class TlsSettings:
    upstream_verify: bool = True
    upstream_ca_file: str | None = None
    ca_cert: str | None = None
    ca_key: str | None = None
    leaf_validity: float = 86400.0


@dataclass(frozen=True, slots=True)
class Connections:
    """Workers' connections to the proxy listener: plain HTTP, CONNECT, tunnels, interceptions."""

    max: int = 4096
    """Open at once; beyond it a new connection is answered 503 (``Connection: close``) and
    closed. Lowered at start when the file-descriptor limit cannot hold it (logged)."""
    head_timeout: float = 10.0
    """Seconds a request head may take to arrive whole: from the connection's opening (its
    first request, or the TLS handshake's end inside an intercepted CONNECT), or from the
    first byte of a later request on a kept-alive connection. Then 408 and close."""
    idle_timeout: float = 60.0
    """Seconds a kept-alive connection may wait for its next request before it is closed."""


@dataclass(frozen=True, slots=True)
class Policy:
    version: int = 1
    listen: Address = Address("127.0.0.1", 8080)
    admin_listen: Address = Address("127.0.0.1", 9090)
    store: StoreSettings = field(default_factory=StoreSettings)
    tenant: TenantSettings = field(default_factory=TenantSettings)
    vendors: tuple[Vendor, ...] = ()
    tls: TlsSettings = field(default_factory=TlsSettings)
    drain_timeout: float = 10.0
    """Seconds SIGTERM waits for in-flight requests before closing them."""
    workers: Workers = 1
    """Processes serving ``listen`` (SPEC §11); ``auto``: one per usable CPU. More than one
    needs a shared store (not ``memory://``)."""
    access_log: bool = True
    connections: Connections = field(default_factory=Connections)
    admin_token: str | None = field(default=None, repr=False)
    """The bearer token ``GET /status`` and ``POST /reload`` require (``QUOTA_PROXY_ADMIN_TOKEN``
    wins over the file); None: they are open to whoever reaches the admin listener."""
    admin_hosts: tuple[str, ...] = ()
    """Names the admin listener answers to (its ``Host``), besides its own address,
    ``localhost`` and IP literals: what stops DNS rebinding."""
    source: str = "<memory>"
    """The file the policy came from, for messages."""
    warnings: tuple[ConfigError, ...] = field(default=(), compare=False)
    """What the loader found worth a look without refusing the policy (``check`` prints
    them, ``run`` logs them), e.g. a vendor host that is an IP address."""

    @property
    def admin_names(self) -> tuple[str, ...]:
        """The host names the admin listener answers to, besides any IP literal:
        ``localhost``, its own listen name if it is one, and ``admin_hosts``."""
        own = () if ip_or_none(self.admin_listen.host) is not None else (self.admin_listen.host,)
        return tuple(dict.fromkeys(("localhost", *own, *self.admin_hosts)))

    def vendor(self, name: str) -> Vendor:
        for v in self.vendors:
            if v.name == name:
                return v
        raise KeyError(name)


def format_number(x: float) -> str:
    """A count or rate as written: ``100``, ``0.5``."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{format_number(seconds * 1000)}ms"
