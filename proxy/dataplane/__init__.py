"""The data plane: HTTP/1.1 on asyncio protocols with llhttp (httptools) parsing.

    http1.py     the worker-facing server: one protocol per connection (plain HTTP, and
                 the HTTP inside an intercepted CONNECT), requests served in order
    upstream.py  the vendor-facing client: a pool of keep-alive connections per vendor

The request path (handler.py) runs on their types: ``http1.Request`` in, ``http1.Responder``
out, ``upstream.Response`` from the vendor (forward.py in between). aiohttp serves the admin
port and the dev tools only; it is off the request path for its cost per request (issue 11).
"""
