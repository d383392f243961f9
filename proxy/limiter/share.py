"""A vendor's schedule under ``share:`` (SPEC §13): the keys and terms of acquire.lua's
"Share" section, which every replica's grants follow (the memory store's twin:
share_memory.py).

The terms are the schedule's, not the policy's: how far ahead a grant may be reserved
(``HORIZON``: a hold that must wait longer asks again on its turn, so a later request of
a higher class, or of a tenant further behind, is not queued behind it), and how long a
refused tenant counts as waiting (until it is expected back, at most ``TAU`` ahead, plus
``GRACE``: a tenant that stopped holds the others back no longer than that).
"""

from __future__ import annotations

from typing import Final

from proxy.limiter.store import ShareAsk
from proxy.policy.model import Share

HORIZON: Final = 0.005
"""Seconds a grant under a share may be reserved ahead (the rest of a hold asks again)."""
TAU: Final = 0.25
"""Seconds ahead, at most, that a refused tenant is expected back (its retry)."""
GRACE: Final = 0.15
"""Seconds a refused tenant still counts as waiting after it was expected back."""
SLACK: Final = 0.025
"""Seconds of the quota a tenant may be ahead of the lowest waiting tag (at least one of its
requests): one that is a few ms from asking again holds no one back."""
CLASS_GRACE: Final = 0.01
"""Seconds a class still counts as busy after its refused request was expected back."""


def share_keys(state_key: str, classes: int) -> tuple[str, ...]:
    """The schedule of a vendor's (partition's) state ``state_key``: its hash, its expiry
    set, then per class its waiting set, then per class its tag set (acquire.lua's order)."""
    base = f"{state_key}:s"
    return (
        f"{base}:h",
        f"{base}:x",
        *(f"{base}:w:{i}" for i in range(classes)),
        *(f"{base}:f:{i}" for i in range(classes)),
    )


def share_ask(share: Share, state_key: str, tenant: str, klass: int, first_global: int, metered: int = 0) -> ShareAsk:
    """What a request of ``tenant`` in class ``klass`` (an index of ``share.classes``) sends."""
    weight = share.weight(tenant)
    return ShareAsk(
        share_keys(state_key, len(share.classes)),
        klass,
        len(share.classes),
        f"{weight:g}|{tenant}",
        weight,
        share.min_share,
        first_global,
        metered,
    )


def share_spec(ask: ShareAsk) -> str:
    """acquire.lua's ARGV[11] (its ARGV[12] is ``ask.member``)."""
    return (
        f"{ask.klass + 1}:{ask.classes}:{ask.weight:g}:{ask.min_share:g}:{HORIZON * 1000:g}:"
        f"{TAU * 1000:g}:{GRACE * 1000:g}:{CLASS_GRACE * 1000:g}:{SLACK * 1000:g}:{ask.first_global + 1}"
        + (f":{ask.metered}" if ask.metered else "")
    )
