"""Page states (:mod:`services.sink.pages`) and their application by :class:`PageLedger`.

The publisher and the page store are in-memory fakes of the sink's own protocols; the page
store compares and sets on a revision like the KV bucket does. Real KV and streams are
covered by ``tests/integration/test_sink.py``.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest

from services.sink.handler import PageLedger
from services.sink.pages import PageEvent, PageRecord, PageState, advance, delivered
from shared import subjects
from shared.contracts import LedgerEntry, Outcome, PageResult
from shared.contracts.base import Contract
from shared.jobs import ledger_msg_id
from shared.subjects import LedgerKind, Stage

TENANT, JOB = "ATESTTENANT", "0190aa00bb11cc22"
FP = "0123456789abcdef0123456789abcdef"
CAUSE = "dedup:ATESTTENANT:0190aa00bb11cc22:from-seeds-0"

S, E = PageState, PageEvent

# ---- the transition table ----------------------------------------------------------------

TABLE = {
    (S.ADMITTED, E.RESULT): S.RESULT,
    (S.ADMITTED, E.EXPANDED): S.EXPANDED,
    (S.ADMITTED, E.FAILED): S.FINISHED,
    (S.RESULT, E.RESULT): None,
    (S.RESULT, E.EXPANDED): S.FINISHED,
    (S.RESULT, E.FAILED): S.FINISHED,
    (S.EXPANDED, E.RESULT): S.FINISHED,
    (S.EXPANDED, E.EXPANDED): None,
    (S.EXPANDED, E.FAILED): S.FINISHED,
    (S.FINISHED, E.RESULT): None,
    (S.FINISHED, E.EXPANDED): None,
    (S.FINISHED, E.FAILED): None,
}


def test_the_table_covers_every_state_and_event() -> None:
    assert set(TABLE) == set(itertools.product(PageState, PageEvent))


@pytest.mark.parametrize(("state", "event"), list(TABLE))
def test_advance(state: PageState, event: PageEvent) -> None:
    assert advance(state, event) is TABLE[(state, event)]


def test_finished_is_terminal() -> None:
    assert all(advance(S.FINISHED, event) is None for event in PageEvent)


def test_failed_finishes_every_unfinished_state() -> None:
    assert all(advance(state, E.FAILED) is S.FINISHED for state in PageState if state is not S.FINISHED)


def test_both_orders_of_result_and_expansion_finish() -> None:
    for first, second in ((E.RESULT, E.EXPANDED), (E.EXPANDED, E.RESULT)):
        middle = advance(S.ADMITTED, first)
        assert middle is not None
        assert advance(middle, second) is S.FINISHED


def test_delivered_once_the_result_is_out() -> None:
    assert {state for state in PageState if delivered(state)} == {S.RESULT, S.FINISHED}


# ---- PageLedger --------------------------------------------------------------------------


class FakePublisher:
    """Records publishes; ``failures`` makes the next that many publishes raise."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Contract, str]] = []
        self.failures = 0

    async def publish(self, subject: str, message: Contract, msg_id: str) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("no PubAck")
        self.sent.append((subject, message, msg_id))

    def on(self, subject: str) -> list[tuple[str, Contract, str]]:
        return [sent for sent in self.sent if sent[0] == subject]


class FakePageStates:
    """Page states with a revision per key; ``set`` is a compare-and-set on it.

    ``before_set`` runs once before the next ``set``, to let "another replica" change the
    page in between (a lost compare-and-set).
    """

    def __init__(self) -> None:
        self.pages: dict[str, tuple[PageState, str, int, str]] = {}
        self.before_set: PageState | None = None

    def put(self, fp: str, state: PageState, cause: str = CAUSE, by: str = "") -> None:
        revision = self.pages[fp][2] + 1 if fp in self.pages else 1
        self.pages[fp] = (state, cause, revision, by)

    def state(self, fp: str) -> PageState:
        return self.pages[fp][0]

    async def get(self, tenant: str, job: str, fingerprint: str) -> PageRecord | None:
        if fingerprint not in self.pages:
            return None
        state, cause, revision, by = self.pages[fingerprint]
        return PageRecord(state, cause, revision, by)

    async def set(self, tenant: str, job: str, fingerprint: str, record: PageRecord,
                  to: PageState, finished_by: str = "") -> bool:
        if self.before_set is not None:
            self.put(fingerprint, self.before_set)
            self.before_set = None
        if self.pages[fingerprint][2] != record.revision:
            return False
        self.put(fingerprint, to, record.cause, finished_by)
        return True


