"""Request framing, both ways, on both request paths: the corpus in corpus.yaml.

Every case runs twice against one policy, once as it comes (the straight path, lane.py,
takes what it can) and once with the straight path switched off (the general path serves
every request), and both runs must give what the case says: the answers the worker
reads, whether the connection is closed after them, and every request the vendor got.

The worker's side reads answers as a naive client does (trusting a ``Content-Length``
whatever the status), so a framing field that contradicts the status shows as the next
answer going wrong; the vendor reads requests by their framing and records each. Both are
written by hand, not with llhttp, which would test the parser against itself.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from multidict import CIMultiDict

from proxy.pipeline.lane import Lane
from proxy.wire.request import Request
from tests.conftest import vendor_policy

WAIT = 10.0
HOST = "api.payments.example"
CORPUS = yaml.safe_load((Path(__file__).parent / "corpus.yaml").read_text())


def _general_only(self: Lane, conn: Any, request: Request) -> None:
    return None  # no flight: the general path serves every request


@pytest.fixture(params=["straight", "general"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "general":
        monkeypatch.setattr(Lane, "flight", _general_only)
    return str(request.param)


# -- the vendor: records every request, echoes it or sends a case's answer ------------------


async def _head(reader: asyncio.StreamReader) -> tuple[str, CIMultiDict[str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    fields: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields.add(name, value.strip())
    return lines[0], fields


def _codings(fields: CIMultiDict[str]) -> list[str]:
    return [c.strip().lower() for v in fields.getall("Transfer-Encoding", []) for c in v.split(",") if c.strip()]


async def _dechunk(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailer fields
            return bytes(out)
        out += await reader.readexactly(size)
        assert await reader.readexactly(2) == b"\r\n", "a chunk longer than its size"


@dataclass
class Vendor:
    url: str = ""
    got: list[str] = field(default_factory=list)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                start, fields = await _head(reader)
                method, target, _ = start.split(" ", 2)
                if _codings(fields)[-1:] == ["chunked"]:
                    body = await _dechunk(reader)
                else:
                    body = await reader.readexactly(int(fields.get("Content-Length", "0")))
                self.got.append(f"{method} {target} {repr(body)[2:-1]}")
                case = self.answers.get(target)
                if case is None:
                    echo = f"{method} {target} {len(body)}".encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(echo), echo))
                else:
                    writer.write(case["vendor_sends"].encode("latin-1"))
                await writer.drain()
                if case is not None and case.get("vendor_closes"):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def vendor() -> AsyncIterator[Vendor]:
    v = Vendor()
    server = await asyncio.start_server(v.serve, "127.0.0.1", 0)
    v.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield v
    server.close()
    await server.wait_closed()


# -- the worker: a naive reader -------------------------------------------------------------


@dataclass
class Answer:
    status: int
    fields: CIMultiDict[str]
    body: bytes

    def said(self) -> str:
        """ "STATUS", or "STATUS echo" for the vendor's echo."""
        return f"{self.status} {self.body.decode('latin-1')}" if self.status == 200 and self.body else str(self.status)


async def _answer(reader: asyncio.StreamReader, *, head: bool = False) -> Answer:
    start, fields = await _head(reader)
    status = int(start.split(" ")[1])
    while 100 <= status < 200 and status != 101:  # an interim answer (100 Continue): the final one follows
        start, fields = await _head(reader)
        status = int(start.split(" ")[1])
    if head:
        body = b""
    elif "Content-Length" in fields:  # trusted whatever the status, as a naive client does
        body = await reader.readexactly(int(fields["Content-Length"]))
    elif _codings(fields)[-1:] == ["chunked"]:
        body = await _dechunk(reader)
    elif status in (204, 304) or status < 200:
        body = b""
    else:
        body = await reader.read()
    return Answer(status, fields, body)


def _probe(version: str) -> bytes:
    keep = "Connection: keep-alive\r\n" if version == "1.0" else ""
    return f"GET http://{HOST}/probe HTTP/{version}\r\nHost: {HOST}\r\n{keep}\r\n".encode()


