#!/usr/bin/env python3
"""A minimal aiohttp forward proxy: the floor the product is compared with in throughput.py.

No limiter, no metrics, no access log, no header hygiene beyond hop-by-hop: an
absolute-form request is sent to ``--upstream`` over one pooled keep-alive
ClientSession and the answer streamed back, the same way proxy/pipeline/forward.py does.
Not part of the product. Prints ``minimal-proxy listening on http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiohttp
from aiohttp import web

_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "proxy-authorization",
        "proxy-authenticate",
    }
)


async def serve(listen_host: str, listen_port: int, upstream: str) -> int:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        raw = request.raw_path
        path = "/" + raw.split("://", 1)[1].split("/", 1)[1] if "://" in raw else raw
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session.request(
            request.method,
            upstream + path,
            headers=headers,
            data=request.content if request.body_exists else None,
            allow_redirects=False,
        ) as up:
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            resp.headers.extend((k, v) for k, v in up.headers.items() if k.lower() not in _HOP)
            if up.content_length is None:
                resp.enable_chunked_encoding()
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    runner = web.ServerRunner(web.Server(handle, access_log=None), handle_signals=False, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, listen_host, listen_port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    print(f"minimal-proxy listening on http://{listen_host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await session.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/_minimal_proxy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument("--upstream", required=True, help="http://127.0.0.1:PORT of the vendor")
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    try:
        import uvloop

        return uvloop.run(serve(host, int(port), args.upstream.rstrip("/")))
    except ImportError:  # pragma: no cover
        return asyncio.run(serve(host, int(port), args.upstream.rstrip("/")))


if __name__ == "__main__":
    sys.exit(main())