class FakeCompletion:
    def __init__(self) -> None:
        self.checks: list[tuple[str, str]] = []

    async def check(self, tenant: str, job: str) -> bool:
        self.checks.append((tenant, job))
        return False


RESULTS = subjects.results(TENANT, JOB)
FINISHED = subjects.ledger(TENANT, JOB, LedgerKind.FINISHED)
FAILED = subjects.ledger(TENANT, JOB, LedgerKind.FAILED)
RESULT_ID = subjects.msg_id(Stage.SINK, TENANT, JOB, FP)
FINISHED_ID = ledger_msg_id(TENANT, JOB, LedgerKind.FINISHED, FP)
FAILED_ID = ledger_msg_id(TENANT, JOB, LedgerKind.FAILED, FP)


def result(outcome: Outcome = Outcome.OK) -> PageResult:
    return PageResult(tenant=TENANT, job_id=JOB, url="https://site.test/", fingerprint=FP,
                      outcome=outcome, status=200, depth=0,
                      fetched_at=datetime(2025, 1, 1, tzinfo=UTC))


@pytest.fixture
def publisher() -> FakePublisher:
    return FakePublisher()


@pytest.fixture
def pages() -> FakePageStates:
    states = FakePageStates()
    states.put(FP, S.ADMITTED)
    return states


@pytest.fixture
def completion() -> FakeCompletion:
    return FakeCompletion()


@pytest.fixture
def ledger(publisher: FakePublisher, pages: FakePageStates, completion: FakeCompletion) -> PageLedger:
    return PageLedger(publisher, pages, completion)  # type: ignore[arg-type]


async def test_a_result_is_delivered_once_even_if_applied_twice(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    assert publisher.sent == [(RESULTS, result(), RESULT_ID)]
    assert pages.state(FP) is S.RESULT
    assert completion.checks == []


async def test_result_then_expansion_finishes_the_page(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED)
    finished = LedgerEntry(tenant=TENANT, job_id=JOB, kind="finished", fingerprint=FP)
    assert publisher.sent == [(RESULTS, result(), RESULT_ID), (FINISHED, finished, FINISHED_ID)]
    assert pages.state(FP) is S.FINISHED
    assert completion.checks == [(TENANT, JOB)]


async def test_expansion_then_result_finishes_the_page(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED)
    assert publisher.sent == [] and pages.state(FP) is S.EXPANDED
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    assert [(s, i) for s, _, i in publisher.sent] == [(RESULTS, RESULT_ID), (FINISHED, FINISHED_ID)]
    assert pages.state(FP) is S.FINISHED
    assert completion.checks == [(TENANT, JOB)]


async def test_a_finished_page_is_not_delivered_again_but_its_ledger_entry_is_republished(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    """A redelivery of the message that finished the page (the sink may have died before
    its ledger entry landed) publishes the entry again with the same msg id, never the
    result; the other message's redelivery publishes nothing."""
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED)
    first = list(publisher.sent)
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED)
    again = publisher.sent[len(first):]
    assert [(s, i) for s, _, i in again] == [(FINISHED, FINISHED_ID)]
    assert len(publisher.on(RESULTS)) == 1
    assert pages.state(FP) is S.FINISHED
    assert len(completion.checks) == 2


