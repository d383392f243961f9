"""The dialects of the proxy's own answers (``vendors[].answers``, SPEC §5 and §9).

A worker runs the vendor's official SDK, whose error classes and retries read the
vendor's own error body and retry headers. An ``Answer`` says what the proxy means
(status, error type and code, a sentence, whether to retry); a dialect writes it the
way that SDK reads it:

    dialect  error object                                        retry headers
    generic  {type, code, message}                               x-should-retry, Stripe-Should-Retry
    stripe   {type: invalid_request_error | api_error,           x-should-retry, Stripe-Should-Retry
              code: rate_limit | <code>, message}
    openai   {message, type: requests | invalid_request_error    x-should-retry
              | server_error, param: null,
              code: rate_limit_exceeded | <code>}

Stripe's SDK raises ``RateLimitError`` for any 429, retries what ``Stripe-Should-Retry``
says and, without it, every 5xx (it ignores ``Retry-After``). OpenAI's SDK, and the SDKs
generated the same way (Anthropic's...), obey ``x-should-retry`` first and wait
``retry-after-ms`` (then ``Retry-After``) when it is at most two minutes; its
``RateLimitError`` is any 429, with ``error`` as the error's body. Every dialect keeps
the generic top-level keys (``message``, ``action``, ``limiter``...) beside ``error``:
SDKs read only ``error``, workers without one read the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final, Protocol

from aiohttp import web

from proxy.pipeline.refusals import ErrorType
from proxy.policy.model import AnswerDialect
from proxy.wire import headers as h


@dataclass(frozen=True, slots=True)
class Answer:
    """What the proxy answers, before a dialect writes it."""

    status: int
    type: ErrorType
    code: str
    message: str
    """A sentence a person can act on."""
    retry: bool
    """Whether the client may send the request again (x-should-retry and kin)."""
    fields: dict[str, object] = field(default_factory=dict)
    """The generic top-level body keys besides ``error`` and ``message``."""
    headers: dict[str, str] = field(default_factory=dict)
    """Headers every dialect sends (X-Quota-*, Retry-After, retry-after-ms, RateLimit...)."""

    @property
    def rate_limited(self) -> bool:
        return self.type == "rate_limited"


class Dialect(Protocol):
    def error(self, answer: Answer) -> dict[str, object]:
        """The body's ``error`` object."""

    def retry_headers(self, retry: bool) -> dict[str, str]:
        """The headers that tell the SDK whether to retry."""


def _flag(retry: bool) -> str:
    return "true" if retry else "false"


class Generic:
    """Both retry headers: a vendor left on ``generic`` whose workers run Stripe's SDK must
    not have its sheds retried (that SDK retries every 5xx it is not told otherwise)."""

    def error(self, answer: Answer) -> dict[str, object]:
        return {"type": answer.type, "code": answer.code, "message": answer.message}

    def retry_headers(self, retry: bool) -> dict[str, str]:
        return {h.SHOULD_RETRY: _flag(retry), h.STRIPE_SHOULD_RETRY: _flag(retry)}


class Stripe:
    """stripe-python: ``_api_requestor.specific_v1_api_error`` maps the status (429 →
    RateLimitError, 400 → InvalidRequestError, 403 → PermissionError, else APIError) and
    reads ``error.type``/``code``/``message``; ``_http_client._should_retry`` obeys
    ``Stripe-Should-Retry``."""

    def error(self, answer: Answer) -> dict[str, object]:
        return {
            "type": "invalid_request_error" if answer.status < 500 else "api_error",
            "code": "rate_limit" if answer.rate_limited else answer.code,
            "message": answer.message,
        }

    def retry_headers(self, retry: bool) -> dict[str, str]:
        return {h.SHOULD_RETRY: _flag(retry), h.STRIPE_SHOULD_RETRY: _flag(retry)}


class OpenAI:
    """openai-python: ``_client._make_status_error`` picks the class by status and gives it
    ``error`` as its body (``message``, ``type``, ``param``, ``code``); a real rate limit
    is type ``requests``, code ``rate_limit_exceeded``."""

    def error(self, answer: Answer) -> dict[str, object]:
        if answer.rate_limited:
            kind, code = "requests", "rate_limit_exceeded"
        else:
            kind, code = ("invalid_request_error" if answer.status < 500 else "server_error"), answer.code
        return {"message": answer.message, "type": kind, "param": None, "code": code}

    def retry_headers(self, retry: bool) -> dict[str, str]:
        return {h.SHOULD_RETRY: _flag(retry)}


DIALECTS: Final[dict[AnswerDialect, Dialect]] = {"generic": Generic(), "stripe": Stripe(), "openai": OpenAI()}


def render(answer: Answer, dialect: AnswerDialect = "generic") -> web.Response:
    """The answer as ``dialect``'s SDK reads it: JSON body and headers."""
    speaker = DIALECTS[dialect]
    body = {"error": speaker.error(answer), "message": answer.message, **answer.fields}
    return web.Response(
        status=answer.status,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers={**answer.headers, **speaker.retry_headers(answer.retry)},
    )
