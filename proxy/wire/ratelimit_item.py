"""One bucket as the IETF ``RateLimit-Policy`` and ``RateLimit`` fields describe it
(draft-ietf-httpapi-ratelimit-headers): what the proxy's own answers carry (wire/refusals.py)
and what pipeline/ratelimit_fields.py works out from the buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICY = "RateLimit-Policy"
RATELIMIT = "RateLimit"


@dataclass(frozen=True, slots=True)
class QuotaItem:
    """One bucket as the RateLimit fields describe it."""

    name: str
    quota: int
    """``q``: tokens per window."""
    window: int
    """``w``: the window, seconds."""
    remaining: int
    """``r``: whole tokens left now."""
    reset: int
    """``t``: seconds until the bucket is full again, rounded up."""

    def fields(self) -> dict[str, str]:
        return {
            POLICY: f'"{self.name}";q={self.quota};w={self.window}',
            RATELIMIT: f'"{self.name}";r={self.remaining};t={self.reset}',
        }
