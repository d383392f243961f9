"""memory://'s straight call (store.StraightCall): the bucket set's ``take``, answered before
``send`` returns."""

from __future__ import annotations

from collections.abc import Callable

from proxy.limiter.store import AcquireResult, Answered, BucketSpec, Leases, Reserve, ShareAsk, StateGuard


class _Done:
    """A straight call of this store: answered before ``send`` returned, nothing to cancel."""

    @staticmethod
    def cancel() -> bool:
        return False


_DONE = _Done()


class TakeNow:
    """A bucket set's acquire as the straight path sends it (store.StraightCall): ``take``,
    answered at once."""

    __slots__ = ("_args", "_guard", "_reserve", "_share", "_take")

    def __init__(
        self,
        take: Callable[..., AcquireResult],
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard,
        reserve: Reserve | None,
        share: ShareAsk | None = None,
    ) -> None:
        self._take = take
        self._args = (buckets, cost, max_wait, queue)
        self._guard = guard
        self._reserve = reserve
        self._share = share

    def send(self, seen: int, leases: Leases | None, then: Answered, costs: tuple[float, ...] | None = None) -> _Done:
        try:
            guard = self._guard._replace(seen=seen)
            result = self._take(*self._args, guard, leases, self._reserve, self._share, costs)
        except Exception as exc:  # (a bug: the caller's to report)
            then(None, exc)
        else:
            then(result, None)
        return _DONE
