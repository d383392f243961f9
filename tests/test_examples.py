"""The worker-side examples (examples/), run for real against an in-process proxy.

The Celery example runs in a real Celery worker (``start_worker``: a worker thread, solo
pool) on Celery's in-memory broker with the in-memory cache result backend, eager mode
off; the Dramatiq example in a real Dramatiq worker on its StubBroker. The proxy and the
mock vendor run on the test's event loop, so every blocking wait (worker start and stop,
results) runs in a thread with ``asyncio.to_thread`` and the loop keeps serving the
worker's requests meanwhile. The target host ``api.payments.example`` does not resolve:
a request that reached the mock vendor went through the proxy.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import dramatiq
import pytest
import requests
from celery import signals
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from dramatiq.brokers.stub import StubBroker
from dramatiq.results import ResultFailure, ResultMissing
from requests.structures import CaseInsensitiveDict

from examples import celery_tasks, dramatiq_actors
from examples import quota_client as qc
from examples.retry_policy import RetryPolicy, attempt_record
from proxy.server import ProxyServer
from tests.conftest import (
    Samples,
    Vendor,
    client_session,
    eventually,
    free_port,
    metric_samples,
    value,
    vendor_policy,
)

TARGET = "http://api.payments.example/v1/charges"
QUIET = "access_log: false"
# Transient backoff in tens of milliseconds so the error paths take no wall-clock time;
# deferrals and vendor 429s keep their real (whole-second) waits.
FAST = RetryPolicy(backoff_base=0.05, backoff_cap=1.0)
TIMER_SLACK = 0.05
"""A broker's timer may fire a few milliseconds before a countdown's exact end."""


async def metrics(proxy: ProxyServer) -> Samples:
    async with client_session() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        assert r.status == 200
        return metric_samples(await r.text())


def check_history(history: list[dict[str, Any]]) -> None:
    """Every retry waited what its answer asked: a deferral at least ``Retry-After`` (and
    the precise hint), a vendor 429 at least the vendor's ``Retry-After``; the next attempt
    started no earlier than that; and only the final attempt succeeded."""
    assert history, "no attempts recorded"
    assert [h["attempt"] for h in history] == list(range(1, len(history) + 1))
    assert history[-1]["kind"] == "ok" and history[-1]["decision"] == "done"
    for entry, following in itertools.pairwise(history):
        assert entry["decision"] == "retry", entry
        if entry["kind"] == "deferred":
            assert entry["status"] == 429 and entry["budget"] == "deferred"
            assert entry["retry_after_header"] >= 1
            assert entry["delay"] >= entry["retry_after_header"] >= entry["retry_after"] > 0
        elif entry["kind"] == "vendor_throttled":
            assert entry["status"] == 429 and entry["budget"] == "throttled"
            assert entry["delay"] >= entry["retry_after"] > 0
        else:
            assert entry["kind"] == "error" and entry["transient"] and entry["budget"] == "transient"
        assert following["at"] - entry["finished"] >= entry["delay"] - TIMER_SLACK, (entry, following)


# -- Celery ---------------------------------------------------------------------------


@pytest.fixture
def fast_policy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., RetryPolicy]:
    """Set both examples' retry policy (FAST with overrides) for this test."""

    def use(**overrides: Any) -> RetryPolicy:
        policy = replace(FAST, **overrides)
        monkeypatch.setattr(celery_tasks, "POLICY", policy)
        monkeypatch.setattr(dramatiq_actors, "POLICY", policy)
        return policy

    use()
    return use


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[ProxyServer], None]]:
    """Point the examples at a proxy: ``$QUOTA_PROXY_URL``, with no other proxy variables."""
    for name in (
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "NO_PROXY",
        "no_proxy",
        "ALL_PROXY",
        "all_proxy",
        "QUOTA_PROXY_URL",
    ):
        monkeypatch.delenv(name, raising=False)

    def point(proxy: ProxyServer) -> None:
        monkeypatch.setenv("QUOTA_PROXY_URL", proxy.url)

    yield point


