"""Which policies the straight path (proxy/pipeline/lane.py) serves, and which it leaves to
the general path: the list is here, and a policy feature that silently falls back to the
slow way fails ``test_a_policy_feature_takes_the_way_this_list_says``.

For every feature the straight path serves, the same request is also sent with the lane
switched off and the two runs compared (tests/test_lane.py's method): the same bytes to the
vendor and the worker, the same access-log line and the same metrics.
"""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import aiohttp
import pytest

from proxy.pipeline.lane import Lane
from proxy.pipeline.routes import Routes
from proxy.telemetry.accesslog import AccessLog
from tests.conftest import eventually, metric_samples, value, vendor_policy
from tests.test_lane import (
    ABSOLUTE,
    HOST,
    OK_BODY,
    REQUESTS,
    ScriptedVendor,
    _comparable,
    _exchange,
    _general_only,
    _log_fields,
    _request,
    _run,
    general_calls,
    scripted,
)

__all__ = ["general_calls", "scripted"]  # (fixtures, used by name)

STRIPE_SHAPED = """
            partition: {header: Authorization}
            concurrency: 25
            endpoints:
              - name: search
                match: {methods: [GET], path: "/v1/*/search"}
                limits: [{rate: 500, per: 1s}]
                concurrency: 5
              - name: files
                match: {methods: [POST], path: "/v1/files"}
                cost: 5
"""

TOKENS = (
    "meters: {tokens: {limits: [{rate: 60, per: 1h, burst: 20000}], "
    "tenant_limits: {default: [{rate: 60, per: 1h, burst: 15000}]}, estimate: openai, settle: openai}}"
)

STRAIGHT: dict[str, dict[str, str]] = {
    "token buckets, per second and per minute": {"limits": "[{rate: 1000, per: 1s}, {rate: 60000, per: 1m}]"},
    "tenant limits": {"tenant_limits": "tenant_limits: {default: [{rate: 500, per: 1s}]}"},
    "defer": {"on_limit": "{action: defer}"},
    "shed": {"on_limit": "{action: shed}"},
    "remaining-quota drain": {"extra_vendor": "feedback: {remaining_header: X-RateLimit-Remaining, low_watermark: 1}"},
    "answers: stripe": {"extra_vendor": "answers: stripe"},
    "answers: openai": {"extra_vendor": "answers: openai"},
    "tenant.max_active": {"extra_top": "tenant: {max_active: 100}"},
    "partition": {"extra_vendor": "partition: {header: Authorization}"},
    "endpoint classes and cost": {
        "extra_vendor": 'endpoints: [{name: charges, match: {path: "/v1/charges"}, cost: 2}]'
    },
    "concurrency": {"extra_vendor": "concurrency: 10"},
    "endpoint concurrency": {
        "extra_vendor": 'endpoints: [{name: charges, match: {path: "/v1/charges"}, concurrency: 3}]'
    },
    "Stripe-shaped": {"extra_vendor": STRIPE_SHAPED},
    "learned limits": {"extra_vendor": "feedback: {headers: auto}"},
    "RateLimit fields": {
        "extra_vendor": "ratelimit_headers: true",
        "tenant_limits": "tenant_limits: {default: [{rate: 500, per: 1s}]}",
    },
    "local shares": {"store": "redis", "store_timeout": "250ms, on_failure: local"},
    "share: weights and classes (X-Quota-Priority)": {
        "extra_vendor": "share: {weights: {default: 1, acme: 4}, classes: [checkout, batch], default_class: batch}"
    },
    "meters (SPEC §14)": {"extra_vendor": TOKENS},
    "proxy credentials": {
        "extra_top": "tenant: {from: proxy_auth, credentials: "
        "{acme: {sha256: 2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b}}}"
    },
}
"""Policy features whose usual requests the straight path serves whole."""

SLOW: dict[str, dict[str, str]] = {  # (none now: a feature added to the general path alone goes here)
}
"""Policy features that still send every request the general way (their rules live
there only): each is the next to bring onto the straight path."""


def _policy(scripted: ScriptedVendor, redis_url: str, feature: dict[str, str]) -> Any:
    options = dict(feature)
    store = redis_url if options.pop("store", "memory") == "redis" else "memory://"
    return vendor_policy(scripted.url, store=store, **options)


def _headers(feature: str) -> tuple[str, ...]:
    if feature == "proxy credentials":
        return ("Proxy-Authorization: Basic YWNtZTpzZWNyZXQ=",)  # acme:secret
    if feature.startswith("share"):
        return ("Authorization: Bearer sk_test_1", "X-Quota-Priority: checkout")
    return ("Authorization: Bearer sk_test_1",)


