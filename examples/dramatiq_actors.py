"""A Dramatiq actor that calls a vendor through quota-proxy and honours every answer.

The same policy as the Celery example (:mod:`examples.retry_policy`); only the plumbing
differs. Run a worker against Redis::

    DRAMATIQ_REDIS_URL=redis://redis:6379/0 HTTP_PROXY=http://quota-proxy:8080 \\
        dramatiq examples.dramatiq_actors --queues charges

Without ``DRAMATIQ_REDIS_URL`` the module uses Dramatiq's in-process ``StubBroker`` (and a
stub result backend), which is what the tests run.

How each answer maps onto Dramatiq:

- **deferred / vendor_throttled / transient** → the actor raises a :class:`QuotaRetry`
  (a ``dramatiq.Retry`` carrying its delay in milliseconds: ≥ ``Retry-After`` plus jitter,
  the vendor's ``Retry-After`` plus jitter, or exponential backoff). The actor's
  ``retry_when`` retries exactly these, so Dramatiq's single ``retries`` counter and
  ``max_retries`` play no part: the per-kind counters live in the message's options
  (``quota_retries``), which Dramatiq keeps across retries.
- **shed** → :class:`Shed`, listed in ``throws``: the message fails at once and goes to the
  broker's dead-letter queue (Redis: ``dramatiq:charges.XQ``; the stub: ``broker.dead_letters``).
- a permanent error or a used-up budget → :class:`PermanentError` / :class:`RetriesExhausted`;
  ``retry_when`` says no, so the message is dead-lettered the same way. So is any exception
  the actor did not expect: a bug is for a human, not for a retry loop.

The dead-lettered message carries the reason and attempt history in
``options["dead_letter"]`` (on the stub broker; Redis keeps the message as last enqueued),
and the same record is logged.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Final

import dramatiq
import requests
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import CurrentMessage
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend

from examples import quota_client as qc
from examples.retry_policy import RetryPolicy, attempt_record

__all__ = [
    "POLICY",
    "DeadLettered",
    "PermanentError",
    "QuotaRetry",
    "RetriesExhausted",
    "Shed",
    "broker",
    "charge",
]

log = logging.getLogger(__name__)

PAYMENTS_API: Final = os.environ.get("PAYMENTS_API", "http://api.payments.example")
QUEUE: Final = "charges"
STATE_OPTION: Final = "quota_retries"
MAX_HISTORY: Final = 20
REQUEST_TIMEOUT: Final = (5.0, 35.0)

POLICY = RetryPolicy()
"""Budgets and backoff; replace it (e.g. in tests) with another :class:`RetryPolicy`."""


def _make_broker() -> dramatiq.Broker:
    redis_url = os.environ.get("DRAMATIQ_REDIS_URL")
    if redis_url:
        from dramatiq.brokers.redis import RedisBroker
        from dramatiq.results.backends import RedisBackend

        made: dramatiq.Broker = RedisBroker(url=redis_url)
        made.add_middleware(Results(backend=RedisBackend(url=redis_url)))
    else:
        made = StubBroker()
        made.add_middleware(Results(backend=StubBackend()))
    made.add_middleware(CurrentMessage())
    return made


broker = _make_broker()
dramatiq.set_broker(broker)


class DeadLettered(Exception):
    """The message failed for good and is in the dead-letter queue."""


class Shed(DeadLettered):
    """The proxy shed the request (503, ``X-Quota-Action: shed``)."""


class RetriesExhausted(DeadLettered):
    """A retry budget (deferred, throttled or transient) is used up."""


class PermanentError(DeadLettered):
    """An answer a retry cannot fix."""


class QuotaRetry(dramatiq.Retry):
    """Retry after ``delay`` milliseconds; raised for deferred, throttled and transient answers."""


def _retry_when(retries: int, exc: BaseException) -> bool:
    # Only the actor's own, budget-checked retries: Dramatiq's shared counter is ignored.
    return isinstance(exc, QuotaRetry)


_local = threading.local()


def _session() -> requests.Session:
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _body(response: requests.Response | None) -> Any:
    if response is None:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


@dramatiq.actor(queue_name=QUEUE, retry_when=_retry_when, throws=(Shed,), store_results=True)
def charge(customer_id: str, amount: int, tenant: str | None = None, on_limit: str | None = None) -> dict[str, Any]:
    """Charge ``amount`` to ``customer_id`` through the proxy (see the module docstring)."""
    message = CurrentMessage.get_current_message()
    assert message is not None, "the CurrentMessage middleware is required"
    state = message.options.setdefault(STATE_OPTION, {"attempt": 0, "used": {}, "history": []})
    attempt = state["attempt"] + 1
    used: dict[str, int] = dict(state["used"])
    url = f"{PAYMENTS_API}/v1/charges"
    started = time.time()
    outcome, response = qc.send(
        _session(),
        "POST",
        url,
        json={"customer_id": customer_id, "amount": amount},
        headers={"Idempotency-Key": message.message_id, **qc.quota_headers(tenant=tenant, on_limit=on_limit)},
        proxies=qc.proxy_settings(),
        timeout=REQUEST_TIMEOUT,
    )
    decision = POLICY.decide(outcome, used)
    history = [*state["history"], attempt_record(attempt, started, outcome, decision)][-MAX_HISTORY:]

    if decision.action == "done":
        return {
            "customer_id": customer_id,
            "amount": amount,
            "status": outcome.status,
            "vendor": _body(response),
            "attempts": attempt,
            "retries": used,
            "history": history,
        }

    if decision.action == "retry":
        assert decision.budget is not None and decision.delay is not None
        used[decision.budget] = used.get(decision.budget, 0) + 1
        message.options[STATE_OPTION] = {"attempt": attempt, "used": used, "history": history}
        log.info(
            "charge[%s] %s (status %s): retry in %.2fs",
            message.message_id,
            outcome.kind,
            outcome.status,
            decision.delay,
        )
        raise QuotaRetry(f"{outcome.kind} (status {outcome.status})", delay=math.ceil(decision.delay * 1000))

    record = {"reason": decision.reason, "history": history}
    message.options["dead_letter"] = record
    log.warning("dead-lettered charge[%s]: %s %s", message.message_id, decision.reason, record)
    if outcome.kind is qc.Kind.SHED:
        raise Shed(decision.reason)
    if decision.budget is not None:
        raise RetriesExhausted(decision.reason)
    raise PermanentError(decision.reason)