@pytest.fixture(scope="module")
def celery_worker_thread() -> Iterator[Any]:
    """One real Celery worker in a thread for the module, on the in-memory broker with the
    cache result backend, eager mode off. (A worker on the memory transport takes a couple of
    seconds to stop, so it is not restarted per test.) Tasks find the proxy through the
    environment at call time, and every test waits for all of its tasks, so none is in
    flight when the next test or the teardown starts."""
    app = celery_tasks.app
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        broker_transport_options={"polling_interval": 0.01},
        task_always_eager=False,
        worker_hijack_root_logger=False,
    )
    # A receiver of setup_logging tells Celery to leave logging alone: otherwise starting the
    # worker sets the root logger's level to the worker's (ERROR) for the rest of the session.
    # It still exports these for forked pool processes; put them back as they were.
    saved = {name: os.environ.get(name) for name in _MP_FORK_VARIABLES}
    signals.setup_logging.connect(_leave_logging_alone)
    try:
        with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, shutdown_timeout=15) as worker:
            yield worker
    finally:
        signals.setup_logging.disconnect(_leave_logging_alone)
        for name, was in saved.items():
            if was is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = was


_MP_FORK_VARIABLES = ("_MP_FORK_LOGLEVEL_", "_MP_FORK_LOGFILE_", "_MP_FORK_LOGFORMAT_")


def _leave_logging_alone(**kwargs: Any) -> None:
    return None


@pytest.fixture
def celery_worker(celery_worker_thread: Any, start_proxy: Any, vendor: Vendor, fast_policy: Any) -> Any:
    """The module's worker, with empty queues (the memory transport's are process-global)."""
    app = celery_tasks.app
    assert not app.conf.task_always_eager
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(celery_tasks.QUEUE)
        conn.default_channel.queue_purge(celery_tasks.DEAD_LETTER.name)
    return celery_worker_thread


async def results(*async_results: AsyncResult, timeout: float = 20) -> list[Any]:
    """Wait for every result in a thread; failures come back as their exception."""

    def wait() -> list[Any]:
        return [r.get(timeout=timeout, interval=0.02, propagate=False) for r in async_results]

    return await asyncio.to_thread(wait)


async def test_celery_charges_go_through_the_proxy(
    celery_worker: Any, start_proxy: Any, vendor: Vendor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With plain HTTP_PROXY (no code change), charges succeed at the first attempt; the
    proxy strips the tenant header and counts them under the tenant."""
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=QUIET))
    for name in ("QUOTA_PROXY_URL", "NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)

    sent = [celery_tasks.charge.delay(f"cus_{i}", 100 + i, tenant="acme") for i in range(3)]
    values = await results(*sent)

    for i, v in enumerate(values):
        assert isinstance(v, dict), v
        assert v["status"] == 200 and v["attempts"] == 1 and v["retries"] == {}
        assert v["vendor"]["method"] == "POST" and v["vendor"]["path"] == "/v1/charges"
        assert (v["customer_id"], v["amount"]) == (f"cus_{i}", 100 + i)
        check_history(v["history"])
    assert vendor.mock.accepted == 3 and vendor.mock.rejected == 0
    recorded = vendor.mock.requests
    assert {r["headers"]["idempotency-key"] for r in recorded} == {r.id for r in sent}
    assert all("x-tenant-id" not in r["headers"] for r in recorded)
    samples = await metrics(proxy)
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="forwarded") == 3


async def test_celery_deferred_tasks_retry_after_retry_after_and_all_succeed(
    celery_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any, fast_policy: Any
) -> None:
    """A proxy limit of 2/s with action defer, six charges at once, a vendor that allows
    more than the proxy: tasks are deferred, retried with countdown >= Retry-After, all
    succeed, and the vendor never answers 429. Deferrals do not touch the transient budget,
    which is zero here."""
    fast_policy(max_transient=0)
    vendor.mock.configure(rate=10, burst=10)
    proxy = await start_proxy(
        vendor_policy(vendor.url, limits="[{rate: 2, per: 1s, burst: 2}]", on_limit="{action: defer}", extra_top=QUIET)
    )
    worker_env(proxy)

    sent = [celery_tasks.charge.delay(f"cus_{i}", 500) for i in range(6)]
    values = await results(*sent, timeout=25)

    assert all(isinstance(v, dict) and v["status"] == 200 for v in values), values
    assert vendor.mock.accepted == 6 and vendor.mock.rejected == 0
    deferrals = [v["retries"].get("deferred", 0) for v in values]
    # Six arrive within well under a second at a bucket of 2: at least three must wait.
    assert sum(1 for d in deferrals if d) >= 3, deferrals
    for v in values:
        assert set(v["retries"]) <= {"deferred"}, v["retries"]
        check_history(v["history"])
        assert sum(h["kind"] == "deferred" for h in v["history"]) == v["retries"].get("deferred", 0)
    samples = await metrics(proxy)
    assert value(samples, "ratelimit_deferred_total", limiter="payments") == sum(deferrals)


async def test_celery_vendor_429_is_retried_as_throttled(
    celery_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any
) -> None:
    """The vendor's own 429 (no X-Quota-Action) is a throttle, not a deferral nor a transient
    error: retried after the vendor's Retry-After, charged to the throttled budget."""
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=QUIET))
    worker_env(proxy)
    vendor.mock.script(status=429, retry_after="1", count=1)

    (v,) = await results(celery_tasks.charge.delay("cus_t", 700))

    assert isinstance(v, dict) and v["status"] == 200, v
    assert v["retries"] == {"throttled": 1}
    assert [h["kind"] for h in v["history"]] == ["vendor_throttled", "ok"]
    first = v["history"][0]
    assert first["retry_after"] == 1.0 and first["delay"] >= 1.0
    check_history(v["history"])
    assert vendor.mock.rejected == 1 and vendor.mock.accepted == 1


