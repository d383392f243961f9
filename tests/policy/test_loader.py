"""The policy loader: good files become frozen model objects; each bad file in
``bad/`` gives its exact ``file:line: path: message`` (one fixture per failure)."""

import dataclasses
from pathlib import Path

import pytest

from proxy.ca.commands import init_ca
from proxy.policy import (
    Address,
    Breaker,
    ConfigError,
    ConfigErrors,
    Connections,
    Feedback,
    Limit,
    OnLimit,
    Policy,
    StoreSettings,
    TenantLimits,
    TenantSettings,
    Timeouts,
    TlsSettings,
    Vendor,
    load_policy,
    parse_address,
    parse_policy,
    parse_store_url,
    values,
)
from proxy.policy.model import Endpoint, EndpointMatch, Partition

ROOT = Path(__file__).resolve().parents[2]
BAD = "tests/policy/bad"

MINIMAL = """\
version: 1
vendors:
  - name: a
    hosts: [api.a.example]
    limits: [{rate: 10}]
"""


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch):
    # Paths in messages are the paths as given, so load them the way `quota-proxy check` would.
    monkeypatch.chdir(ROOT)


def problems(path: str) -> list[str]:
    with pytest.raises(ConfigErrors) as raised:
        load_policy(path)
    return str(raised.value).splitlines()


# ---------------------------------------------------------------- good files


def test_example_policy_loads_into_the_model():
    assert load_policy("config/example.yaml") == Policy(
        version=1,
        listen=Address("127.0.0.1", 8080),
        admin_listen=Address("127.0.0.1", 9090),
        store=StoreSettings(url="memory://", timeout=0.05, on_failure="closed"),
        tenant=TenantSettings(header="X-Tenant-Id", default="default"),
        vendors=(
            Vendor(
                name="mock-vendor",
                hosts=("api.mock-vendor.example",),
                route="/mock-vendor",
                upstream="http://127.0.0.1:8081",
                limits=(Limit(rate=80, per=1, burst=20), Limit(rate=4000, per=60, burst=4000)),
                tenant_limits=TenantLimits(default=(Limit(rate=40, per=1, burst=40),)),
                on_limit=OnLimit(action="hold", max_hold=0.5),
                feedback=Feedback(remaining_header="X-RateLimit-Remaining", low_watermark=10, retry_after_default=30),
                connect="deny",
            ),
        ),
        source="config/example.yaml",
    )


def test_payments_policy_loads_with_overrides_and_several_vendors():
    policy = load_policy(Path("config/payments.yaml"))
    assert policy.source == "config/payments.yaml"
    assert policy.store.url == "redis://127.0.0.1:6379/0"
    assert policy.store.breaker == Breaker(failures=3, cooloff=1.0)
    assert [v.name for v in policy.vendors] == ["payments-api", "crm", "mail-api"]

    payments = policy.vendor("payments-api")
    assert payments.upstream == "https://api.payments.example"
    assert payments.limits == (Limit(90, 1, 10),)
    assert (payments.partition, payments.concurrency) == (Partition("Authorization"), 25)
    assert payments.endpoints == (
        Endpoint("search", EndpointMatch(("GET",), "/v1/*/search"), (Limit(18, 1, 2),), concurrency=5),
        Endpoint("files", EndpointMatch(("POST",), "/v1/files"), cost=5, concurrency=4),
    )
    assert payments.feedback.headers == "auto"
    assert payments.tenant_limits.for_tenant("acme") == (Limit(20, 1, 20),)
    assert payments.tenant_limits.for_tenant("globex") == (Limit(12, 1, 12), Limit(500, 60, 500))
    assert payments.tenant_limits.for_tenant("someone-else") == (Limit(8, 1, 8),)
    assert payments.feedback.max_retry_after == 600
    assert payments.timeouts == Timeouts(connect=3, read=30)
    assert (payments.answers.name, payments.answers_max_wait, payments.ratelimit_headers) == ("stripe", 30, True)

    assert policy.vendor("crm").on_limit.action == "defer"
    mail = policy.vendor("mail-api")
    assert (mail.on_limit.action, mail.connect, mail.max_tunnels) == ("shed", "tunnel", 20)
    assert mail.feedback.remaining_header is None
    assert mail.upstream is None and mail.route is None
    assert (mail.answers.name, mail.answers_max_wait, mail.ratelimit_headers) == ("generic", 60, False)


