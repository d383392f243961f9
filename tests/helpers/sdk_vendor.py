"""A local vendor that speaks the wire formats of Stripe, OpenAI, Anthropic, GitHub and Slack, so their
real SDKs can be pointed at it (through the proxy, which maps each vendor's host name to
this one HTTPS origin with ``upstream:``).

    POST /v1/customers         Stripe: a customer (form-encoded request)
    GET  /v1/customers/{id}    Stripe: a customer
    POST /v1/chat/completions  OpenAI: a chat completion
    POST /v1/messages          Anthropic: a message
    GET  /users/{login}        GitHub: a user (PyGithub's get_user)
    POST /api/{method}         Slack: a Web API method (slack_sdk's WebClient)
    anything else              {"ok": true} (for load that is not an SDK's)

It enforces its own quota (a sliding window, answered with a 429 in the vendor's own
error format), records every request it receives, and can stall: with ``stalling`` set,
each request waits (until the test ends) without answering, so the proxy's read timeout
fires.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Seen:
    """One request as the vendor received it."""

    at: float
    """time.monotonic() on arrival"""
    method: str
    path: str
    headers: dict[str, str]
    """lower-case names"""
    body: bytes


@dataclass
class SdkVendor:
    quota: int = 1000
    """Requests allowed in any ``window`` seconds; more get the vendor's own 429."""
    window: float = 1.0
    seen: list[Seen] = field(default_factory=list)
    rejected: int = 0
    """Requests this vendor refused with its own 429: the proxy let too many through."""
    stalling: bool = False
    _release: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._receive])
        app.router.add_post("/v1/customers", self._stripe_customer)
        app.router.add_get("/v1/customers/{id}", self._stripe_customer)
        app.router.add_post("/v1/chat/completions", self._openai_chat)
        app.router.add_post("/v1/messages", self._anthropic_message)
        app.router.add_get("/users/{login}", self._github_user)
        app.router.add_post("/api/{method}", self._slack_method)
        app.router.add_route("*", "/{tail:.*}", self._other)
        return app

    def release(self) -> None:
        """End every stall (the test is over)."""
        self._release.set()

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]

    def max_in_window(self, window: float | None = None) -> int:
        """The most requests that arrived within any ``window`` seconds (default: the quota's)."""
        span = self.window if window is None else window
        times = sorted(s.at for s in self.seen)
        return max((bisect.bisect_left(times, t + span) - i for i, t in enumerate(times)), default=0)

    @web.middleware
    async def _receive(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        now = time.monotonic()
        recent = sum(1 for s in self.seen if s.at > now - self.window)
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append(Seen(now, request.method, request.path, headers, body))
        if recent >= self.quota:
            self.rejected += 1
            return _vendor_429(request.path)
        if self.stalling:
            await self._release.wait()
        return await handler(request)

    def _answer(self, request_id_header: str, body: dict[str, object]) -> web.Response:
        """``body`` with the vendor's request-id header (the SDKs log it)."""
        return web.json_response(body, headers={request_id_header: f"req_{len(self.seen)}"})

    async def _stripe_customer(self, request: web.Request) -> web.Response:
        form = dict(parse_qsl(self.seen[-1].body.decode())) if request.method == "POST" else {}
        number = len(self.seen)
        customer = {"id": request.match_info.get("id", f"cus_test{number}"), "object": "customer"}
        return self._answer(
            "Request-Id",
            {**customer, "created": 1700000000 + number, "email": form.get("email"), "livemode": False, "metadata": {}},
        )

    async def _openai_chat(self, request: web.Request) -> web.Response:
        model, number = (await request.json())["model"], len(self.seen)
        message = {"role": "assistant", "content": "hello from the mock", "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        return self._answer(
            "x-request-id",
            {"id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1700000000 + number, "model": model}
            | {"choices": [choice], "usage": usage},
        )

    async def _anthropic_message(self, request: web.Request) -> web.Response:
        model, number = (await request.json())["model"], len(self.seen)
        content = [{"type": "text", "text": "hello from the mock"}]
        return self._answer(
            "request-id",
            {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": model, "content": content}
            | {"stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 4}},
        )

    async def _github_user(self, request: web.Request) -> web.Response:
        login, number = request.match_info["login"], len(self.seen)
        user = {"login": login, "id": number, "type": "User", "name": "The Mock", "url": f"/users/{login}"}
        return self._answer("X-GitHub-Request-Id", user)

    async def _slack_method(self, request: web.Request) -> web.Response:
        return self._answer("x-slack-req-id", {"ok": True, "args": {}})

    async def _other(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "path": request.path})


def _vendor_429(path: str) -> web.Response:
    """The vendor's own rate-limit answer, in its own format (never X-Quota-*)."""
    message = "Too many requests: the vendor's quota is exceeded"
    if path.startswith("/v1/customers"):
        body: object = {"error": {"type": "invalid_request_error", "code": "rate_limit", "message": message}}
    elif path == "/v1/messages":
        body = {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    elif path.startswith("/users/"):  # GitHub: a 403 whose message says it
        return web.json_response(
            {"message": f"API rate limit exceeded: {message}"}, status=403, headers={"Retry-After": "1"}
        )
    elif path.startswith("/api/"):
        body = {"ok": False, "error": "ratelimited"}
    else:
        body = {"error": {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    return web.json_response(body, status=429, headers={"Retry-After": "1"})
