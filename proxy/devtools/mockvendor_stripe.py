"""Stripe-shaped answers of the mock vendor, enough for stripe-python and plain HTTP clients.

    POST   /v1/customers           create (form-encoded, as Stripe takes it: email, name,
                                   description, phone, metadata[KEY])
    GET    /v1/customers           a list object, newest first (``limit`` 1..100, default 10)
    GET    /v1/customers/{id}      the customer; every id exists (one never created is made
                                   up on first sight, so ``cus_123`` answers like a real one)
    POST   /v1/customers/{id}      update
    DELETE /v1/customers/{id}      ``{"id", "object": "customer", "deleted": true}``
    the same for /v1/payment_intents (``amount`` and ``currency`` required; no DELETE)

Answers carry ``Request-Id`` and ``Stripe-Version``; a ``POST`` with an
``Idempotency-Key`` seen before gets the first answer again (``Idempotent-Replayed: true``),
as Stripe does, so an SDK's retry of a created object creates nothing new. Errors are
Stripe's: ``{"error": {"type", "code", "message", "param"}}``; the quota's 429 is
``rate_limit`` with ``Retry-After``. Stripe tells no quota in headers, so neither does this.
No API key is checked: any key, or none, is served. ``/v1/charges`` is left to the mock's
plain answers (the examples and the demo post there with JSON, which Stripe would refuse).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Final
from urllib.parse import parse_qsl

from aiohttp import web

from proxy.devtools.mockvendor_shapes import BadInput, json_answer, made_up_id
from proxy.devtools.mockvendor_tokens import Reservation

__all__ = ["API_VERSION", "StripeShape"]

API_VERSION: Final = "2024-06-20"
_KEPT: Final = 10_000  # objects and idempotent answers kept, oldest dropped first
_RESOURCES: Final = {"customers": ("cus_", "customer"), "payment_intents": ("pi_", "payment_intent")}
_FIELDS: Final = {
    "customers": ("email", "name", "description", "phone"),
    "payment_intents": ("amount", "currency", "customer", "description", "receipt_email"),
}
_RATE_LIMITED: Final = (
    "Too many requests hit the API too quickly. We recommend an exponential backoff of your requests."
)


class _StripeError(Exception):
    def __init__(self, status: int, code: str | None, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def _error_body(kind: str, code: str | None, message: str, param: str | None = None) -> dict[str, object]:
    error: dict[str, object] = {"type": kind, "message": message}
    if code is not None:
        error["code"] = code
        error["doc_url"] = f"https://stripe.com/docs/error-codes/{code.replace('_', '-')}"
    if param is not None:
        error["param"] = param
    return {"error": error}


def _form(raw: bytes, content_type: str) -> dict[str, Any]:
    """Stripe's form encoding: ``a=1&metadata[k]=v`` → ``{"a": "1", "metadata": {"k": "v"}}``."""
    if raw and content_type != "application/x-www-form-urlencoded":
        raise BadInput(
            f"Invalid request: send parameters form-encoded (application/x-www-form-urlencoded), not {content_type}"
        )
    try:
        pairs = parse_qsl(raw.decode(), keep_blank_values=True, strict_parsing=bool(raw))
    except (UnicodeDecodeError, ValueError):
        raise BadInput("Invalid request: the body is not a form-encoded list of parameters") from None
    params: dict[str, Any] = {}
    for key, value in pairs:
        name, bracket, rest = key.partition("[")
        if not bracket:
            params[name] = value
        elif name == "metadata" and rest.endswith("]") and "[" not in rest:
            params.setdefault("metadata", {})[rest[:-1]] = value
        # other nested parameters (expand[], ...) change nothing the mock answers
    return params


def _amount(value: object) -> int:
    if not (isinstance(value, str) and value.isascii() and value.isdigit() and int(value) > 0):
        raise _StripeError(400, "parameter_invalid_integer", f"Invalid integer: {value}", "amount")
    return int(value)


