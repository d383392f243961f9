"""A Celery task that calls a vendor through quota-proxy and honours every answer.

Run a worker (``CELERY_BROKER_URL`` / ``CELERY_RESULT_BACKEND`` point at your broker;
the in-memory defaults only work inside one process, as in the tests)::

    HTTP_PROXY=http://quota-proxy:8080 celery -A examples.celery_tasks worker -Q charges

and enqueue ``charge.delay("cus_42", 1999)``. What the task does with each answer
(the policy lives in :mod:`examples.retry_policy`, shared with the Dramatiq example):

- **ok** → returns the vendor's JSON plus the attempt history.
- **deferred** (proxy 429, ``X-Quota-Action: defer``) → ``self.retry(countdown=...)`` with a
  countdown of at least ``Retry-After`` plus jitter. Charged to the *deferred* budget only.
- **vendor_throttled** (vendor 429, no ``X-Quota-Action``) → retry after the vendor's
  ``Retry-After`` plus jitter, charged to the *throttled* budget.
- **transient error** (5xx, 408, timeout, connection refused) → retry with exponential
  backoff, charged to the *transient* budget.
- **shed** (proxy 503) → dead-lettered at once: a record goes to the ``charges.dead-letter``
  queue, the task fails with :class:`Shed`, no retry. Permanent errors (4xx) and used-up
  budgets are dead-lettered the same way (:class:`PermanentError`, :class:`RetriesExhausted`).

Separate budgets, the choice: Celery's ``request.retries`` counts every retry alike and
``max_retries`` would charge a deferral (healthy back-pressure, nothing reached the vendor)
against the allowance meant for outages. So the task sets ``max_retries=None`` (Celery never
gives up on its own) and carries its own per-kind counters, plus a short attempt history,
in a message header (``quota_retries``) from retry to retry; :class:`RetryPolicy` decides
per kind. The header survives any broker because Celery copies a retried task's headers.

Every request carries ``Idempotency-Key: <task id>``: a deferred or throttled request never
reached the vendor, but a timeout or a 502 may have, and the retry must not charge twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Final

import requests
from celery import Celery, Task
from kombu import Exchange, Queue

from examples import quota_client as qc
from examples.retry_policy import RetryPolicy, attempt_record

__all__ = [
    "DEAD_LETTER",
    "POLICY",
    "DeadLettered",
    "PermanentError",
    "RetriesExhausted",
    "Shed",
    "app",
    "charge",
    "drain_dead_letters",
]

log = logging.getLogger(__name__)

PAYMENTS_API: Final = os.environ.get("PAYMENTS_API", "http://api.payments.example")
QUEUE: Final = "charges"
DEAD_LETTER: Final = Queue(
    "charges.dead-letter", Exchange("charges.dead-letter", type="direct"), routing_key="charges.dead-letter"
)
STATE_HEADER: Final = "quota_retries"
MAX_HISTORY: Final = 20
REQUEST_TIMEOUT: Final = (5.0, 35.0)
"""(connect, read) seconds: the read timeout covers the proxy's longest hold plus the vendor."""

POLICY = RetryPolicy()
"""Budgets and backoff; replace it (e.g. in tests) with another :class:`RetryPolicy`."""

app = Celery("quota_examples")
app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL", "memory://"),
    result_backend=os.environ.get("CELERY_RESULT_BACKEND", "cache+memory://"),
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # A worker that dies mid-task leaves the message to be redelivered, not lost.
    task_acks_late=True,
    # Countdown retries sit in the worker's memory until due; do not also hoard fresh work.
    worker_prefetch_multiplier=1,
)


class DeadLettered(Exception):
    """The job was sent to the dead-letter queue and will not be retried."""


class Shed(DeadLettered):
    """The proxy shed the request (503, ``X-Quota-Action: shed``)."""


class RetriesExhausted(DeadLettered):
    """A retry budget (deferred, throttled or transient) is used up."""


class PermanentError(DeadLettered):
    """An answer a retry cannot fix (a 4xx other than 429, a malformed request)."""


class QuotaRetry(Exception):
    """Why a retry was scheduled; shown in Celery's retry log line."""


_local = threading.local()
_warned_no_proxy = False


