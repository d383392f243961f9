from pathlib import Path

import pytest

from proxy.policy import load_policy, parse_policy, summarize


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])


def test_example_summary_is_one_screen_with_effective_values():
    text = summarize(load_policy("config/example.yaml"))
    lines = text.splitlines()
    assert lines[0] == "OK config/example.yaml: 1 vendor(s)"
    assert len(lines) <= 40
    for expected in [
        "listen        127.0.0.1:8080",
        "workers       1 process",
        "admin         127.0.0.1:9090",
        "store         memory://",
        "              timeout 50ms, on_failure closed",
        'tenant        header X-Tenant-Id, default "default"',
        "              any tenant; at most 10000 not in the policy per vendor and replica at once",
        "vendor mock-vendor",
        "  hosts       api.mock-vendor.example",
        "  route       /mock-vendor",
        "  upstream    http://127.0.0.1:8081",
        "  limits      80/1s burst 20; 4000/1m burst 4000",
        "  worst case  at most 100 requests in any 1s, 4820 in any 1m, fleet-wide",
        "  partition   none: one quota for the whole vendor",
        "  concurrency no cap",
        "  endpoints   none: every request takes the vendor's buckets, cost 1",
        "  learned     off (feedback.headers none): only 429s and the low watermark",
        "  tenants     default 40/1s burst 40; sustained 40/s",
        "  on_limit    hold, max_hold 500ms",
        "  connect     deny",
        "  answers     generic, no SDK retry beyond 1m; RateLimit fields on 429s only",
        "              defer 429, long defer 429, shed 503 (check --answers shows each answer)",
        "connections   at most 4096 open (then 503), request head within 10s (then 408), idle keep-alive 1m",
        "admin access  no admin_token: /status and POST /reload are open unless QUOTA_PROXY_ADMIN_TOKEN is set",
        "              Host must be an IP address or localhost",
    ]:
        assert expected in lines


def test_summary_masks_the_store_password_and_lists_overrides():
    policy = parse_policy(
        """\
version: 1
store: {url: "redis://app:s3cret@redis.internal:6379/0", on_failure: open}
vendors:
  - name: crm
    hosts: [api.crm.example]
    limits: [{rate: 10, per: 1s, burst: 5}]
    tenant_limits:
      overrides: {acme: [{rate: 2}], exempt: []}
    on_limit: {action: defer}
    answers: stripe
    answers_max_wait: 90s
    ratelimit_headers: true
tls: {upstream_verify: false}
""",
        "p.yaml",
    )
    text = summarize(policy)
    assert "s3cret" not in text
    assert "store         redis://app:***@redis.internal:6379/0" in text
    assert "on_failure open (store down = NO LIMITS)" in text
    assert "upstream_verify OFF" in text
    assert "              acme: 2/1s burst 2; sustained 2/s" in text.splitlines()
    assert "              exempt: (none)" in text.splitlines()
    assert "  on_limit    defer, max_hold 500ms" in text.splitlines()
    assert "  answers     stripe, no SDK retry beyond 90s; RateLimit fields on forwarded answers" in text.splitlines()


def test_summary_shows_connection_limits_and_admin_access_but_never_the_token():
    policy = parse_policy(
        """\
version: 1
connections: {max: 500, head_timeout: 5s, idle_timeout: 2m}
admin_token: "k8s-secret-0123456789"
admin_hosts: [quota-proxy-admin.quota-proxy.svc]
vendors:
  - name: crm
    hosts: [api.crm.example]
    limits: [{rate: 10}]
""",
        "p.yaml",
    )
    text = summarize(policy)
    assert "k8s-secret" not in text
    lines = text.splitlines()
    assert "connections   at most 500 open (then 503), request head within 5s (then 408), idle keep-alive 2m" in lines
    assert "admin access  bearer token (admin_token) required for /status and POST /reload" in lines
    assert "              Host must be an IP address or localhost, quota-proxy-admin.quota-proxy.svc" in lines


@pytest.mark.parametrize(
    ("tenant", "rows"),
    [
        (
            "{known_only: true}",
            [
                'tenant        header X-Tenant-Id, default "default"',
                "              known only: acme, default (others 400)",
            ],
        ),
        ("{max_active: null}", ["              any tenant, no bound on how many"]),
        (
            f"{{from: proxy_auth, credentials: {{acme: {{sha256: {'ab' * 32}}}}}}}",
            [
                "tenant        from proxy credentials (Basic; 407 without): acme",
                "              header X-Tenant-Id ignored (and stripped)",
            ],
        ),
    ],
)
def test_summary_says_which_tenants_get_in(tenant: str, rows: list[str]) -> None:
    text = summarize(
        parse_policy(
            f"version: 1\ntenant: {tenant}\nvendors:\n  - name: a\n    hosts: [api.a.example]\n"
            "    limits: [{rate: 1}]\n    tenant_limits: {overrides: {acme: [{rate: 1}]}}\n",
            "p.yaml",
        )
    )
    lines = text.splitlines()
    for row in rows:
        assert row in lines
    assert "ab" * 32 not in text


