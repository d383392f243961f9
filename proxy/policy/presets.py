"""Answer presets (``vendors[].answers``, SPEC §9): the proxy's own answers as data.

A worker runs the vendor's official SDK, whose error classes and retries read the
vendor's own status codes, error body and retry headers. A preset says, for each kind of
answer the proxy writes itself, what that SDK should see:

    kind            when                                              status (unless the preset says)
    defer           a 429 that says when to come back (and the store  429
                    being down, failing closed)
    long_defer      a defer whose hint is beyond ``answers_max_wait``: 429
                    "do not retry", the wait still readable
    shed            the request was not sent; do not retry it         503
    deny            no vendor matches, missing proxy credentials      403, 407
    bad_request     a malformed request, a body that never came       400, 408
    upstream_error  the vendor unreachable or slow, a proxy bug       502, 504, 500

Each kind has a status (only ``defer``, ``long_defer`` and ``shed`` may change theirs: the
others mean something to HTTP itself, e.g. 407 asks for credentials), the headers that
tell the SDK whether to retry, and a JSON body template. Placeholders ``{name}`` are
filled in when the answer is written; a string that is one placeholder alone becomes
the value itself (``"{wait_ms}"`` → 1500, ``"{retry}"`` → true, ``"{limiter}"`` → null
without a vendor); ``{{`` and ``}}`` are braces. The headers every answer carries
(X-Quota-*, Retry-After, retry-after-ms, RateLimit...) are the proxy's and stay; a
preset's header of the same name replaces one of them, and ``null`` removes it (not
X-Quota-*). The generic top-level body keys (``action``, ``limiter``, ``retry_after``...)
follow the template's own keys wherever the template has not used the name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Final, Literal

AnswerKind = Literal["defer", "long_defer", "shed", "deny", "bad_request", "upstream_error"]
KINDS: Final[tuple[AnswerKind, ...]] = ("defer", "long_defer", "shed", "deny", "bad_request", "upstream_error")
STATUS_KINDS: Final[tuple[AnswerKind, ...]] = ("defer", "long_defer", "shed")
"""The kinds whose status a preset may choose (a 4xx or 5xx)."""
OWN_STATUS: Final[dict[AnswerKind, int]] = {"defer": 429, "long_defer": 429, "shed": 503}
"""The status of each of ``STATUS_KINDS`` when a preset leaves it alone (the table above)."""

PLACEHOLDERS: Final[dict[str, str]] = {
    "message": "the sentence for a person (what refused, what to do)",
    "type": "the error type: rate_limited, forbidden, bad_request, upstream_error or proxy_error",
    "code": "the error code, e.g. rate_limited, store_unavailable, upstream_timeout",
    "status": "the answer's status code",
    "wait_s": "a defer's wait in whole seconds (Retry-After); null otherwise",
    "wait_ms": "a defer's retry hint in ms (retry-after-ms); null otherwise",
    "limiter": "the vendor's name; null without a vendor",
    "action": "defer, shed or deny; null otherwise",
    "retry": "whether the SDK may retry: true or false",
}
BUILT_IN_NAMES: Final = ("generic", "stripe", "openai", "anthropic", "github", "slack")

_PLACEHOLDER_RE: Final = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")


@dataclass(frozen=True, slots=True)
class AnswerTemplate:
    """How one kind of answer is written."""

    status: int | None = None
    """None: the refusal's own status (the table above)."""
    headers: tuple[tuple[str, str | None], ...] = ()
    """Added to the proxy's own (a name it has already replaces it; None removes it)."""
    body: str = "{}"
    """The JSON body template, as JSON text (hashable, like the rest of the policy)."""


@dataclass(frozen=True, slots=True)
class AnswerPreset:
    """A vendor's answers: one template per kind (``KINDS`` order)."""

    name: str
    """The built-in or policy preset it is, or names its base with ``+`` when a vendor
    overrode parts of it (e.g. ``github+``)."""
    kinds: tuple[AnswerTemplate, ...]
    retry_jitter: float = 0.0
    """Seconds the SDK's retry may come after the ``Retry-After`` it sleeps (its own jitter):
    a deferred call's slot is kept that much longer (``Limiter.reserve``)."""

    def kind(self, kind: AnswerKind) -> AnswerTemplate:
        return self.kinds[KINDS.index(kind)]

    def status_of(self, kind: AnswerKind, own: int) -> int:
        status = self.kind(kind).status
        return own if status is None else status

    def rate_limit_statuses(self) -> dict[AnswerKind, int]:
        """What a worker gets for a defer, a long defer and a shed from this preset: what
        ``check`` prints and the live page's legends say (a preset may answer 403 or 409)."""
        return {kind: self.status_of(kind, OWN_STATUS[kind]) for kind in STATUS_KINDS}


