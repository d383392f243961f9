"""The live page, read as a newcomer reads it (issue 36, item 7), in the real headless chromium
of tests/test_admin_page.py: a bucket "binds now" only when it cannot grant a request; the
legends and the vendor's line give the statuses its workers really get (a preset may answer a
defer 403 and a shed 429); the long-run quota says which limit makes it (config/example.yaml's
66.7/s is its 4000/1m, as ``check`` says).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp

from proxy.clock import ManualClock
from proxy.policy import load_policy
from proxy.policy.model import Address
from proxy.policy.summary import summarize
from tests.conftest import ROOT, Vendor, make_policy
from tests.helpers.browser import Browser, open_tab
from tests.test_admin_page import browser, rendered_when  # noqa: F401  (browser: the module's chromium)

READ_WORDS = """(() => {
  const out = {};
  for (const card of document.querySelectorAll("[data-vendor]")) {
    const th = [...card.querySelectorAll("table.reasons th")].map((e) => e.title);
    out[card.dataset.vendor] = {
      where: (card.querySelector("p.where") || {}).textContent || "",
      quotaTile: card.querySelector('[data-metric="rate"] .sub').textContent,
      bound: (card.querySelector('[data-field="quota_bound"]') || {}).textContent || null,
      quota: card.querySelector('[data-part="quota"]').innerText,
      tags: [...card.querySelectorAll("ul.buckets .tag")].map((t) => t.textContent),
      legend: [...card.querySelectorAll('[data-part="requests"] ul.legend li')].map((e) => e.textContent),
      reasonTitles: th,
    };
  }
  out.glossary = document.getElementById("glossary").innerText;
  return out;
})()"""


async def status_of(proxy: Any) -> Any:
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/status") as r:
        assert r.status == 200
        return await r.json()


async def get(proxy: Any, path: str, **headers: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}{path}", headers=headers) as r:
        await r.read()
        return r.status


async def test_a_full_bucket_does_not_bind_now_an_empty_one_does_and_the_quota_names_its_limit(
    vendor: Vendor,
    start_proxy: Any,
    browser: Browser,  # noqa: F811
) -> None:
    """config/example.yaml as shipped (80/1s burst 20 and 4000/1m), on free ports."""
    example = load_policy(str(ROOT / "config" / "example.yaml"))
    (mock,) = example.vendors
    policy = dataclasses.replace(
        example,
        listen=Address("127.0.0.1", 0),
        admin_listen=Address("127.0.0.1", 0),
        vendors=(dataclasses.replace(mock, upstream=vendor.url),),
    )
    proxy = await start_proxy(policy, clock=ManualClock())
    quota = (await status_of(proxy))["vendors"][0]["quota"]
    # Nothing sent yet: every bucket full, the one with the fewest tokens (20 of 20) binds nothing.
    assert quota["now"] == {"bucket": "global 80/1s burst 20", "tokens": 20, "burst": 20, "fill": 1, "binds": False}
    assert quota["long_run"]["limit"] == "4000/1m" and round(quota["long_run"]["rate_per_second"], 1) == 66.7
    assert "sustained   66.7/s in the long run (4000/1m binds)" in summarize(policy)  # check says the same

    async with open_tab(browser) as tab:
        await tab.viewport(1280, 900)
        await tab.goto(f"{proxy.admin_url}/?every=0.25")
        page = await tab.evaluate(rendered_when("true"))
        card = page["vendors"]["mock-vendor"]
        words = (await tab.evaluate(READ_WORDS))["mock-vendor"]
        assert "binds_now" not in card["binds"] and "binds now" not in words["tags"], words
        assert not any("now" in b["binds"].split() for b in card["buckets"]), card["buckets"]
        assert "Nothing binds now: the fewest tokens are 80/1s burst 20's, 20 of 20 (100% full)" in words["quota"]
        assert words["quotaTile"] == "of 66.7 /s long-run quota, bound by 4000/1m"
        assert "long-run quota 66.7/s, bound by 4000/1m" in words["legend"]

        # The burst spent (the clock stands still): now the 80/1s bucket binds, and says so.
        for _ in range(20):
            assert await get(proxy, "/mock-vendor/v1/x") == 200
        now = (await status_of(proxy))["vendors"][0]["quota"]["now"]
        assert now["bucket"] == "global 80/1s burst 20" and now["tokens"] == 0 and now["binds"] is True
        page = await tab.evaluate(rendered_when('document.querySelector("[data-field=binds_now]") !== null'))
        card = page["vendors"]["mock-vendor"]
        assert card["binds"]["binds_now"]["bucket"] == "global 80/1s burst 20"
        assert "0 of 20 (0% full): requests wait for its refill." in card["binds"]["binds_now"]["text"]
        (binding,) = [b for b in card["buckets"] if "now" in b["binds"].split()]
        assert binding["bucket"] == "global 80/1s burst 20" and "binds now" in binding["text"]
        assert tab.problems == []


def preset_vendors(upstream: str) -> Any:
    """github answers a defer 403 (a long one 409) and a shed 429; generic 429 and 503."""
    return make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        access_log: false
        store: {url: "memory://"}
        vendors:
          - name: github
            hosts: [api.github.example]
            route: /github
            upstream: $upstream
            limits: [{rate: 1, per: 1m, burst: 1}]
            on_limit: {action: defer}
            answers: github
          - name: plain
            hosts: [api.plain.example]
            route: /plain
            upstream: $upstream
            limits: [{rate: 1, per: 1m, burst: 1}]
            on_limit: {action: shed}
        """,
        upstream=upstream,
    )