def test_summary_shows_quota_shapes_with_defaults_and_worst_cases():
    policy = parse_policy(
        """\
version: 1
vendors:
  - name: stripe
    hosts: [api.stripe.com]
    partition: {header: Authorization}
    limits: [{rate: 95, per: 1s, burst: 10}, {rate: 5000, per: 1m}]
    concurrency: 50
    endpoints:
      - name: search
        match: {methods: [GET, head], path: "/v1/*/search"}
        limits: [{rate: 20, per: 1s, burst: 5}]
        concurrency: 5
      - name: files
        match: {path: "/v1/files*"}
        cost: 5
      - name: refunds
        match: {methods: [POST]}
        limits: [{rate: 100, per: 1h, burst: 10}]
    feedback: {headers: auto}
""",
        "p.yaml",
    )
    lines = summarize(policy).splitlines()
    start = lines.index("vendor stripe")
    assert lines[start + 4 : start + 21] == [
        "  limits      95/1s burst 10; 5000/1m burst 5000",
        # 95 + 10 in the first second: a vendor allowing 100 in any second would refuse some.
        "  worst case  at most 105 requests in any 1s, 5710 in any 1m, per value of Authorization",
        "  sustained   83.3/s in the long run (5000/1m binds)",
        "  partition   Authorization: global and endpoint buckets per value (hashed), requests without it share one",
        "  concurrency at most 50 in flight, fleet-wide",
        "  endpoints   search: GET,HEAD /v1/*/search",
        "                limits 20/1s burst 5; concurrency 5; cost 1",
        "                at most 25 requests in any 1s, per value of Authorization",
        "              files: any method /v1/files*",
        "                no limits of its own; no concurrency cap of its own; cost 5",
        "                at most 21 requests in any 1s, 1142 in any 1m, per value of Authorization",
        "              refunds: POST (any path)",
        "                limits 100/1h burst 10; no concurrency cap of its own; cost 1",
        "                at most 110 requests in any 1h, per value of Authorization",
        "              any other request: the vendor's buckets only, cost 1",
        "  tenants     default (none)",
        "  on_limit    hold, max_hold 500ms",
    ]
    assert "  learned     auto: the vendor's quota headers only ever tighten these limits" in lines


def test_worst_case_counts_the_cheapest_requests_and_says_when_it_does_not_hold():
    text = summarize(
        parse_policy(
            """\
version: 1
store: {on_failure: open}
vendors:
  - name: shop
    hosts: [shop.example]
    limits: [{rate: 2, per: 1s, burst: 40}]
    endpoints: [{name: light, match: {methods: [HEAD]}, cost: 0.5}]
""",
            "p.yaml",
        )
    )
    # 40 + 2 tokens in a second, half a token a HEAD: 84 requests.
    assert (
        "  worst case  at most 84 requests in any 1s, fleet-wide; unbounded while the store is down (on_failure open)"
        in text.splitlines()
    )


@pytest.mark.parametrize(
    ("workers", "store", "shown"),
    [
        ("2", "redis://127.0.0.1:6380/0", "2 processes, one listen port (SO_REUSEPORT)"),
        ("auto", "redis://127.0.0.1:6380/0", "auto: one process per usable CPU, one listen port (SO_REUSEPORT)"),
        ("auto", "memory://", "auto: 1 process on memory:// (its buckets live in one process)"),
    ],
)
def test_workers_are_shown_as_they_will_run(workers: str, store: str, shown: str) -> None:
    text = f"""
version: 1
workers: {workers}
store: {{url: "{store}"}}
vendors:
  - {{name: payments, hosts: [api.payments.example], limits: [{{rate: 5, per: 1s}}]}}
"""
    assert f"workers       {shown}" in summarize(parse_policy(text, "w.yaml")).splitlines()