def _pieces(data: bytes, split: int | None) -> Iterator[bytes]:
    if split is None:
        yield data
    else:
        yield from (data[i : i + split] for i in range(0, len(data), split))


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), WAIT) == b""
    except ConnectionResetError:
        return True


def _check_fields(answer: Answer, expected: dict[str, str | None], where: str) -> None:
    for name, want in expected.items():
        got = ", ".join(answer.fields.getall(name, [])) or None
        if want is not None and got is not None and name.lower() in ("connection", "transfer-encoding"):
            got = got.lower()
        assert got == want, f"{where}: {name} is {got!r}, not {want!r} ({dict(answer.fields)})"


async def _talk(proxy: Any, pieces: Iterator[bytes]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
    return reader, writer


async def _then(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, closed: bool, version: str) -> None:
    """The connection after a case's answers: closed, or in step (a second probe answered next)."""
    if closed:
        assert await _closed(reader), "the connection should be closed after these answers"
    else:
        writer.write(_probe(version))
        answer = await asyncio.wait_for(_answer(reader), WAIT)
        assert answer.said() == "200 GET /probe 0", f"the connection is out of step: {answer}"


REQUESTS = CORPUS["requests"]
ANSWERS = CORPUS["answers"]


@pytest.mark.parametrize("case", REQUESTS, ids=[c["name"] for c in REQUESTS])
async def test_requests(case: dict[str, Any], path: str, vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 100000, per: 1s}]"))
    data = case["send"].encode("latin-1")
    version = case.get("probe_version", "1.0" if b" HTTP/1.0\r\n" in data[:200] else "1.1")
    if case.get("probe", True):
        data += _probe(version)
    reader, writer = await _talk(proxy, _pieces(data, case.get("split")))
    try:
        said = []
        for i in range(len(case["answers"])):
            answer = await asyncio.wait_for(_answer(reader), WAIT)
            said.append(answer.said())
            assert said == case["answers"][: i + 1], f"answers so far: {said}, the last {answer}"
            _check_fields(answer, case.get("headers", {}).get(i, {}), f"answer {i}")
        closed = case.get("closed", False)
        await _then(reader, writer, closed, version)
        if "vendor" in case:
            expected = case["vendor"] + ([] if closed else ["GET /probe "])
            assert vendor.got == expected
    finally:
        writer.close()


@pytest.mark.parametrize("case", ANSWERS, ids=[c["name"] for c in ANSWERS])
async def test_answers(case: dict[str, Any], path: str, vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 100000, per: 1s}]"))
    target = f"/answer/{re.sub(r'[^a-z0-9]+', '-', case['name'].lower())}"
    vendor.answers[target] = case
    version = case.get("version", "1.1")
    method = case.get("method", "GET")
    keep = "Connection: keep-alive\r\n" if version == "1.0" else ""
    data = f"{method} http://{HOST}{target} HTTP/{version}\r\nHost: {HOST}\r\n{keep}\r\n".encode()
    reader, writer = await _talk(proxy, iter([data]))
    try:
        if case.get("cut"):
            with pytest.raises((asyncio.IncompleteReadError, ConnectionResetError)):
                await asyncio.wait_for(_answer(reader, head=method == "HEAD"), WAIT)
            return
        answer = await asyncio.wait_for(_answer(reader, head=method == "HEAD"), WAIT)
        assert answer.status == case["status"], answer
        _check_fields(answer, case.get("headers", {}), "the answer")
        if "body" in case:
            assert answer.body == case["body"].encode("latin-1")
        await _then(reader, writer, case.get("closed", False), version)
    finally:
        writer.close()


CONNECTS = CORPUS["connects"]


@pytest.mark.parametrize("case", CONNECTS, ids=[c["name"] for c in CONNECTS])
async def test_connects(case: dict[str, Any], vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    reader, writer = await _talk(proxy, iter([case["send"].encode("latin-1")]))
    try:
        answer = await asyncio.wait_for(_answer(reader), WAIT)
        assert answer.status == case["status"], answer
        assert await _closed(reader)
        assert vendor.got == []
    finally:
        writer.close()