WAYS = [
    (f, store) for f in [*STRAIGHT, *SLOW] for store in ("memory", "redis") if f != "local shares" or store == "redis"
]


@pytest.mark.parametrize(("feature", "store"), WAYS, ids=[f"{f}-{s}" for f, s in WAYS])
async def test_a_policy_feature_takes_the_way_this_list_says(
    scripted: ScriptedVendor,
    start_proxy: Any,
    general_calls: list[str],
    redis_url: str,
    feature: str,
    store: str,
) -> None:
    spec = STRAIGHT.get(feature) or SLOW[feature]
    if store == "redis":
        spec = {"store": "redis", **spec}
    proxy = await start_proxy(_policy(scripted, redis_url, spec))
    data = _request("GET", ABSOLUTE, *_headers(feature))
    await _exchange(proxy.address.port, data)  # the first opens the store's connection
    general_calls.clear()
    for _ in range(3):
        answer = await _exchange(proxy.address.port, data)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    if feature in STRAIGHT:
        assert general_calls == [], f"{feature}: the general path served {len(general_calls)} of 3"
    else:
        assert len(general_calls) == 3, f"{feature} is served straight now: move it to STRAIGHT"


PARITY: dict[str, tuple[str, bytes]] = {
    "partition": ("partition", _request("GET", ABSOLUTE, "Authorization: Bearer sk_test_1")),
    "no partition field": ("partition", REQUESTS["plain GET"]),
    "endpoint class": ("endpoint classes and cost", _request("GET", f"http://{HOST}/v1/charges")),
    "outside the classes": ("endpoint classes and cost", REQUESTS["plain GET"]),
    "concurrency": ("concurrency", REQUESTS["plain GET"]),
    "Stripe-shaped search": (
        "Stripe-shaped",
        _request("GET", f"http://{HOST}/v1/customers/search?q=x", "Authorization: Bearer sk_test_1"),
    ),
    "Stripe-shaped file": (
        "Stripe-shaped",
        _request("POST", f"http://{HOST}/v1/files", "Authorization: Bearer sk_test_2", "Content-Length: 2") + b"{}",
    ),
    "proxy credentials": (
        "proxy credentials",
        _request("GET", ABSOLUTE, "Proxy-Authorization: Basic YWNtZTpzZWNyZXQ="),
    ),
    "share, a class asked": (
        "share: weights and classes (X-Quota-Priority)",
        _request("GET", ABSOLUTE, "X-Quota-Priority: checkout"),
    ),
    "share, the tenant's class": ("share: weights and classes (X-Quota-Priority)", REQUESTS["plain GET"]),
    "Stripe-shaped, by route": (
        "Stripe-shaped",
        _request("GET", "/payments/v1/customers/search", "Authorization: Bearer sk_test_1", host="127.0.0.1"),
    ),
}


@pytest.mark.parametrize("case", list(PARITY))
async def test_the_straight_path_charges_and_accounts_as_the_general_path(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
    redis_url: str,
    case: str,
) -> None:
    feature, data = PARITY[case]
    policy = _policy(scripted, redis_url, STRAIGHT[feature])  # memory://: each run its own buckets
    runs = []
    charged = []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        stream = io.StringIO()
        proxy = await start_proxy(policy, access_log=AccessLog(stream))
        runs.append(await _run(proxy, scripted, stream, data))
        if lane == "straight":
            assert general_calls == []
        state = proxy.runtime.deps.limiter.store._state
        charged.append({key: round(tokens) for key, (tokens, *_) in state.items()})
    straight, general = runs
    assert straight.vendor_got == general.vendor_got
    assert straight.answer == general.answer
    assert straight.log == general.log
    assert straight.metrics == general.metrics
    assert straight.log["outcome"] == "forwarded"
    assert charged[0] == charged[1] and charged[0]  # the same buckets, the same cost taken


async def test_a_capped_request_gives_its_lease_back_before_the_worker_has_its_answer(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], redis_url: str
) -> None:
    """A worker calling one after another is never refused by its own last call: the lease
    is back in the store before the answer is written (SPEC §10)."""
    policy = vendor_policy(scripted.url, store=redis_url, extra_vendor="concurrency: 1", on_limit="{action: shed}")
    proxy = await start_proxy(policy)
    await _exchange(proxy.address.port, REQUESTS["plain GET"])  # the first opens the store's connection
    general_calls.clear()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        for _ in range(20):
            writer.write(REQUESTS["plain GET"])
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 OK"), head
            await reader.readexactly(11)
    finally:
        writer.close()
    assert general_calls == []
    inflight = await proxy.runtime.deps.limiter.store.inflight(
        proxy.runtime.deps.concurrency.sets(proxy.runtime.deps.policy.vendors[0], None)
    )
    assert inflight == (0,)