def test_spec_example_with_a_ca_defaults_connect_to_intercept():
    text = """\
version: 1
vendors:
  - name: payments-api
    hosts: [api.payments.example]
    limits: [{rate: 80, per: 1s, burst: 40}]
  - name: crm
    hosts: [api.crm.example]
    limits: [{rate: 10}]
    connect: tunnel
tls:
  ca_cert: /etc/quota-proxy/ca.pem
  ca_key: /etc/quota-proxy/ca-key.pem
  leaf_validity: 1d
"""
    policy = parse_policy(text, "spec.yaml", check_ca=False)  # the CA files are checked in test_ca_files.py
    assert [v.connect for v in policy.vendors] == ["intercept", "tunnel"]
    assert policy.tls == TlsSettings(
        ca_cert="/etc/quota-proxy/ca.pem", ca_key="/etc/quota-proxy/ca-key.pem", leaf_validity=86400
    )


def test_omitted_settings_take_the_model_defaults():
    policy = parse_policy(MINIMAL, "minimal.yaml")
    vendor = Vendor(name="a", hosts=("api.a.example",), limits=(Limit(10, 1, 10),))
    assert policy == Policy(vendors=(vendor,), source="minimal.yaml")
    assert policy.vendors[0].connect == "deny"  # no CA: CONNECT is refused, never tunnelled blindly


def test_policy_objects_are_frozen():
    policy = load_policy("config/example.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.listen = Address("0.0.0.0", 1)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.vendors[0].limits[0].rate = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.vendors[0].on_limit.action = "shed"  # type: ignore[misc]


def test_hosts_and_upstream_are_normalised():
    text = """\
version: 1
vendors:
  - name: a
    hosts: [API.A.Example., "api.a.example:8443", "::1", "[::1]:8080", 10.0.0.1, my_service]
    route: /a/v1
    upstream: "HTTPS://API.A.example:8443/"
    limits: [{rate: 10}]
"""
    vendor = parse_policy(text, "x.yaml").vendors[0]
    assert vendor.hosts == ("api.a.example", "api.a.example:8443", "[::1]", "[::1]:8080", "10.0.0.1", "my_service")
    assert vendor.upstream == "https://api.a.example:8443"
    assert vendor.route == "/a/v1"


def test_burst_defaults_to_rate_but_never_below_one_token():
    text = MINIMAL.replace("[{rate: 10}]", "[{rate: 0.5, per: 1s}, {rate: 300, per: 5m}]")
    assert parse_policy(text, "x.yaml").vendors[0].limits == (Limit(0.5, 1, 1), Limit(300, 300, 300))


def test_tls_paths_resolve_against_the_policy_directory(tmp_path):
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "vendors.pem").write_text("bundle")
    _, key = init_ca(tmp_path / "ca")
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        MINIMAL + f"tls:\n  upstream_ca_file: certs/vendors.pem\n  ca_cert: ca/ca.pem\n  ca_key: {key}\n"
    )
    tls = load_policy(policy_file).tls
    assert tls.upstream_ca_file == str(tmp_path / "certs" / "vendors.pem")
    assert tls.ca_cert == str(tmp_path / "ca" / "ca.pem")
    assert tls.ca_key == str(key)


def test_ca_paths_need_not_exist_when_the_ca_is_not_checked(tmp_path):
    # `quota-proxy ca init -c` reads the policy to make the very files it names.
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(MINIMAL + "tls:\n  ca_cert: ca.pem\n  ca_key: /abs/ca-key.pem\n")
    tls = load_policy(policy_file, check_ca=False).tls
    assert (tls.ca_cert, tls.ca_key) == (str(tmp_path / "ca.pem"), "/abs/ca-key.pem")


