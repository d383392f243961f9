"""A raw HTTP/1.1 peer for the data plane's protocol tests: exact bytes out, answers parsed
by hand (not by llhttp, which would test the parser against itself)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from multidict import CIMultiDict

WAIT = 10.0


@dataclass
class Message:
    start: str
    """The status line or the request line."""
    headers: CIMultiDict[str]
    body: bytes
    trailers: list[str] = field(default_factory=list)

    @property
    def status(self) -> int:
        return int(self.start.split(" ")[1])


async def read_head(reader: asyncio.StreamReader) -> tuple[str, CIMultiDict[str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.add(name.strip(), value.strip())
    return lines[0], headers


async def read_body(
    reader: asyncio.StreamReader, headers: CIMultiDict[str], *, until_eof: bool
) -> tuple[bytes, list[str]]:
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                trailers = []
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    trailers.append(line.decode("latin-1").strip())
                return bytes(out), trailers
            out += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
    if "Content-Length" in headers:
        return await reader.readexactly(int(headers["Content-Length"])), []
    return (await reader.read() if until_eof else b""), []


async def read_response(reader: asyncio.StreamReader, *, head: bool = False) -> Message:
    async def read() -> Message:
        start, headers = await read_head(reader)
        status = int(start.split(" ")[1])
        if head or status in (204, 304) or status < 200:
            return Message(start, headers, b"")
        body, trailers = await read_body(reader, headers, until_eof=True)
        return Message(start, headers, body, trailers)

    return await asyncio.wait_for(read(), WAIT)


async def read_request(reader: asyncio.StreamReader) -> Message:
    start, headers = await read_head(reader)
    body, trailers = await read_body(reader, headers, until_eof=False)
    return Message(start, headers, body, trailers)


def request(
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    *,
    version: str = "1.1",
) -> bytes:
    lines = [f"{method} {target} HTTP/{version}", "Host: example.test"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers or []):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(*parts: bytes, trailers: str = "") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailers.encode() + b"\r\n"


class Peer:
    """One TCP connection: sends exact bytes, reads answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, **kwargs: object) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, **kwargs)  # type: ignore[arg-type]
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def exchange(self, data: bytes, *, head: bool = False) -> Message:
        await self.send(data)
        return await read_response(self.reader, head=head)

    async def closed(self) -> bool:
        """Does the other side close the connection (nothing more comes)?"""
        try:
            return await asyncio.wait_for(self.reader.read(1), WAIT) == b""
        except ConnectionResetError:
            return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


async def until(check: Callable[[], bool], what: str) -> None:
    """Wait for a state the code under test reaches on its own (no event to wait on)."""
    async with asyncio.timeout(WAIT):
        while not check():
            await asyncio.sleep(0.005)
    assert check(), what
