"""A drain does not wait on an intercepted connection whose worker keeps it pooled.

A pooled keep-alive client does not read its idle socket, so it never answers the proxy's
close_notify: asyncio waits 30 s for it by default, and a SIGTERM drain (or a test's
teardown) waited out ``drain_timeout`` for each such worker."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest

from proxy.tls import intercept
from tests.helpers.sdks import HOSTS


def pooled_idle_connection(proxy_port: int, ca_file: str, host: str) -> socket.socket:
    """CONNECT, TLS, one request and its whole answer; then the socket left open and unread,
    as a pool keeps it."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += raw.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    tls = ssl.create_default_context(cafile=ca_file).wrap_socket(raw, server_hostname=host)
    tls.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += tls.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(
        next(v for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:]) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += tls.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    return tls


async def test_a_drain_closes_an_idle_pooled_tls_connection_without_waiting_out_drain_timeout(
    sdk_proxies, monkeypatch: pytest.MonkeyPatch
):
    assert intercept._SHUTDOWN_TIMEOUT <= 5.0
    monkeypatch.setattr(intercept, "_SHUTDOWN_TIMEOUT", 1.0)  # the bound, shortened for the test
    proxy = await sdk_proxies.start()
    port = int(proxy.url.rsplit(":", 1)[1])
    conn = await asyncio.to_thread(pooled_idle_connection, port, str(sdk_proxies.trust.bundle), HOSTS["openai"])
    try:
        assert proxy.runtime.policy.drain_timeout >= 10
        started = time.monotonic()
        await proxy.stop()
        took = time.monotonic() - started
    finally:
        conn.close()
    assert took < 4.0, took  # the close_notify wait is bounded, well inside drain_timeout