async def test_celery_shed_is_dead_lettered_not_retried(
    celery_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any
) -> None:
    """With action shed and one token a minute, the second charge is shed: dead-lettered at
    once (a record on the dead-letter queue, the task failed with Shed), never retried."""
    proxy = await start_proxy(
        vendor_policy(vendor.url, limits="[{rate: 1, per: 1m, burst: 1}]", on_limit="{action: shed}", extra_top=QUIET)
    )
    worker_env(proxy)

    first = celery_tasks.charge.delay("cus_a", 1)
    (ok,) = await results(first)
    second = celery_tasks.charge.delay("cus_b", 2)
    (failed,) = await results(second)

    assert isinstance(ok, dict) and ok["status"] == 200
    assert second.state == "FAILURE" and type(failed).__name__ == "Shed", failed
    letters = await asyncio.to_thread(celery_tasks.drain_dead_letters, 10, 5.0)
    assert len(letters) == 1, letters
    (letter,) = letters
    assert letter["id"] == second.id and letter["task"] == "examples.charge"
    assert letter["args"] == ["cus_b", 2] and letter["retries"] == 0
    assert "shed" in letter["reason"]
    assert [(h["kind"], h["status"], h["decision"]) for h in letter["history"]] == [("shed", 503, "dead_letter")]
    assert vendor.mock.accepted == 1
    samples = await metrics(proxy)
    assert value(samples, "ratelimit_shed_total", limiter="payments") == 1


async def test_celery_transient_errors_back_off_then_exhaust_their_budget(
    celery_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any, fast_policy: Any
) -> None:
    """Vendor 5xx: retried with exponential backoff on the transient budget; once the budget
    is used up, the task is dead-lettered with RetriesExhausted."""
    fast_policy(max_transient=2)
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=QUIET))
    worker_env(proxy)

    vendor.mock.script(status=503, count=2)
    (v,) = await results(celery_tasks.charge.delay("cus_x", 3))
    assert isinstance(v, dict) and v["status"] == 200, v
    assert v["retries"] == {"transient": 2}
    check_history(v["history"])
    delays = [h["delay"] for h in v["history"][:-1]]
    assert FAST.backoff_base / 2 <= delays[0] <= FAST.backoff_base
    assert FAST.backoff_base <= delays[1] <= 2 * FAST.backoff_base

    vendor.mock.script(status=503, count=3)
    doomed = celery_tasks.charge.delay("cus_y", 4)
    (failed,) = await results(doomed)
    assert type(failed).__name__ == "RetriesExhausted", failed
    (letter,) = await asyncio.to_thread(celery_tasks.drain_dead_letters, 10, 5.0)
    assert letter["id"] == doomed.id and "transient budget" in letter["reason"]
    assert [h["kind"] for h in letter["history"]] == ["error"] * 3
    # 503, 503, 200 for the first; 503 x 3 for the second: no attempt after its budget ran out.
    assert len(vendor.mock.requests) == 6


