"""The dedup handler counts every link of a running job once, by decision."""

from __future__ import annotations

from shared.telemetry import metrics
from tests.unit.dedup.test_handler import TENANT, delivery, links, make


def counts() -> dict[str, float]:
    return {decision: metrics.DEDUP_LINKS.labels(TENANT, decision)._value.get()
            for decision in ("admitted", "duplicate", "out_of_scope", "too_deep", "invalid")}


async def test_each_link_counts_under_its_decision() -> None:
    handler, _ = make(max_depth=2)
    before = counts()
    await handler.handle(links(
        "https://site.test/a", "https://site.test/a#again",  # admitted, then a repeat
        "https://other.test/x",                               # another host
        "ftp://site.test/file", "https://site.test/" + "a" * 2100,  # invalid, too long
        "https://site.test/b",
    ), delivery())
    await handler.handle(links("https://site.test/deep", depth=3), delivery())
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {
        "admitted": 2, "duplicate": 1, "out_of_scope": 1, "too_deep": 1, "invalid": 2,
    }
