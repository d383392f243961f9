"""The policy of the store-fault tests: one vendor, a store of the test's own, a breaker."""

from __future__ import annotations

from typing import Any

from tests.conftest import make_policy


def fault_policy(
    upstream: str,
    store: str,
    *,
    on_failure: str = "closed",
    timeout: str = "100ms",
    failures: int = 3,
    cooloff: str = "500ms",
    limits: str = "[{rate: 1000, per: 1s}]",
    on_limit: str = "{action: defer}",
) -> Any:
    return make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store:
          url: "$store"
          timeout: $timeout
          on_failure: $on_failure
          breaker: {failures: $failures, cooloff: $cooloff}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            route: /payments
            upstream: $upstream
            limits: $limits
            on_limit: $on_limit
        """,
        store=store,
        upstream=upstream,
        on_failure=on_failure,
        timeout=timeout,
        failures=failures,
        cooloff=cooloff,
        limits=limits,
        on_limit=on_limit,
    )
