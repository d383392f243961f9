"""``vendors[].share`` (SPEC §13): weights per tenant, priority classes and ``min_share``;
every accepted form, and every mistake reported with its path and line."""

from __future__ import annotations

import pytest

from proxy.policy import ConfigErrors, parse_policy
from proxy.policy.model import Policy, Share

HEAD = """\
version: 1
vendors:
  - name: v
    hosts: [api.v.example]
    limits: [{rate: 10}]
"""


def policy(share: str, head: str = HEAD) -> Policy:
    return parse_policy(head + share, "p.yaml")


def problems(share: str, head: str = HEAD) -> list[str]:
    with pytest.raises(ConfigErrors) as raised:
        policy(share, head)
    return str(raised.value).splitlines()


def test_without_share_a_vendor_has_none() -> None:
    assert policy("").vendors[0].share is None


@pytest.mark.parametrize("share", ["    share: null\n", "    share:\n", "    share: ~\n"])
def test_a_null_share_is_no_share(share: str) -> None:
    assert policy(share).vendors[0].share is None


def test_an_empty_share_is_equal_weights_in_one_class() -> None:
    share = policy("    share: {}\n").vendors[0].share
    assert share == Share()
    assert (share.classes, share.default_class, share.default_weight, share.min_share) == (
        ("default",),
        "default",
        1.0,
        0.1,
    )
    assert share.weight("anyone") == 1.0
    assert share.class_of("anyone") == 0
    assert share.class_of("anyone", "default") == 0
    assert share.class_of("anyone", "urgent") is None


def test_the_spec_example() -> None:
    share = (
        policy(
            "    share:\n"
            "      weights: {default: 1, acme: 4}\n"
            "      classes: [checkout, batch]\n"
            "      default_class: batch\n"
            "      tenant_class: {acme: checkout}\n"
            "      min_share: 10%\n"
        )
        .vendors[0]
        .share
    )
    assert share == Share(
        weights=(("acme", 4.0),),
        default_weight=1.0,
        classes=("checkout", "batch"),
        default_class="batch",
        tenant_class=(("acme", "checkout"),),
        min_share=0.1,
    )
    assert (share.weight("acme"), share.weight("other")) == (4.0, 1.0)
    assert (share.class_of("acme"), share.class_of("other")) == (0, 1)
    assert share.class_of("acme", "batch") == 1  # the request's own class wins
    assert share.class_of("other", "Checkout") is None  # as sent: class names are case-sensitive


def test_the_default_class_is_the_lowest_and_weights_keep_file_order() -> None:
    share = (
        policy("    share:\n      weights: {zed: 0.5, 'a.b@c': 2, '123': 3}\n      classes: [hi, mid, lo]\n")
        .vendors[0]
        .share
    )
    assert share is not None
    assert share.default_class == "lo"
    assert share.weights == (("zed", 0.5), ("a.b@c", 2.0), ("123", 3.0))
    assert share.default_weight == 1.0
    assert share.tenant_class == ()


def test_weights_default_alone_sets_every_tenants_weight() -> None:
    share = policy("    share: {weights: {default: 3}}\n").vendors[0].share
    assert share is not None and share.weights == () and share.weight("x") == 3.0


@pytest.mark.parametrize(
    ("written", "fraction"),
    [("10%", 0.1), ("0%", 0.0), ("50%", 0.5), ("12.5%", 0.125), ("0.2", 0.2), ("0", 0.0), ("0.5", 0.5), ("'5%'", 0.05)],
)
def test_min_share_is_a_percentage_or_a_fraction(written: str, fraction: float) -> None:
    share = policy(f"    share:\n      classes: [a, b]\n      min_share: {written}\n").vendors[0].share
    assert share is not None and share.min_share == pytest.approx(fraction)


