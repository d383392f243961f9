"""GitHub- and Slack-shaped answers of the mock vendor: enough for PyGithub and slack_sdk to
make a call and read a rate limit as their vendor words it.

    GET  /users/{login}            GitHub: the user (``login``, ``id``, ``name`` "The Mock")
    GET  /rate_limit               GitHub: the rate-limit resource
    GET|POST /api/{method}         Slack: ``{"ok": true, ...}`` for any Web API method (a name
                                   with a dot: ``api.test``, ``auth.test``, ``chat.postMessage``)

The request quota's refusal is each vendor's own: GitHub's 403 "API rate limit exceeded"
(``X-RateLimit-Remaining: 0``, ``Retry-After``), Slack's 429 ``{"ok": false, "error":
"ratelimited"}`` with ``Retry-After``. No token is checked. GitHub's answers carry its
``X-RateLimit-*`` headers; Slack tells no quota in headers.
"""

from __future__ import annotations

import re
import time
from typing import Final

from aiohttp import web

from proxy.devtools.mockvendor_shapes import json_answer, made_up_id
from proxy.devtools.mockvendor_tokens import Reservation

__all__ = ["GitHubShape", "SlackShape"]

_GITHUB_DOCS: Final = "https://docs.github.com/rest/overview/resources-in-the-rest-api#rate-limiting"
_USER: Final = re.compile(r"/users/([A-Za-z0-9-]{1,39})")
_SLACK_METHOD: Final = re.compile(r"/api/([a-zA-Z]+\.[a-zA-Z.]+)")


class GitHubShape:
    """GitHub's REST API, as far as the mock imitates it (see the module docstring)."""

    name = "github"
    quota_headers = "x-ratelimit"
    meter = None

    def owns(self, path: str) -> bool:
        return path == "/rate_limit" or _USER.fullmatch(path) is not None

    def reset(self) -> None:
        return None

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        await request.read()
        if request.method != "GET":
            return json_answer(404, {"message": "Not Found", "documentation_url": _GITHUB_DOCS}, headers)
        if request.path == "/rate_limit":
            core = {"limit": 5000, "remaining": 5000, "reset": int(time.time()) + 3600, "used": 0}
            return json_answer(200, {"resources": {"core": core}, "rate": core}, headers)
        login = request.path.rsplit("/", 1)[1]
        user = {
            "login": login,
            "id": 1,
            "type": "User",
            "name": "The Mock",
            "url": f"https://api.github.com/users/{login}",
        }
        return json_answer(200, user, headers)

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        body = {"message": "API rate limit exceeded for mock.", "documentation_url": _GITHUB_DOCS}
        return json_answer(403, body, {**headers, "X-RateLimit-Remaining": "0", "Retry-After": str(retry_after)})


class SlackShape:
    """Slack's Web API, as far as the mock imitates it (see the module docstring)."""

    name = "slack"
    quota_headers = "none"
    meter = None

    def owns(self, path: str) -> bool:
        return _SLACK_METHOD.fullmatch(path) is not None

    def reset(self) -> None:
        return None

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        await request.read()
        method = request.path.removeprefix("/api/")
        body: dict[str, object] = {"ok": True}
        if method == "auth.test":
            body |= {"url": "https://mock.slack.com/", "team": "mock", "user": "mock-bot", "user_id": "U0MOCK"}
        elif method == "chat.postMessage":
            body |= {"channel": "C0MOCK", "ts": f"{time.time():.6f}", "message": {"type": "message", "text": ""}}
        elif method != "api.test":
            body |= {"warning": "the mock answers every method alike", "id": made_up_id("M", 8)}
        return json_answer(200, body, headers)

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        return json_answer(429, {"ok": False, "error": "ratelimited"}, {**headers, "Retry-After": str(retry_after)})
