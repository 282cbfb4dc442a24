"""Replays of dead letters: headers, message ids, what each stage does with a page replay,
and the pure parts of ``crawlmesh dlq`` (refusals, headers of a replay, payload display)."""

from __future__ import annotations

import asyncio
import base64

import orjson
import pytest

from services.dedup.handler import DedupHandler
from services.fetcher.main import fetchable
from shared.bus import replays
from shared.bus.dlqstore import Selection, StoredLetter, job_token
from shared.bus.loop import Delivery, Outbound
from shared.bus.replays import REPLAY_HEADER, REPLAY_OF_HEADER, Replay, carry, replay_msg_id
from shared.cli.deadletters import decode_original, refusal, replay_headers
from shared.codec import encode
from shared.contracts import (
    CrawlRequest,
    DeadLetter,
    DiscoveredLinks,
    FetchedPage,
    JobRecord,
    JobState,
    LedgerEntry,
    Link,
    LinkOrigin,
)

T = "ATESTTENANT"


def letter(stream: str, **fields: object) -> DeadLetter:
    values: dict[str, object] = {
        "id": f"{stream}:7", "tenant": T, "job_id": "job1", "stage": "fetcher",
        "reason": "boom", "delivery_count": 3, "subject": f"mesh.x.{T}.job1", "stream": stream,
        "stream_seq": 7, "headers": {"Nats-Msg-Id": f"dedup:{T}:job1:fp"}, "original": b"{}",
    }
    values.update(fields)
    return DeadLetter.model_validate(values)


def test_replay_headers_round_trip_and_page_streams() -> None:
    replay = Replay(42, "FETCHED:7")
    assert replays.of(replay.headers()) == replay
    assert replay.page and replay.stream == "FETCHED"
    assert not Replay(1, "LINKS:3").page and not Replay(1, "INTAKE_AX:3").page
    assert replays.of({}) is None and replays.of(None) is None
    assert replays.of({REPLAY_HEADER: "x", REPLAY_OF_HEADER: "FETCHED:7"}) is None
    assert replays.of({REPLAY_HEADER: "3"}) is None


def test_replay_msg_ids_get_one_fresh_suffix() -> None:
    assert replay_msg_id("parser:t:j:fp", 9) == "parser:t:j:fp:replay9"
    assert replay_msg_id("parser:t:j:fp:replay9", 12) == "parser:t:j:fp:replay12"
    assert replay_msg_id("frontier:t:j:fp:2", 5) == "frontier:t:j:fp:2:replay5"


def test_carry_marks_every_output_and_suffixes_its_id() -> None:
    entry = LedgerEntry(tenant=T, job_id="j", kind="seeded")
    outputs = [Outbound("mesh.a", entry, "id-a", headers={"x": "1"}),
               Outbound("_INBOX.r", entry, "", core=True)]
    assert carry(outputs, None) == outputs
    assert carry(outputs, Replay(5, "LINKS:2")) == outputs  # not a page: an ordinary input
    marked = carry(outputs, Replay(5, "FETCHED:2"))
    assert [o.msg_id for o in marked] == ["id-a:replay5", ""]
    assert marked[0].headers == {"x": "1", REPLAY_HEADER: "5", REPLAY_OF_HEADER: "FETCHED:2"}
    assert marked[1].headers[REPLAY_OF_HEADER] == "FETCHED:2"


def test_the_fetcher_fetches_a_page_replay_of_a_completed_job_only() -> None:
    record = JobRecord(tenant=T, job_id="j", request=CrawlRequest(seeds=("https://a.test/",)))
    completed = record.model_copy(update={"state": JobState.COMPLETED})
    cancelled = record.model_copy(update={"state": JobState.CANCELLED})

    def check(replay: Replay | None, job: JobRecord | None) -> bool:
        async def inside_a_delivery() -> bool:  # a task of its own, as in the loop
            replays.handling(replay)
            return fetchable(job)
        return asyncio.run(inside_a_delivery())

    assert check(None, record) and check(Replay(1, "FRONTIER:1"), record)
    assert not check(None, completed) and check(Replay(1, "FRONTIER:1"), completed)
    assert not check(Replay(1, "LINKS:1"), completed)  # links of a completed job: no
    assert not check(Replay(1, "FRONTIER:1"), cancelled)
    assert not check(Replay(1, "FRONTIER:1"), None)
    assert replays.current() is None


