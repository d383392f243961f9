"""The proxy's own answers, written as the vendor's preset says (``vendors[].answers``,
SPEC §5 and §9; the presets themselves are data: policy/presets.py). In the wire layer:
the wire's own answers (a turned-away connection, wire/connections.py) use it as the
request path's do.

An ``Answer`` says what the proxy means (status, error type and code, a sentence, whether
to retry, the generic body keys, the headers every answer carries); ``render`` picks the
preset's template for its kind (defer, long defer, shed, deny, bad request, upstream
error) and fills it in: the status (a preset may answer a shed or a long defer with a
status its SDK does not retry), the JSON body, and the retry headers the SDK reads.
Every preset keeps the generic top-level keys (``action``, ``limiter``...) beside its own:
SDKs read their own keys, workers without one read the rest.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from aiohttp import web

from proxy.policy import presets
from proxy.policy.presets import GENERIC, AnswerKind, AnswerPreset
from proxy.wire.refusals import ErrorType


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
    """Headers every preset sends (X-Quota-*, Retry-After, retry-after-ms, RateLimit...)."""
    kind: AnswerKind | None = None
    """Which of a preset's templates writes it (None: by its type and status)."""
    limiter: str | None = None
    """The vendor's name (None without a vendor)."""

    @property
    def rate_limited(self) -> bool:
        return self.type == "rate_limited"


def kind_of(answer: Answer) -> AnswerKind:
    """The preset template ``answer`` is written with."""
    if answer.kind is not None:
        return answer.kind
    if answer.rate_limited:
        return "defer" if answer.retry else "shed"
    if answer.status in (403, 407):
        return "deny"
    return "upstream_error" if answer.status >= 500 else "bad_request"


@functools.cache
def _template(body: str) -> object:
    """A preset's body template, parsed once."""
    return json.loads(body)


def _filled(template: object, values: dict[str, object]) -> object:
    if isinstance(template, str):
        return presets.fill(template, values)
    if isinstance(template, dict):
        return {presets.fill_text(k, values): _filled(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_filled(v, values) for v in template]
    return template


def render(answer: Answer, preset: AnswerPreset = GENERIC) -> web.Response:
    """The answer as ``preset`` says its SDK reads it: status, JSON body and headers."""
    kind = kind_of(answer)
    template = preset.kind(kind)
    status = answer.status if template.status is None else template.status
    fields = answer.fields
    values: dict[str, object] = {
        "message": answer.message,
        "type": answer.type,
        "code": answer.code,
        "status": status,
        "wait_s": fields.get("retry_after"),
        "wait_ms": fields.get("retry_after_ms"),
        "limiter": answer.limiter,
        "action": fields.get("action"),
        "retry": answer.retry,
    }
    body = _filled(_template(template.body), values)
    if isinstance(body, dict):  # the generic keys, where the template has not used the name
        for key, value in fields.items():
            body.setdefault(key, value)
    headers = dict(answer.headers)
    if template.headers:
        names = {name.lower(): name for name in headers}
        for name, value in template.headers:
            mine = names.pop(name.lower(), None)
            if mine is not None:
                del headers[mine]
            if value is not None:
                headers[name] = presets.fill_text(value, values)
    return web.Response(
        status=status,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers=headers,
    )
