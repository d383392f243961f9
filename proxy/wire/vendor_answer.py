"""The vendor's answer as it is read (``Response``): its status and fields from its head, its
body piece by piece with flow control (inbox.py), from the connection that parses it (upstream.py)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.wire.inbox import Inbox


class Connection(Protocol):
    """What an answer needs of the connection it is read from (upstream.py's
    ``UpstreamConnection``), named here: upstream.py imports this module, not the reverse."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def awaiting(self) -> None: ...

    def finished(self, response: Response) -> None: ...

    def close(self) -> None: ...


class Response(Inbox):
    """The vendor's answer: status and fields once in, the body as it arrives."""

    __slots__ = ("_conn", "_fields", "_headers", "_low", "_raw", "block", "reason", "status")

    def __init__(self, conn: Connection, status: int, reason: str, block: bytes) -> None:
        super().__init__()
        self._conn = conn
        self.status = status
        self.reason = reason
        self.block = block
        """The answer's fields as the vendor sent them: its head's lines after the status
        line, each with its CRLF (b"" for none). llhttp has checked them (CRLF line ends,
        no folding, no space before a colon, no control characters), so a line splits into
        its field at its first colon. The usual answer is relayed from these bytes (the
        kept lines as they came), never split into fields (headers.answer_lines)."""
        self._raw: list[tuple[bytes, bytes]] | None = None
        self._fields: list[tuple[str, str]] | None = None
        self._headers: CIMultiDictProxy[str] | None = None
        self._low: bytes | None = None  # (first: the block lowered, after a CRLF)

    @property
    def raw(self) -> list[tuple[bytes, bytes]]:
        """The fields, in their order, as llhttp reads them (name, and the value without its
        leading whitespace), made from ``block`` when first asked for."""
        raw = self._raw
        if raw is None:
            raw = self._raw = [
                (name, value.lstrip(b" \t"))
                for name, _, value in (line.partition(b":") for line in self.block.split(b"\r\n")[:-1])
            ]
        return raw

    def first(self, name: bytes) -> str | None:
        """The first field named ``name`` (lower case), decoded (latin-1), as a lookup in
        ``headers`` finds it, found in ``block`` without splitting it into fields."""
        block = self.block
        # As headers.answer_lines finds a line: at offset p of ``low`` is the CRLF before the
        # line at p of the block (llhttp has checked the lines: no space before a colon).
        low = self._low
        if low is None:
            low = self._low = b"\r\n" + block.lower()
        at = low.find(b"\r\n" + name + b":")
        if at < 0:
            return None
        return block[at + len(name) + 1 : block.find(b"\r\n", at)].lstrip(b" \t").decode("latin-1")

    @property
    def transfer_codings(self) -> list[bytes]:
        """The values of the answer's ``Transfer-Encoding`` fields (framing.py reads them)."""
        return [value for name, value in self.raw if name.lower() == b"transfer-encoding"]

    @property
    def fields(self) -> list[tuple[str, str]]:
        """``raw`` decoded (latin-1), made when first asked for."""
        fields = self._fields
        if fields is None:
            fields = self._fields = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in self.raw]
        return fields

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The fields by name, made when first asked for: the usual answer never asks."""
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDictProxy(CIMultiDict(self.fields))
        return headers

    @property
    def done(self) -> bool:
        return self._done and not self._chunks

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    def _pause(self) -> None:
        self._conn.pause_reading()

    def _resume(self) -> None:
        self._conn.resume_reading()

    def _waiting(self) -> None:
        self._conn.awaiting()  # the connection's read timer fails the read when the vendor goes silent

    def whole(self, limit: int) -> bytes | None:
        """The rest of the body at once when it is all in (and at most ``limit`` bytes), else
        None: a small answer is relayed in one write, without a read per piece."""
        if not self._done or self._exc is not None or self._size > limit:
            return None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._drop_unread()
        return data

    def whole_exactly(self, length: int) -> bytes | None:
        """The body at once when it is all in and exactly ``length`` bytes, else None (and
        nothing taken: the answer can still be read piece by piece)."""
        if not self._done or self._exc is not None or self._size != length:
            return None
        chunks = self._chunks
        if len(chunks) == 1:
            data = chunks[0]
        elif chunks:
            data = b"".join(chunks)
        else:
            return b""
        self._drop_unread()
        return data

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if it can be reused."""
        self._conn.finished(self)

    def close(self) -> None:
        """Done with the answer before its end: the connection is closed, never reused."""
        self._conn.close()