class StripeShape:
    """Stripe's customers and payment intents; see the module docstring."""

    name: Final = "stripe"
    quota_headers: Final = "none"
    meter: Final = None  # Stripe counts requests only

    def __init__(self) -> None:
        self._objects: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._answered: OrderedDict[str, tuple[int, object]] = OrderedDict()

    def owns(self, path: str) -> bool:
        parts = path.split("/")
        return len(parts) >= 3 and parts[1] == "v1" and parts[2] in _RESOURCES

    def reset(self) -> None:
        self._objects.clear()
        self._answered.clear()

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        # Stripe names which limit refused in Stripe-Rate-Limited-Reason.
        extra = {"Retry-After": str(retry_after), "Stripe-Rate-Limited-Reason": "global-rate"}
        body = _error_body("invalid_request_error", "rate_limit", _RATE_LIMITED)
        return json_answer(429, body, {**headers, **self._headers(None), **extra})

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        headers = {**headers, **self._headers(request)}
        key = request.headers.get("Idempotency-Key") if request.method == "POST" else None
        if key is not None:
            headers["Idempotency-Key"] = key
            if key in self._answered:
                status, body = self._answered[key]
                return json_answer(status, body, {**headers, "Idempotent-Replayed": "true"})
        try:
            params = _form(await request.read(), request.content_type) if request.method == "POST" else {}
            status, body = 200, self._serve(request, params)
        except BadInput as exc:
            status, body = 400, _error_body("invalid_request_error", None, str(exc))
        except _StripeError as exc:
            status, body = exc.status, _error_body("invalid_request_error", exc.code, exc.message, exc.param)
        if key is not None:
            self._keep(self._answered, key, (status, body))
        return json_answer(status, body, headers)

    def _headers(self, request: web.BaseRequest | None) -> dict[str, str]:
        version = request.headers.get("Stripe-Version", API_VERSION) if request is not None else API_VERSION
        return {"Request-Id": made_up_id("req_", 14), "Stripe-Version": version}

    def _serve(self, request: web.BaseRequest, params: dict[str, Any]) -> object:
        method, path = request.method, request.path
        parts = path.split("/")[2:]  # resource, then the id if any
        resource = parts[0]
        if len(parts) == 1 and method == "POST":
            return self._create(resource, params)
        if len(parts) == 1 and method == "GET":
            return self._list(resource, path, request.query.get("limit", "10"))
        if len(parts) == 2 and parts[1]:
            found = self._find(resource, parts[1])
            if method == "GET":
                return found
            if method == "POST":
                found.update(self._fields(resource, params, creating=False))
                return found
            if method == "DELETE" and resource == "customers":
                self._objects.pop(found["id"], None)
                return {"id": found["id"], "object": "customer", "deleted": True}
        raise _StripeError(404, None, f"Unrecognized request URL ({method}: {path}).")

    def _create(self, resource: str, params: dict[str, Any]) -> dict[str, Any]:
        prefix, kind = _RESOURCES[resource]
        fields = self._fields(resource, params, creating=True)
        made = self._new(resource, made_up_id(prefix, 14))
        made.update(fields)
        if kind == "payment_intent":
            made["client_secret"] = f"{made['id']}_secret_{made_up_id('', 25)}"
        return made

    def _fields(self, resource: str, params: dict[str, Any], *, creating: bool) -> dict[str, Any]:
        known = ("metadata", *_FIELDS[resource])
        unknown = sorted(k for k in params if k not in known and k != "expand")
        if unknown:
            raise _StripeError(400, "parameter_unknown", f"Received unknown parameter: {unknown[0]}", unknown[0])
        fields = {k: v for k, v in params.items() if k != "expand"}
        if resource == "payment_intents":
            for required in ("amount", "currency"):
                if creating and required not in fields:
                    raise _StripeError(400, "parameter_missing", f"Missing required param: {required}.", required)
            if "amount" in fields:
                fields["amount"] = _amount(fields["amount"])
            if "currency" in fields:
                fields["currency"] = str(fields["currency"]).lower()
        return fields

    def _new(self, resource: str, object_id: str) -> dict[str, Any]:
        _, kind = _RESOURCES[resource]
        made: dict[str, Any] = {"id": object_id, "object": kind, "created": int(time.time()), "livemode": False}
        made.update(dict.fromkeys(_FIELDS[resource]))
        made["metadata"] = {}
        if kind == "customer":
            made.update(balance=0, currency=None, delinquent=False, invoice_prefix=object_id[4:12].upper())
        else:
            made.update(amount_received=0, status="requires_payment_method", payment_method_types=["card"])
        self._keep(self._objects, object_id, made)
        return made

    def _find(self, resource: str, object_id: str) -> dict[str, Any]:
        prefix, _ = _RESOURCES[resource]
        if not object_id.startswith(prefix):
            message = f"No such {resource[:-1].replace('_', ' ')}: '{object_id}'"
            raise _StripeError(404, "resource_missing", message, "id")
        found = self._objects.get(object_id)
        if found is None:  # every id exists: one never created is made up now
            found = self._new(resource, object_id)
            if resource == "payment_intents":
                found.update(amount=1000, currency="usd", client_secret=f"{object_id}_secret_{made_up_id('', 25)}")
        return found

    def _list(self, resource: str, path: str, limit_text: str) -> dict[str, Any]:
        if not (limit_text.isascii() and limit_text.isdigit() and 1 <= int(limit_text) <= 100):
            raise _StripeError(400, "parameter_invalid_integer", "Invalid integer: limit must be 1 to 100", "limit")
        _, kind = _RESOURCES[resource]
        mine = [o for o in reversed(self._objects.values()) if o["object"] == kind]
        limit = int(limit_text)
        return {"object": "list", "data": mine[:limit], "has_more": len(mine) > limit, "url": path}

    @staticmethod
    def _keep(store: OrderedDict[str, Any], key: str, value: Any) -> None:
        store[key] = value
        store.move_to_end(key)
        while len(store) > _KEPT:
            store.popitem(last=False)
