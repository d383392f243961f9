"""The one admin port of ``run --workers N``, served by the supervisor (workers.py).

Each worker serves its own admin endpoints on a private Unix socket; this app asks every
running worker and adds their answers up, so a scraper or the live page sees one proxy:

- ``/metrics``: counters and histograms summed; gauges summed where each worker holds its
  own part (held requests, open connections and tunnels, local shares), the highest value
  where every worker reports the same fleet-wide or configured figure (tokens, learned
  rates, in-flight leases, breaker state); reloads counted once, here. Plus
  ``ratelimit_workers_running`` and ``ratelimit_worker_restarts_total``.
- ``/status``: the first worker's document (buckets and leases are the store's, the same
  for all) with the per-process counts summed (recent rates, refusals by reason; the top
  tenants refused summed by tenant over what each worker lists; a shared quota's rates by
  class and tenant, summed over every tenant each worker follows, fair shares computed
  again from the sums), and a ``workers`` list (pid, state, restarts, requests, open
  connections, its policy's vendors).
- ``/status/history``: the workers' per-second series summed second by second, their
  events (vendor 429s, blocks, drains) together in time order.
- ``/readyz``: ready when every worker is; ``/healthz``: the supervisor is alive.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from proxy import __version__
from proxy.ops.admin import TOP_TENANTS, add_page_routes, share_tenants
from proxy.ops.admin_access import admin_access
from proxy.ops.workers import Supervisor, Worker
from proxy.policy.model import Address
from proxy.telemetry.shares import TENANTS_SHOWN, finish

SUMMED_GAUGES: Final = frozenset(
    {
        "ratelimit_held_requests",
        "ratelimit_tunnels_open",
        "ratelimit_connections_open",
        "ratelimit_connections_max",
        "ratelimit_degraded_share",
    }
)
"""Gauges each worker holds a part of; every other gauge is the same figure in each (the
store's, or the policy's) and is reported once, as its highest."""
OWN_FAMILIES: Final = frozenset({"ratelimit_config_reload"})
"""Counted by the supervisor (a reload is one event however many workers apply it)."""
_BREAKER_ORDER: Final = ("closed", "half-open", "open")


class AdminServer:
    """The admin listener of the supervisor."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._runner = web.AppRunner(
            admin_app(supervisor),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=75.0,  # as one process's admin port: longer than common scrape intervals
        )
        self.address = supervisor.policy.admin_listen

    async def start(self, address: Address) -> None:
        """Bind; raises OSError."""
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, address.host, address.port, reuse_address=True).start()
        except OSError:
            await self._runner.cleanup()
            raise
        host, port, *_ = self._runner.addresses[0]
        self.address = Address(host, port)

    async def stop(self) -> None:
        await self._runner.cleanup()


SUPERVISOR = web.AppKey("supervisor", Supervisor)


def admin_app(supervisor: Supervisor) -> web.Application:
    app = web.Application(middlewares=[admin_access(lambda: supervisor.policy)])
    app[SUPERVISOR] = supervisor
    app[METRICS] = MetricsView()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/status/history", history)
    app.router.add_post("/reload", reload)
    add_page_routes(app)
    return app


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body, indent=2) + "\n", status=status, content_type="application/json")


async def _ask_all(supervisor: Supervisor, path: str) -> list[tuple[Worker, int, int, str]]:
    """(worker, the pid that answered, status, body) of every running worker that answered ``GET path``."""

    async def one(worker: Worker) -> tuple[Worker, int, int, str] | None:
        pid = worker.pid
        if pid is None or worker.session is None or worker.session.closed:
            return None  # it died since: its session is being closed
        try:
            async with supervisor.ask(worker, "GET", path) as resp:
                return worker, pid, resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, AssertionError):
            return None  # it died (or is restarting) while we asked: the others still answer

    answers = await asyncio.gather(*(one(w) for w in supervisor.running()))
    return [a for a in answers if a is not None]


# ---------------------------------------------------------------- endpoints