# -- Dramatiq -------------------------------------------------------------------------


def stub_broker() -> StubBroker:
    """The examples' broker: the in-memory stub, DRAMATIQ_REDIS_URL being unset here."""
    broker = dramatiq_actors.broker
    assert isinstance(broker, StubBroker), broker
    return broker


@pytest.fixture
async def dramatiq_worker(start_proxy: Any, vendor: Vendor, fast_policy: Any) -> AsyncIterator[dramatiq.Worker]:
    broker = stub_broker()
    broker.flush_all()
    broker.dead_letters_by_queue.clear()
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=20)
    await asyncio.to_thread(worker.start)
    try:
        yield worker
    finally:
        await asyncio.to_thread(worker.stop)


async def outcome_of(message: Any, deadline: float = 20.0) -> Any:
    """The actor's result, or the ResultFailure it ended with. Polled without blocking (the
    stub result backend is a dict): its blocking wait backs off exponentially."""
    got: list[Any] = []

    def probe() -> bool:
        try:
            got.append(message.get_result())
        except ResultMissing:
            return False
        except ResultFailure as failure:
            got.append(failure)
        return True

    await eventually(probe, f"a result for {message.message_id}", deadline)
    return got[0]


async def test_dramatiq_per_request_defer_is_retried_after_retry_after(
    dramatiq_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any
) -> None:
    """The vendor's policy holds, but the job asks for X-Quota-On-Limit: defer: with two
    worker threads and five jobs at a 2/s limit, jobs are deferred, retried no sooner than
    Retry-After, and all succeed; the vendor never answers 429."""
    vendor.mock.configure(rate=10, burst=10)
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 2, per: 1s, burst: 2}]", extra_top=QUIET))
    worker_env(proxy)

    sent = [dramatiq_actors.charge.send(f"cus_{i}", 10, on_limit="defer") for i in range(5)]
    values = await asyncio.gather(*(outcome_of(m) for m in sent))

    assert all(isinstance(v, dict) and v["status"] == 200 for v in values), values
    assert vendor.mock.accepted == 5 and vendor.mock.rejected == 0
    deferred = sum(v["retries"].get("deferred", 0) for v in values)
    assert deferred >= 2
    for v in values:
        assert set(v["retries"]) <= {"deferred"}
        check_history(v["history"])
    samples = await metrics(proxy)
    assert value(samples, "ratelimit_deferred_total", limiter="payments") == deferred
    assert value(samples, "ratelimit_held_requests", limiter="payments") == 0


async def test_dramatiq_vendor_429_is_retried_as_throttled(
    dramatiq_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any
) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=QUIET))
    worker_env(proxy)
    vendor.mock.script(status=429, retry_after="1", count=1)

    v = await outcome_of(dramatiq_actors.charge.send("cus_t", 70))

    assert isinstance(v, dict) and v["status"] == 200, v
    assert v["retries"] == {"throttled": 1}
    assert [h["kind"] for h in v["history"]] == ["vendor_throttled", "ok"]
    assert v["history"][0]["delay"] >= 1.0
    check_history(v["history"])
    assert vendor.mock.rejected == 1 and vendor.mock.accepted == 1


async def test_dramatiq_shed_is_dead_lettered_not_retried(
    dramatiq_worker: Any, start_proxy: Any, vendor: Vendor, worker_env: Any
) -> None:
    """A per-request X-Quota-On-Limit: shed on an empty bucket: the message fails at once into
    the broker's dead-letter queue, with no Dramatiq retry."""
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 1, per: 1m, burst: 1}]", extra_top=QUIET))
    worker_env(proxy)

    ok = await outcome_of(dramatiq_actors.charge.send("cus_a", 1))
    shed = dramatiq_actors.charge.send("cus_b", 2, on_limit="shed")
    failure = await outcome_of(shed)

    assert isinstance(ok, dict) and ok["status"] == 200
    assert isinstance(failure, ResultFailure) and "Shed" in str(failure), failure
    dead = stub_broker().dead_letters
    assert [m.message_id for m in dead] == [shed.message_id]
    assert dead[0].options.get("retries", 0) == 0
    record = dead[0].options["dead_letter"]
    assert "shed" in record["reason"]
    assert [(h["kind"], h["status"]) for h in record["history"]] == [("shed", 503)]
    assert vendor.mock.accepted == 1
    assert value(await metrics(proxy), "ratelimit_shed_total", limiter="payments") == 1


