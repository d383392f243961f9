"""``vendors[].meters`` (SPEC §14): what a vendor counts besides requests. Every accepted
form loads into the frozen model; every mistake is reported with its path and line, each
warning too."""

from __future__ import annotations

import dataclasses

import pytest

from proxy.policy import ConfigErrors, Limit, TenantLimits, parse_policy
from proxy.policy.model import Meter, MeterEstimate, MeterSettle, Policy

HEAD = """\
version: 1
vendors:
  - name: v
    hosts: [api.v.example]
"""
LIMITS = "        limits: [{rate: 50, per: 1s, burst: 1000}]\n"


def policy(text: str, head: str = HEAD) -> Policy:
    return parse_policy(head + text, "p.yaml")


def problems(text: str, head: str = HEAD) -> list[str]:
    with pytest.raises(ConfigErrors) as raised:
        policy(text, head)
    return str(raised.value).splitlines()


def meter(body: str) -> Meter:
    """The one meter ``t`` of a vendor without request limits; ``body``: its keys."""
    (loaded,) = policy("    meters:\n      t:\n" + body).vendors[0].meters
    return loaded


# ---------------------------------------------------------------- good forms

SPEC_EXAMPLE = """\
version: 1
tenant: {known_only: true, default: null}
vendors:
  - name: openai
    hosts: [api.openai.com]
    limits: [{rate: 500, per: 1m}]             # requests, as before
    meters:
      tokens:                                  # the meter's name: a mapping key
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
"""


def test_the_spec_example_loads_into_the_model() -> None:
    loaded = parse_policy(SPEC_EXAMPLE, "p.yaml")
    openai, shopify = loaded.vendors
    assert openai.limits == (Limit(500, 60, 500),)
    assert openai.meters == (
        Meter(
            name="tokens",
            limits=(Limit(200000, 60, 200000),),
            estimate=MeterEstimate("openai"),
            settle=MeterSettle("openai"),
            tenant_limits=TenantLimits(
                default=(Limit(50000, 60, 50000),), overrides=(("acme", (Limit(100000, 60, 100000),)),)
            ),
            default=4000,
        ),
    )
    assert shopify.limits == ()  # no request limits: only points are counted
    assert shopify.meters == (
        Meter(
            name="points",
            limits=(Limit(50, 1, 1000),),
            estimate=MeterEstimate("fixed", amount=100),
            settle=MeterSettle("json", pointer="/extensions/cost/actualQueryCost"),
        ),
    )
    assert (shopify.meters[0].default, shopify.meters[0].capacity) == (None, 1000)
    assert loaded.warnings == ()
    # A tenant named only in a meter's overrides is a tenant the policy names (known_only).
    assert loaded.tenant.named(loaded.vendors) == frozenset({"acme"})