async def healthz(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    running = len(supervisor.running())
    return _json({"status": "ok", "version": __version__, "workers": supervisor.count, "workers_running": running})


async def readyz(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    if supervisor.draining:
        return _json({"status": "draining"}, 503)
    running = supervisor.running()
    if len(running) < supervisor.count:
        return _json({"status": "starting", "workers": supervisor.count, "workers_ready": len(running)}, 503)
    answers = await _ask_all(supervisor, "/readyz")
    bodies = [json.loads(body) for _, _, _, body in answers]
    for (_, _, code, _), body in zip(answers, bodies, strict=True):
        if code != 200:
            return _json(body, code)
    if len(answers) < supervisor.count:
        return _json({"status": "starting", "workers": supervisor.count, "workers_ready": len(answers)}, 503)
    degraded = [b for b in bodies if b.get("status") == "degraded"]
    return _json(degraded[0] if degraded else bodies[0])


async def metrics(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    answers = await _ask_all(supervisor, "/metrics")
    texts = [(w.index, pid, body) for w, pid, code, body in answers if code == 200]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected([*request.app[METRICS].collect(texts), *own_metrics(supervisor)]))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    # Every tenant each worker follows: a fair share needs the weights of all the active ones.
    asked = await _ask_all(supervisor, "/status?share_tenants=all")
    answers = [(w, json.loads(body)) for w, _, code, body in asked if code == 200]
    if not answers:
        return _json({"status": "no worker is running", "workers": _workers(supervisor, {})}, 503)
    merged = merge_status([doc for _, doc in answers], share_tenants(request))
    merged["workers"] = _workers(supervisor, {w.index: doc for w, doc in answers})
    return _json(merged)


async def history(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    docs = [json.loads(body) for _, _, code, body in await _ask_all(supervisor, "/status/history") if code == 200]
    if not docs:
        return _json({"status": "no worker is running"}, 503)
    return _json(merge_history(docs))


async def reload(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    outcome = await supervisor.reload("POST /reload")
    return _json(outcome.as_json(supervisor.policy), 200 if outcome.ok else 400)


# ---------------------------------------------------------------- /status


def _workers(supervisor: Supervisor, docs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per worker slot: its process now, and what it served (since it started)."""
    entries: list[dict[str, Any]] = []
    for worker in supervisor.workers:
        doc = docs.get(worker.index)
        entry: dict[str, Any] = {
            "index": worker.index,
            "pid": worker.pid,
            "state": worker.state,
            "restarts": worker.restarts,
            "requests": None,
            "connections_open": None,
            "vendors": None,
        }
        if doc is not None:  # its policy's vendors: what shows that a reload reached it
            entry["vendors"] = [v["name"] for v in doc.get("vendors", [])]
            entry["requests"] = sum(sum(v.get("requests_by_mode", {}).values()) for v in doc.get("vendors", []))
            entry["connections_open"] = doc.get("connections", {}).get("open")
        entries.append(entry)
    return entries


def merge_status(docs: list[dict[str, Any]], shown: int = TENANTS_SHOWN) -> dict[str, Any]:
    """The workers' /status documents as one: the first's, with per-process counts summed
    (``shown``: the tenants listed per vendor with ``share:``, of all the workers list)."""
    merged = copy.deepcopy(docs[0])
    others = docs[1:]
    if "connections" in merged:
        for key in ("open", "max"):
            merged["connections"][key] = sum(d.get("connections", {}).get(key, 0) for d in docs)
    merged["store"]["breaker"] = _worst(d["store"]["breaker"] for d in docs)
    by_name = [{v["name"]: v for v in d.get("vendors", [])} for d in others]
    for vendor in merged["vendors"]:
        peers = [names[vendor["name"]] for names in by_name if vendor["name"] in names]
        _merge_vendor(vendor, peers)
        if isinstance(vendor.get("share"), dict):
            vendor["share"] = merge_share(
                vendor["share"], [p["share"] for p in peers if isinstance(p.get("share"), dict)], shown
            )
    return merged


def _merge_vendor(vendor: dict[str, Any], peers: list[dict[str, Any]]) -> None:
    for peer in peers:
        for mode, count in peer.get("requests_by_mode", {}).items():
            vendor["requests_by_mode"][mode] = vendor["requests_by_mode"].get(mode, 0) + count
        if "tunnels" in vendor and "tunnels" in peer:
            vendor["tunnels"]["open"] += peer["tunnels"]["open"]
        vendor["held_now"] += peer.get("held_now", 0)
        if isinstance(vendor.get("concurrency"), dict) and isinstance(peer.get("concurrency"), dict):
            vendor["concurrency"]["held_for_slot"] += peer["concurrency"].get("held_for_slot", 0)
        for key, value in peer.get("recent", {}).items():
            if key != "window_seconds":
                vendor["recent"][key] = round(vendor["recent"].get(key, 0) + value, 3)
        if vendor.get("partitions") and peer.get("partitions"):
            for key in ("seen_recently", "blocked_now"):  # each saw the same partitions, or some of them
                vendor["partitions"][key] = max(vendor["partitions"][key], peer["partitions"][key])
        if isinstance(vendor.get("refusals"), dict) and isinstance(peer.get("refusals"), dict):
            _merge_refusals(vendor["refusals"], peer["refusals"])
        vendor["blocked_for_seconds"] = max(vendor["blocked_for_seconds"], peer.get("blocked_for_seconds", 0))
        if peer.get("blocked_for_seconds", 0) >= vendor["blocked_for_seconds"] and peer.get("blocked_until"):
            vendor["blocked_until"] = peer["blocked_until"]
        if vendor.get("learned") is None and peer.get("learned") is not None:
            vendor["learned"] = peer["learned"]
    vendor["breaker"] = _worst([vendor["breaker"], *(p.get("breaker", "closed") for p in peers)])


def _merge_refusals(into: dict[str, Any], peer: dict[str, Any]) -> None:
    """A worker's refusals by reason added in; its top tenants summed with ours by tenant
    (a tenant another worker did not list counts there as 0: a lower bound), the reason
    the one of the worker that refused it most."""
    for reason, counts in peer.get("by_reason", {}).items():
        mine = into["by_reason"].setdefault(reason, {})
        for outcome, n in counts.items():
            mine[outcome] = mine.get(outcome, 0) + n
    tenants = {t["tenant"]: dict(t) for t in into.get("top_tenants", [])}
    for theirs in peer.get("top_tenants", []):
        mine = tenants.get(theirs["tenant"])
        if mine is None:
            tenants[theirs["tenant"]] = dict(theirs)
            continue
        if theirs["refused"] > mine["refused"]:
            mine["reason"] = theirs["reason"]
        mine["refused"] += theirs["refused"]
    ranked = sorted(tenants.values(), key=lambda t: (-t["refused"], t["tenant"]))
    into["top_tenants"] = ranked[:TOP_TENANTS]


def merge_share(mine: dict[str, Any], peers: list[dict[str, Any]], shown: int) -> dict[str, Any]:
    """A vendor's ``share`` over the workers: each class's and each (tenant, class)'s rates
    summed (waiting if it waited in any worker), over the classes of the first (the policy's);
    then the shares of the vendor's grants, the active tenants and weights and each tenant's
    fair share as one process computes them (shares.finish), from the sums. Exact as long as
    each worker listed every tenant it follows (``?share_tenants=all``)."""
    classes = [dict(c) for c in mine.get("classes", [])]
    by_name = {c["name"]: c for c in classes}
    tenants: dict[tuple[str, str], dict[str, Any]] = {}
    for index, doc in enumerate([mine, *peers]):
        if index:
            for theirs in doc.get("classes", []):
                c = by_name.get(theirs["name"])
                if c is not None:
                    _add_rates(c, theirs)
        for theirs in doc.get("tenants", []):
            if theirs["class"] not in by_name:
                continue  # a class another policy had (a reload under way)
            key = (theirs["tenant"], theirs["class"])
            t = tenants.get(key)
            if t is None:
                tenants[key] = {k: theirs[k] for k in _TENANT_KEYS}
            else:
                _add_rates(t, theirs)
    return finish(mine.get("min_share", 0.0), classes, list(tenants.values()), shown)


_TENANT_KEYS: Final = ("tenant", "class", "weight", "granted_per_second", "waiting", "refused_per_second")


def _add_rates(into: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key in ("granted_per_second", "refused_per_second"):
        into[key] = into.get(key, 0.0) + theirs.get(key, 0.0)
    into["waiting"] = bool(into.get("waiting")) or bool(theirs.get("waiting"))


SUMMED_READINGS: Final = frozenset({"held_now"})
"""/status/history readings each worker holds a part of; the others (tokens, in flight) are
fleet-wide figures every worker reads: the highest is kept."""


def merge_history(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' /status/history documents as one: each vendor's counts summed second by
    second (aligned on their ends: the workers answered within the same moment), its
    readings summed or the highest (``SUMMED_READINGS``), its events from every worker,
    oldest first."""
    merged = copy.deepcopy(docs[0])
    for vendor in merged["vendors"]:
        for doc in docs[1:]:
            peer = next((v for v in doc.get("vendors", []) if v["name"] == vendor["name"]), None)
            if peer is None:
                continue
            for name, values in peer.get("series", {}).items():
                _combine(vendor["series"].setdefault(name, [0] * len(values)), values, True)
            for name, values in peer.get("gauges", {}).items():
                _combine(
                    vendor.setdefault("gauges", {}).setdefault(name, [None] * len(values)),
                    values,
                    name in SUMMED_READINGS,
                )
            vendor["events"].extend(peer.get("events", []))
        vendor["events"].sort(key=lambda e: -e["seconds_ago"])
    return merged


def _combine(mine: list[Any], theirs: list[Any], summed: bool) -> None:
    """``theirs`` into ``mine``, element by element from the ends; None (no reading) yields."""
    for i in range(1, min(len(mine), len(theirs)) + 1):
        a, b = mine[-i], theirs[-i]
        if a is None or b is None:
            mine[-i] = b if a is None else a
        else:
            mine[-i] = round(a + b, 3) if summed else max(a, b)


def _worst(states: Iterable[str]) -> str:
    return max(states, key=lambda s: _BREAKER_ORDER.index(s) if s in _BREAKER_ORDER else 0)


# ---------------------------------------------------------------- /metrics


Key = tuple[str, tuple[tuple[str, str], ...]]
"""A sample: its name and its sorted labels."""


@dataclass(slots=True)
class Family:
    """One metric family parsed from a worker's exposition text."""

    type: str
    documentation: str
    samples: dict[Key, float] = field(default_factory=dict)

    @property
    def accumulates(self) -> bool:
        """Counters and histograms only grow; a gauge is a reading."""
        return self.type != "gauge"


Families = dict[str, Family]


def parse(text: str) -> Families:
    """A worker's /metrics; no ``_created`` series (the creation time of a sum over
    processes means nothing; the parser hands them back as families of their own)."""
    families: Families = {}
    for family in text_string_to_metric_families(text):
        if family.name in OWN_FAMILIES or family.name.endswith("_created"):
            continue
        into = families.setdefault(family.name, Family(family.type, family.documentation))
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                into.samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families


def merge(parts: Iterable[Families]) -> Families:
    """Each sample summed over the parts, except same-figure gauges (the highest)."""
    merged: Families = {}
    for part in parts:
        for name, family in part.items():
            into = merged.setdefault(name, Family(family.type, family.documentation))
            summed = family.accumulates or name in SUMMED_GAUGES
            for key, value in family.samples.items():
                old = into.samples.get(key)
                into.samples[key] = value if old is None else old + value if summed else max(old, value)
    return merged


class MetricsView:
    """The workers' /metrics as one, its counters never going down when a worker is
    replaced: the last counts scraped from a process that has since died are kept and
    added in (what it counted after that last scrape is lost with it). A scraper would
    otherwise read the drop as a counter reset and count the survivors' totals again."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, Families]] = {}
        """Worker slot → (pid, its counters at the last scrape)."""
        self._retired: Families = {}

    def collect(self, answers: list[tuple[int, int, str]]) -> list[Metric]:
        """``answers``: (slot, pid, exposition text) of every worker that answered."""
        live = [(slot, pid, parse(text)) for slot, pid, text in answers]
        answered = {slot: pid for slot, pid, _ in live}
        for slot, (pid, counters) in list(self._last.items()):
            if answered.get(slot, pid) != pid:  # a new process in the slot: the old one is gone
                self._retired = merge([self._retired, counters])
                del self._last[slot]
        for slot, pid, families in live:
            self._last[slot] = (pid, {n: f for n, f in families.items() if f.accumulates})
        # A worker that did not answer this time (restarting, or too slow) counts as last seen.
        silent = [counters for slot, (_, counters) in self._last.items() if slot not in answered]
        merged = merge([*(families for _, _, families in live), *silent, self._retired])
        return [_metric(name, family) for name, family in merged.items()]


METRICS = web.AppKey("metrics", MetricsView)


def _metric(name: str, family: Family) -> Metric:
    metric = Metric(name, family.documentation, family.type)
    for (sample_name, labels), value in family.samples.items():
        metric.add_sample(sample_name, dict(labels), value)
    return metric


def own_metrics(supervisor: Supervisor) -> Iterator[Metric]:
    """What the supervisor counts itself: reloads, workers running, restarts."""
    reloads = Metric("ratelimit_config_reload", "Policy reloads by result (success, failure).", "counter")
    for result, count in supervisor.reloads.items():
        reloads.add_sample("ratelimit_config_reload_total", {"result": result}, float(count))
    yield reloads
    running = Metric("ratelimit_workers_running", "Worker processes serving the proxy port now.", "gauge")
    running.add_sample("ratelimit_workers_running", {}, float(len(supervisor.running())))
    yield running
    restarts = Metric(
        "ratelimit_worker_restarts", "Worker processes restarted after they died, by worker slot.", "counter"
    )
    for worker in supervisor.workers:
        labels = {"worker": str(worker.index)}
        restarts.add_sample("ratelimit_worker_restarts_total", labels, float(worker.restarts))
    yield restarts


class _Collected(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)