def _session() -> requests.Session:
    """One session (and so one keep-alive pool to the proxy) per worker thread."""
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
    return session


def _proxies(url: str) -> dict[str, str] | None:
    global _warned_no_proxy
    proxies = qc.proxy_settings()
    if proxies is None and not requests.utils.get_environ_proxies(url) and not _warned_no_proxy:
        _warned_no_proxy = True
        log.warning("neither QUOTA_PROXY_URL nor HTTP_PROXY is set: %s is called directly, outside the quota", url)
    return proxies


def _state(request: Any) -> dict[str, Any]:
    headers = request.headers or {}
    state = headers.get(STATE_HEADER) or getattr(request, STATE_HEADER, None) or {}
    return {
        "attempt": int(state.get("attempt", 0)),
        "used": dict(state.get("used", {})),
        "history": list(state.get("history", [])),
    }


def _body(response: requests.Response | None) -> Any:
    if response is None:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


def dead_letter(task: Task, reason: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """Publish a record of the job to the dead-letter queue, where an operator (or a replay
    job) finds the task name, its arguments, why it was given up and what it went through."""
    request = task.request
    record = {
        "task": task.name,
        "id": request.id,
        "args": list(request.args or ()),
        "kwargs": dict(request.kwargs or {}),
        "reason": reason,
        "retries": request.retries,
        "history": history,
        "at": time.time(),
    }
    with task.app.producer_or_acquire() as producer:
        producer.publish(
            record,
            exchange=DEAD_LETTER.exchange,
            routing_key=DEAD_LETTER.routing_key,
            declare=[DEAD_LETTER],
            serializer="json",
            retry=True,
        )
    log.warning("dead-lettered %s[%s]: %s", task.name, request.id, reason)
    return record


def drain_dead_letters(limit: int = 100, timeout: float = 0.0) -> list[dict[str, Any]]:
    """Take up to ``limit`` records off the dead-letter queue, waiting up to ``timeout``
    seconds for the first one, then taking only what is already there. Each record is
    acknowledged, so it is gone from the queue."""
    records: list[dict[str, Any]] = []
    with app.connection_for_read() as conn, conn.SimpleQueue(DEAD_LETTER) as queue:
        while len(records) < limit:
            wait = timeout if timeout > 0 and not records else None
            try:
                message = queue.get(block=wait is not None, timeout=wait)
            except queue.Empty:
                break
            records.append(message.payload)
            message.ack()
    return records


@app.task(bind=True, name="examples.charge", max_retries=None)
def charge(
    self: Task, customer_id: str, amount: int, tenant: str | None = None, on_limit: str | None = None
) -> dict[str, Any]:
    """Charge ``amount`` to ``customer_id`` at the payments vendor, through the proxy.

    ``tenant`` is sent in the proxy's tenant header (per-tenant buckets); ``on_limit``
    (``hold``/``defer``/``shed``) overrides the vendor's policy for this request.
    """
    state = _state(self.request)
    attempt = state["attempt"] + 1
    used: dict[str, int] = state["used"]
    url = f"{PAYMENTS_API}/v1/charges"
    started = time.time()
    outcome, response = qc.send(
        _session(),
        "POST",
        url,
        json={"customer_id": customer_id, "amount": amount},
        headers={"Idempotency-Key": str(self.request.id), **qc.quota_headers(tenant=tenant, on_limit=on_limit)},
        proxies=_proxies(url),
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
        used = {**used, decision.budget: used.get(decision.budget, 0) + 1}
        headers = {**(self.request.headers or {}), STATE_HEADER: {"attempt": attempt, "used": used, "history": history}}
        log.info(
            "%s[%s] %s (status %s): retry in %.2fs",
            self.name,
            self.request.id,
            outcome.kind,
            outcome.status,
            decision.delay,
        )
        raise self.retry(
            countdown=decision.delay, headers=headers, exc=QuotaRetry(f"{outcome.kind} (status {outcome.status})")
        )

    dead_letter(self, decision.reason, history)
    if outcome.kind is qc.Kind.SHED:
        raise Shed(decision.reason)
    if decision.budget is not None:
        raise RetriesExhausted(decision.reason)
    raise PermanentError(decision.reason)
