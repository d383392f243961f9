"""Answer presets (SPEC §9, policy/presets.py): the built-in ones written byte for byte as
the dialects they replace wrote them, and each kind of answer as its SDK reads it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.pipeline.refusals import BadRequest, Denied, Limited, StoreDown, UpstreamFailed
from proxy.pipeline.responses import refusal_response
from proxy.policy.presets import BUILT_IN
from tests.test_answers import REFUSALS, VENDOR

GOLDEN = json.loads((Path(__file__).parent / "golden" / "answers.json").read_text())
"""Every refusal in the generic, stripe and openai dialects as they were written before
presets (status, reason, headers in order, body bytes)."""

CASES = {
    **REFUSALS,
    "long-defer": Limited("defer", 90.0, "global", "global 100/1s burst 10", hint=95.0),
    "long-store-down": replace(REFUSALS["store-down"], retry_after=120.0),
    "idempotent-timeout": UpstreamFailed(
        504, "upstream-timeout", "payments did not answer in time", reached=True, idempotent=True
    ),
}


def written(refusal: Any, vendor: Any) -> dict[str, Any]:
    r = refusal_response(refusal, vendor)
    assert isinstance(r.body, bytes)
    return {"status": r.status, "reason": r.reason, "headers": [list(kv) for kv in r.headers.items()], "body": r.body.decode()}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_the_dialects_presets_replace_are_written_byte_for_byte(key: str) -> None:
    dialect, case, *rest = key.split("/")
    vendor = None if rest else replace(VENDOR, answers=BUILT_IN[dialect])
    assert written(CASES[case], vendor) == GOLDEN[key]
