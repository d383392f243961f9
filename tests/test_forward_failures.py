"""How forward.send classifies a failed exchange (SPEC §9): 502 or 504, and whether the
request may have reached the vendor. Only a request that certainly did not, or that is
safe to repeat, is answered with "retry"."""

from __future__ import annotations

import ssl
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from proxy.forward import send
from proxy.headers import idempotent
from proxy.policy.model import Vendor
from proxy.refusals import UpstreamFailed

KEY = ConnectionKey("api.payments.example", 443, True, True, None, None, None, None)
VENDOR = Vendor(name="payments", hosts=("api.payments.example",))


class FailingSession:
    """Stands in for the vendor's ClientSession: every request fails with ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def request(self, *args: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "status", "kind", "reached"),
    [
        # No connection was made: nothing was sent.
        (aiohttp.ClientConnectorError(KEY, ConnectionRefusedError(111, "refused")), 502, "upstream-unreachable", False),
        (
            aiohttp.ClientConnectorDNSError(KEY, OSError(-2, "Name or service not known")),
            502,
            "upstream-unreachable",
            False,
        ),
        (aiohttp.ConnectionTimeoutError("connect timed out"), 504, "upstream-timeout", False),
        (
            aiohttp.ClientConnectorCertificateError(KEY, ssl.SSLCertVerificationError(1, "bad cert")),
            502,
            "upstream-tls",
            False,
        ),
        (aiohttp.ClientConnectorSSLError(KEY, ssl.SSLError(1, "handshake failure")), 502, "upstream-tls", False),
        # A connection was made and the request written, or being written.
        (aiohttp.SocketTimeoutError("read timed out"), 504, "upstream-timeout", True),
        (TimeoutError(), 504, "upstream-timeout", True),
        (aiohttp.ServerDisconnectedError(), 502, "upstream-unreachable", True),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), 502, "upstream-unreachable", True),
        (aiohttp.ClientPayloadError("bad chunk"), 502, "upstream-unreachable", True),
    ],
)
@pytest.mark.parametrize(("method", "headers"), [("POST", {}), ("POST", {"Idempotency-Key": "k1"}), ("GET", {})])
async def test_a_failure_says_whether_the_request_may_have_reached_the_vendor(
    exc: BaseException, status: int, kind: str, reached: bool, method: str, headers: dict[str, str]
) -> None:
    request = make_mocked_request(method, "/v1/charges", headers=headers)
    with pytest.raises(UpstreamFailed) as raised:
        await send(FailingSession(exc), VENDOR, request, "https://api.payments.example/v1/charges", "X-Tenant-Id")  # type: ignore[arg-type]
    failed = raised.value
    assert (failed.status, failed.kind, failed.reached) == (status, kind, reached)
    assert failed.idempotent == (method == "GET" or "Idempotency-Key" in headers)
    assert failed.retry == (not reached or failed.idempotent)
    assert failed.detail.startswith("payments")


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
