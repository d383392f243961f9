"""Token buckets shared by the fleet: what a request draws from, and where state lives."""

from proxy.clock import Clock
from proxy.limiter.blocks import BlockMark
from proxy.limiter.breaker import Breaker
from proxy.limiter.buckets import Buckets, buckets_for, global_buckets
from proxy.limiter.limiter import Limiter
from proxy.limiter.store import AcquireResult, BlockResult, BucketSpec, BucketStore, StoreUnavailable

__all__ = [
    "AcquireResult",
    "BlockMark",
    "BlockResult",
    "Breaker",
    "BucketSpec",
    "BucketStore",
    "Buckets",
    "Limiter",
    "StoreUnavailable",
    "buckets_for",
    "global_buckets",
    "open_store",
]


def open_store(url: str, timeout: float, clock: Clock) -> BucketStore:
    """The store a policy's ``store.url`` names."""
    if url == "memory://" or url.startswith("memory:"):
        from proxy.limiter.memory_store import MemoryStore

        return MemoryStore(clock)
    from proxy.limiter.redis_store import RedisStore

    return RedisStore(url, timeout)
