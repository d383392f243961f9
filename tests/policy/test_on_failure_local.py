"""store.on_failure: local (SPEC §12, degraded mode) in the policy and its summary."""

from __future__ import annotations

from proxy.policy import parse_policy, summarize

POLICY = """\
version: 1
store: {url: "redis://redis.internal:6379/0", on_failure: local}
vendors:
  - name: crm
    hosts: [api.crm.example]
    limits: [{rate: 10, per: 1s}]
"""


def test_on_failure_local_loads() -> None:
    assert parse_policy(POLICY, "p.yaml").store.on_failure == "local"


def test_the_summary_says_what_local_means() -> None:
    text = summarize(parse_policy(POLICY, "p.yaml"))
    assert "on_failure local (store down = each replica its share, in-process)" in text