def test_check_tells_the_long_run_and_warns_where_a_window_lets_through_more_than_the_vendor_allows():
    policy = parse_policy(
        """\
version: 1
vendors:
  - name: crm
    hosts: [api.crm.example]
    limits:
      - {rate: 10, per: 1s, burst: 10}
      - {rate: 100000, per: 24h}
    tenant_limits:
      default: [{rate: 5, per: 1s}]
  - name: mail
    hosts: [api.mail.example]
    vendor_limit: [{rate: 14, per: 1s}]
    limits: [{rate: 14, per: 1s, burst: 2}]
""",
        "p.yaml",
    )
    lines = summarize(policy).splitlines()
    # Windows as written (24h, not 1d); the binding rate in the long run, for the vendor
    # and its tenants (the vendor's 1.16/s binds the tenant's 5/s).
    assert "  limits      10/1s burst 10; 100000/24h burst 100000" in lines
    assert "  worst case  at most 20 requests in any 1s, 200000 in any 24h, fleet-wide" in lines
    assert "  sustained   1.16/s in the long run (100000/24h binds)" in lines
    assert "  tenants     default 5/1s burst 5; sustained 1.16/s (the vendor's quota binds)" in lines
    warnings = [line.strip() for line in lines if "WARNING" in line]
    assert warnings[:2] == [
        "WARNING: up to 20 in any 1s, twice 10/1s (its burst 10 comes on top): a vendor allowing 10 per 1s "
        "would refuse the rest; set a smaller burst, or state vendor_limit",
        "WARNING: up to 200000 in any 24h, twice 100000/24h (its burst 100000 comes on top): a vendor allowing "
        "100000 per 24h would refuse the rest; set a smaller burst, or state vendor_limit",
    ]
    # A stated vendor_limit: any excess is a warning of the loader too (check prints it, run logs it).
    assert "WARNING: up to 16 in any 1s, above the vendor's 14/1s (vendor_limit)" in warnings
    assert "  vendor says 14/1s burst 14" in lines
    (loaded,) = policy.warnings
    assert (loaded.line, loaded.path) == (12, "vendors[1].vendor_limit")
    assert "the fleet may send 16 requests in any 1s, more than the vendor's 14" in loaded.message


def test_summary_shows_how_a_shared_quota_is_divided():
    policy = parse_policy(
        """\
version: 1
vendors:
  - name: stripe
    hosts: [api.stripe.com]
    limits: [{rate: 100, per: 1s, burst: 20}]
    share:
      weights: {default: 2, acme: 4, beta: 1, gamma: 3}
      classes: [checkout, batch]
      default_class: batch
      tenant_class: {acme: checkout, beta: checkout, delta: checkout}
      min_share: 12.5%
  - name: plain
    hosts: [api.plain.example]
    limits: [{rate: 1}]
""",
        "p.yaml",
    )
    lines = summarize(policy).splitlines()
    start = lines.index("  tenants     default (none)")
    # Listed tenants by class: acme 4, beta 1 and delta (the default weight, 2) share checkout.
    assert lines[start + 1 : start + 10] == [
        "  share       classes checkout > batch, highest first (X-Quota-Priority picks; unknown: 400)",
        "              a lower class waiting keeps at least 12.5% of the quota",
        "              other tenants: weight 2, class batch",
        "              fair share with every listed tenant of its class waiting:",
        "              acme: weight 4, checkout → 57.1% of checkout",
        "              beta: weight 1, checkout → 14.3% of checkout",
        "              delta: weight 2, checkout → 28.6% of checkout",
        "              gamma: weight 3, batch → 100% of batch",
        "  on_limit    hold, max_hold 500ms",
    ]
    plain = lines[lines.index("vendor plain") :]
    assert not any(line.startswith("  share") for line in plain), "no share row without share"


@pytest.mark.parametrize(
    ("share", "rows"),
    [
        (
            "{}",
            [
                "  share       one class, default: tenants by weight, no priorities",
                "              every tenant: weight 1, class default",
            ],
        ),
        (
            "{weights: {acme: 4}}",
            [
                "  share       one class, default: tenants by weight, no priorities",
                "              other tenants: weight 1, class default",
                "              fair share with every listed tenant of its class waiting:",
                "              acme: weight 4, default → 100% of default",
            ],
        ),
        (
            "{classes: [hi, lo], min_share: 0}",
            [
                "  share       classes hi > lo, highest first (X-Quota-Priority picks; unknown: 400)",
                "              a lower class gets only what higher classes leave (min_share 0)",
                "              every tenant: weight 1, class lo",
            ],
        ),
    ],
)
def test_summary_of_a_share_without_tenants_or_classes(share: str, rows: list[str]) -> None:
    text = summarize(
        parse_policy(
            f"version: 1\nvendors:\n  - {{name: a, hosts: [a.example], limits: [{{rate: 1}}], share: {share}}}\n",
            "p.yaml",
        )
    )
    lines = text.splitlines()
    start = lines.index(rows[0])
    assert lines[start : start + len(rows) + 1] == [*rows, "  on_limit    hold, max_hold 500ms"]