async def test_a_worker_gone_while_its_capped_request_is_granted_frees_the_slot(
    scripted: ScriptedVendor, start_proxy: Any, redis_url: str
) -> None:
    policy = vendor_policy(scripted.url, store=redis_url, extra_vendor="concurrency: 2", on_limit="{action: shed}")
    proxy = await start_proxy(policy)
    await _exchange(proxy.address.port, REQUESTS["plain GET"])
    deps = proxy.runtime.deps
    sets = deps.concurrency.sets(deps.policy.vendors[0], None)
    for _ in range(5):  # written and dropped at once: gone while its store call is out
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
        writer.write(REQUESTS["plain GET"])
        await writer.drain()
        writer.transport.abort()

    async def free() -> bool:
        return await deps.limiter.store.inflight(sets) == (0,)

    await eventually(free, "every lease given back")
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        samples = metric_samples(await r.text())
    counted = sum(
        value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome=o) or 0
        for o in ("forwarded", "error")
    )
    assert counted == 6  # each counted once, whatever the moment it went


async def test_wrong_or_missing_proxy_credentials_are_refused_whichever_came_before(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], redis_url: str
) -> None:
    """A route is learnt per credentials: a worker's good ones never let another's through."""
    proxy = await start_proxy(_policy(scripted, redis_url, STRAIGHT["proxy credentials"]))
    good = _request("GET", ABSOLUTE, "Proxy-Authorization: Basic YWNtZTpzZWNyZXQ=")  # acme:secret
    for _ in range(2):
        assert (await _exchange(proxy.address.port, good)).startswith(b"HTTP/1.1 200 OK")
    wrong = _request("GET", ABSOLUTE, "Proxy-Authorization: Basic YWNtZTpzZWNyZXU=")  # acme:secreu
    for data in (wrong, wrong, REQUESTS["plain GET"], REQUESTS["plain GET"]):
        answer = await _exchange(proxy.address.port, data)
        assert answer.startswith(b"HTTP/1.1 407 "), answer
    assert len(scripted.got) == 2