def test_meters_are_frozen() -> None:
    loaded = parse_policy(SPEC_EXAMPLE, "p.yaml").vendors[0].meters[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.default = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.estimate.kind = "fixed"  # type: ignore[misc]


def test_without_meters_a_vendor_has_none() -> None:
    assert policy("    limits: [{rate: 10}]\n").vendors[0].meters == ()


def test_anthropic_is_two_meters_in_file_order() -> None:
    loaded = policy(
        "    limits: [{rate: 50, per: 1m}]\n"
        "    meters:\n"
        "      output_tokens: {limits: [{rate: 8000, per: 1m}], estimate: anthropic_output, settle: anthropic_output}\n"
        "      input_tokens: {limits: [{rate: 40000, per: 1m}], estimate: anthropic_input, settle: anthropic_input}\n"
    ).vendors[0]
    assert [(m.name, m.estimate.kind, m.settle.kind) for m in loaded.meters] == [
        ("output_tokens", "anthropic_output", "anthropic_output"),
        ("input_tokens", "anthropic_input", "anthropic_input"),
    ]


@pytest.mark.parametrize(
    ("written", "estimate"),
    [
        ("openai", MeterEstimate("openai")),
        ("anthropic_input", MeterEstimate("anthropic_input")),
        ("anthropic_output", MeterEstimate("anthropic_output")),
        ("{fixed: 100}", MeterEstimate("fixed", amount=100)),
        ("{fixed: 0.5}", MeterEstimate("fixed", amount=0.5)),
        ("{json: /variables/first, default: 50}", MeterEstimate("json", amount=50, pointer="/variables/first")),
        ("{json: /a~1b/~0c/0, default: 0}", MeterEstimate("json", amount=0, pointer="/a~1b/~0c/0")),
        ("{json: '', default: 1}", MeterEstimate("json", amount=1, pointer="")),  # the whole body
    ],
)
def test_estimate_forms(written: str, estimate: MeterEstimate) -> None:
    assert meter(LIMITS + f"        estimate: {written}\n").estimate == estimate


@pytest.mark.parametrize(
    ("written", "settle"),
    [
        ("", MeterSettle()),
        ("        settle: none\n", MeterSettle("none")),
        ("        settle: null\n", MeterSettle()),
        ("        settle:\n", MeterSettle()),
        (
            "        settle: {json: /extensions/cost/actualQueryCost}\n",
            MeterSettle("json", pointer="/extensions/cost/actualQueryCost"),
        ),
        ("        settle: {header: X-Query-Cost}\n", MeterSettle("header", header="X-Query-Cost")),
    ],
)
def test_settle_forms(written: str, settle: MeterSettle) -> None:
    assert meter(LIMITS + "        estimate: {json: /cost, default: 10}\n" + written).settle == settle


def test_a_fixed_estimate_keeps_a_default_it_never_needs() -> None:
    loaded = policy("    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 5}\n        default: 7\n")
    assert loaded.vendors[0].meters[0].default == 7
    assert loaded.warnings == ()


def test_meter_names_are_letters_digits_underscores_and_hyphens() -> None:
    names = ["tokens", "input_tokens", "query-points", "7d", "x" * 64]
    body = "".join(f"      {name}: {{limits: [{{rate: 5}}], estimate: {{fixed: 1}}}}\n" for name in names)
    assert [m.name for m in policy("    meters:\n" + body).vendors[0].meters] == names


@pytest.mark.parametrize("limits", ["    limits: []\n", "    limits:\n", ""], ids=["empty", "null", "absent"])
def test_a_vendor_with_meters_needs_no_request_limits(limits: str) -> None:
    loaded = policy(limits + "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 1}\n").vendors[0]
    assert (loaded.limits, [m.name for m in loaded.meters]) == ((), ["t"])


def test_a_vendor_with_neither_limits_nor_meters_fails_as_before() -> None:
    assert problems("") == ['p.yaml:3: vendors[0]: missing required key "limits"']


def test_a_merged_meter_is_read_like_any_other() -> None:
    loaded = policy(
        "    meters:\n"
        "      base: &base {limits: [{rate: 5, burst: 10}], estimate: {fixed: 1}}\n"
        "      other: {<<: *base, estimate: {fixed: 2}}\n"
    ).vendors[0]
    assert [(m.name, m.estimate.amount, m.limits) for m in loaded.meters] == [
        ("base", 1, (Limit(5, 1, 10),)),
        ("other", 2, (Limit(5, 1, 10),)),
    ]


# ---------------------------------------------------------------- mistakes, each on its line

FORMS = "openai, anthropic_input, anthropic_output, {fixed: N} or {json: /pointer, default: N}"
SETTLES = "openai, anthropic_input, anthropic_output, none, {json: /pointer} or {header: Name}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # meters: itself
        (
            "    meters: {}\n",
            "5: vendors[0].meters: at least one meter is required (leave meters out to count requests only)",
        ),
        (
            "    meters:\n",
            "5: vendors[0].meters: at least one meter is required (leave meters out to count requests only)",
        ),
        ("    meters: [tokens]\n", "5: vendors[0].meters: expected a mapping, got a list"),
        ("    meters:\n      tokens: [{rate: 5}]\n", "6: vendors[0].meters.tokens: expected a mapping, got a list"),
        # names
        (
            "    meters:\n      'my tokens': {limits: [{rate: 5}], estimate: openai}\n",
            '6: vendors[0].meters."my tokens": "my tokens" is not a valid meter name (letters, digits, _ and -,'
            " at most 64)",
        ),
        (
            "    meters:\n      a.b: {limits: [{rate: 5}], estimate: openai}\n",
            '6: vendors[0].meters."a.b": "a.b" is not a valid meter name (letters, digits, _ and -, at most 64)',
        ),
        (
            "    meters:\n      _t: {limits: [{rate: 5}], estimate: openai}\n",
            '6: vendors[0].meters._t: "_t" is not a valid meter name (letters, digits, _ and -, at most 64)',
        ),
        (
            f"    meters:\n      {'x' * 65}: {{limits: [{{rate: 5}}], estimate: openai}}\n",
            f'6: vendors[0].meters.{"x" * 65}: "{"x" * 65}" is not a valid meter name (letters, digits, _ and -,'
            " at most 64)",
        ),
        (
            "    meters:\n"
            "      t: {limits: [{rate: 5}], estimate: openai}\n"
            "      t: {limits: [{rate: 6}], estimate: openai}\n",
            '7: vendors[0].meters.t: duplicate key "t"',
        ),
        # a meter's keys
        ("    meters:\n      t: {estimate: openai}\n", '6: vendors[0].meters.t: missing required key "limits"'),
        ("    meters:\n      t: {limits: [{rate: 5}]}\n", '6: vendors[0].meters.t: missing required key "estimate"'),
        (
            "    meters:\n      t: {limits: [], estimate: openai}\n",
            "6: vendors[0].meters.t.limits: at least one limit is required",
        ),
        (
            "    meters:\n      t:\n        limits: [{rate: 0}]\n        estimate: openai\n",
            "7: vendors[0].meters.t.limits[0].rate: rate must be a positive number",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        limit: 3\n",
            '9: vendors[0].meters.t.limit: unknown key "limit" (did you mean "limits"?)',
        ),
        (
            "    meters:\n      t:\n"
            + LIMITS
            + "        estimate: openai\n        tenant_limits: {overrides: {'a b': []}}\n",
            '9: vendors[0].meters.t.tenant_limits.overrides."a b": "a b" is not a valid tenant name'
            " (letters, digits and ._:@-, at most 128)",
        ),
        (
            "    meters:\n      t:\n"
            + LIMITS
            + "        estimate: openai\n        tenant_limits: {default: [{rate: 5, burst: 0.5}]}\n",
            "9: vendors[0].meters.t.tenant_limits.default[0].burst: burst must be at least 1",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        default: -4\n",
            "9: vendors[0].meters.t.default: default must not be negative",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        default: lots\n",
            '9: vendors[0].meters.t.default: expected a number, got "lots"',
        ),
        # estimate
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: opnai\n",
            f'8: vendors[0].meters.t.estimate: unknown estimate "opnai" (did you mean "openai"?): one of {FORMS}',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: fixed\n",
            f'8: vendors[0].meters.t.estimate: unknown estimate "fixed": one of {FORMS}',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: 100\n",
            f"8: vendors[0].meters.t.estimate: estimate must be one of {FORMS}, got 100",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate:\n",
            f"8: vendors[0].meters.t.estimate: estimate must be one of {FORMS}, got null",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: [openai]\n",
            f"8: vendors[0].meters.t.estimate: estimate must be one of {FORMS}, got a list",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 0}\n",
            "8: vendors[0].meters.t.estimate.fixed: fixed must be a positive number",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: -3}\n",
            "8: vendors[0].meters.t.estimate.fixed: fixed must be a positive number",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: '100'}\n",
            '8: vendors[0].meters.t.estimate.fixed: expected a number, got "100"',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 1.0e+20}\n",
            "8: vendors[0].meters.t.estimate.fixed: fixed must be at most 9007199254740992",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 1, json: /n}\n",
            "8: vendors[0].meters.t.estimate: fixed and json are two forms of estimate, give one: {fixed: N} or"
            " {json: /pointer, default: N}",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {}\n",
            "8: vendors[0].meters.t.estimate: estimate needs fixed or json: {fixed: N} or {json: /pointer, default: N}",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {default: 3}\n",
            "8: vendors[0].meters.t.estimate: estimate needs fixed or json: {fixed: N} or {json: /pointer, default: N}",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixd: 1}\n",
            '8: vendors[0].meters.t.estimate.fixd: unknown key "fixd" (did you mean "fixed"?)',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate:\n          fixed: 1\n          default: 3\n",
            "10: vendors[0].meters.t.estimate.default: default goes with json: a fixed estimate costs its amount"
            " whatever the body",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: /n}\n",
            '8: vendors[0].meters.t.estimate: missing required key "default"',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: /n, default: -1}\n",
            "8: vendors[0].meters.t.estimate.default: default must not be negative",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: n/total, default: 1}\n",
            '8: vendors[0].meters.t.estimate.json: "n/total" is not a JSON pointer: it starts with "/" (e.g.'
            " /usage/total_tokens)",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: /a~2b, default: 1}\n",
            '8: vendors[0].meters.t.estimate.json: "/a~2b" is not a JSON pointer: "~" is written "~0" in it,'
            ' and "/" in a key "~1"',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: /a~, default: 1}\n",
            '8: vendors[0].meters.t.estimate.json: "/a~" is not a JSON pointer: "~" is written "~0" in it,'
            ' and "/" in a key "~1"',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {json: 5, default: 1}\n",
            "8: vendors[0].meters.t.estimate.json: expected a string, got 5",
        ),
        # settle
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: usage\n",
            f'9: vendors[0].meters.t.settle: unknown settle "usage": one of {SETTLES}',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: opeanai\n",
            f'9: vendors[0].meters.t.settle: unknown settle "opeanai" (did you mean "openai"?): one of {SETTLES}',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: false\n",
            f"9: vendors[0].meters.t.settle: settle must be one of {SETTLES}, got false",
        ),
        (
            "    meters:\n      t:\n"
            + LIMITS
            + "        estimate: openai\n        settle: {json: /a, header: X-Cost}\n",
            "9: vendors[0].meters.t.settle: json and header are two forms of settle, give one: {json: /pointer} or"
            " {header: Name}",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: {}\n",
            "9: vendors[0].meters.t.settle: settle needs json or header: {json: /pointer} or {header: Name}",
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: {headers: X-Cost}\n",
            '9: vendors[0].meters.t.settle.headers: unknown key "headers" (did you mean "header"?)',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: {header: 'X Cost'}\n",
            '9: vendors[0].meters.t.settle.header: "X Cost" is not a valid header name',
        ),
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: openai\n        settle: {json: cost}\n",
            '9: vendors[0].meters.t.settle.json: "cost" is not a JSON pointer: it starts with "/" (e.g.'
            " /usage/total_tokens)",
        ),
        # a settle preset goes with its own estimate
        (
            "    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 100}\n        settle: openai\n",
            "9: vendors[0].meters.t.settle: settle openai goes with estimate openai (a preset settles what its own"
            " estimate counts), not with estimate {fixed: 100}",
        ),
        (
            "    meters:\n      t:\n"
            + LIMITS
            + "        estimate: anthropic_input\n        settle: anthropic_output\n",
            "9: vendors[0].meters.t.settle: settle anthropic_output goes with estimate anthropic_output (a preset"
            " settles what its own estimate counts), not with estimate anthropic_input",
        ),
        (
            "    meters:\n      t:\n"
            + LIMITS
            + "        estimate: {json: /n, default: 2}\n        settle: anthropic_input\n",
            "9: vendors[0].meters.t.settle: settle anthropic_input goes with estimate anthropic_input (a preset"
            ' settles what its own estimate counts), not with estimate {json: "/n", default: 2}',
        ),
    ],
)
def test_a_mistake_names_its_path_and_line(text: str, expected: str) -> None:
    assert problems(text) == [f"p.yaml:{expected}"]


