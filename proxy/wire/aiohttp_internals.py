"""Every aiohttp detail the project relies on beyond its documented API, in one place.

The proxy's data plane no longer runs on aiohttp (proxy/wire/): what is left here
serves the mock vendor (devtools/mockvendor.py), which is an aiohttp application. Each
entry says why it is used and what breaks if an aiohttp upgrade removes or changes it;
tests/test_aiohttp_internals.py exercises each, so such an upgrade fails loudly there
rather than subtly elsewhere. Written against aiohttp 3.14.
"""

from __future__ import annotations

from aiohttp import web

# -- an interim 100 Continue: StreamWriter.output_size ---------------------------------------------
#
# Why: aiohttp's low-level server has no public way to answer ``Expect: 100-continue`` once
# the body is really wanted (web.Application's ``expect_handler`` needs its router), so the
# line goes to the request's writer. aiohttp's own error handling (RequestHandler.handle_error)
# asks whether an answer has begun from ``output_size``: the interim line is taken back out
# of it, or a failure after it could no longer be answered 500.
# Upgrade: if output_size goes away, send_continue fails every upload that waits for 100 Continue.


async def send_continue(request: web.BaseRequest) -> None:
    """Write an interim ``100 Continue`` ahead of the answer."""
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0