def test_ten_classes_at_ten_percent_leave_the_top_class_ten_percent() -> None:
    classes = ", ".join(f"c{i}" for i in range(10))
    share = policy(f"    share:\n      classes: [{classes}]\n").vendors[0].share
    assert share is not None and len(share.classes) == 10 and share.default_class == "c9"


def test_share_goes_with_on_failure_local_and_tenant_limits() -> None:
    head = HEAD.replace("version: 1\n", "version: 1\nstore: {url: 'redis://r:6379/0', on_failure: local}\n")
    share = (
        policy("    tenant_limits: {default: [{rate: 5}]}\n    share: {weights: {acme: 2}}\n", head).vendors[0].share
    )
    assert share is not None and share.weight("acme") == 2.0


def test_min_share_with_one_class_is_a_warning() -> None:
    loaded = policy("    share:\n      min_share: 20%\n")
    assert [(w.line, w.path) for w in loaded.warnings] == [(7, "vendors[0].share.min_share")]
    assert "no effect with one class" in loaded.warnings[0].message


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (
            "    share: {wieghts: {acme: 2}}\n",
            'p.yaml:6: vendors[0].share.wieghts: unknown key "wieghts" (did you mean "weights"?)',
        ),
        ("    share: true\n", "p.yaml:6: vendors[0].share: expected a mapping (share: {} for equal weights"),
        ("    share: [a]\n", "p.yaml:6: vendors[0].share: expected a mapping, got a list"),
        ("    share:\n      weights: [acme]\n", "p.yaml:7: vendors[0].share.weights: expected a mapping"),
        (
            "    share:\n      weights: {acme: 0}\n",
            "p.yaml:7: vendors[0].share.weights.acme: weight must be a positive number",
        ),
        (
            "    share:\n      weights: {acme: -1}\n",
            "p.yaml:7: vendors[0].share.weights.acme: weight must be a positive number",
        ),
        (
            "    share:\n      weights: {acme: .inf}\n",
            "p.yaml:7: vendors[0].share.weights.acme: expected a finite number",
        ),
        (
            "    share:\n      weights: {acme: .nan}\n",
            "p.yaml:7: vendors[0].share.weights.acme: expected a finite number",
        ),
        (
            "    share:\n      weights: {acme: '4'}\n",
            'p.yaml:7: vendors[0].share.weights.acme: expected a number, got "4"',
        ),
        (
            "    share:\n      weights: {acme: true}\n",
            "p.yaml:7: vendors[0].share.weights.acme: expected a number, got true",
        ),
        (
            "    share:\n      weights: {default: 0}\n",
            "p.yaml:7: vendors[0].share.weights.default: weight must be a positive",
        ),
        (
            "    share:\n      weights:\n        'bad name': 2\n",
            'p.yaml:8: vendors[0].share.weights."bad name": "bad name" is not a valid tenant name',
        ),
        (
            "    share:\n      weights:\n        acme: 2\n        acme: 3\n",
            'p.yaml:9: vendors[0].share.weights.acme: duplicate key "acme"',
        ),
        ("    share:\n      classes: []\n", "p.yaml:7: vendors[0].share.classes: at least one class is required"),
        ("    share:\n      classes: null\n", "p.yaml:7: vendors[0].share.classes: at least one class is required"),
        ("    share:\n      classes: batch\n", 'p.yaml:7: vendors[0].share.classes: expected a list, got "batch"'),
        ("    share:\n      classes: [a, b, a]\n", 'p.yaml:7: vendors[0].share.classes[2]: class "a" is listed twice'),
        (
            "    share:\n      classes: [ok, 'not ok']\n",
            'p.yaml:7: vendors[0].share.classes[1]: "not ok" is not a valid class name',
        ),
        ("    share:\n      classes: [-x]\n", 'p.yaml:7: vendors[0].share.classes[0]: "-x" is not a valid class name'),
        ("    share:\n      classes: [1]\n", "p.yaml:7: vendors[0].share.classes[0]: expected a string, got 1"),
        (
            f"    share:\n      classes: [{'x' * 65}]\n",
            f'p.yaml:7: vendors[0].share.classes[0]: "{"x" * 65}" is not a valid class name',
        ),
        (
            "    share:\n      classes: [checkout, batch]\n      default_class: chekout\n",
            'p.yaml:8: vendors[0].share.default_class: "chekout" is not one of the classes (did you mean "checkout"?)',
        ),
        (
            "    share:\n      classes: [checkout, batch]\n      default_class: zzz\n",
            'p.yaml:8: vendors[0].share.default_class: "zzz" is not one of the classes (classes: checkout, batch)',
        ),
        (
            "    share:\n      default_class: batch\n",
            'p.yaml:7: vendors[0].share.default_class: "batch" is not one of the classes (classes: default)',
        ),
        (
            "    share:\n      classes: [checkout, batch]\n      tenant_class:\n        acme: bach\n",
            'p.yaml:9: vendors[0].share.tenant_class.acme: "bach" is not one of the classes (did you mean "batch"?)',
        ),
        (
            "    share:\n      tenant_class:\n        'a b': default\n",
            'p.yaml:8: vendors[0].share.tenant_class."a b": "a b" is not a valid tenant name',
        ),
        ("    share:\n      tenant_class: [acme]\n", "p.yaml:7: vendors[0].share.tenant_class: expected a mapping"),
        (
            "    share:\n      classes: [a, b]\n      min_share: 60%\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: 0.51\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: -0.1\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: 10\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: ten\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: .nan\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b]\n      min_share: true\n",
            "p.yaml:8: vendors[0].share.min_share: min_share must be",
        ),
        (
            "    share:\n      classes: [a, b, c, d]\n      min_share: 31%\n",
            "p.yaml:8: vendors[0].share.min_share: min_share 31% for each of the 3 lower classes guarantees them 93%",
        ),
        (
            f"    share:\n      classes: [{', '.join(f'c{i}' for i in range(11))}]\n",
            "p.yaml:7: vendors[0].share.classes: min_share 10% for each of the 10 lower classes guarantees them 100%",
        ),
    ],
)
def test_a_mistake_names_its_path_and_line(share: str, expected: str) -> None:
    found = problems(share)
    assert any(line.startswith(expected) for line in found), found