@pytest.mark.parametrize("state", [S.ADMITTED, S.EXPANDED])
async def test_failed_before_delivery_publishes_a_failed_result_and_ledger_entries(
    state: PageState, ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    pages.put(FP, state)
    failed = result(Outcome.FAILED)
    await ledger.apply(TENANT, JOB, FP, E.FAILED, failed)
    assert [(s, i) for s, _, i in publisher.sent] == [
        (RESULTS, RESULT_ID), (FAILED, FAILED_ID), (FINISHED, FINISHED_ID)]
    assert publisher.sent[0][1] == failed
    assert publisher.sent[1][1] == LedgerEntry(tenant=TENANT, job_id=JOB, kind="failed",
                                               fingerprint=FP)
    assert pages.state(FP) is S.FINISHED
    assert completion.checks == [(TENANT, JOB)]


async def test_failed_after_delivery_keeps_the_delivered_result(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
) -> None:
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    await ledger.apply(TENANT, JOB, FP, E.FAILED, result(Outcome.FAILED))
    assert [(s, i) for s, _, i in publisher.sent] == [
        (RESULTS, RESULT_ID), (FAILED, FAILED_ID), (FINISHED, FINISHED_ID)]
    assert publisher.sent[0][1].outcome is Outcome.OK  # type: ignore[attr-defined]
    assert pages.state(FP) is S.FINISHED


async def test_a_lost_compare_and_set_is_retried_from_the_new_state(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
    completion: FakeCompletion,
) -> None:
    pages.before_set = S.EXPANDED  # another replica applies the expansion meanwhile
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    assert pages.state(FP) is S.FINISHED
    # The result went out before the lost compare-and-set and again before the retried one:
    # with the same msg id, so the stream stores it once.
    assert [(s, i) for s, _, i in publisher.sent] == [
        (RESULTS, RESULT_ID), (RESULTS, RESULT_ID), (FINISHED, FINISHED_ID)]
    assert completion.checks == [(TENANT, JOB)]


async def test_a_failed_publish_leaves_the_state_for_the_retry(
    ledger: PageLedger, publisher: FakePublisher, pages: FakePageStates,
) -> None:
    publisher.failures = 1
    with pytest.raises(RuntimeError):
        await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    assert pages.state(FP) is S.ADMITTED
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result())
    assert publisher.sent == [(RESULTS, result(), RESULT_ID)]
    assert pages.state(FP) is S.RESULT


async def test_a_page_without_state_is_ignored(
    ledger: PageLedger, publisher: FakePublisher, completion: FakeCompletion,
) -> None:
    await ledger.apply(TENANT, JOB, "f" * 32, E.RESULT, result())
    await ledger.apply(TENANT, JOB, "f" * 32, E.FAILED, result(Outcome.FAILED))
    assert publisher.sent == [] and completion.checks == []


async def test_seeded_publishes_one_seeded_entry_and_checks(
    ledger: PageLedger, publisher: FakePublisher, completion: FakeCompletion,
) -> None:
    await ledger.seeded(TENANT, JOB)
    assert publisher.sent == [(
        subjects.ledger(TENANT, JOB, LedgerKind.SEEDED),
        LedgerEntry(tenant=TENANT, job_id=JOB, kind="seeded"),
        ledger_msg_id(TENANT, JOB, LedgerKind.SEEDED, "seeds"),
    )]
    assert completion.checks == [(TENANT, JOB)]


async def test_a_late_duplicate_from_another_message_does_not_count_the_page_twice() -> None:
    publisher, pages, completion = FakePublisher(), FakePageStates(), FakeCompletion()
    ledger = PageLedger(publisher, pages, completion)  # type: ignore[arg-type]
    pages.put(FP, PageState.ADMITTED)
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result(), source="mesh.parsed.T.J#7")
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED, source="mesh.expanded.T.J#9")
    finished_id = ledger_msg_id(TENANT, JOB, LedgerKind.FINISHED, FP)
    assert [m for _, _, m in publisher.sent].count(finished_id) == 1
    # The finishing message redelivered: its ledger entry is republished (same id).
    await ledger.apply(TENANT, JOB, FP, E.EXPANDED, source="mesh.expanded.T.J#9")
    assert [m for _, _, m in publisher.sent].count(finished_id) == 2
    # A duplicate page from another message (e.g. a replay, past the duplicate window):
    # nothing is published, so the ledger cannot count the page twice.
    before = len(publisher.sent)
    await ledger.apply(TENANT, JOB, FP, E.RESULT, result(), source="mesh.parsed.T.J#99")
    await ledger.apply(TENANT, JOB, FP, E.FAILED, result(Outcome.FAILED), source="mesh.dlq.x#1")
    assert len(publisher.sent) == before
