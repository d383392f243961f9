"""One request head as a worker sent it, and its body: what the request path reads."""

from __future__ import annotations

from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.wire.body import Body, BodySource
from proxy.wire.framing import NONE, RequestFraming


class WorkerConnection(BodySource, Protocol):
    """The worker's connection, as a request made on it sees it (http1.Http1Connection)."""

    kept_slots: dict[str, str] | None
    answered_at: float | None


class Request:
    """One request head as the worker sent it, and its body.

    Made from the parser's pieces (``parsed``) without decoding them: the fields stay the
    bytes they came as (``raw``), decoded to ``fields`` and looked up by name (``headers``)
    only when something asks, and a request without a body gets its (ended) ``body`` only
    if something reads it. What the straight path (lane.py) needs of the usual request was
    noted while its head was parsed (``lean`` and what follows it)."""

    __slots__ = (
        "_body",
        "_conn",
        "_fields",
        "_headers",
        "has_body",
        "host",
        "keep_alive",
        "kinds",
        "lean",
        "length",
        "lines",
        "max_hold",
        "method",
        "on_limit",
        "priority",
        "raw",
        "raw_path",
        "tag",
        "target",
        "tenant",
        "url",
        "version",
    )

    def __init__(
        self,
        method: str,
        target: str,
        version: str,
        headers: CIMultiDictProxy[str],
        body: Body,
        keep_alive: bool,
        has_body: bool,
        tag: object = None,
        fields: list[tuple[str, str]] | None = None,
        length: int = 0,
    ) -> None:
        self.method = method
        self.target = self.raw_path = target
        """The request target byte for byte (latin-1): absolute form, a path, an authority
        (``raw_path`` too, as aiohttp's requests name it)."""
        self.url = target.encode("latin-1")
        """The same, as the bytes it came as."""
        self.version = version
        """``"1.1"`` or ``"1.0"``."""
        self._headers: CIMultiDictProxy[str] | None = headers
        self._fields: list[tuple[str, str]] | None = list(headers.items()) if fields is None else fields
        self.raw: list[tuple[bytes, bytes]] = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in self._fields]
        """The fields as the worker sent them, in their order, as bytes."""
        self._body: Body | None = body
        self._conn: WorkerConnection | None = None
        self.keep_alive = keep_alive
        self.has_body = has_body
        """The head announced a body (a Content-Length above 0, or chunked)."""
        self.length = length
        """The body's bytes by its ``Content-Length`` (0: none), or -1: chunked (framing.py)."""
        self.tag = tag
        """What the connection was tagged with (an interception: where its tunnel leads)."""
        self.lean = False
        """Nothing in the head needs the general request path (lane.py): no chunked body,
        no ``Expect``, no other hop's ``Connection`` options, no ``X-Quota-*`` but the
        worker's wish (``on_limit``, ``max_hold``, ``priority``)."""
        self.kinds: dict[bytes, int] | None = None
        """The field classifier the head was read with (headers.request_kinds)."""
        self.host: bytes | None = None
        """The first ``Host`` field's value."""
        self.tenant: bytes | None = None
        """The first tenant header field's value (the classifier's tenant header)."""
        self.lines = b""
        """The ``PLAIN`` fields as ``Name: value\r\n`` lines: what a vendor is sent of them."""
        self.on_limit: bytes | None = None
        """The first ``X-Quota-On-Limit`` field's value (a ``lean`` request's)."""
        self.max_hold: bytes | None = None
        """The first ``X-Quota-Max-Hold`` field's value (a ``lean`` request's)."""
        self.priority: bytes | None = None
        """The first ``X-Quota-Priority`` field's value (a ``lean`` request's)."""

    @property
    def fields(self) -> list[tuple[str, str]]:
        """The fields as the worker sent them, in their order (what ``headers`` holds)."""
        fields = self._fields
        if fields is None:
            fields = self._fields = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw]
        return fields

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The fields by name, made when first asked for."""
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDictProxy(CIMultiDict(self.fields))
        return headers

    def raw_field(self, name: bytes) -> bytes | None:
        """The first field named ``name`` (lower case), as a lookup in ``headers`` finds it,
        as the bytes it came as, without making ``headers``."""
        size = len(name)
        for field, value in self.raw:
            if len(field) == size and field.lower() == name:
                return value
        return None

    def first(self, name: bytes) -> str | None:
        """``raw_field``, decoded (latin-1)."""
        value = self.raw_field(name)
        return None if value is None else value.decode("latin-1")

    def body_in_hand(self) -> bytes | None:
        """The whole body when it has all come and none of it was read (a lean request's
        small one: the straight path's), b"" when none was announced; else None."""
        body = self._body
        if body is None:
            return b""
        return body.in_hand()

    @property
    def body(self) -> Body:
        body = self._body
        if body is None:  # none was announced: an ended body, made when first asked for
            assert self._conn is not None
            body = self._body = Body(self._conn, False)
            body._done = True
        return body

    @property
    def body_broken(self) -> BaseException | None:
        """Why the body broke off, if it did (a request without one: never)."""
        body = self._body
        return None if body is None else body._exc

    @property
    def kept_slots(self) -> dict[str, str] | None:
        """What the request path keeps for the worker's connection between its requests
        (the slots kept for its deferred calls: handler.admit); None without a connection."""
        conn = self._conn
        if conn is None:
            return None
        kept = conn.kept_slots
        if kept is None:
            kept = conn.kept_slots = {}
        return kept

    @property
    def follows(self) -> float | None:
        """Seconds since the previous answer on this connection was written (None: the
        connection's first request): a worker's next call comes right after its answer,
        a retry after a wait."""
        conn = self._conn
        if conn is None or conn.answered_at is None:
            return None
        return conn.loop.time() - conn.answered_at

    @property
    def chunk_pending(self) -> bool:
        """The chunked body has not all come (or broke off)."""
        body = self._body
        return self.length < 0 and body is not None and (not body._done or body._exc is not None)

    @property
    def waits_to_send(self) -> bool:
        """The worker waits for ``100 Continue`` before sending its body, not sent yet."""
        body = self._body
        return body is not None and body._continue


_new_request = object.__new__


def parsed_request(
    conn: WorkerConnection,
    method: str,
    url: bytes,
    version: str,
    raw: list[tuple[bytes, bytes]],
    framing: RequestFraming,
    expect_continue: bool,
    tag: object,
) -> Request:
    """A request from the parser's pieces, made without ``Request.__init__``'s decoding."""
    has_body = framing.body != NONE
    req: Request = _new_request(Request)
    req.method = method
    req.target = req.raw_path = url.decode("latin-1")
    req.url = url
    req.version = version
    req._headers = None
    req._fields = None
    req.raw = raw
    req._body = Body(conn, expect_continue) if has_body else None
    req._conn = conn
    req.keep_alive = framing.keep_alive
    req.has_body = has_body
    req.length = framing.length
    req.tag = tag
    req.lean = False
    req.kinds = None
    req.host = req.tenant = req.on_limit = req.max_hold = req.priority = None
    req.lines = b""
    return req