# -- quota_client: classification against the real proxy ----------------------------------


def through(proxy: ProxyServer, url: str = TARGET, **headers: str) -> tuple[qc.Outcome, requests.Response | None]:
    with requests.Session() as session:
        return qc.send(session, "POST", url, headers=headers, proxies=qc.proxy_settings(proxy.url), timeout=10)


async def test_classify_real_proxy_answers(start_proxy: Any, vendor: Vendor) -> None:
    """Each kind, from the proxy's and the vendor's real answers."""
    proxy = await start_proxy(
        vendor_policy(vendor.url, limits="[{rate: 1, per: 1m, burst: 1}]", on_limit="{action: defer}", extra_top=QUIET)
    )

    ok, _ = await asyncio.to_thread(through, proxy)
    assert ok.kind is qc.Kind.OK and ok.status == 200 and ok.ok and not ok.retryable

    deferred, _ = await asyncio.to_thread(through, proxy)
    assert deferred.kind is qc.Kind.DEFERRED and deferred.status == 429 and deferred.retryable
    assert deferred.limiter == "payments" and deferred.reason is None
    # One token a minute: the precise wait is just under 60 s; Retry-After rounds it up.
    assert deferred.retry_after_header == 60
    retry_after = deferred.retry_after
    assert retry_after is not None and 55 < retry_after <= 60
    delay, precise = qc.retry_delay(deferred), qc.retry_delay(deferred, precise=True)
    assert delay is not None and delay >= 60
    assert precise is not None and retry_after <= precise < 60 + qc.MAX_JITTER

    shed, _ = await asyncio.to_thread(through, proxy, **{"X-Quota-On-Limit": "shed"})
    assert shed.kind is qc.Kind.SHED and shed.status == 503 and shed.limiter == "payments"
    assert not shed.retryable

    denied, _ = await asyncio.to_thread(through, proxy, "http://elsewhere.example/")
    assert denied.kind is qc.Kind.ERROR and denied.status == 403 and not denied.transient
    assert denied.reason == "deny"


async def test_classify_vendor_429_and_5xx_through_the_proxy(start_proxy: Any, vendor: Vendor) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=QUIET))
    vendor.mock.script(status=502, count=1)
    bad_gateway, _ = await asyncio.to_thread(through, proxy)
    assert bad_gateway.kind is qc.Kind.ERROR and bad_gateway.status == 502 and bad_gateway.transient

    vendor.mock.script(status=429, retry_after="7", count=1)
    throttled, response = await asyncio.to_thread(through, proxy)
    assert response is not None and "X-Quota-Action" not in response.headers
    assert throttled.kind is qc.Kind.VENDOR_THROTTLED and throttled.retry_after == 7.0
    assert 7.0 <= qc.retry_delay(throttled) <= 7.0 + 0.2 * 7.0

    # The proxy now blocks the vendor fleet-wide for those 7 s: its own answer is a deferral.
    blocked, _ = await asyncio.to_thread(through, proxy)
    assert blocked.kind is qc.Kind.DEFERRED and blocked.retry_after_header is not None
    assert 1 <= blocked.retry_after_header <= 7


async def test_classify_store_unavailable_deferral(start_proxy: Any, vendor: Vendor) -> None:
    """A Redis nobody listens on, failing closed: a deferral with X-Quota-Reason."""
    store = f"redis://127.0.0.1:{free_port()}/0"
    proxy = await start_proxy(vendor_policy(vendor.url, store=store, extra_top=QUIET))
    outcome, _ = await asyncio.to_thread(through, proxy)
    assert outcome.kind is qc.Kind.DEFERRED and outcome.reason == "store-unavailable"
    assert outcome.retry_after_header is not None and outcome.retry_after_header >= 1
    assert vendor.mock.accepted == 0


