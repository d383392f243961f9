"""Where the straight path (lane.py) hands a request over to the general path (handler.py):
how far it took it (``Carried``), and what it asks of and shares with the general path
(``GeneralPath``, the one thing the straight path knows of the handler)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from proxy.deps import Deps
    from proxy.limiter.store import AcquireResult, StoreUnavailable
    from proxy.pipeline.decide import Admission
    from proxy.pipeline.kept_slots import KeptSlots
    from proxy.pipeline.match import Match
    from proxy.pipeline.share_lines import ShareLines
    from proxy.quota.concurrency import Slot
    from proxy.quota.seats import Seats
    from proxy.wire.body import BodyBroken
    from proxy.wire.request import Request
    from proxy.wire.responder import Responder
    from proxy.wire.upstream import UpstreamConnection, UpstreamFailed
    from proxy.wire.vendor_answer import Response


class Carried(NamedTuple):
    """How far the straight path took a request it hands to the general path: what it did
    is not done again, what it learnt is not asked again."""

    match: Match
    taken: AcquireResult | StoreUnavailable | None = None
    """The store's answer for the request's tokens, or why it gave none; None: not asked yet."""
    admission: Admission | None = None
    """Granted and sent: how it is counted; then ``upstream`` is the vendor's answer (its
    head in) or ``failure`` why the exchange failed, on ``conn``, sent at ``sent``."""
    upstream: Response | None = None
    failure: UpstreamFailed | BodyBroken | OSError | None = None
    conn: UpstreamConnection | None = None
    sent: float = 0.0
    slot: Slot | None = None
    """The request's leases (concurrency caps), taken with its tokens: the general path's
    to give back from here on."""
    metered: tuple[tuple[str, float, float | None], ...] = ()
    """A metered request's estimates (metering.noted), made from its body: not made again."""


class GeneralPath(Protocol):
    """What the straight path hands over to, and shares with, the general path (handler.py):
    the request it cannot finish, a worker gone while the vendor works, the tenants'
    seats and the slots kept for deferred calls."""

    @property
    def deps(self) -> Deps: ...

    @property
    def seats(self) -> Seats: ...

    @property
    def kept(self) -> KeptSlots: ...

    @property
    def lines(self) -> ShareLines: ...

    def __call__(
        self,
        request: Request,
        responder: Responder,
        deps: Deps | None = None,
        started: float | None = None,
        carried: Carried | None = None,
    ) -> Awaitable[None]:
        """Go on with ``request`` from where the straight path stopped (``carried``)."""

    def heard_out(self, deps: Deps, match: Match, release: Callable[[], None], response: Response | None) -> None:
        """The vendor is done with a request whose worker went away."""