def placeholder_problem(text: str) -> str | None:
    """What is wrong with a template string's placeholders, or None."""
    for m in _PLACEHOLDER_RE.finditer(text):
        token = m.group(0)
        if token in ("{{", "}}"):
            continue
        name = m.group(1)
        if name is None:
            return f'a lone "{token}" in {json.dumps(text)} (write {token}{token} for a brace)'
        if name not in PLACEHOLDERS:
            return f"unknown placeholder {{{name}}} in {json.dumps(text)} (known: {', '.join(PLACEHOLDERS)})"
    return None


def fill(text: str, values: Mapping[str, object]) -> object:
    """``text`` with its placeholders filled: the value itself when ``text`` is one
    placeholder alone, else text (true/false for booleans, "" for null)."""
    m = _PLACEHOLDER_RE.fullmatch(text)
    if m is not None and m.group(1) is not None:
        return values[m.group(1)]
    return _PLACEHOLDER_RE.sub(lambda m: _text(m, values), text)


def fill_text(text: str, values: Mapping[str, object]) -> str:
    """``fill`` for a header: always text."""
    return _PLACEHOLDER_RE.sub(lambda m: _text(m, values), text)


def _text(m: re.Match[str], values: Mapping[str, object]) -> str:
    token = m.group(0)
    if token == "{{":
        return "{"
    if token == "}}":
        return "}"
    value = values[m.group(1)]
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def strings(value: object) -> Iterator[str]:
    """Every string in a JSON template, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


# -- the built-in presets ------------------------------------------------------------------

_SHOULD_RETRY = (("x-should-retry", "{retry}"),)
_BOTH_RETRY = (("x-should-retry", "{retry}"), ("Stripe-Should-Retry", "{retry}"))


def _body(error: object, **top: object) -> str:
    return json.dumps({"error": error, **top}, separators=(",", ":"))


def _same(template: AnswerTemplate, **status: int) -> tuple[AnswerTemplate, ...]:
    return tuple(replace(template, status=status.get(kind)) for kind in KINDS)


def _per_kind(**templates: AnswerTemplate) -> tuple[AnswerTemplate, ...]:
    return tuple(templates[kind] for kind in KINDS)


_GENERIC: Final = AnswerPreset(
    "generic",
    _same(
        AnswerTemplate(
            headers=_BOTH_RETRY,
            body=_body({"type": "{type}", "code": "{code}", "message": "{message}"}, message="{message}"),
        )
    ),
)
"""SPEC §5's answer. Both retry headers: a vendor left on ``generic`` whose workers run
Stripe's SDK must not have its sheds retried (that SDK retries every 5xx it is not told
otherwise)."""


def _stripe(kind: str, code: str) -> AnswerTemplate:
    error = {"type": kind, "code": code, "message": "{message}"}
    return AnswerTemplate(headers=_BOTH_RETRY, body=_body(error, message="{message}"))


_STRIPE: Final = AnswerPreset(
    "stripe",
    _per_kind(
        defer=_stripe("invalid_request_error", "rate_limit"),
        long_defer=_stripe("invalid_request_error", "rate_limit"),
        shed=_stripe("api_error", "rate_limit"),
        deny=_stripe("invalid_request_error", "{code}"),
        bad_request=_stripe("invalid_request_error", "{code}"),
        upstream_error=_stripe("api_error", "{code}"),
    ),
)
"""stripe-python: ``_api_requestor.specific_v1_api_error`` maps the status (429 →
RateLimitError, 400 → InvalidRequestError, 403 → PermissionError, else APIError) and
reads ``error.type``/``code``/``message``; ``_http_client._should_retry`` obeys
``Stripe-Should-Retry`` and, without it, retries every 5xx (it ignores ``Retry-After``)."""


def _openai(kind: str, code: str) -> AnswerTemplate:
    error = {"message": "{message}", "type": kind, "param": None, "code": code}
    return AnswerTemplate(headers=_SHOULD_RETRY, body=_body(error, message="{message}"))


_OPENAI: Final = AnswerPreset(
    "openai",
    _per_kind(
        defer=_openai("requests", "rate_limit_exceeded"),
        long_defer=_openai("requests", "rate_limit_exceeded"),
        shed=_openai("requests", "rate_limit_exceeded"),
        deny=_openai("invalid_request_error", "{code}"),
        bad_request=_openai("invalid_request_error", "{code}"),
        upstream_error=_openai("server_error", "{code}"),
    ),
)
"""openai-python, and the SDKs generated the same way: ``x-should-retry`` first, then
``retry-after-ms`` (then ``Retry-After``) when at most a minute or two; otherwise they retry
408, 409, 429 and 5xx. ``_make_status_error`` picks the class by status and gives it
``error`` as its body; a real rate limit is type ``requests``, code ``rate_limit_exceeded``."""


def _anthropic(kind: str) -> AnswerTemplate:
    body = json.dumps(
        {"type": "error", "error": {"type": kind, "message": "{message}"}, "message": "{message}"},
        separators=(",", ":"),
    )
    return AnswerTemplate(headers=_SHOULD_RETRY, body=body)


_ANTHROPIC: Final = AnswerPreset(
    "anthropic",
    _per_kind(
        defer=_anthropic("rate_limit_error"),
        long_defer=_anthropic("rate_limit_error"),
        shed=_anthropic("rate_limit_error"),
        deny=_anthropic("permission_error"),
        bad_request=_anthropic("invalid_request_error"),
        upstream_error=_anthropic("api_error"),
    ),
)
"""anthropic-python (generated like OpenAI's: ``x-should-retry``, ``retry-after-ms``):
Anthropic's own error body, ``{"type": "error", "error": {"type", "message"}}``."""


def _github(message: str, status: int | None = None) -> AnswerTemplate:
    return AnswerTemplate(status=status, body=json.dumps({"message": message}, separators=(",", ":")))


_GITHUB: Final = AnswerPreset(
    "github",
    _per_kind(
        defer=_github("API rate limit exceeded ({message})", 403),
        long_defer=_github("API rate limit exceeded ({message})", 409),
        shed=_github("API rate limit exceeded ({message})", 429),
        deny=_github("{message}"),
        bad_request=_github("{message}"),
        upstream_error=_github("{message}"),
    ),
)
"""PyGithub (and octokit): GitHub's own rate limit is a 403 whose ``message`` starts "API
rate limit exceeded" (PyGithub's RateLimitExceededException). Its default ``GithubRetry``
retries every 5xx whatever the headers (one 503 shed was sent 11 times), a 403 with
``Retry-After`` or a rate-limit message, and (urllib3's rule) a 413, 429 or 503 with
``Retry-After``, sleeping it. So a defer is a 403 with ``Retry-After`` (retried after the
wait); a shed, which never has ``Retry-After``, a 429 (not retried: raised at once); a
long defer, which keeps ``Retry-After``, a 409 (in no retry list)."""


def _slack(error: str, status: int | None = None) -> AnswerTemplate:
    body = json.dumps({"ok": False, "error": error, "message": "{message}"}, separators=(",", ":"))
    return AnswerTemplate(status=status, body=body)


_SLACK: Final = AnswerPreset(
    "slack",
    _per_kind(
        defer=_slack("ratelimited"),
        long_defer=_slack("ratelimited", 409),
        shed=_slack("ratelimited", 409),
        deny=_slack("{code}"),
        bad_request=_slack("{code}"),
        upstream_error=_slack("{code}"),
    ),
    retry_jitter=1.0,
)
"""slack_sdk: Slack's errors are ``{"ok": false, "error": "<string>"}`` (code tests
``e.response["error"] == "ratelimited"``); its ``RateLimitErrorRetryHandler`` retries every
429 after ``Retry-After`` plus up to a second of jitter, its ``ServerErrorRetryHandler``
every 500 and 503. So a defer is a 429, whose slot is kept a second longer (a second retry
through a proxy fails in slack_sdk: it reuses the urllib Request, whose proxy set-up is not
idempotent); a shed and a long defer a 409, which no handler retries."""

BUILT_IN: Final[dict[str, AnswerPreset]] = {
    p.name: p for p in (_GENERIC, _STRIPE, _OPENAI, _ANTHROPIC, _GITHUB, _SLACK)
}
GENERIC: Final = _GENERIC