def test_classify_no_proxy_listening_is_transient() -> None:
    with requests.Session() as session:
        outcome, response = qc.send(
            session, "GET", TARGET, proxies=qc.proxy_settings(f"http://127.0.0.1:{free_port()}"), timeout=5
        )
    assert response is None
    assert outcome.kind is qc.Kind.ERROR and outcome.status is None and outcome.transient
    assert outcome.reason == "ProxyError"


# -- quota_client: classification units -----------------------------------------------


def response(status: int, **headers: str) -> requests.Response:
    r = requests.Response()
    r.status_code = status
    r.headers = CaseInsensitiveDict({k.replace("_", "-"): v for k, v in headers.items()})
    r._content = b"{}"
    return r


def test_classify_ok_statuses() -> None:
    for status in (200, 201, 204, 302):
        assert qc.classify(response(status)).kind is qc.Kind.OK


def test_classify_defer_prefers_the_precise_hint() -> None:
    outcome = qc.classify(
        response(429, Retry_After="1", X_Quota_Action="defer", X_Quota_Retry_After_Ms="250", X_Quota_Limiter="payments")
    )
    assert outcome == qc.Outcome(qc.Kind.DEFERRED, 429, 0.25, 1.0, "payments")
    rng = random.Random(7)
    for _ in range(200):
        assert 1.0 <= qc.retry_delay(outcome, rng=rng) < 1.0 + 0.2
        assert 0.25 <= qc.retry_delay(outcome, precise=True, rng=rng) < 0.25 + qc.MIN_JITTER


def test_classify_defer_without_ms_uses_retry_after() -> None:
    outcome = qc.classify(response(429, Retry_After="3", X_Quota_Action="defer"))
    assert outcome.kind is qc.Kind.DEFERRED and outcome.retry_after == 3.0
    bare = qc.classify(response(429, X_Quota_Action="defer"))
    assert bare.retry_after == qc.DEFAULT_DEFER_RETRY_AFTER and bare.retry_after_header is None


def test_classify_store_unavailable_reason() -> None:
    outcome = qc.classify(
        response(
            429,
            Retry_After="1",
            X_Quota_Action="defer",
            X_Quota_Retry_After_Ms="1000",
            X_Quota_Reason="store-unavailable",
        )
    )
    assert outcome.kind is qc.Kind.DEFERRED and outcome.reason == "store-unavailable"


def test_classify_shed_and_plain_503() -> None:
    assert qc.classify(response(503, X_Quota_Action="shed")).kind is qc.Kind.SHED
    vendor_503 = qc.classify(response(503))
    assert vendor_503.kind is qc.Kind.ERROR and vendor_503.transient


def test_classify_vendor_429_retry_after_forms() -> None:
    seconds = qc.classify(response(429, Retry_After="2"))
    assert seconds.kind is qc.Kind.VENDOR_THROTTLED and seconds.retry_after == 2.0
    date = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = datetime(2030, 1, 1, 12, 0, 30, tzinfo=UTC)
    dated = qc.classify(
        response(429, Retry_After=format_datetime(later, usegmt=True), Date=format_datetime(date, usegmt=True))
    )
    assert dated.kind is qc.Kind.VENDOR_THROTTLED and dated.retry_after == 30.0
    missing = qc.classify(response(429))
    assert missing.retry_after == qc.DEFAULT_VENDOR_RETRY_AFTER and missing.retry_after_header is None


def test_classify_errors() -> None:
    for status, transient in (
        (500, True),
        (502, True),
        (504, True),
        (408, True),
        (400, False),
        (404, False),
        (422, False),
        (501, False),
    ):
        outcome = qc.classify(response(status))
        assert outcome.kind is qc.Kind.ERROR and outcome.transient is transient, status
    gateway = qc.classify(response(504, X_Quota_Error="upstream-timeout"))
    assert gateway.reason == "upstream-timeout"
    assert qc.classify_exception(requests.ConnectTimeout()).transient
    assert qc.classify_exception(requests.ReadTimeout()).transient
    assert not qc.classify_exception(requests.exceptions.InvalidURL()).transient
    with pytest.raises(ValueError):
        qc.retry_delay(qc.classify(response(500)))