async def test_a_bug_in_learning_a_route_leaves_the_request_to_the_general_path(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called from the parser's callback, a bug there would cut the worker's connection."""

    def bug(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Routes, "learn", bug)
    proxy = await start_proxy(vendor_policy(scripted.url))
    assert (await _exchange(proxy.address.port, REQUESTS["plain GET"])).startswith(b"HTTP/1.1 200 OK")
    assert general_calls == [ABSOLUTE]


@pytest.mark.parametrize(
    "own",
    ["", 'RateLimit: "vendor";r=3;t=1\r\n', 'RateLimit: "vendor";r=900;t=1\r\n'],
    ids=["vendor sends none", "the vendor's tighter", "the proxy's tighter"],
)
async def test_the_ratelimit_fields_are_those_the_general_path_writes(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
    redis_url: str,
    own: str,
) -> None:
    """Beside the vendor's own RateLimit field (handed over: the general path compares them)
    or alone (written here), the same bytes."""
    scripted.answer = f"HTTP/1.1 200 OK\r\n{own}Content-Length: 2\r\n\r\nok".encode()
    policy = _policy(scripted, redis_url, STRAIGHT["RateLimit fields"])
    runs = []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        stream = io.StringIO()
        proxy = await start_proxy(policy, access_log=AccessLog(stream))
        runs.append(await _run(proxy, scripted, stream, REQUESTS["plain GET"]))
        if lane == "straight":
            assert len(general_calls) == (1 if own else 0)
    straight, general = runs
    assert _comparable(straight.answer, scripted.answer) == _comparable(general.answer, scripted.answer)
    ours = b'\r\nRateLimit: "quota-proxy-tenant-500-1s";r=499;t=1\r\n'
    assert (ours in straight.answer) is ("r=3" not in own)
    assert straight.log == general.log and straight.metrics == general.metrics


LEARNING = (
    b"HTTP/1.1 200 OK\r\nX-RateLimit-Limit: 2000\r\nX-RateLimit-Remaining: 1990\r\n"
    b"X-RateLimit-Reset: 60\r\nContent-Length: 2\r\n\r\nok"
)


async def test_an_answer_that_teaches_what_is_known_already_is_relayed_straight(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
) -> None:
    """feedback.headers: auto: the answer that teaches the buckets something new goes to the
    general path (its store call); the same lesson again does not, and the buckets learn
    the same either way. (The vendor allows more than the policy: the policy applies.)"""
    scripted.answer = LEARNING
    policy = vendor_policy(scripted.url, limits="[{rate: 1000, per: 1m}]", extra_vendor="feedback: {headers: auto}")
    learned = []
    answers = []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        proxy = await start_proxy(policy)
        general_calls.clear()
        got = [await _exchange(proxy.address.port, REQUESTS["plain GET"]) for _ in range(5)]
        answers.append([_comparable(a, LEARNING) for a in got])
        limiter = proxy.runtime.deps.limiter
        learned.append((limiter.learned_rate(proxy.runtime.deps.policy.vendors[0]), limiter.teacher.memory.reports))
        if lane == "straight":
            assert 1 <= len(general_calls) < 5, general_calls  # the first taught the store, not every one
    assert answers[0] == answers[1]
    assert learned[0] == learned[1] and learned[0][1] == 5  # every answer read, learnt the same


@pytest.mark.parametrize(
    ("on_limit", "wish", "outcome"),
    [
        ("{action: defer}", "X-Quota-On-Limit: hold", "held"),
        ("{action: hold, max_hold: 1s}", "X-Quota-On-Limit: shed", "shed"),
        ("{action: hold, max_hold: 1s}", "X-Quota-On-Limit: defer", "deferred"),
        ("{action: hold, max_hold: 1s}", "X-Quota-Max-Hold: 1ms", "deferred"),
    ],
    ids=["hold", "shed", "defer", "a shorter hold"],
)
async def test_a_workers_wish_is_taken_on_the_straight_path(
    scripted: ScriptedVendor,
    start_proxy: Any,
    general_calls: list[str],
    redis_url: str,
    on_limit: str,
    wish: str,
    outcome: str,
) -> None:
    """X-Quota-On-Limit and X-Quota-Max-Hold decide the store call the straight path sends:
    granted now, it never enters the general path; refused or held, the general path
    answers as the wish says (with the store's answer the straight path had)."""
    stream = io.StringIO()
    policy = vendor_policy(scripted.url, store=redis_url, limits="[{rate: 2, per: 1s, burst: 2}]", on_limit=on_limit)
    proxy = await start_proxy(policy, access_log=AccessLog(stream))
    data = _request("GET", ABSOLUTE, wish)
    await _exchange(proxy.address.port, data)  # the first opens the store's connection (and takes a token)
    general_calls.clear()
    assert (await _exchange(proxy.address.port, data)).startswith(b"HTTP/1.1 200 OK")  # the last token, at once
    assert general_calls == []
    answer = await _exchange(proxy.address.port, data)  # the bucket is empty
    proxy.runtime.deps.access_log.flush()
    logged = [json.loads(line)["outcome"] for line in stream.getvalue().splitlines()]
    assert logged[-1] == outcome, logged
    assert answer.startswith(b"HTTP/1.1 200 OK" if outcome == "held" else b"HTTP/1.1 ")
    assert len(general_calls) == 1  # handed over with the store's answer
    got = scripted.got[-1].lower()
    assert b"x-quota" not in got  # the wish is the proxy's, never the vendor's


# -- meters (SPEC §14): estimated from the body in hand, settled from the answer ------------

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50}).encode()


def _answer(status: str, fields: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nDate: Tue, 01 Dec 2026 12:00:00 GMT\r\n{fields}\r\n".encode() + body


_USAGE = b'{"id":"c1","usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120}}'
_EVENTS = (
    b'data: {"id":"c1","choices":[{"delta":{"content":"hi"}}]}\n\n'
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":7,"total_tokens":107}}\n\n'
    b"data: [DONE]\n\n"
)
_JSON = "Content-Type: application/json\r\n"
METERED_ANSWERS = {
    "json with usage": _answer("200 OK", f"{_JSON}Content-Length: {len(_USAGE)}\r\n", _USAGE),
    "json without usage": _answer("200 OK", f"{_JSON}Content-Length: 11\r\n", OK_BODY),
    "an error": _answer("500 Internal Server Error", f"{_JSON}Content-Length: 11\r\n", OK_BODY),
    "a stream (relayed by the general path)": _answer(
        "200 OK",
        "Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n",
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(_EVENTS), _EVENTS),
    ),
    "a vendor 429 (handed over)": _answer(
        "429 Too Many Requests", "Content-Type: application/json\r\nRetry-After: 0\r\nContent-Length: 11\r\n", OK_BODY
    ),
}
METER_FAMILIES = ("ratelimit_meter_estimated_total", "ratelimit_meter_settled_total")


