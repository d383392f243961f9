"""rediss://: the store over TLS, on a real redis-server with a TLS port."""

from __future__ import annotations

import asyncio
import gc
import shutil
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import trustme

from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec, StoreUnavailable
from tests.conftest import free_port


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is missing; refusing to skip")
    work = tmp_path_factory.mktemp("rediss")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(work / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(work / "cert.pem"))
    cert.private_key_pem.write_to_path(str(work / "key.pem"))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(work),
            "--tls-cert-file",
            str(work / "cert.pem"),
            "--tls-key-file",
            str(work / "key.pem"),
            "--tls-ca-cert-file",
            str(work / "ca.pem"),
            "--tls-auth-clients",
            "no",
            "--logfile",
            str(work / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=port, ssl=True, ssl_ca_certs=str(work / "ca.pem"), socket_timeout=0.5) as c:
                    c.ping()
                break
            except redis.RedisError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server with TLS did not start: {(work / 'redis.log').read_text()}")
                time.sleep(0.05)
        yield port, work / "ca.pem"
    finally:
        proc.kill()
        proc.wait()


BUCKETS = (BucketSpec("t:{v}:g:1", 0.001, 2, "global", "g"),)


async def test_acquire_and_feedback_over_tls(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    store = RedisStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", timeout=1.0)
    try:
        grants = [(await store.acquire(BUCKETS, 1, 0)).granted for _ in range(3)]  # the pipelined path
        assert grants == [True, True, False]
        assert (await store.peek(BUCKETS))[0] == pytest.approx(0, abs=0.01)  # the redis-py path
        assert (await store.block(BUCKETS, 1.0, "")).until == pytest.approx(1.0, abs=0.01)
    finally:
        await store.close()


async def test_an_unknown_server_certificate_is_refused(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    store = RedisStore(f"rediss://127.0.0.1:{port}/0", timeout=1.0)  # the system CAs only
    try:
        with pytest.raises(StoreUnavailable):
            await store.acquire(BUCKETS, 1, 0)
        with pytest.raises(StoreUnavailable):
            await store.ping()
    finally:
        await store.close()


def test_a_store_closed_as_its_loop_ends_leaves_no_socket_open(tls_redis: tuple[int, Path]) -> None:
    """Over TLS, closing the pipelined connection started a close_notify exchange that needed
    more turns of the loop: a store closed just before its loop ended (a test's, a shutdown's)
    left the socket open, a ResourceWarning ("unclosed transport") when collected, which failed
    a later test at random."""
    port, ca = tls_redis

    async def use_and_close() -> None:
        store = RedisStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", timeout=1.0)
        assert (await store.acquire((BucketSpec("t:{v}:g:closing", 1000, 10, "global", "g"),), 1, 0)).granted
        await store.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(use_and_close())
        finally:
            loop.close()
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
