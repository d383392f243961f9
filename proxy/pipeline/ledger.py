"""Accounting: every request and every CONNECT ends in exactly one outcome, one
``ratelimit_requests_total`` increment and one access-log line.

Both doors run their work through ``accounted``, the one try / refuse / finally
skeleton: the request path (handler.py) and the CONNECT door (front_door.py). A
refusal is counted and answered (``Ledger.refuse``: the refusal says its outcome,
status and detail); a bug, or a worker that went away, ends in outcome error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

from proxy.deps import Deps
from proxy.pipeline.responses import refusal_response, write_answer
from proxy.telemetry.accesslog import AccessRecord
from proxy.telemetry.metrics import NO_VENDOR
from proxy.wire.headers import idempotent
from proxy.wire.refusals import InternalError, Refusal
from proxy.wire.request import Request
from proxy.wire.responder import Responder

log = logging.getLogger("quota_proxy")

T = TypeVar("T")

INTERNAL_ERROR = "internal proxy error"


class Ledger:
    """One request or CONNECT as it will be counted and logged: its access-log record
    (vendor, tenant, outcome, status, detail...), filled in along the way."""

    __slots__ = ("_started", "counted", "deps", "rec")

    def __init__(self, deps: Deps, method: str, path: str, started: float | None = None) -> None:
        self.deps = deps
        self.rec = AccessRecord(method, "", path)
        self.counted = True
        """False once a CONNECT became an interception: not a request, the requests inside it are counted."""
        self._started = deps.clock.monotonic() if started is None else started

    def refuse(self, refusal: Refusal) -> web.Response:
        """Account for a refusal (outcome, counters, log detail, status) and build its answer."""
        deps, rec, vendor = self.deps, self.rec, self.rec.vendor
        rec.outcome = refusal.outcome
        if refusal.detail is not None:
            rec.detail = refusal.detail
        if vendor is not None:
            if refusal.outcome in ("deferred", "shed"):  # the buckets, or the store, said no
                deps.tally(vendor).refused(refusal.outcome, refusal.reason, rec.tenant)
                (deps.metrics.shed if refusal.outcome == "shed" else deps.metrics.deferred).labels(vendor).inc()
            if refusal.tls_error is not None:
                deps.metrics.tls_errors.labels(vendor, refusal.tls_error).inc()
        # The vendor's dialect and settings (answers, answers_max_wait) shape the answer.
        speaker = None
        for candidate in deps.policy.vendors:  # a loop, not next(generator): cheaper, per refusal
            if candidate.name == vendor:
                speaker = candidate
                break
        answer = refusal_response(refusal, speaker)
        rec.status = answer.status
        return answer

    def close(self) -> None:
        """The exchange is over: count it (unless it became an interception) and log it."""
        deps, rec = self.deps, self.rec
        rec.duration = deps.clock.monotonic() - self._started
        if self.counted:
            tenant = "-" if rec.tenant is None else rec.tenant
            if rec.vendor is None:
                deps.metrics.count_request(NO_VENDOR, tenant, rec.outcome)
            else:
                tally = deps.tally(rec.vendor)
                tally.ended(tenant, rec.outcome, rec.endpoint)
                shared = rec.shared
                if shared is not None:  # (share:) counted by class too
                    tally.shared(shared[0], shared[1], tenant, rec.outcome, shared[2])
        if deps.policy.access_log:
            deps.access_log.emit(rec)


async def crashed(
    deps: Deps,
    request: Request,
    responder: Responder,
    started: float,
    exc: Exception,
    record: Callable[[AccessRecord], None],
) -> None:
    """A bug on the straight path (lane.py), in the connection's serving task: logged,
    counted (outcome error, the record filled in by ``record``), answered 500 unless the
    answer had begun (then the connection is cut, never a spliced body)."""
    log.error("internal error on %s %s", request.method, request.target[:200], exc_info=exc)
    ledger = Ledger(deps, request.method, request.target, started)
    record(ledger.rec)
    ledger.rec.outcome, ledger.rec.detail = "error", INTERNAL_ERROR
    try:
        if responder.begun:
            raise exc
        answer = ledger.refuse(InternalError(INTERNAL_ERROR, idempotent(request.method, request.headers)))
    finally:
        ledger.close()
    await write_answer(responder, answer)


async def accounted(
    ledger: Ledger,
    work: Awaitable[T],
    answer: Callable[[web.Response], T],
    crashed: Callable[[Exception], T],
) -> T:
    """Run ``work`` (one request or one CONNECT) to its end, accounted for once.

    A refusal is counted and its answer handed to ``answer``, which delivers it. A bug
    ends in outcome error and goes to ``crashed``, which logs it and ends the exchange
    (a 500 if nothing was sent yet, else a cut connection). A worker that went away
    ends in outcome error too. Whatever happens: one metric increment, one log line."""
    rec = ledger.rec
    try:
        return await work
    except Refusal as refusal:
        return answer(ledger.refuse(refusal))
    except asyncio.CancelledError:
        rec.outcome, rec.detail = "error", "the worker went away"
        raise
    except Exception as exc:
        rec.outcome, rec.detail = "error", INTERNAL_ERROR
        return crashed(exc)
    finally:
        ledger.close()
