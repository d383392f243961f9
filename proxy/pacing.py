"""Requests reach the vendor no closer together than their tokens allow.

The store grants by the vendor's buckets, on the store's clock; the vendor counts
arrivals. Between its grant and its write a request can be delayed while the next ones
are not: a connection still opening (TLS handshakes at a cold start), a busy or stalled
event loop, a held request woken late. Grants that fitted the bucket then reach the vendor
bunched, and a vendor counting a strict window that rate + burst fills exactly sees one
too many (issue 10 item 5).

So each replica mirrors, per vendor-side bucket (the vendor's global and endpoint-class
buckets of the request's partition, at their learned rates), the bucket on the times its
requests are *written*, and writes a request only once the mirror holds its tokens (a
generic cell rate algorithm: one "theoretical arrival time" per bucket). On time, one
replica's requests are a subset of the grants and always find their tokens: no wait. A
late one spends the slack the bucket has, and later ones wait only for what it has not:
a lag shrinks as fast as spare tokens allow, never carried on under steady traffic, and
after a stall at most a burst leaves at once, the rest at the rate.

Per replica: one replica's request written late while another's go on time is not seen here.

A wait of more than ``MAX_WAIT`` is not a bunch to spread (a request is that late only
after as long a stall) but the mirror disagreeing with the store: the store lost its state
and restarted its buckets (the limiter's own repair then governs), or requests went out
without the store (failing open). The store granted the request, so it goes, and the
mirror restarts from the store's answer rather than holding every request for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.clock import Clock
from proxy.limiter.store import BucketSpec

MAX_WAIT = 1.0  # seconds a write is held at most; longer: the store is trusted (see above)
_MAX_TRACKED = 10_000  # buckets remembered at most (partitions are many): full ones are forgotten first


class Pacer:
    """Per vendor-side bucket: when the mirror would be full again (its ``tat``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._tat: dict[str, float] = {}

    def reserve(self, specs: Sequence[BucketSpec], cost: float = 1.0) -> tuple[float, Sequence[BucketSpec]]:
        """Take ``cost`` from the mirror of every bucket in ``specs`` for a request about to
        be written. Returns ``(0.0, ())`` when it may go now: all taken. Else the seconds it
        must wait and the buckets still to take from once it has (``reserve`` them again
        then, until it may go): the ones that made it wait are taken now, for the moment it
        may go, so that callers behind it wait behind it; the others only then, so that a
        request waiting for a tight bucket (an endpoint class) does not hold back the
        requests of the looser ones it shares (the vendor's global bucket)."""
        now = self.clock.monotonic()
        tats = self._tat
        at = now
        for spec in specs:
            tat = tats.get(spec.ident)
            if tat is not None and spec.rate > 0:
                # The mirror holds ``burst - (tat - t) * rate`` tokens at t: enough from here.
                earliest = tat - max(spec.burst - cost, 0.0) / spec.rate
                if earliest > at:
                    at = earliest
        if at == now or at - now > MAX_WAIT:
            for spec in specs:
                if spec.rate > 0:
                    ident = spec.ident
                    tat = tats.get(ident, now)
                    tats[ident] = (now if tat <= now or at > now else tat) + cost / spec.rate
            if len(tats) > _MAX_TRACKED:
                self._forget_full(now)
            return 0.0, ()
        rest = []
        for spec in specs:
            tat = tats.get(spec.ident)
            if tat is not None and spec.rate > 0 and tat - max(spec.burst - cost, 0.0) / spec.rate > now:
                tats[spec.ident] = max(tat, at) + cost / spec.rate
            else:
                rest.append(spec)
        return at - now, rest

    def _forget_full(self, now: float) -> None:
        """Drop the mirrors that are full again (nothing to remember); if that frees less
        than half, all of them (a forgotten mirror is a full one, as at start), so that the
        scan is not repeated on the next request."""
        tats = self._tat
        for ident in [ident for ident, tat in tats.items() if tat <= now]:
            del tats[ident]
        if len(tats) > _MAX_TRACKED // 2:
            tats.clear()
