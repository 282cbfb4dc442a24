"""Per-page state, the truth for delivery and completion (KV ``pages``, CAS transitions).

Dedup creates each page's key as ``admitted <cause>``. A page is *finished* once its
result is delivered **and** its outlinks were admitted or rejected by dedup, in either
order; a page that failed (dead-lettered) is finished at once::

    admitted --result--> result   --expanded--> finished
    admitted --expanded--> expanded --result--> finished
    any unfinished --failed--> finished

Each transition is a compare-and-set on the key's revision, so exactly one delivery makes
it, and a page that is ``result`` or ``finished`` is never delivered again, whatever the
duplicate window (the delivered marker).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.streams import PAGES_BUCKET


class PageState(StrEnum):
    ADMITTED = "admitted"
    RESULT = "result"
    EXPANDED = "expanded"
    FINISHED = "finished"


class PageEvent(StrEnum):
    RESULT = "result"
    EXPANDED = "expanded"
    FAILED = "failed"


_NEXT: dict[tuple[PageState, PageEvent], PageState] = {
    (PageState.ADMITTED, PageEvent.RESULT): PageState.RESULT,
    (PageState.EXPANDED, PageEvent.RESULT): PageState.FINISHED,
    (PageState.ADMITTED, PageEvent.EXPANDED): PageState.EXPANDED,
    (PageState.RESULT, PageEvent.EXPANDED): PageState.FINISHED,
    (PageState.ADMITTED, PageEvent.FAILED): PageState.FINISHED,
    (PageState.RESULT, PageEvent.FAILED): PageState.FINISHED,
    (PageState.EXPANDED, PageEvent.FAILED): PageState.FINISHED,
}


def advance(state: PageState, event: PageEvent) -> PageState | None:
    """The state after ``event``, or None when the event changes nothing (already done)."""
    return _NEXT.get((state, event))


def delivered(state: PageState) -> bool:
    """True once the page's result has reached the tenant."""
    return state in (PageState.RESULT, PageState.FINISHED)


@dataclass(frozen=True, slots=True)
class PageRecord:
    state: PageState
    cause: str
    revision: int
    finished_by: str = ""
    """``<event>@<input message>`` that finished the page: only a redelivery of that same
    message republishes the page's ledger entries (a late duplicate must not count twice)."""


class KvPageStates:
    """Page states in the ``pages`` bucket, key ``<tenant>.<job>.<fingerprint>``."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def get(self, tenant: str, job: str, fingerprint: str) -> PageRecord | None:
        kv = await self.js.key_value(PAGES_BUCKET)
        try:
            entry = await kv.get(f"{tenant}.{job}.{fingerprint}")
        except KeyNotFoundError:
            return None
        state, cause, by = [*(entry.value or b"").decode().split(" ", 2), "", ""][:3]
        return PageRecord(PageState(state), cause, entry.revision or 0, by)

    async def set(self, tenant: str, job: str, fingerprint: str, record: PageRecord,
                  to: PageState, finished_by: str = "") -> bool:
        """Compare-and-set from ``record`` to ``to``; False if someone changed it first.

        The value is ``<state> <cause>[ <finished_by>]`` (no spaces inside the parts).
        """
        kv = await self.js.key_value(PAGES_BUCKET)
        value = f"{to} {record.cause}" + (f" {finished_by}" if finished_by else "")
        try:
            await kv.update(f"{tenant}.{job}.{fingerprint}", value.encode(),
                            last=record.revision)
        except KeyWrongLastSequenceError:
            return False
        return True
