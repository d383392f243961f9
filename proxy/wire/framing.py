"""The one reading of a message's framing (RFC 9112 §6), which every request path asks.

A request: its ``Host`` fields, ``Content-Length`` and every ``Transfer-Encoding`` field,
taken together, decide whether it has a body and how that body is framed, and whether its
connection may carry another request (``request_framing``). llhttp has already refused
what it can see on its own (a malformed or duplicate ``Content-Length``, both fields
together, a bad chunk), but it reads each ``Transfer-Encoding`` field apart, and it
skips the body of a request that asks for an ``Upgrade``: deciding from its reading would
let one field's coding hide behind another's, or a body be read as the next request.

A vendor answer: its codings are relayed to the worker, never dropped silently
(``answer_codings``); a 1xx, 204 or 304 goes out with no framing field at all
(``NO_BODY_STATUS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

NONE, LENGTH, CHUNKED = 0, 1, 2
"""How a request body is framed: none, by its ``Content-Length``, chunked."""

NO_BODY_STATUS: Final = frozenset({204, 304})
"""Final statuses whose answer ends with its head (RFC 9112 §6.3), like every 1xx: the
worker is sent no ``Content-Length`` or ``Transfer-Encoding`` with them (RFC 9110 §8.6
forbids the first on a 204; on a 304 it only describes another answer, and a client that
takes it for this one's would read the next answer's bytes as a body)."""


class FramingError(ValueError):
    """A request whose framing cannot be trusted: answered 400, then the connection closed."""


class RequestFraming(NamedTuple):
    body: int
    """``NONE``, ``LENGTH`` or ``CHUNKED``."""
    length: int
    """The body's bytes when framed by its length (0 for none); -1 when chunked."""
    keep_alive: bool
    """Whether the connection may carry another request after this one's answer."""


def codings(values: Iterable[bytes]) -> list[bytes]:
    """The transfer codings ``Transfer-Encoding`` fields list, in order: all the fields'
    comma-separated members as one list (RFC 9110 §5.3), lower case, empty members
    dropped (RFC 9110 §5.6.1)."""
    return [member for value in values for m in value.split(b",") if (member := m.strip(b" \t").lower())]


def request_framing(
    version: str,
    method: str,
    *,
    hosts: int,
    lengths: list[bytes],
    transfers: list[bytes],
    keep_alive: bool,
) -> RequestFraming:
    """How a request's body is framed and whether its connection goes on, from the values of
    its ``Content-Length`` fields (``lengths``) and ``Transfer-Encoding`` fields
    (``transfers``), the number of its ``Host`` fields, and ``keep_alive`` as the
    connection options and the version say (llhttp's ``should_keep_alive``). Raises
    FramingError for a request that must be refused with 400 (RFC 9112 §3.2, §6.1, §6.3):

    - more than one ``Host`` field;
    - ``Transfer-Encoding`` with ``Content-Length``;
    - any transfer coding but a single ``chunked``: a request's ``chunked`` must be its
      final coding, and a coding before it is one the proxy would have to undo or pass on
      to a vendor that may not know it, so it is refused rather than framed by guesswork;
    - a ``Content-Length`` that is not one decimal number.

    An HTTP/1.0 request with ``Transfer-Encoding`` is served, its connection closed after
    the answer (RFC 9112 §6.1: its framing is treated as faulty); CONNECT never keeps it."""
    if hosts > 1:
        raise FramingError("more than one Host field")
    keep = keep_alive and method != "CONNECT"
    if transfers:
        if lengths:
            raise FramingError("both Content-Length and Transfer-Encoding")
        listed = codings(transfers)
        if listed != [b"chunked"]:
            said = ", ".join(c.decode("latin-1") for c in listed) or "(no coding)"
            if b"chunked" not in listed:
                why = "chunked is not among them"
            elif listed[-1] != b"chunked":
                why = "chunked is not the final coding"
            elif listed.count(b"chunked") > 1:
                why = "chunked is applied more than once"
            else:
                why = "the proxy applies no coding but chunked"
            raise FramingError(f"Transfer-Encoding {said}: {why}")
        return RequestFraming(CHUNKED, -1, keep and version != "1.0")
    if lengths:
        if len(lengths) > 1:
            raise FramingError("more than one Content-Length field")
        value = lengths[0].strip(b" \t")
        if not value.isdigit():
            raise FramingError(f"Content-Length {value.decode('latin-1')!r} is not a number")
        length = int(value)
        return RequestFraming(LENGTH if length else NONE, length, keep)
    return RequestFraming(NONE, 0, keep)


class AnswerCodings(NamedTuple):
    """What the worker is told of a vendor answer's transfer codings (``answer_codings``)."""

    before_chunked: bytes
    """The codings the vendor applied before ``chunked`` (``b"gzip"``): the body llhttp
    gives is de-chunked but still coded so, and the worker is sent it chunked again under
    ``Transfer-Encoding: <these>, chunked``. Empty: none."""
    to_close: bytes
    """The codings of an answer whose last one is not ``chunked``: its body runs to the
    connection's close, and goes to the worker as it came, under the same
    ``Transfer-Encoding`` and ending at the close too. Empty: none."""


NO_CODINGS: Final = AnswerCodings(b"", b"")


def answer_codings(values: Iterable[bytes]) -> AnswerCodings:
    """A vendor answer's ``Transfer-Encoding`` field values, as the worker must be told of
    them: a coding the proxy does not undo is never dropped silently."""
    listed = codings(values)
    if not listed or listed == [b"chunked"]:
        return NO_CODINGS
    if listed[-1] == b"chunked":
        return AnswerCodings(b", ".join(listed[:-1]), b"")
    return AnswerCodings(b"", b", ".join(listed))
