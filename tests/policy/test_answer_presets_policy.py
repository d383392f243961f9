"""``vendors[].answers`` and ``answer_presets:`` (SPEC §9): a preset's name or a mapping that
changes one, a policy's own presets, and every mistake reported with its path and line."""

from __future__ import annotations

import json

import pytest

from proxy.limiter.buckets import buckets_for
from proxy.limiter.limiter import Limiter
from proxy.pipeline.responses import refusal_response
from proxy.policy import ConfigErrors, parse_policy
from proxy.policy.model import Policy
from proxy.policy.presets import BUILT_IN, KINDS
from proxy.wire.refusals import Limited

HEAD = """\
version: 1
vendors:
  - name: v
    hosts: [api.v.example]
    limits: [{rate: 10}]
"""


def policy(answers: str, presets: str = "") -> Policy:
    return parse_policy(presets + HEAD + answers, "p.yaml")


def problems(answers: str, presets: str = "") -> list[str]:
    with pytest.raises(ConfigErrors) as raised:
        policy(answers, presets)
    return str(raised.value).splitlines()


SHED = Limited("shed", 0.2, "global", "global 10/1s")
LONG = Limited("defer", 300.0, "global", "global 10/1s", hint=300.0)


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_built_in_preset_by_name(name: str) -> None:
    vendor = policy(f"    answers: {name}\n").vendors[0]
    assert vendor.answers is BUILT_IN[name]


def test_a_mapping_changes_a_presets_shed_and_long_defer_status_and_keeps_the_rest() -> None:
    vendor = policy(
        "    answers:\n      preset: stripe\n      shed: {status: 409}\n      long_defer: {status: 422}\n"
    ).vendors[0]
    assert vendor.answers.name == "stripe+"
    shed = refusal_response(SHED, vendor)
    assert shed.status == 409
    assert shed.headers["Stripe-Should-Retry"] == "false" and "Retry-After" not in shed.headers
    assert json.loads(shed.body)["error"]["code"] == "rate_limit"  # type: ignore[arg-type]
    long = refusal_response(LONG, vendor)
    assert (long.status, long.headers["Retry-After"], long.headers["x-should-retry"]) == (422, "300", "false")
    assert vendor.answers.kind("defer") == BUILT_IN["stripe"].kind("defer")


@pytest.mark.parametrize(
    ("answers", "life"),
    [
        ("    answers: slack\n", 2.0),
        ("    answers: {preset: slack, shed: {status: 422}}\n", 2.0),
        ("    answers: {preset: mine}\n", 2.0),
        ("    answers: github\n", 1.0),
        ("", 1.0),
    ],
)
def test_a_deferred_calls_slot_outlives_its_maturity_by_its_sdks_retry_jitter(answers: str, life: float) -> None:
    # slack_sdk sleeps Retry-After plus up to 1 s: its slot is kept until then (changed or not).
    vendor = policy(answers, "answer_presets:\n  mine: {preset: slack}\n").vendors[0]
    b = buckets_for("test", vendor, "t")
    assert Limiter.reserve(vendor, b).life == life


def test_a_body_template_for_every_kind_with_typed_placeholders_and_the_generic_keys_after_it() -> None:
    vendor = policy(
        "    answers:\n"
        "      body: {errors: [{message: '{message}', code: '{code}', wait: '{wait_ms}', again: '{retry}'}]}\n"
        "      headers: {X-Trace: 'proxy {action} {{x}}', x-should-retry: null}\n"
    ).vendors[0]
    for kind in KINDS:
        assert vendor.answers.kind(kind).body.startswith('{"errors"')
    answer = refusal_response(LONG, vendor)
    body = json.loads(answer.body)  # type: ignore[arg-type]
    assert list(body)[:2] == ["errors", "action"]  # the template's keys, then the generic ones
    assert body["errors"] == [
        {"message": body["errors"][0]["message"], "code": "deferred", "wait": 300000, "again": False}
    ]
    assert answer.headers["X-Trace"] == "proxy defer {x}"
    assert "x-should-retry" not in answer.headers  # removed
    assert answer.headers["Stripe-Should-Retry"] == "false"  # the rest kept


def test_a_policys_own_preset_based_on_another_and_used_by_name() -> None:
    presets = (
        "answer_presets:\n"
        "  acme:\n"
        "    preset: slack\n"
        "    shed: {status: 422}\n"
        "  acme-strict:\n"
        "    preset: acme\n"
        "    long_defer: {status: 422}\n"
    )
    vendor = policy("    answers: acme-strict\n", presets).vendors[0]
    assert vendor.answers.name == "acme-strict"
    assert refusal_response(SHED, vendor).status == 422
    assert refusal_response(LONG, vendor).status == 422
    assert json.loads(refusal_response(SHED, vendor).body)["error"] == "ratelimited"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answers", "presets", "expected"),
    [
        ("    answers: antropic\n", "", 'p.yaml:6: vendors[0].answers: unknown answer preset "antropic" (did you mean'),
        ("    answers: {preset: gihub}\n", "", 'p.yaml:6: vendors[0].answers.preset: unknown answer preset "gihub"'),
        ("    answers: {shedd: {status: 409}}\n", "", 'p.yaml:6: vendors[0].answers.shedd: unknown key "shedd"'),
        (
            "    answers: {deny: {status: 409}}\n",
            "",
            "p.yaml:6: vendors[0].answers.deny.status: the status of deny answers is the refusal's own",
        ),
        ("    answers: {shed: {status: 200}}\n", "", "p.yaml:6: vendors[0].answers.shed.status: status must be"),
        ("    answers: {shed: {status: '409'}}\n", "", "p.yaml:6: vendors[0].answers.shed.status: status must be"),
        (
            "    answers:\n      body: {message: '{mesage}'}\n",
            "",
            "p.yaml:7: vendors[0].answers.body.message: unknown placeholder {mesage}",
        ),
        ("    answers:\n      body: {message: 'a { b'}\n", "", 'p.yaml:7: vendors[0].answers.body.message: a lone "{"'),
        ("    answers:\n      body: [1, 2]\n", "", "p.yaml:7: vendors[0].answers.body: body must be a JSON object"),
        ("    answers:\n      body: {at: 2024-01-01}\n", "", "p.yaml:7: vendors[0].answers.body.at: "),
        (
            "    answers:\n      headers: {X-Quota-Action: x}\n",
            "",
            "p.yaml:7: vendors[0].answers.headers.X-Quota-Action: X-Quota-Action is the proxy's own header",
        ),
        (
            "    answers:\n      headers: {Content-Length: '1'}\n",
            "",
            "p.yaml:7: vendors[0].answers.headers.Content-Length: Content-Length frames the answer",
        ),
        (
            "    answers:\n      headers: {X-A: '{nope}'}\n",
            "",
            "p.yaml:7: vendors[0].answers.headers.X-A: unknown placeholder",
        ),
        (
            "    answers: acme\n",
            "answer_presets:\n  generic: {}\n",
            'p.yaml:2: answer_presets.generic: "generic" is a built-in',
        ),
        (
            "    answers: later\n",
            "answer_presets:\n  early: {preset: later}\n  later: {}\n",
            "p.yaml:2: answer_presets.early.preset",
        ),
    ],
)
def test_a_mistake_names_its_path_and_line(answers: str, presets: str, expected: str) -> None:
    found = problems(answers, presets)
    assert any(line.startswith(expected) for line in found), found
