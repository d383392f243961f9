"""Policy files for tests that run ``quota-proxy`` as a subprocess."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import write_policy


def payments_policy(path: Path, upstream: str, *, top: str = "", rate: int = 1000) -> Path:
    """One vendor ``payments`` (api.payments.example, route /payments) at ``upstream``, both
    listeners on free ports; ``top``: more top-level YAML, one line."""
    return write_policy(
        path,
        f"""
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        {top}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            route: /payments
            upstream: {upstream}
            limits: [{{rate: {rate}, per: 1s}}]
        """,
    )