def test_null_sections_mean_defaults_and_anchors_merge():
    text = """\
version: 1
store:            # every key commented out
tenant:
vendors:
  - &base
    name: a
    hosts: [api.a.example]
    limits: [{rate: 10}]
    on_limit: {action: defer}
  - <<: *base
    name: b
    hosts: [api.b.example]
"""
    policy = parse_policy(text, "x.yaml")
    assert policy.store == StoreSettings() and policy.tenant == TenantSettings()
    assert [(v.name, v.hosts, v.on_limit.action) for v in policy.vendors] == [
        ("a", ("api.a.example",), "defer"),
        ("b", ("api.b.example",), "defer"),
    ]


def test_connections_and_admin_access_settings():
    text = (
        MINIMAL
        + """\
connections: {max: 200, head_timeout: 2s, idle_timeout: 30s}
admin_token: "0123456789abcdef-._~+/=="
admin_hosts: [Quota-Proxy-Admin.quota-proxy.svc., "::1", 10.0.0.7, quota-proxy-admin.quota-proxy.svc]
"""
    )
    policy = parse_policy(text, "x.yaml")
    assert policy.connections == Connections(max=200, head_timeout=2, idle_timeout=30)
    assert policy.admin_token == "0123456789abcdef-._~+/=="
    assert policy.admin_hosts == ("quota-proxy-admin.quota-proxy.svc", "::1", "10.0.0.7")
    assert "0123456789abcdef" not in repr(policy)  # a policy printed in a log never shows the token
    defaults = parse_policy(MINIMAL, "x.yaml")
    assert defaults.connections == Connections(max=4096, head_timeout=10, idle_timeout=60)
    assert (defaults.admin_token, defaults.admin_hosts) == (None, ())


SPEC_QUOTA_SHAPES = """\
version: 1
vendors:
  - name: stripe
    hosts: [api.stripe.com]
    partition: {header: Authorization}
    limits: [{rate: 100, per: 1s}]
    concurrency: 50
    endpoints:
      - name: search
        match: {methods: [get, HEAD], path: "/v1/*/search"}
        limits: [{rate: 20, per: 1s}]
        concurrency: 5
      - name: files
        match: {path: "/v1/files*"}
        cost: 5
      - name: customer
        match: {path: "/v1/customers/cus_????????????[0-9]"}
        cost: 1.5
    feedback:
      headers: auto
"""


def test_spec_quota_shapes_load_into_the_model():
    policy = parse_policy(SPEC_QUOTA_SHAPES, "shapes.yaml")
    stripe = policy.vendors[0]
    assert stripe.partition == Partition(header="Authorization")
    assert stripe.concurrency == 50
    assert stripe.feedback == Feedback(headers="auto")
    assert stripe.endpoints == (
        Endpoint(
            name="search",
            match=EndpointMatch(methods=("GET", "HEAD"), path="/v1/*/search"),
            limits=(Limit(20, 1, 20),),
            concurrency=5,
        ),
        Endpoint(name="files", match=EndpointMatch(path="/v1/files*"), cost=5),
        Endpoint(name="customer", match=EndpointMatch(path="/v1/customers/cus_????????????[0-9]"), cost=1.5),
    )
    assert policy.warnings == ()


def test_quota_shapes_are_off_unless_asked_for():
    vendor = parse_policy(MINIMAL, "p.yaml").vendors[0]
    assert (vendor.endpoints, vendor.concurrency, vendor.partition, vendor.feedback.headers) == ((), None, None, "none")
    nulls = MINIMAL + "    endpoints: null\n    concurrency: null\n    partition: null\n"
    assert parse_policy(nulls, "p.yaml") == parse_policy(MINIMAL, "p.yaml")


def test_a_cost_fits_when_every_bucket_it_touches_holds_it():
    """An exempt tenant (``[]``) has no bucket to overflow; bursts equal to the cost are enough."""
    text = MINIMAL.replace("[{rate: 10}]", "[{rate: 10, burst: 5}]") + (
        "    tenant_limits:\n      default: [{rate: 5}]\n      overrides: {bulk: []}\n"
        "    endpoints:\n      - {name: files, match: {path: /v1/files}, cost: 5, limits: [{rate: 1, burst: 5}]}\n"
    )
    assert parse_policy(text, "p.yaml").vendors[0].endpoints[0].cost == 5


