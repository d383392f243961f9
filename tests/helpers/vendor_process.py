"""A mock vendor in a process of its own (``quota-proxy mock-vendor``), for the tests that
read its arrival times: one in the test's own event loop stamps an arrival when that loop
gets round to reading it, behind the workers' and the proxy's work (tens of ms at a cold
start on a loaded machine), which no proxy can see and a strict window or a rate measured
over 0.8 s counts against it. Its process's loop has nothing else to do."""

from __future__ import annotations

import bisect
import re
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers.cli import ROOT, cli, server_process


@dataclass
class VendorProcess:
    url: str
    ca_file: Path | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file is not None else True

    async def stats(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/__mock/stats", ssl=self._ssl()) as r:
            assert r.status == 200
            return dict(await r.json())

    async def requests(self) -> list[dict[str, Any]]:
        """What it received: ``[{"method", "path_qs", "headers"}]``, oldest first."""
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/__mock/requests", ssl=self._ssl()) as r:
            assert r.status == 200
            return list(await r.json())

    async def set_limit(self, rate: float) -> None:
        url = f"{self.url}/__mock/limit"
        async with aiohttp.ClientSession() as s, s.post(url, json={"rate": rate}, ssl=self._ssl()) as r:
            assert r.status == 200, await r.text()


def measured_rate(arrivals: list[float], since: float, until: float) -> float:
    """MockVendor.measured_rate over a list of arrivals: ``(n - 1) / (last - first)`` of those
    in ``[since, until]``."""
    lo, hi = bisect.bisect_left(arrivals, since), bisect.bisect_right(arrivals, until)
    n = hi - lo
    if n < 2:
        return 0.0
    span = arrivals[hi - 1] - arrivals[lo]
    return (n - 1) / span if span > 0 else float("inf")


@contextmanager
def vendor_process(
    tmp_path: Path,
    *args: str,
    tls: tuple[Path, Path, Path] | None = None,
    ca_dir: Path | None = None,
    cwd: Path | None = None,
) -> Iterator[VendorProcess]:
    """``quota-proxy mock-vendor ARGS`` on a free port (run from ``cwd``); ``tls``: (certificate,
    key, the CA that signed it) to serve HTTPS; ``ca_dir``: ``--tls ca_dir`` (relative to ``cwd``)."""
    argv = cli("mock-vendor", "--listen", "127.0.0.1:0", *args)
    ca_file = None if tls is None else tls[2]
    if tls is not None:
        argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    if ca_dir is not None:
        argv += ["--tls", str(ca_dir)]
        ca_file = (cwd or ROOT) / ca_dir / "ca.pem"
    with server_process(argv, tmp_path, name="mock-vendor", cwd=cwd or ROOT) as vendor:
        line = vendor.readline()
        match = re.match(r"mock-vendor listening on (https?://127\.0\.0\.1:\d+) ", line)
        assert match, line
        yield VendorProcess(match[1], ca_file)
        assert vendor.terminate_and_wait() == 0
