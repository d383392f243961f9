"""Server-sent events found in a ``text/event-stream`` answer as it is relayed, chunk by chunk.

The wire only finds the events; what an event means (a vendor's usage) is quota work
(``quota/usage.py``). Parsing follows the WHATWG EventSource rules: a line ends with CRLF, LF
or CR; a line starting with ``:`` is a comment; ``field: value`` loses one space after the
colon; ``data`` lines join with ``\\n``; an empty line dispatches the event, named ``message``
when no ``event`` field named it, and an event without data is not dispatched. A UTF-8 BOM at
the very start is dropped; bytes that are not UTF-8 become U+FFFD, as a browser reads them.

Chunks may split anywhere (mid-line, between CR and LF, inside a UTF-8 sequence): lines are
cut on bytes (CR and LF never occur inside a UTF-8 sequence) and decoded whole, so the same
bytes give the same events however they are cut. Memory is bounded: a line, or an event's
data, longer than ``limit`` is discarded and counted, never held; an event that lost a line
(but a comment) is discarded too, so no event is ever handed over with a piece missing. Nothing here raises
on any bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_LIMIT", "Event", "EventSplitter"]

DEFAULT_LIMIT: Final = 1 << 20
"""Bytes of one line, or characters of one event's data, kept at most (1 MiB)."""

_BOM: Final = b"\xef\xbb\xbf"
_LINE_ENDS: Final = (b"\n", b"\r")


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event."""

    name: str
    """The ``event`` field, or ``message`` when the event did not name itself."""
    data: str
    """The ``data`` lines, joined with ``\\n``."""


class EventSplitter:
    """Feed it a stream's bytes in any chunks; each ``feed`` returns the events they completed.

    An event's ``id`` and ``retry`` fields are read and ignored: nothing reconnects here.
    """

    __slots__ = (
        "_data",
        "_data_size",
        "_discarding",
        "_name",
        "_pending",
        "_skip_lf",
        "_started",
        "_tainted",
        "events_discarded",
        "limit",
        "lines_discarded",
    )

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1 byte, not {limit}")
        self.limit: Final = limit
        self.lines_discarded = 0
        """Lines longer than ``limit``, dropped unread."""
        self.events_discarded = 0
        """Events dropped because a line of theirs was, or their data grew past ``limit``."""
        self._pending = bytearray()  # the line the last chunk left unfinished
        self._discarding = False  # inside a line already too long: skip to its end
        self._skip_lf = False  # the last chunk ended with CR: an LF next is the same line end
        self._started = False  # a first line was seen (the BOM may only open the stream)
        self._name = ""
        self._data: list[str] = []
        self._data_size = 0
        self._tainted = False

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[Event]:
        """The events ``chunk`` completes, in order (often none)."""
        if not isinstance(chunk, bytes):  # a reader's buffer: copied, as the caller may reuse it
            chunk = bytes(chunk)
        if not chunk:
            return []
        if self._skip_lf and chunk[0] == 0x0A:
            chunk = chunk[1:]
        # A CR that ends the chunk ends its line now; an LF opening the next chunk is its pair.
        self._skip_lf = chunk[-1:] == b"\r"
        events: list[Event] = []
        # bytes.splitlines cuts at exactly CRLF, LF and CR: the EventSource line ends.
        for piece in chunk.splitlines(keepends=True):
            if piece[-1:] not in _LINE_ENDS:  # only the last piece can be unfinished
                self._unfinished(piece)
                break
            end = 2 if piece[-2:] == b"\r\n" else 1
            if self._discarding:
                self._discarding = False  # the too-long line ends here; it was counted
                continue
            if self._pending:
                if len(self._pending) + len(piece) - end > self.limit:
                    self._drop_line(self._pending[0])
                    self._pending.clear()
                    continue
                self._pending += piece[:-end]
                line = bytes(self._pending)
                self._pending.clear()
            else:
                if len(piece) - end > self.limit:
                    self._drop_line(piece[0])
                    continue
                line = piece[:-end]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _unfinished(self, piece: bytes) -> None:
        if self._discarding:
            return
        if len(self._pending) + len(piece) > self.limit:
            self._drop_line(self._pending[0] if self._pending else piece[0])
            self._pending.clear()
            self._discarding = True
            return
        self._pending += piece

    def _drop_line(self, first: int) -> None:
        self.lines_discarded += 1
        self._started = True
        if first != 0x3A:  # a comment loses nothing; any other line is a piece of its event
            self._tainted = True

    def _line(self, raw: bytes) -> Event | None:
        if not self._started:
            self._started = True
            if raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
        if not raw:
            return self._dispatch()
        if raw[0] == 0x3A:  # ":" opens a comment
            return None
        line = raw.decode("utf-8", "replace")
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            if self._tainted:
                return None
            self._data_size += len(value) + 1
            if self._data_size > self.limit + 1:  # the last line's "\n" is not the data's
                self._tainted = True
                self._data.clear()
                return None
            self._data.append(value)
        elif field == "event":
            self._name = value
        return None  # "id", "retry" and unknown fields: nothing to keep

    def _dispatch(self) -> Event | None:
        name, data, tainted = self._name, self._data, self._tainted
        self._name, self._data, self._data_size, self._tainted = "", [], 0, False
        if tainted:
            self.events_discarded += 1
            return None
        if not data:
            return None
        return Event(name or "message", "\n".join(data))