@pytest.mark.parametrize(
    ("endpoints", "warning"),
    [
        (
            "[{name: tagged, match: {path: /v1/x}}]",
            '9: vendors[0].endpoints[0]: endpoint "tagged" has no limits, concurrency or cost of its own:'
            " its requests are limited like the vendor's others, only labelled with its name",
        ),
        (
            "[{name: search, match: {path: /v1/search}, concurrency: 9}]",
            "9: vendors[0].endpoints[0].concurrency: concurrency 9 is above the vendor's concurrency 8:"
            " the vendor's cap binds first",
        ),
        (
            "[{name: all, match: {methods: [GET, POST]}, cost: 2}, {name: search, match: {methods: [get], path: /s},"
            " cost: 3}]",
            '9: vendors[0].endpoints[1]: endpoint "search" never matches: endpoints[0] ("all") matches all its'
            " requests first",
        ),
        (
            '[{name: everything, match: {path: "/*"}, cost: 2}, {name: search, match: {path: /s}, cost: 3}]',
            '9: vendors[0].endpoints[1]: endpoint "search" never matches: endpoints[0] ("everything") matches'
            " all its requests first",
        ),
        (
            '[{name: search, match: {path: "/v1/search?query=*"}, cost: 2}]',
            '9: vendors[0].endpoints[0].match.path: path "/v1/search?query=*" seems to hold a query: only the'
            ' path is matched, never the query, and "?" matches any one character',
        ),
    ],
)
def test_endpoints_worth_a_look_are_warnings(endpoints: str, warning: str) -> None:
    text = MINIMAL + "    concurrency: 8\n    tenant_limits: {}\n    partition: {header: Stripe-Account}\n"
    text += f"    endpoints: {endpoints}\n"
    policy = parse_policy(text, "p.yaml")
    assert [str(w) for w in policy.warnings] == [f"p.yaml:{warning}"]


def test_endpoints_that_differ_are_not_shadowed():
    text = MINIMAL + (
        "    endpoints:\n"
        "      - {name: reads, match: {methods: [GET], path: /v1/x}, cost: 2}\n"
        "      - {name: writes, match: {methods: [GET, POST], path: /v1/x}, cost: 2}\n"
        "      - {name: other, match: {path: /v1/y}, cost: 2}\n"
        "      - {name: rest, match: {methods: [DELETE]}, cost: 2}\n"
    )
    assert parse_policy(text, "p.yaml").warnings == ()


@pytest.mark.parametrize(("written", "method"), [("get", "GET"), ("Post", "POST"), ("PURGE", "PURGE")])
def test_methods_are_upper_cased_tokens(written: str, method: str) -> None:
    assert values.http_method("method", written) == method


@pytest.mark.parametrize(
    "header",
    [
        "Host",
        "connection",
        "Transfer-Encoding",
        "Proxy-Connection",
        "TE",
        "Proxy-Anything",
        "X-Quota-On-Limit",
        "Upgrade",
    ],
)
def test_headers_the_vendor_never_sees_as_sent_cannot_partition(header: str) -> None:
    with pytest.raises(ValueError, match="cannot partition"):
        values.partition_header("header", header)


@pytest.mark.parametrize("header", ["Authorization", "Stripe-Account", "X-Shopify-Access-Token", "api-key"])
def test_credential_and_account_headers_partition(header: str) -> None:
    assert values.partition_header("header", header) == header


@pytest.mark.parametrize("glob", ["/v1/x y", "/v1/\x00", "*/search", ""])
def test_path_globs_refused(glob: str) -> None:
    with pytest.raises(ValueError, match="path"):
        values.path_glob("path", glob)


def test_listeners_on_port_zero_may_coincide():
    text = "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n" + MINIMAL
    assert parse_policy(text, "x.yaml").listen == Address("127.0.0.1", 0)


# ---------------------------------------------------------------- bad files: one per failure

