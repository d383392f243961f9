"""How forward.send classifies a failed exchange (SPEC §9): 502 or 504, and whether the
request may have reached the vendor. Only a request that certainly did not, or that is
safe to repeat, is answered with "retry"."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.pipeline.forward import send
from proxy.policy.model import Vendor
from proxy.wire import upstream
from proxy.wire.body import Body
from proxy.wire.headers import idempotent
from proxy.wire.refusals import UpstreamFailed
from proxy.wire.request import Request

VENDOR = Vendor(name="payments", hosts=("api.payments.example",))


def failed(kind: upstream.FailureKind, reached: bool) -> upstream.UpstreamFailed:
    return upstream.UpstreamFailed(kind, f"{kind} happened", reached=reached)


class FailingPool:
    """Stands in for the vendor's connection pool: connecting fails with ``exc`` when no
    connection could be made, else the request sent on the connection does."""

    def __init__(self, exc: BaseException, connected: bool) -> None:
        self.exc = exc
        self.connected = connected

    def idle(self, *args: Any) -> Any:
        return None  # nothing pooled: every request opens a connection

    async def open(self, *args: Any) -> Any:
        if not self.connected:
            raise self.exc
        return self

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "connected", "status", "kind", "reached"),
    [
        # No connection was made: nothing was sent.
        (failed("refused", False), False, 502, "upstream-unreachable", False),  # refused, DNS, unreachable
        (failed("connect-timeout", False), False, 504, "upstream-timeout", False),
        (failed("certificate", False), False, 502, "upstream-tls", False),
        (failed("tls", False), False, 502, "upstream-tls", False),
        # A connection was made and the request written, or being written.
        (failed("timeout", True), True, 504, "upstream-timeout", True),
        (failed("broken", True), True, 502, "upstream-unreachable", True),  # closed, reset, malformed answer
        (ConnectionResetError(104, "Connection reset by peer"), True, 502, "upstream-unreachable", True),
    ],
)
@pytest.mark.parametrize(("method", "headers"), [("POST", {}), ("POST", {"Idempotency-Key": "k1"}), ("GET", {})])
async def test_a_failure_says_whether_the_request_may_have_reached_the_vendor(
    exc: BaseException,
    connected: bool,
    status: int,
    kind: str,
    reached: bool,
    method: str,
    headers: dict[str, str],
) -> None:
    request = Request(
        method,
        "/v1/charges",
        "1.1",
        CIMultiDictProxy(CIMultiDict(headers)),
        Body(None, False),  # type: ignore[arg-type]  # never read: no body
        True,
        False,
    )
    with pytest.raises(UpstreamFailed) as raised:
        pool: Any = FailingPool(exc, connected)
        await send(pool, VENDOR, request, "https://api.payments.example", "/v1/charges", "X-Tenant-Id")
    failure = raised.value
    assert (failure.status, failure.kind, failure.reached) == (status, kind, reached)
    assert failure.idempotent == (method == "GET" or "Idempotency-Key" in headers)
    assert failure.retry == (not reached or failure.idempotent)
    assert failure.detail.startswith("payments")


@pytest.mark.parametrize(
    ("method", "headers", "safe"),
    [
        ("GET", {}, True),
        ("head", {}, True),
        ("PUT", {}, True),
        ("DELETE", {}, True),
        ("OPTIONS", {}, True),
        ("POST", {}, False),
        ("PATCH", {}, False),
        ("POST", {"idempotency-key": "k"}, True),
        ("PATCH", {"Idempotency-Key": "k"}, True),
    ],
)
def test_which_requests_are_safe_to_repeat(method: str, headers: dict[str, str], safe: bool) -> None:
    assert idempotent(method, CIMultiDict(headers)) is safe