async def test_legends_and_lines_give_the_statuses_the_vendors_workers_really_get(
    vendor: Vendor,
    start_proxy: Any,
    browser: Browser,  # noqa: F811
) -> None:
    proxy = await start_proxy(preset_vendors(vendor.url), clock=ManualClock())
    # What the workers really get: one call each spends the bucket, then a defer and a shed.
    got: dict[str, dict[str, int]] = {}
    for name in ("github", "plain"):
        assert await get(proxy, f"/{name}/v1/x") == 200
        got[name] = {
            "defer": await get(proxy, f"/{name}/v1/x", **{"X-Quota-On-Limit": "defer"}),
            "shed": await get(proxy, f"/{name}/v1/x", **{"X-Quota-On-Limit": "shed"}),
        }
    assert got == {"github": {"defer": 403, "shed": 429}, "plain": {"defer": 429, "shed": 503}}
    by_name = {v["name"]: v for v in (await status_of(proxy))["vendors"]}
    assert by_name["github"]["answers"] == {
        "preset": "github",
        "status": {"defer": 403, "long_defer": 409, "shed": 429},
    }
    assert by_name["plain"]["answers"] == {
        "preset": "generic",
        "status": {"defer": 429, "long_defer": 429, "shed": 503},
    }

    async with open_tab(browser) as tab:
        await tab.viewport(1280, 900)
        await tab.goto(f"{proxy.admin_url}/")
        await tab.evaluate(rendered_when("true"))
        words = await tab.evaluate(READ_WORDS)
        github, plain = words["github"], words["plain"]
        assert {"deferred (403; 409 when long)", "shed (429)"} <= set(github["legend"]), github["legend"]
        assert not {"deferred (429)", "shed (503)"} & set(github["legend"]), github["legend"]
        assert "on limit: defer (403 + Retry-After)" in github["where"]
        assert "answers: github (defer 403, long defer 409, shed 429)" in github["where"]
        assert github["reasonTitles"][1:] == ["403 + Retry-After: the worker retries later", "429: the work is dropped"]
        assert {"deferred (429)", "shed (503)"} <= set(plain["legend"]), plain["legend"]
        assert "on limit: shed (503)" in plain["where"]
        assert plain["reasonTitles"][1:] == ["429 + Retry-After: the worker retries later", "503: the work is dropped"]
        # The glossary, one for every vendor, promises no status a preset may change.
        assert "answered 429" not in words["glossary"] and "answered 503" not in words["glossary"]
        assert "answers" in words["glossary"]
        assert tab.problems == []