def test_a_meter_with_a_wrong_name_still_has_its_mistakes_reported() -> None:
    assert problems("    meters:\n      'two words':\n" + LIMITS + "        estimate: openia\n") == [
        'p.yaml:6: vendors[0].meters."two words": "two words" is not a valid meter name (letters, digits, _ and -,'
        " at most 64)",
        'p.yaml:8: vendors[0].meters."two words".estimate: unknown estimate "openia" (did you mean "openai"?):'
        f" one of {FORMS}",
    ]


def test_every_mistake_of_the_meters_is_reported_at_once_in_line_order() -> None:
    found = problems(
        "    meters:\n"
        "      tokens:\n"
        "        limits: [{rate: -1}]\n"
        "        estimate: {json: nope}\n"
        "        settle: {header: 'a b'}\n"
        "        default: -1\n"
        "      'bad name': {estimate: openai}\n"
    )
    assert [line.split(": ")[:2] for line in found] == [
        ["p.yaml:7", "vendors[0].meters.tokens.limits[0].rate"],
        ["p.yaml:8", "vendors[0].meters.tokens.estimate"],  # missing default
        ["p.yaml:8", "vendors[0].meters.tokens.estimate.json"],
        ["p.yaml:9", "vendors[0].meters.tokens.settle.header"],
        ["p.yaml:10", "vendors[0].meters.tokens.default"],
        ["p.yaml:11", 'vendors[0].meters."bad name"'],
        ["p.yaml:11", 'vendors[0].meters."bad name"'],  # and its missing limits
    ], found


