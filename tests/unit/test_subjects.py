"""Subject names, the frontier partition hash, message ids and token checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from shared import subjects
from shared.subjects import NO_JOB, PARTITIONS, Route, Stage, SubjectError

TENANT = "ATESTTENANT"
JOB = "0190f3a2b4c5deadbeef"


# ---- partition_of ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "partition"),
    [("example.com", 38), ("www.example.com", 49), ("a.b.c.d.test", 37), ("localhost", 14),
     ("127.0.0.1", 12)],
)
def test_partition_of_is_a_fixed_function_of_the_host(host: str, partition: int) -> None:
    """Golden values: changing the hash (or P) would re-home every host's politeness state."""
    assert subjects.partition_of(host) == partition


def test_partition_of_ignores_host_case() -> None:
    assert subjects.partition_of("EXAMPLE.com") == subjects.partition_of("example.com")


def test_partition_of_is_stable_across_processes() -> None:
    """Not Python's salted ``hash()``: another interpreter with another seed agrees."""
    hosts = [f"host-{i}.example" for i in range(50)]
    code = (
        "import sys; from shared.subjects import partition_of; "
        "print(','.join(str(partition_of(h)) for h in sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, *hosts], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == ",".join(str(subjects.partition_of(h)) for h in hosts)


def test_partition_of_is_in_range_and_spreads() -> None:
    partitions = [subjects.partition_of(f"site{i}.example.org") for i in range(2000)]
    assert all(0 <= p < PARTITIONS for p in partitions)
    assert len(set(partitions)) == PARTITIONS  # 2000 hosts reach every partition


# ---- builders and parse ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "route"),
    [
        (subjects.seeds(TENANT), Route("seeds", TENANT, NO_JOB)),
        (subjects.links(TENANT, JOB), Route("links", TENANT, JOB)),
        (subjects.frontier(0, TENANT, JOB), Route("frontier", TENANT, JOB)),
        (subjects.frontier(PARTITIONS - 1, TENANT, JOB), Route("frontier", TENANT, JOB)),
        (subjects.fetched(TENANT, JOB), Route("fetched", TENANT, JOB)),
        (subjects.parsed(TENANT, JOB), Route("parsed", TENANT, JOB)),
        (subjects.expanded(TENANT, JOB), Route("expanded", TENANT, JOB)),
        (subjects.parked(TENANT, JOB), Route("parked", TENANT, JOB)),
        *((subjects.ledger(TENANT, JOB, kind), Route("ledger", TENANT, JOB))
          for kind in subjects.LedgerKind),
        (subjects.results(TENANT, JOB), Route("results", TENANT, JOB)),
        (subjects.events(TENANT, JOB), Route("events", TENANT, JOB)),
        *((subjects.dlq(stage, TENANT, JOB), Route("dlq", TENANT, JOB)) for stage in Stage),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_parse_round_trips_every_builder(subject: str, route: Route) -> None:
    assert subjects.parse(subject) == route


def test_builders_use_the_documented_token_positions() -> None:
    assert subjects.seeds(TENANT) == f"crawl.seeds.{TENANT}"
    assert subjects.links(TENANT, JOB) == f"mesh.links.{TENANT}.{JOB}"
    assert subjects.frontier(7, TENANT, JOB) == f"mesh.frontier.7.{TENANT}.{JOB}"
    assert subjects.dlq(Stage.FETCHER, TENANT, JOB) == f"mesh.dlq.fetcher.{TENANT}.{JOB}"
    assert subjects.dlq("sink", TENANT, JOB) == f"mesh.dlq.sink.{TENANT}.{JOB}"
    assert subjects.results(TENANT, JOB) == f"tenant.{TENANT}.results.{JOB}"
    assert subjects.events(TENANT, JOB) == f"tenant.{TENANT}.events.{JOB}"


@pytest.mark.parametrize(
    "subject",
    ["", "mesh", "mesh.links", "mesh.links.T", "crawl.seeds", "crawl.seeds.T.extra",
     "mesh.links.T.J.extra", "other.links.T.J", "tenant.T.results",
     "mesh.frontier.1.T", "mesh.frontier.x.T.J", f"mesh.frontier.{PARTITIONS}.T.J",
     "mesh.dlq.dedup.T", "mesh.dlq.crawler.T.J", "mesh.nowhere.T.J", "tenant.T.nowhere.J",
     "mesh.links.T.*", "mesh.links.>.J", "mesh.ledger.T.J.bogus"],
)
def test_parse_rejects_foreign_subjects(subject: str) -> None:
    with pytest.raises(SubjectError, match="not a crawlmesh subject"):
        subjects.parse(subject)


@pytest.mark.parametrize("partition", [-1, PARTITIONS, PARTITIONS + 10])
def test_frontier_rejects_partitions_out_of_range(partition: int) -> None:
    with pytest.raises(SubjectError, match="partition"):
        subjects.frontier(partition, TENANT, JOB)


def test_dlq_rejects_unknown_stages() -> None:
    with pytest.raises(ValueError):
        subjects.dlq("crawler", TENANT, JOB)


# ---- msg_id and job ids ------------------------------------------------------------------


def test_msg_id_shape() -> None:
    assert subjects.msg_id(Stage.DEDUP, TENANT, JOB, "abc123") == f"dedup:{TENANT}:{JOB}:abc123"
    assert subjects.msg_id("fetcher", TENANT, JOB, "abc123", generation=0) == (
        f"fetcher:{TENANT}:{JOB}:abc123")
    assert subjects.msg_id(Stage.FETCHER, TENANT, JOB, "abc123", generation=2) == (
        f"fetcher:{TENANT}:{JOB}:abc123:2")


def test_msg_id_is_deterministic_and_distinguishes_its_parts() -> None:
    ids = {
        subjects.msg_id(Stage.DEDUP, TENANT, JOB, "fp"),
        subjects.msg_id(Stage.FETCHER, TENANT, JOB, "fp"),
        subjects.msg_id(Stage.DEDUP, "OTHERTENANT", JOB, "fp"),
        subjects.msg_id(Stage.DEDUP, TENANT, "otherjob", "fp"),
        subjects.msg_id(Stage.DEDUP, TENANT, JOB, "fp2"),
        subjects.msg_id(Stage.DEDUP, TENANT, JOB, "fp", generation=1),
    }
    assert len(ids) == 6
    assert subjects.msg_id(Stage.DEDUP, TENANT, JOB, "fp") == subjects.msg_id(
        Stage.DEDUP, TENANT, JOB, "fp")


def test_new_job_id_is_a_time_ordered_token() -> None:
    first = subjects.new_job_id()
    second = subjects.new_job_id()
    for job in (first, second):
        assert re.fullmatch(r"[0-9a-f]{20}", job)
        assert subjects.check_token(job, "job") == job
    assert first != second
    assert first[:12] <= second[:12]  # millisecond prefix never goes backwards


# ---- check_token -------------------------------------------------------------------------


@pytest.mark.parametrize("token", [TENANT, "a", "job_1-x", "A" * 64, "0"])
def test_check_token_accepts_plain_tokens(token: str) -> None:
    assert subjects.check_token(token, "tenant") == token


@pytest.mark.parametrize(
    "token", ["", "a.b", "*", ">", "a*", "a>", "a b", "tab\there", "new\nline", "A" * 65, "é",
              "a/b", "$JS"],
)
def test_check_token_rejects_dots_wildcards_and_whitespace(token: str) -> None:
    with pytest.raises(SubjectError, match="invalid tenant"):
        subjects.check_token(token, "tenant")


def test_seeds_checks_its_tenant_token() -> None:
    with pytest.raises(SubjectError):
        subjects.seeds("evil.>")
