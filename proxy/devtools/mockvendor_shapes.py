"""What a vendor's *shape* is to the mock vendor: the paths it owns, its answers, its refusal.

``MockVendor`` keeps the quota (one request = one token, whatever the path) and hands a
request whose path a shape owns to that shape for the answer: Stripe's objects
(``mockvendor_stripe``), OpenAI's completions (``mockvendor_openai``). A vendor the mock
should imitate next (Anthropic's ``/v1/messages``...) is one more module with one class
that satisfies ``Shape``, added to ``MockVendor``'s list; a quota counted in tokens would
read the ``usage`` its shape reports.

The helpers here are what every shape writes with: JSON answers, server-sent events, a
request body read as a JSON object, and made-up ids.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Iterable
from typing import Any, Final, Protocol

from aiohttp import web

from proxy.devtools.mockvendor_control import JSON_TYPE

__all__ = ["BadInput", "Shape", "json_answer", "made_up_id", "read_json_object", "write_events"]

_ALNUM: Final = string.ascii_letters + string.digits


class Shape(Protocol):
    """One vendor's API, imitated."""

    @property
    def name(self) -> str:
        """The vendor, e.g. ``stripe``."""
        ...

    @property
    def quota_headers(self) -> str:
        """The family of quota headers its answers carry (``mockvendor_quota.QUOTA_HEADERS``):
        the vendor's own, whatever ``--quota-headers`` says for the other paths."""
        ...

    def owns(self, path: str) -> bool:
        """Whether a request for ``path`` is this vendor's to answer."""
        ...

    async def answer(self, request: web.BaseRequest, headers: dict[str, str]) -> web.StreamResponse:
        """The answer to a request the quota admitted; ``headers`` (the quota's) go on it.
        Bad input is the vendor's own 4xx, in its error format."""
        ...

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        """The vendor's own 429 when the quota refuses: its error body, its headers,
        ``Retry-After: retry_after`` and ``headers``."""
        ...

    def reset(self) -> None:
        """Forget what it stored (``POST /__mock/reset``)."""
        ...


class BadInput(Exception):
    """A request body the vendor cannot read; its message says why (a 400)."""


def made_up_id(prefix: str, length: int = 24) -> str:
    """``prefix`` then ``length`` random letters and digits, as vendors write ids."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


def json_answer(status: int, payload: object, headers: dict[str, str]) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type=JSON_TYPE, headers=headers)


async def read_json_object(request: web.BaseRequest) -> dict[str, Any]:
    """The body as a JSON object; BadInput otherwise."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadInput("We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise BadInput("The body of your request must be a JSON object.")
    return body


async def write_events(
    request: web.BaseRequest, headers: dict[str, str], events: Iterable[tuple[str | None, object]]
) -> web.StreamResponse:
    """A ``text/event-stream`` answer: each (event name or None, data) as one event, the data
    JSON-encoded unless it is a string (``[DONE]``), written and flushed one at a time."""
    response = web.StreamResponse(headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    for event, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        head = f"event: {event}\n" if event else ""
        await response.write(f"{head}data: {text}\n\n".encode())
    await response.write_eof()
    return response