def test_dedup_does_not_follow_the_links_of_a_page_replay() -> None:
    links = DiscoveredLinks(tenant=T, job_id="j", origin=LinkOrigin.OUTLINKS, depth=1,
                            source_url="https://a.test/", source_fingerprint="fp",
                            links=(Link(url="https://a.test/b"),))
    delivery = Delivery(subject=f"mesh.links.{T}.j", headers=Replay(4, "PARSED:1").headers(),
                        delivered=1, stream_seq=1, tenant=T, job="j")
    handler = DedupHandler(admission=None, jobs=None)  # type: ignore[arg-type]
    assert asyncio.run(handler.handle(links, delivery)) == []


@pytest.mark.parametrize(("stream", "job", "expected"), [
    ("FRONTIER", JobState.RUNNING, None),
    ("FETCHED", JobState.COMPLETED, None),
    ("PARSED", JobState.CANCELLED, "job job1 was cancelled"),
    ("PARSED", None, "job job1 does not exist"),
    ("LINKS", JobState.RUNNING, None),
    ("LINKS", JobState.COMPLETED, "job job1 is completed: dedup admits links only"),
    ("PARKED", JobState.CANCELLED, "job job1 was cancelled"),
    ("PARKED", JobState.COMPLETED, None),
    ("EXPANDED", JobState.RUNNING, "nothing to replay"),
    ("LEDGER", JobState.RUNNING, "dead letters of stream LEDGER are not replayable"),
    (f"INTAKE_{T}", None, None),
])
def test_refusals_say_why(stream: str, job: JobState | None, expected: str | None) -> None:
    why = refusal(letter(stream), job, tenant_known=True, recorded=True)
    assert why == expected if expected is None else why is not None and why.startswith(expected)


def test_unrecorded_letters_and_unknown_tenants_are_refused() -> None:
    assert "not recorded" in (refusal(letter("FETCHED"), JobState.RUNNING, True, False) or "")
    assert "not registered" in (refusal(letter("FETCHED"), JobState.RUNNING, False, True) or "")


def test_a_replay_keeps_the_original_headers_with_a_new_generation() -> None:
    original = letter("FETCHED", headers={
        "Nats-Msg-Id": f"fetcher:{T}:job1:fp:replay3", "traceparent": "00-abc-def-01",
        REPLAY_HEADER: "3", REPLAY_OF_HEADER: "FRONTIER:1", "Nats-Expected-Stream": "X"})
    headers = replay_headers(StoredLetter(dlq_seq=51, letter=original))
    assert headers == {"Nats-Msg-Id": f"fetcher:{T}:job1:fp:replay51",
                       "traceparent": "00-abc-def-01", REPLAY_HEADER: "51",
                       REPLAY_OF_HEADER: "FETCHED:7"}
    bare = replay_headers(StoredLetter(dlq_seq=2, letter=letter("LINKS", headers={})))
    assert bare["Nats-Msg-Id"] == "LINKS:7:replay2"


def test_original_payloads_are_shown_decoded() -> None:
    page = FetchedPage(tenant=T, job_id="j", url="https://a.test/", final_url="https://a.test/",
                       fingerprint="fp", depth=0, status=200, body=b"\x00\x01zz")
    kind, value = decode_original(encode(page))
    assert kind == "cmb1" and value["url"] == "https://a.test/" and value["binary_bytes"] == 4
    assert decode_original(orjson.dumps({"a": 1})) == ("json", {"a": 1})
    assert decode_original(b"not json") == ("text", "not json")
    assert decode_original(b"\xff\xfe") == ("base64", base64.b64encode(b"\xff\xfe").decode())


def test_filters() -> None:
    assert Selection().subject() == "mesh.dlq.*.*.*"
    assert Selection("parser", T, "none").subject() == f"mesh.dlq.parser.{T}.none"
    assert job_token("-") == "none" and job_token(None) is None and job_token("j1") == "j1"
    with pytest.raises(ValueError):
        job_token("a.b")
    only = Selection(ids=frozenset({"FETCHED:7"}))
    assert only.matches(letter("FETCHED")) and not only.matches(letter("LINKS"))