BAD_FILES = {
    "unknown_key": '2: ratelimit: unknown key "ratelimit"',
    "misspelled_key": '5: vendors[0].upstrem: unknown key "upstrem" (did you mean "upstream"?)',
    "duplicate_key": '6: vendors[0].limits: duplicate key "limits"',
    "bad_duration": '7: vendors[0].limits[1].per: "1x" is not a duration',
    "nonpositive_rate": "6: vendors[0].limits[0].rate: rate must be a positive number",
    "burst_below_one": "6: vendors[0].limits[0].burst: burst must be at least 1",
    "duplicate_limit": "7: vendors[0].limits[1]: limit 10/1000ms burst 10 is listed twice",  # as written
    "duplicate_vendor_name": '6: vendors[1].name: duplicate vendor name "a" (first at line 3)',
    "duplicate_host": '7: vendors[1].hosts[1]: host "api.a.example:443" already belongs to vendor "a"',
    "duplicate_route": '8: vendors[1].route: route "/api" already belongs to vendor "a"',
    "bad_host": '4: vendors[0].hosts[1]: "api a.example" is not a host name or IP address',
    "upstream_not_http": '5: vendors[0].upstream: upstream "ftp://api.a.example" must be an http:// or https:// origin',
    "upstream_with_path": (
        '5: vendors[0].upstream: upstream "https://api.a.example/v1" must be an http:// or https:// origin,'
        " without a path, query or fragment"
    ),
    "route_without_upstream": '4: vendors[0].route: route "/a" needs an upstream',
    "route_trailing_slash": '4: vendors[0].route: route "/a/" must not end with "/"',
    "vendor_without_target": "3: vendors[0]: a vendor needs hosts or a route",
    "missing_vendors": '2: missing required key "vendors"',
    "empty_vendors": "2: vendors: at least one vendor is required",
    "missing_limits": '3: vendors[0]: missing required key "limits"',
    "wrong_version": "1: version: version must be 1, got 2",
    "bad_listen": '2: listen: "localhost" is not HOST:PORT (e.g. 127.0.0.1:8080 or [::1]:8080)',
    "bad_port": '3: admin_listen: "[::1]:70000": port must be 0..65535',
    "listen_clash": "3: admin_listen: listen 127.0.0.1:8080 and admin_listen 127.0.0.1:8080 use the same port",
    "bad_store_url": (
        '3: store.url: url must be memory://, redis://, rediss:// or redis+cluster://, got "postgres://db:5432/quota"'
    ),
    "store_password_masked": (
        "3: store.url: url must be memory://, redis://, rediss:// or redis+cluster://,"
        ' got "http://user:***@redis.internal:6379/0"'
    ),
    "bad_on_failure": '4: store.on_failure: on_failure must be closed, open or local, got "ignore"',
    "bad_action": '7: vendors[0].on_limit.action: action must be hold, defer or shed, got "wait"',
    "bad_tenant_name": (
        '13: vendors[0].tenant_limits.overrides."big corp": "big corp" is not a valid tenant name'
        " (letters, digits and ._:@-, at most 128)"
    ),
    "bad_header": '3: tenant.header: "X Tenant" is not a valid header name',
    "not_a_mapping": "1: expected a mapping, got a list",
    "empty": "1: the policy is empty",
    "syntax_error": "5: invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence at line 4)",
    "two_documents": (
        "2: invalid YAML: expected a single document in the stream at line 1, but found another document"
    ),
    "intercept_without_ca": "6: vendors[0].connect: connect: intercept needs tls.ca_cert and tls.ca_key",
    "ca_cert_without_key": "7: tls.ca_cert: ca_cert and ca_key must be set together",
    "bad_answers": (
        '6: vendors[0].answers: unknown answer preset "antropic" (did you mean "anthropic"?): '
        "one of generic, stripe, openai, anthropic, github, slack"
    ),
    "bad_answers_max_wait": "7: vendors[0].answers_max_wait: answers_max_wait must be greater than 0",
    "bad_ratelimit_headers": '6: vendors[0].ratelimit_headers: expected true or false, got "yes"',
    "bad_connections_max": "3: connections.max: max must be at least 1",
    "bad_head_timeout": "4: connections.head_timeout: head_timeout must be greater than 0",
    "bad_idle_timeout": '3: connections.idle_timeout: "forever" is not a duration',
    "short_admin_token": "2: admin_token: the admin token must be at least 16 characters long, it has 7",
    "bad_admin_token": "2: admin_token: the admin token may hold only letters, digits and -._~+/ (and = at the end)",
    "unquoted_admin_token": "2: admin_token: the admin token must be a string (quote it)",
    "bad_admin_host": '4: admin_hosts[1]: "proxy admin" is not a host name or IP address',
    "bad_workers": '2: workers: workers must be a whole number of at least 1 or auto, got "many"',
    "workers_on_memory": (
        "4: workers: 2 workers need a shared store: memory:// buckets live in one process and would not be"
        " shared (use redis://, or one worker)"
    ),
    "retry_after_above_max": (
        "7: vendors[0].feedback.retry_after_default: retry_after_default (2h) exceeds max_retry_after (1h)"
    ),
    "tenant_bad_from": '3: tenant.from: from must be header or proxy_auth, got "password"',
    "proxy_auth_without_credentials": "4: tenant.from: from: proxy_auth needs tenant.credentials",
    "credentials_without_proxy_auth": (
        "4: tenant.credentials: credentials are used only with from: proxy_auth"
        " (set tenant.from, or the tenant header decides)"
    ),
    "credentials_empty": "4: tenant.credentials: at least one tenant's credentials are required",
    "credential_bad_sha256": (
        "6: tenant.credentials.globex.sha256: sha256 must be 64 hex digits (the SHA-256 of the secret),"
        ' got "not-a-digest"'
    ),
    "credential_plain_password": (
        '7: tenant.credentials.acme.password: unknown key "password": give the secret\'s SHA-256 as sha256'
        ' (printf %s "$SECRET" | sha256sum), never the secret'
    ),
    "credential_user_with_colon": (
        '5: tenant.credentials."team:acme": "team:acme" cannot be a proxy user:'
        ' Basic credentials end the user at the first ":"'
    ),
    "known_only_with_proxy_auth": (
        "6: tenant.known_only: known_only is for from: header (with proxy_auth only tenants with credentials get in)"
    ),
    "known_only_without_tenants": (
        "4: tenant.known_only: the policy names no tenant (no default, no tenant_limits.overrides):"
        " every request would get 400"
    ),
    "bad_known_only": '3: tenant.known_only: expected true or false, got "sometimes"',
    "bad_max_active": "3: tenant.max_active: max_active must be at least 1",
    "endpoint_bad_name": (
        '7: vendors[0].endpoints[0].name: "search api" is not a valid endpoint name (letters, digits'
        " and _.-, at most 64)"
    ),
    "duplicate_endpoint_name": '10: vendors[0].endpoints[1].name: duplicate endpoint name "search" (first at line 7)',
    "endpoint_without_match": '7: vendors[0].endpoints[0]: missing required key "match"',
    "endpoint_empty_match": "8: vendors[0].endpoints[0].match: match needs methods, a path or both",
    "endpoint_bad_method": '8: vendors[0].endpoints[0].match.methods[1]: "GE T" is not an HTTP method',
    "endpoint_connect_method": (
        "9: vendors[0].endpoints[0].match.methods[0]: CONNECT cannot be matched: it opens a tunnel (the"
        " vendor's connect), and the requests inside an intercepted tunnel are matched like any other"
    ),
    "endpoint_empty_methods": (
        "8: vendors[0].endpoints[0].match.methods: at least one method is required (leave methods out"
        " to match any method)"
    ),
    "endpoint_duplicate_method": '9: vendors[0].endpoints[0].match.methods[2]: method "GET" is listed twice',
    "endpoint_relative_path": '8: vendors[0].endpoints[0].match.path: path "v1/search" must start with "/"',
    "endpoint_path_fragment": (
        '8: vendors[0].endpoints[0].match.path: path "/v1/search#top" may not hold a fragment (#),'
        " spaces or control characters"
    ),
    "endpoint_bad_limit": "9: vendors[0].endpoints[0].limits[1].rate: rate must be a positive number",
    "endpoint_bad_cost": "9: vendors[0].endpoints[0].cost: cost must be a positive number",
    "endpoint_cost_above_burst": (
        "9: vendors[0].endpoints[0].cost: cost 5 is more than the burst of the vendor's limit 100/1s"
        ' burst 4: a request of "files" could never be granted'
    ),
    "endpoint_cost_above_tenant_burst": (
        '14: vendors[0].endpoints[0].cost: cost 5 is more than the burst of tenant "acme"\'s limit 2/1s'
        ' burst 2: a request of "files" could never be granted'
    ),
    "endpoint_cost_above_own_burst": (
        "10: vendors[0].endpoints[0].cost: cost 5 is more than the burst of its own limit 1/1s burst 3:"
        ' a request of "files" could never be granted'
    ),
    "endpoint_bad_concurrency": "9: vendors[0].endpoints[0].concurrency: concurrency must be at least 1",
    "bad_vendor_concurrency": "6: vendors[0].concurrency: expected an integer, got 2.5",
    "endpoint_unknown_key": '9: vendors[0].endpoints[0].limit: unknown key "limit" (did you mean "limits"?)',
    "endpoint_match_unknown_key": '8: vendors[0].endpoints[0].match.paths: unknown key "paths" (did you mean "path"?)',
    "endpoints_not_a_list": "7: vendors[0].endpoints: expected a list, got a mapping",
    "partition_tenant_header": (
        '8: vendors[0].partition.header: "x-account" is the tenant header, stripped before forwarding:'
        " it cannot partition the vendor's quota (tenant_limits keep buckets per tenant)"
    ),
    "partition_hop_by_hop": (
        '7: vendors[0].partition.header: "Proxy-Authorization" cannot partition a vendor\'s quota: Host,'
        " hop-by-hop, Proxy-* and X-Quota-* headers never reach the vendor as the worker sent them"
    ),
    "partition_bad_header": '6: vendors[0].partition.header: "Stripe Account" is not a valid header name',
    "partition_missing_header": '6: vendors[0].partition: missing required key "header"',
    "partition_unknown_key": '6: vendors[0].partition.hashed: unknown key "hashed"',
    "bad_feedback_headers": '7: vendors[0].feedback.headers: headers must be auto or none, got "learn"',
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_reports_file_line_path_and_message(name):
    assert problems(f"{BAD}/{name}.yaml") == [f"{BAD}/{name}.yaml:{BAD_FILES[name]}"]


def test_every_bad_fixture_is_asserted():
    on_disk = {p.stem for p in (ROOT / BAD).glob("*.yaml")}
    # ca_outside_constraints needs a CA made at test time: asserted in test_ca_files.py
    assert on_disk == set(BAD_FILES) | {"missing_ca_file", "wrong_type", "several_problems", "ca_outside_constraints"}


def test_missing_ca_bundle_names_where_it_looked():
    looked = ROOT / BAD / "no-such-bundle.pem"
    assert problems(f"{BAD}/missing_ca_file.yaml") == [
        f'{BAD}/missing_ca_file.yaml:7: tls.upstream_ca_file: "no-such-bundle.pem" is not a file (looked at {looked})'
    ]


def test_wrong_types_are_named():
    assert problems(f"{BAD}/wrong_type.yaml") == [
        f'{BAD}/wrong_type.yaml:2: store: expected a mapping, got "memory://"',
        f"{BAD}/wrong_type.yaml:4: vendors[0].name: expected a string, got 12",
        f'{BAD}/wrong_type.yaml:5: vendors[0].hosts: expected a list, got "api.a.example"',
        f'{BAD}/wrong_type.yaml:6: vendors[0].limits[0].rate: expected a number, got "10/s"',
    ]


def test_all_problems_are_reported_at_once_in_line_order():
    f = f"{BAD}/several_problems.yaml"
    assert problems(f) == [
        f'{f}:2: listen: "127.0.0.1:99999": port must be 0..65535',
        f"{f}:5: store.timeout: timeout must be greater than 0",
        f'{f}:11: vendors[0].limits[1].per: "1x" is not a duration',
        f'{f}:12: vendors[0].on_limit.action: action must be hold, defer or shed, got "wait"',
        f'{f}:13: vendors[1].name: duplicate vendor name "payments-api" (first at line 7)',
        f'{f}:14: vendors[1].hosts[0]: host "api.payments.example" already belongs to vendor "payments-api"',
        f"{f}:15: vendors[1].limits[0].rate: rate must be a positive number",
        f'{f}:16: vendors[1].colour: unknown key "colour"',
    ]


def test_errors_are_values_carried_by_one_exception():
    with pytest.raises(ConfigErrors) as raised:
        load_policy(f"{BAD}/bad_duration.yaml")
    assert raised.value.errors == (
        ConfigError(f"{BAD}/bad_duration.yaml", 7, "vendors[0].limits[1].per", '"1x" is not a duration'),
    )


def test_unreadable_file_has_no_line():
    assert problems("config/nope.yaml") == ["config/nope.yaml: cannot read policy: No such file or directory"]


def test_tenant_settings_load_with_their_defaults():
    assert parse_policy(MINIMAL, "p.yaml").tenant == TenantSettings(
        header="X-Tenant-Id", default="default", from_="header", credentials=(), known_only=False, max_active=10_000
    )
    digest = "ab" * 32
    text = MINIMAL + f"tenant:\n  from: proxy_auth\n  credentials: {{acme: {{sha256: {digest.upper()}}}}}\n"
    text += "  max_active: null\n"
    tenant = parse_policy(text, "p.yaml").tenant
    assert (tenant.from_, tenant.credentials, tenant.max_active) == (
        "proxy_auth",
        (("acme", bytes.fromhex(digest)),),
        None,
    )
    assert digest not in repr(tenant) and "credentials" not in repr(tenant)  # the digests stay out of reprs


def test_a_default_tenant_with_proxy_auth_is_a_warning():
    text = (
        MINIMAL + f"tenant:\n  from: proxy_auth\n  default: nobody\n  credentials: {{acme: {{sha256: {'ab' * 32}}}}}\n"
    )
    (warning,) = parse_policy(text, "p.yaml").warnings
    assert str(warning) == (
        "p.yaml:8: tenant.default: default is not used with from: proxy_auth: a request without credentials gets 407"
    )


def test_overrides_path_for_a_plain_tenant():
    text = MINIMAL + "    tenant_limits:\n      overrides:\n        acme: [{rate: 0}]\n"
    with pytest.raises(ConfigErrors) as raised:
        parse_policy(text, "p.yaml")
    assert (
        str(raised.value) == "p.yaml:8: vendors[0].tenant_limits.overrides.acme[0].rate: rate must be a positive number"
    )


def test_unsupported_tags_are_refused():
    with pytest.raises(ConfigErrors) as raised:
        parse_policy(MINIMAL.replace("rate: 10", "rate: !!python/object:os.system 10"), "p.yaml")
    assert "p.yaml:5: vendors[0].limits[0].rate: could not determine a constructor" in str(raised.value)


# ---------------------------------------------------------------- pieces the command line reuses


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:8080", Address("127.0.0.1", 8080)),
        ("[::1]:8080", Address("::1", 8080)),
        ("0.0.0.0:0", Address("0.0.0.0", 0)),
        ("LocalHost:80", Address("localhost", 80)),
    ],
)
def test_parse_address(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["localhost", ":8080", "::1:8080", "[::1]", "host:http", "[1.2.3.4]:80", "h:65536"])
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        parse_address(text)


@pytest.mark.parametrize(
    "url", ["memory://", "redis://127.0.0.1:6379/0", "rediss://:pw@cache:6380", "redis+cluster://node1:7000"]
)
def test_parse_store_url_accepts(url):
    assert parse_store_url(url) == url


@pytest.mark.parametrize(
    "url", ["memory://x", "redis://", "redis://h:6379/db", "redis+cluster://h:7000/3", "unix:///tmp/r.sock", "redis:h"]
)
def test_parse_store_url_rejects(url):
    with pytest.raises(ValueError):
        parse_store_url(url)


def test_config_error_formats_without_path_or_line():
    assert str(ConfigError("p.yaml", 3, "", "the policy is empty")) == "p.yaml:3: the policy is empty"
    assert str(ConfigError("p.yaml", None, "", "cannot read policy: x")) == "p.yaml: cannot read policy: x"
