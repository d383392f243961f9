"""``quota-proxy run --workers N``: one port served by N processes (SPEC §11).

The supervisor (this module, the process the command started) binds nothing that serves
requests. It reserves the proxy port, starts N workers (each ``quota-proxy run`` with one
worker), serves the one admin port (workers_admin.py asks the workers and adds up), and:

- SIGTERM / SIGINT: /readyz turns 503, every worker gets SIGTERM and drains as one process
  does (bounded by ``drain_timeout``), then the supervisor exits 0;
- SIGHUP, ``POST /reload``, ``--watch``: the supervisor reads and checks the policy file; a
  bad one is refused there and no worker sees it; a good one becomes the supervisor's copy
  (in its private directory) and every worker reloads from that copy, so all load the same
  text. If one of them fails anyway, the copy goes back and every worker reloads it: the
  workers never stay on different policies. A worker (re)starts from the copy too: one
  restarted while the file holds an edit nobody reloaded runs what the others run;
- a worker that dies is restarted (logged), after a back-off that grows while it keeps
  dying young, so a crash loop does not spin.

Why SO_REUSEPORT (each worker its own listening socket on the one port) rather than one
socket shared by all: with a shared socket every idle worker's epoll wakes on each
connection and the one that accepts first wins, which on Linux piles connections onto
whichever worker happens to be waiting (the last to have gone idle), far from even. With
SO_REUSEPORT the kernel hashes each connection's addresses and ports onto one of the
sockets: an even spread whatever the workers are doing. The cost: connections still in a
dying worker's accept queue are reset. The supervisor keeps one socket bound (never
listening) in the group, so the port stays ours while a worker restarts, and ``listen``
with port 0 becomes one concrete port for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import math
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from proxy.ops.reload import ReloadResult, refused, watch_file
from proxy.policy import ConfigErrors, Policy, mask_password, read_policy_text
from proxy.policy.model import Address
from proxy.tasks import spawn

log = logging.getLogger("quota_proxy.workers")

BACKOFF_FIRST: Final = 0.25
"""Seconds before restarting a worker that died; doubled while workers keep dying young."""
BACKOFF_MAX: Final = 30.0
STABLE_AFTER: Final = 30.0
"""A worker that lived this long died of something new: its restart waits BACKOFF_FIRST again."""
START_TIMEOUT: Final = 60.0
"""Seconds a worker may take to print its ready line."""
_ASK_TIMEOUT: Final = 5.0
"""Seconds the supervisor waits for a worker's admin answer."""
_PR_SET_PDEATHSIG: Final = 1


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), and no more than its cgroup's CPU
    quota allows (a container's CPU limit), at least 1."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU counts
    count = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # cgroup v1, or no cgroup file system: the affinity says it
    return max(1, count)


def next_delay(previous: float, lived: float) -> float:
    """Seconds before restarting a worker that died after ``lived`` seconds, the previous
    restart of its slot having waited ``previous`` (0: none yet)."""
    if previous == 0 or lived >= STABLE_AFTER:
        return BACKOFF_FIRST
    return min(previous * 2, BACKOFF_MAX)


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """How to start worker ``index``: the command line the supervisor was given, with one
    worker, the concrete proxy port, a private admin socket and the policy's copy."""

    argv: Callable[[int, Address, str, str], list[str]]


@dataclass(slots=True)
class Worker:
    """One worker slot: the process now in it, and how it has fared."""

    index: int
    admin_socket: str
    process: asyncio.subprocess.Process | None = None
    session: aiohttp.ClientSession | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = 0.0
    state: str = "starting"
    first_start: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid


class Supervisor:
    """N worker processes on one port, and what the admin port needs to ask them."""

    def __init__(
        self,
        policy: Policy,
        count: int,
        command: WorkerCommand,
        load: Callable[[str], Policy],
        text: str,
    ) -> None:
        self.policy = policy
        self.count = count
        self._command = command
        self._load = load
        self._text = text  # the policy's text, as the workers run it
        self._dir: str | None = None
        self._copy = ""  # where the workers read it: policy.yaml in the private directory
        self.workers = [Worker(i, "") for i in range(count)]
        self.stopping = False
        self.draining = False
        self._stopped = asyncio.Event()
        self.listen = policy.listen
        self._reserved: list[socket.socket] = []
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self.reloads = {"success": 0, "failure": 0}

    # ------------------------------------------------------------------ the port

    def reserve_port(self) -> Address:
        """Bind (never listen on) the proxy address with SO_REUSEPORT: the port is ours,
        port 0 becomes a real one, and the workers join the group. Raises OSError."""
        host, port = self.policy.listen.host, self.policy.listen.port
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], port, *address[2:]))
            except OSError:
                sock.close()
                self.release_port()
                raise
            self._reserved.append(sock)
            port = sock.getsockname()[1]  # the others (IPv4 and IPv6 of a name) take the same
        self.listen = Address(host, port)
        return self.listen

    def release_port(self) -> None:
        for sock in self._reserved:
            sock.close()
        self._reserved.clear()

    # ------------------------------------------------------------------ processes

    async def start(self) -> bool:
        """Start every worker; True once all are ready, False if one failed (stop() then)."""
        try:
            self._dir = tempfile.mkdtemp(prefix="quota-proxy-")  # 0700: only we reach the sockets
            self._copy = os.path.join(self._dir, "policy.yaml")
            _write_whole(self._copy, self._text)
        except OSError as exc:
            log.error("cannot prepare the workers' directory in %s: %s", tempfile.gettempdir(), exc)
            return False
        for worker in self.workers:
            worker.admin_socket = os.path.join(self._dir, f"w{worker.index}.sock")  # AF_UNIX paths: 107 bytes at most
        self._tasks = [spawn(self._keep(w), name=f"worker-{w.index}") for w in self.workers]
        started = await asyncio.gather(*(w.first_start for w in self.workers))
        return all(started)

    def _keep_copy(self) -> None:
        """The policy's copy, written again if a /tmp cleaner took it (weeks on, a worker restarts)."""
        if self._dir is not None and not os.path.exists(self._copy):
            try:
                os.makedirs(self._dir, mode=0o700, exist_ok=True)
                _write_whole(self._copy, self._text)
            except OSError as exc:  # the worker fails to start, says why, and is retried
                log.error("cannot write the workers' copy of the policy %s: %s", self._copy, exc)

    async def _spawn(self, worker: Worker) -> bool:
        """Start the slot's process and wait for its ready line; False if it died first."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(worker.admin_socket)
        self._keep_copy()
        argv = self._command.argv(worker.index, self.listen, worker.admin_socket, self._copy)
        worker.state = "starting"
        worker.process = process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,  # relayed whole lines at a time: see _relay
            preexec_fn=_die_with_parent,
        )
        assert process.stderr is not None
        spawn(_relay(process.stderr, sys.stderr.fileno()), name=f"worker-{worker.index}-stderr")
        worker.started_at = time.monotonic()
        if self.stopping:  # stop() looked before this process existed
            process.send_signal(signal.SIGTERM)
        log.info("worker %d started (pid %d)", worker.index, process.pid)
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        except TimeoutError:
            log.error("worker %d (pid %d) not ready within %.0fs: stopped", worker.index, process.pid, START_TIMEOUT)
            process.kill()
            return False
        if not line:
            return False
        spawn(_relay(process.stdout, sys.stdout.fileno()), name=f"worker-{worker.index}-stdout")
        worker.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=worker.admin_socket),
            timeout=aiohttp.ClientTimeout(total=_ASK_TIMEOUT),
        )
        worker.ready = True
        worker.state = "ready"
        return True

    async def _keep(self, worker: Worker) -> None:
        """Run the slot's worker; restart it when it dies, until the supervisor stops."""
        delay = 0.0
        while True:
            ready = await self._spawn(worker)
            if not worker.first_start.done():
                worker.first_start.set_result(ready)
            process = worker.process
            assert process is not None
            status = await process.wait()
            worker.ready = False
            # Forgotten before it is closed: an admin request gathering the workers' answers
            # meanwhile must not use a closed session (aiohttp raises RuntimeError: a 500).
            session, worker.session = worker.session, None
            if session is not None:
                await session.close()
            if self.stopping or not worker.first_start.result():
                worker.state = "stopped"
                return
            lived = time.monotonic() - worker.started_at
            delay = next_delay(delay, lived)
            worker.restarts += 1
            worker.state = "restarting"
            log.warning(
                "worker %d (pid %d) %s after %.1fs; restarting it in %.2fs (restart %d)",
                worker.index,
                process.pid,
                _exit_text(status),
                lived,
                delay,
                worker.restarts,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)
            if self.stopping:
                worker.state = "stopped"
                return

    async def stop(self) -> None:
        """SIGTERM to every worker, which drains (drain_timeout); SIGKILL to any that
        outlives that by a margin. Returns once all have exited."""
        self.stopping = self.draining = True
        self._stopped.set()
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                worker.process.send_signal(signal.SIGTERM)
        bound = self.policy.drain_timeout + 5.0
        _, pending = await asyncio.wait(self._tasks, timeout=bound) if self._tasks else (set(), set())
        for worker in self.workers:
            if pending and worker.process is not None and worker.process.returncode is None:
                log.error("worker %d (pid %d) running %.0fs after SIGTERM: killed", worker.index, worker.pid, bound)
                worker.process.kill()
        if pending:
            await asyncio.wait(pending)
        self.release_port()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.ready and w.session is not None]

    # ------------------------------------------------------------------ reload

    async def reload(self, reason: str) -> ReloadResult:
        """Read and check the file here first: a bad policy is refused before any worker sees
        it; a good one becomes the copy every running worker reloads from. If a worker fails
        to, the previous copy is put back and every worker reloads that: none is left on
        the new policy while another runs the old."""
        async with self._reload_lock:
            try:
                text = await asyncio.to_thread(read_policy_text, self.policy.source)
                policy = await asyncio.to_thread(self._load, text)
            except ConfigErrors as exc:
                return self._refused(reason, tuple(str(e) for e in exc.errors))
            except (OSError, ValueError) as exc:
                return self._refused(reason, (f"{type(exc).__name__}: {exc}",))
            notes: list[str] = []
            if policy.workers != self.policy.workers:
                notes.append(f"workers: {policy.workers} takes effect on restart; {self.count} keep serving")
            try:
                await asyncio.to_thread(_write_whole, self._copy, text)
            except OSError as exc:
                return self._refused(reason, (f"cannot write the workers' copy of the policy: {exc}",))
            answers = await asyncio.gather(*(self._ask_reload(w) for w in self.running()))
            errors = [e for ok, errs, _ in answers if not ok for e in errs]
            if errors:
                await self._roll_back(reason)
                return self._refused(reason, tuple(dict.fromkeys(errors)))
            for _, _, worker_notes in answers[:1]:
                notes.extend(worker_notes)
            self.policy, self._text = policy, text
        self.reloads["success"] += 1
        log.info("policy reloaded (%s) by %d worker(s): %s", reason, len(answers), policy.source)
        return ReloadResult(True, (), tuple(notes))

    async def _roll_back(self, reason: str) -> None:
        """A reload some workers took and one did not: every running worker (those that took
        it, and any started from the new copy meanwhile) reloads the previous copy."""
        try:
            await asyncio.to_thread(_write_whole, self._copy, self._text)
        except OSError as exc:  # asking them now would load the new policy again
            log.error("rolling back the reload (%s) failed: cannot write the copy: %s", reason, exc)
            return
        answers = await asyncio.gather(*(self._ask_reload(w) for w in self.running()))
        for ok, errs, _ in answers:
            if not ok:  # it may now run the new policy: say so, loudly
                log.error("rolling back the reload (%s) failed: %s", reason, "; ".join(errs))

    async def _ask_reload(self, worker: Worker) -> tuple[bool, list[str], list[str]]:
        try:
            async with self.ask(worker, "POST", "/reload") as resp:
                body = await resp.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return False, [f"worker {worker.index}: {type(exc).__name__}: {exc}"], []
        return body.get("result") == "success", list(body.get("errors", [])), list(body.get("notes", []))

    def _refused(self, reason: str, errors: tuple[str, ...]) -> ReloadResult:
        self.reloads["failure"] += 1
        return refused(reason, errors)

    def watch(self, path: str, interval: float = 1.0) -> Coroutine[Any, Any, None]:
        """--watch, as one process does (reload.py); the file is read before the workers start."""
        return watch_file(path, self.reload, interval)

    # ------------------------------------------------------------------ asking workers

    def ask(self, worker: Worker, method: str, path: str) -> aiohttp.client._RequestContextManager:
        """A request to a worker's admin socket, with the admin token when one is set."""
        assert worker.session is not None
        token = self.policy.admin_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return worker.session.request(method, f"http://localhost{path}", headers=headers)