def test_a_wrong_class_list_does_not_make_every_class_name_unknown() -> None:
    found = problems("    share:\n      classes: [a, a]\n      default_class: b\n      tenant_class: {acme: c}\n")
    assert found == ['p.yaml:7: vendors[0].share.classes[1]: class "a" is listed twice']


@pytest.mark.parametrize(
    ("head", "line"),
    [(HEAD.replace("    limits: [{rate: 10}]\n", ""), 5), (HEAD.replace("[{rate: 10}]", "[]"), 6)],
    ids=["missing", "empty"],
)
def test_share_on_a_vendor_without_limits_has_nothing_to_divide(head: str, line: int) -> None:
    found = problems("    share: {}\n", head)
    assert f"p.yaml:{line}: vendors[0].share: share divides the vendor's limits, and this vendor has none" in found


def test_every_mistake_of_one_share_is_reported_at_once() -> None:
    found = problems(
        "    share:\n"
        "      weights: {acme: 0, beta: x}\n"
        "      classes: [hi, lo]\n"
        "      default_class: mid\n"
        "      tenant_class: {acme: top}\n"
        "      min_share: 90%\n"
    )
    assert [line.split(": ")[0] for line in found] == [
        "p.yaml:7",
        "p.yaml:7",
        "p.yaml:9",
        "p.yaml:10",
        "p.yaml:11",
    ], found
    assert [line.split(": ")[1] for line in found] == [
        "vendors[0].share.weights.acme",
        "vendors[0].share.weights.beta",
        "vendors[0].share.default_class",
        "vendors[0].share.tenant_class.acme",
        "vendors[0].share.min_share",
    ]