def test_a_wrong_meters_section_is_one_problem_not_also_missing_limits() -> None:
    assert problems("    meters: {}\n") == [
        "p.yaml:5: vendors[0].meters: at least one meter is required (leave meters out to count requests only)"
    ]


def test_share_still_needs_request_limits() -> None:
    text = "    share: {}\n    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 1}\n"
    assert problems(text) == ["p.yaml:5: vendors[0].share: share divides the vendor's limits, and this vendor has none"]


# ---------------------------------------------------------------- warnings


@pytest.mark.parametrize(
    ("body", "warning"),
    [
        (
            "        estimate: {fixed: 5000}\n",
            "8: vendors[0].meters.t.estimate: estimate {fixed: 5000} is more than the burst of the meter's limit"
            " 50/1s burst 1000: no request can ever be granted",
        ),
        (
            "        estimate: {fixed: 500}\n"
            "        tenant_limits: {default: [{rate: 5, burst: 400}], overrides: {acme: [{rate: 5, burst: 50}]}}\n",
            '8: vendors[0].meters.t.estimate: estimate {fixed: 500} is more than the burst of tenant "acme"\'s'
            ' limit 5/1s burst 50: no request of tenant "acme" can ever be granted',
        ),
        (
            "        estimate: {fixed: 500}\n        tenant_limits: {default: [{rate: 5, burst: 400}]}\n",
            "8: vendors[0].meters.t.estimate: estimate {fixed: 500} is more than the burst of the default tenant"
            " limit 5/1s burst 400: no request of a tenant without an override can ever be granted",
        ),
        (
            "        estimate: openai\n        default: 4000\n",
            "9: vendors[0].meters.t.default: default 4000 is more than the burst of the meter's limit 50/1s"
            " burst 1000: a request whose body cannot be read would be refused at once",
        ),
        (
            "        estimate:\n          json: /cost\n          default: 2000\n",
            "10: vendors[0].meters.t.estimate.default: default 2000 is more than the burst of the meter's limit"
            ' 50/1s burst 1000: a request whose body has no number at "/cost" would be refused at once',
        ),
    ],
)
def test_a_cost_above_a_burst_is_a_warning(body: str, warning: str) -> None:
    loaded = policy("    meters:\n      t:\n" + LIMITS + body)
    assert [str(w) for w in loaded.warnings] == [f"p.yaml:{warning}"]


@pytest.mark.parametrize(
    "body",
    [
        "        estimate: {fixed: 1000}\n",  # as large as the burst: granted from a full bucket
        "        estimate: {fixed: 100}\n        default: 1000000\n",  # a fixed estimate never reads the body
        "        estimate: {json: /n, default: 5}\n        default: 1000000\n",  # json has a default of its own
        "        estimate: anthropic_output\n        default: 1000\n",
        "        estimate: {fixed: 900}\n        tenant_limits: {overrides: {bulk: []}}\n",  # an exempt tenant
    ],
)
def test_a_cost_within_every_burst_is_no_warning(body: str) -> None:
    assert policy("    meters:\n      t:\n" + LIMITS + body).warnings == ()


def test_vendor_limit_on_a_vendor_counting_no_requests_is_a_warning() -> None:
    loaded = policy(
        "    vendor_limit: [{rate: 10}]\n    meters:\n      t:\n" + LIMITS + "        estimate: {fixed: 1}\n"
    )
    assert [str(w) for w in loaded.warnings] == [
        "p.yaml:5: vendors[0].vendor_limit: vendor_limit counts requests, and this vendor has no limits: nothing"
        " keeps the fleet's requests within it (only its meters are counted)"
    ]