def _write_whole(path: str, text: str) -> None:
    """Replace ``path``'s content at once: a worker starting meanwhile reads the old or the new, never half."""
    partial = f"{path}.new"
    # 0600: the policy may hold secrets (a store password, the admin token)
    with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(partial, path)


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM when the supervisor dies, however it dies
    (a killed supervisor must not leave workers serving the port)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def _relay(stream: asyncio.StreamReader, fd: int) -> None:
    """Copy a worker's output to ours, whole lines only. Workers write their access log in
    batches far larger than a pipe writes atomically (PIPE_BUF, 4 KiB): N processes sharing
    one stderr would interleave in the middle of lines. Here the supervisor is the one writer."""
    rest = b""
    while chunk := await stream.read(1 << 16):
        end = chunk.rfind(b"\n") + 1
        if not end:
            rest += chunk
            continue
        _write_all(fd, rest + chunk[:end])
        rest = chunk[end:]
    if rest:
        _write_all(fd, rest + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # a non-blocking stream that is full: wait for the reader
            select.select([], [fd], [])
        except OSError:
            return  # nobody reads our output any more: drop, never stop serving


def _exit_text(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def ready_line(listen: Address, admin: Address, policy: Policy) -> str:
    """The same ready line one process prints."""
    return (
        f"quota-proxy listening on http://{listen} (admin http://{admin}, store "
        f"{mask_password(policy.store.url)}, {len(policy.vendors)} vendor(s))"
    )


def worker_argv(base: Sequence[str]) -> Callable[[int, Address, str, str], list[str]]:
    """Worker ``index``'s command line: ``base`` (the run command's own options) with one
    worker, the port the supervisor reserved, the worker's admin socket and the policy's copy."""

    def argv(index: int, listen: Address, admin_socket: str, policy_copy: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "proxy",
            "run",
            *base,
            "--workers",
            "1",
            "--listen",
            str(listen),
            "--worker-admin-socket",
            admin_socket,
            "--worker-index",
            str(index),
            "--worker-policy",
            policy_copy,
        ]

    return argv