def test_parse_retry_after_edge_cases() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert qc.parse_retry_after("0") == 0.0
    assert qc.parse_retry_after(" 5 ") == 5.0
    for bad in (None, "", "-1", "nan", "inf", "soon"):
        assert qc.parse_retry_after(bad) is None, bad
    past = format_datetime(datetime(2029, 12, 31, tzinfo=UTC), usegmt=True)
    assert qc.parse_retry_after(past, now=now) == 0.0
    future = format_datetime(datetime(2030, 1, 1, 0, 1, tzinfo=UTC), usegmt=True)
    assert qc.parse_retry_after(future, now=now) == 60.0
    assert qc.parse_retry_after(future, date="not a date", now=now) == 60.0


def test_jitter_and_backoff_bounds() -> None:
    rng = random.Random(1)
    for delay, spread in ((0.0, qc.MIN_JITTER), (0.25, qc.MIN_JITTER), (1.0, 0.2), (10.0, 2.0), (100.0, qc.MAX_JITTER)):
        samples = [qc.jitter(delay, rng) for _ in range(500)]
        assert all(delay <= s < delay + spread for s in samples), (delay, min(samples), max(samples))
        assert max(samples) - min(samples) > spread / 2, "jitter must actually spread the retries"
    for attempt, ceiling in ((0, 1.0), (1, 2.0), (3, 8.0), (20, 300.0), (10_000, 300.0)):
        samples = [qc.backoff(attempt, rng=rng) for _ in range(200)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples), attempt
    with pytest.raises(ValueError):
        qc.backoff(-1)


def test_quota_headers_and_proxy_settings() -> None:
    assert qc.quota_headers() == {}
    assert qc.quota_headers(tenant="acme", on_limit="defer", max_hold=0.25) == {
        "X-Tenant-Id": "acme",
        "X-Quota-On-Limit": "defer",
        "X-Quota-Max-Hold": "250ms",
    }
    assert qc.quota_headers(max_hold="1s", tenant="t", tenant_header="X-Account") == {
        "X-Quota-Max-Hold": "1s",
        "X-Account": "t",
    }
    with pytest.raises(ValueError):
        qc.quota_headers(on_limit="wait")
    with pytest.raises(ValueError):
        qc.quota_headers(max_hold=-1.0)
    assert qc.proxy_settings("http://p:8080") == {"http": "http://p:8080", "https": "http://p:8080"}
    assert qc.proxy_settings(environ={"QUOTA_PROXY_URL": "http://q:1"}) == {"http": "http://q:1", "https": "http://q:1"}
    assert qc.proxy_settings(environ={}) is None


def test_retry_policy_keeps_a_budget_per_kind() -> None:
    policy = RetryPolicy(max_deferrals=3, max_throttled=2, max_transient=1, rng=random.Random(3))
    deferred = qc.classify(response(429, Retry_After="2", X_Quota_Action="defer", X_Quota_Retry_After_Ms="1500"))
    throttled = qc.classify(response(429, Retry_After="4"))
    transient = qc.classify(response(502))

    # Transient budget used up, deferrals and throttles still retried (and vice versa).
    spent = {"transient": 1}
    d = policy.decide(deferred, spent)
    assert (d.action, d.budget) == ("retry", "deferred") and d.delay is not None and d.delay >= 2.0
    t = policy.decide(throttled, spent)
    assert (t.action, t.budget) == ("retry", "throttled") and t.delay is not None and t.delay >= 4.0
    assert policy.decide(transient, spent).action == "dead_letter"
    assert policy.decide(transient, {"deferred": 3, "throttled": 2}).action == "retry"
    assert policy.decide(deferred, {"deferred": 3}).action == "dead_letter"
    assert policy.decide(throttled, {"throttled": 2}).action == "dead_letter"

    assert policy.decide(qc.classify(response(200)), {}).action == "done"
    shed = policy.decide(qc.classify(response(503, X_Quota_Action="shed")), {})
    assert (shed.action, shed.budget) == ("dead_letter", None)
    permanent = policy.decide(qc.classify(response(403, X_Quota_Action="deny")), {})
    assert permanent.action == "dead_letter" and "403" in permanent.reason

    record = attempt_record(1, 100.0, deferred, d)
    assert record["kind"] == "deferred" and record["delay"] == d.delay and record["retry_after"] == 1.5