@pytest.mark.parametrize("answer", list(METERED_ANSWERS))
async def test_a_metered_call_is_estimated_and_settled_on_the_straight_path_as_the_general_path_does(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
    redis_url: str,
    answer: str,
) -> None:
    """The estimate is read from the body the straight path has in hand, taken in its one
    store call, and the answer it relays settles it: the same bytes, access-log line, metrics
    and buckets as the general path's (which relays a stream, and a 429, for it)."""
    scripted.answer = METERED_ANSWERS[answer]
    policy = _policy(scripted, redis_url, {"extra_vendor": TOKENS, "on_limit": "{action: defer}"})
    data = _request(
        "POST",
        f"http://{HOST}/v1/chat/completions",
        "Content-Type: application/json",
        f"Content-Length: {len(CHAT)}",
    )
    data += CHAT
    runs, charged, meters = [], [], []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        general_calls.clear()
        stream = io.StringIO()
        proxy = await start_proxy(policy, access_log=AccessLog(stream))
        runs.append(await _run(proxy, scripted, stream, data))
        handed_over = "handed over" in answer or "general path" in answer
        if lane == "straight":
            assert len(general_calls) == handed_over, general_calls
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
            samples = metric_samples(await r.text())
        meters.append({k: v for k, v in samples.items() if k[0] in METER_FAMILIES})
        state = proxy.runtime.deps.limiter.store._state
        charged.append({key: round(tokens) for key, (tokens, *_) in state.items() if ":tokens" in key})
    straight, general = runs
    assert straight.vendor_got == general.vendor_got
    assert straight.answer == general.answer
    assert straight.log == general.log
    assert straight.metrics == general.metrics
    assert meters[0] == meters[1] and meters[0], meters
    assert charged[0] == charged[1], charged
    said = straight.log["meters"]["tokens"]
    assert said["estimated"] == 100 + 50  # 400 characters / 4, and max_tokens 50
    settled = {"json with usage": 120, "a stream (relayed by the general path)": 107, "a vendor 429 (handed over)": 0}
    assert said["settled"] == settled.get(answer), said
    tenant = [level for key, level in charged[0].items() if ":t:default:" in key]
    assert tenant == [15000 - settled.get(answer, 150)], charged  # (a 429 gives it all back)


async def test_a_metered_call_whose_worker_goes_before_the_answer_gives_its_estimate_back(
    start_proxy: Any, monkeypatch: pytest.MonkeyPatch, general_calls: list[str]
) -> None:
    """As a failed exchange does, on either path: the vendor had not answered."""
    got = asyncio.Event()
    vendor_side: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        vendor_side.append(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            got.set()
            await reader.read()  # (never answers: closed once the test has seen what it needs)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    policy = vendor_policy(url, extra_vendor=TOKENS, on_limit="{action: defer}")
    data = _request(
        "POST", f"http://{HOST}/v1/chat/completions", "Content-Type: application/json", f"Content-Length: {len(CHAT)}"
    )
    lines, levels = [], []
    try:
        for lane in ("straight", "general"):
            if lane == "general":
                monkeypatch.setattr(Lane, "flight", _general_only)
            general_calls.clear()
            got.clear()
            stream = io.StringIO()
            proxy = await start_proxy(policy, access_log=AccessLog(stream))
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
            writer.write(data + CHAT)
            await asyncio.wait_for(got.wait(), 10)
            writer.transport.abort()
            deps = proxy.runtime.deps

            def logged(deps: Any = deps, stream: io.StringIO = stream) -> bool:
                deps.access_log.flush()
                return bool(stream.getvalue())

            await eventually(logged, "the request logged")
            assert len(general_calls) == (lane == "general")
            lines.append(_log_fields(stream.getvalue().splitlines()[0]))
            state = deps.limiter.store._state
            given_back = [15000]
            await eventually(
                lambda: [round(v[0]) for k, v in state.items() if ":t:default:" in k] == given_back,  # noqa: B023
                "the estimate given back",
            )
            levels.append({key: round(tokens) for key, (tokens, *_) in state.items()})
            for w in vendor_side:
                w.transport.abort()  # (the proxy stops without waiting for an answer)
    finally:
        server.close()
    assert lines[0] == lines[1], lines
    assert lines[0]["meters"] == {"tokens": {"estimated": 150, "settled": 0}}
    assert levels[0] == levels[1], levels