def test_summary_shows_each_meter_with_its_long_run_worst_case_estimate_and_settle():
    policy = parse_policy(
        """\
version: 1
vendors:
  - name: openai
    hosts: [api.openai.com]
    limits: [{rate: 500, per: 1m}]
    meters:
      tokens:
        limits: [{rate: 200000, per: 1m}]
        tenant_limits: {default: [{rate: 50000, per: 1m}], overrides: {acme: [{rate: 100000, per: 1m}]}}
        estimate: openai
        settle: openai
        default: 4000
  - name: shopify
    hosts: [shop.myshopify.com]
    meters:
      points:
        limits: [{rate: 50, per: 1s, burst: 1000}]
        estimate: {fixed: 100}
        settle: {json: /extensions/cost/actualQueryCost}
""",
        "p.yaml",
    )
    lines = summarize(policy).splitlines()
    start = lines.index("  sustained   8.33/s in the long run (500/1m binds)")
    assert lines[start + 1 : start + 10] == [
        "  meters      tokens: 200000/1m burst 200000",
        "                long run 3333/s, 200000/min (200000/1m binds)",
        "                worst case at most 400000 tokens in any 1m, fleet-wide; one request at most 200000"
        " (the smallest burst)",
        "                tenants default 50000/1m burst 50000; sustained 833/s",
        "                  acme: 100000/1m burst 100000; sustained 1667/s",
        "                estimate openai: prompt characters / 4, rounded up, + completion cap x n, as OpenAI admits"
        " a request",
        "                settle openai: the answer's usage.total_tokens (streamed: its usage chunk); without it the"
        " estimate stands",
        "                a body it cannot read (not JSON, too large) costs 4000 (default)",
        "  partition   none: one quota for the whole vendor",
    ]
    start = lines.index("vendor shopify")
    assert lines[start + 4 : start + 13] == [
        "  limits      (none): requests are not counted, only its meters",
        "  worst case  unbounded",
        "  sustained   unbounded",
        "  meters      points: 50/1s burst 1000",
        "                long run 50/s, 3000/min (50/1s binds)",
        "                worst case at most 1050 points in any 1s, fleet-wide; one request at most 1000 (the smallest"
        " burst)",
        "                estimate every request costs 100",
        "                settle the number at /extensions/cost/actualQueryCost in the answer's JSON body; without it"
        " the estimate stands",
        "  partition   none: one quota for the whole vendor",
    ]


def test_summary_of_anthropic_meters_per_partition_and_the_general_forms():
    policy = parse_policy(
        """\
version: 1
vendors:
  - name: anthropic
    hosts: [api.anthropic.com]
    partition: {header: x-api-key}
    limits: [{rate: 50, per: 1m}]
    meters:
      input_tokens:
        limits: [{rate: 40000, per: 1m, burst: 10000}, {rate: 1000000, per: 1d}]
        estimate: anthropic_input
        settle: anthropic_input
      output_tokens:
        limits: [{rate: 8000, per: 1m}]
        estimate: anthropic_output
        settle: anthropic_output
  - name: graph
    hosts: [api.graph.example]
    meters:
      points:
        limits: [{rate: 5000, per: 1h}]
        estimate: {json: /variables/first, default: 50}
        settle: {header: X-Query-Cost}
""",
        "p.yaml",
    )
    lines = summarize(policy).splitlines()
    start = lines.index("  meters      input_tokens: 40000/1m burst 10000; 1000000/1d burst 1000000")
    assert lines[start + 1 : start + 13] == [
        # The day's refill binds in the long run; the 1m bucket's burst bounds one request.
        "                long run 11.6/s, 694/min (1000000/1d binds)",
        "                worst case at most 50000 input_tokens in any 1m, 2000000 in any 1d, per value of"
        " x-api-key; one request at most 10000 (the smallest burst)",
        "                estimate anthropic_input: input characters / 4, rounded up, as Anthropic estimates input"
        " tokens",
        "                settle anthropic_input: the answer's usage.input_tokens + cache_creation_input_tokens"
        " (streamed: message_start); without it the estimate stands",
        "                a body it cannot read (not JSON, too large) costs 10000, the smallest burst",
        "              output_tokens: 8000/1m burst 8000",
        "                long run 133/s, 8000/min (8000/1m binds)",
        "                worst case at most 16000 output_tokens in any 1m, per value of x-api-key; one request at"
        " most 8000 (the smallest burst)",
        "                estimate anthropic_output: the request's max_tokens, as Anthropic estimates output tokens",
        "                settle anthropic_output: the answer's usage.output_tokens (streamed: the last message_delta);"
        " without it the estimate stands",
        "                a body it cannot read (not JSON, too large) costs 8000, the smallest burst",
        "  partition   x-api-key: global, endpoint and meter buckets per value (hashed), requests without it share one",
    ]
    assert "                estimate the number at /variables/first in the request's JSON body, else 50" in lines
    assert (
        "                settle the number in the answer's X-Query-Cost header; without it the estimate stands" in lines
    )


def test_summary_without_meters_has_no_meter_rows():
    lines = summarize(load_policy("config/example.yaml")).splitlines()
    assert not any(line.startswith("  meters") for line in lines)
