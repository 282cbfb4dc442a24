"""Listing the keys of a KV bucket reliably.

nats-py's ``KeyValue.keys()`` lists keys through an ordered-consumer watcher and can come
back short or empty under load (seen in CI: ``crawlmesh status`` listed no jobs right after
one completed); its ``filters`` argument also matches *substrings*, so a subject-style
filter such as ``acme.*`` never matches anything. Listing the bucket stream's subjects
(``STREAM.INFO`` with ``subjects_filter``, one request answered from the server's subject
index) has neither problem. Keys whose last entry is a delete or purge marker still have a
subject, so :func:`live_entries` reads each candidate and leaves those out.
"""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

MAX_SUBJECT_DETAILS = 100_000
"""Most subjects one ``STREAM.INFO`` answer lists (the server's ``JSMaxSubjectDetails``)."""


class TooManyKeysError(RuntimeError):
    """The filter matches more keys than one listing can return."""


async def kv_keys(js: JetStreamContext, bucket: str, pattern: str = ">") -> list[str]:
    """Keys of ``bucket`` matching the subject-style ``pattern`` (``*`` one token, ``>`` the
    rest), sorted. Includes keys whose last entry is a delete or purge marker: use
    :func:`live_entries` when removed keys must be left out.

    Raises:
        TooManyKeysError: more than :data:`MAX_SUBJECT_DETAILS` keys match (narrow it).
        nats.js.errors.NotFoundError: no such bucket.
    """
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + pattern)
    subjects = info.state.subjects or {}
    if len(subjects) >= MAX_SUBJECT_DETAILS:
        raise TooManyKeysError(f"more than {MAX_SUBJECT_DETAILS} keys in {bucket} match "
                               f"{pattern!r}")
    return sorted(subject.removeprefix(prefix) for subject in subjects)


async def live_entries(js: JetStreamContext, kv: KeyValue, bucket: str,
                       pattern: str = ">") -> dict[str, bytes]:
    """``{key: value}`` for every key of ``bucket`` matching ``pattern`` that has a value now
    (deleted and purged keys left out), read concurrently (64 at a time).

    Raises:
        TooManyKeysError: see :func:`kv_keys`.
    """

    slots = asyncio.Semaphore(64)

    async def read(key: str) -> tuple[str, bytes | None]:
        try:
            async with slots:
                entry = await kv.get(key)
        except KeyNotFoundError:  # KeyDeletedError is a subclass: delete or purge marker
            return key, None
        return key, entry.value or b""

    pairs = await asyncio.gather(*(read(key) for key in await kv_keys(js, bucket, pattern)))
    return {key: value for key, value in pairs if value is not None}
