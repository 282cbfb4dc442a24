"""Replayed dead letters: the headers that mark them and how they travel through the mesh.

``crawlmesh dlq replay`` (:mod:`shared.cli.deadletters`) republishes a dead letter's
original payload to its original subject with its original headers plus two of its own::

    Crawlmesh-Replay: <N>           the replay's generation: the dead letter's DLQ sequence
    Crawlmesh-Replay-Of: <id>       the dead letter's id, ``<stream>:<sequence>``

and ``Nats-Msg-Id: <original id>:replay<N>``. N is unique per dead letter (each dead letter
is one DLQ message), so a replay is never swallowed by a duplicate window, while replaying
the same dead letter twice (an operator re-running a replay that crashed before removing
the dead letter) is de-duplicated by JetStream.

While a replayed message is handled, :func:`current` returns its :class:`Replay` (a
context variable, for code that sees no delivery).

A *page replay* (:attr:`Replay.page`: the dead letter came from ``FRONTIER``, ``FETCHED``,
``PARSED`` or ``PARKED``) re-processes a page that the sink already finished as ``failed``. It
delivers one additional result, marked ``replay_of``, and nothing else: the fetcher
fetches it even if its job has completed since (not if it was cancelled), dedup does not
follow its outlinks, and the sink neither changes its page state nor its job's counters
(:mod:`services.sink.handler`). The consume loop (:mod:`shared.bus.loop`) carries a page
replay's two headers from an input to every output and suffixes each output's
``Nats-Msg-Id`` with ``:replay<N>`` (:func:`carry`), so the stages after it know, a replay's
outputs never collide with earlier outputs for the same page, and a redelivery of a
replayed message still produces the same ids.

Other replays (links, a seed submission) are ordinary inputs of their
stage: their outputs keep their ids, which are per job and page (admissions, ledger
entries, events), so whatever the original had already done is de-duplicated as usual.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loop.py imports this module
    from shared.bus.loop import Outbound

REPLAY_HEADER = "Crawlmesh-Replay"
"""The replay's generation N (the dead letter's DLQ stream sequence), decimal."""

REPLAY_OF_HEADER = "Crawlmesh-Replay-Of"
"""The replayed dead letter's id, ``<stream>:<sequence>`` of the original message."""

PAGE_STREAMS = frozenset({"FRONTIER", "FETCHED", "PARSED", "PARKED"})
"""Streams whose messages are one page each (on the way from admission to its result, or
its result parked over the tenant's quota)."""

_SUFFIX = re.compile(r":replay\d+$")


@dataclass(frozen=True, slots=True)
class Replay:
    """A replay in flight: generation ``generation`` of dead letter ``of``."""

    generation: int
    of: str

    @property
    def stream(self) -> str:
        """The stream the replayed message was dead-lettered from (``FRONTIER``, ...)."""
        return self.of.rsplit(":", 1)[0]

    @property
    def page(self) -> bool:
        """True for a page replay (see module docstring)."""
        return self.stream in PAGE_STREAMS

    def headers(self) -> dict[str, str]:
        """The two replay headers, as sent."""
        return {REPLAY_HEADER: str(self.generation), REPLAY_OF_HEADER: self.of}


def of(headers: dict[str, str] | None) -> Replay | None:
    """The replay that ``headers`` carry, or None (absent or malformed headers)."""
    if not headers:
        return None
    generation, replayed = headers.get(REPLAY_HEADER), headers.get(REPLAY_OF_HEADER)
    if not generation or not replayed or not generation.isdigit() or ":" not in replayed:
        return None
    return Replay(int(generation), replayed)


def replay_msg_id(msg_id: str, generation: int) -> str:
    """``<msg_id>:replay<generation>``, replacing a trailing ``:replay<k>`` of an earlier
    replay (a replay of a replay gets a fresh suffix, not a growing chain)."""
    return f"{_SUFFIX.sub('', msg_id)}:replay{generation}"


def carry(outputs: Sequence[Outbound], replay: Replay | None) -> list[Outbound]:
    """``outputs`` with a page replay's headers and ``:replay<N>`` msg ids (unchanged if
    ``replay`` is None or not a page replay); plain NATS replies (``core``) get the headers
    only."""
    if replay is None or not replay.page:
        return list(outputs)
    marks = replay.headers()
    return [replace(out, headers={**out.headers, **marks},
                    msg_id=out.msg_id if out.core else replay_msg_id(out.msg_id, replay.generation))
            for out in outputs]


_current: contextvars.ContextVar[Replay | None] = contextvars.ContextVar(
    "crawlmesh_replay", default=None)


def current() -> Replay | None:
    """The replay whose message this task is handling, or None."""
    return _current.get()


def handling(replay: Replay | None) -> contextvars.Token[Replay | None]:
    """Mark this task as handling ``replay`` (the loop calls it per delivery)."""
    return _current.set(replay)
