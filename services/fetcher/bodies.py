"""Packing a page body for the wire: zlib-compressed, inline or in the body store.

Bodies travel as raw compressed bytes (never base64). When the compressed body is larger
than ``body_inline_max_bytes`` (NATS's max payload is 1 MiB by default) it goes to the
tenant's Object Store bucket under the deterministic name ``<job>/<fingerprint>`` (a
redelivery overwrites the same object; the bucket's TTL removes it) and the message
carries a :class:`~shared.contracts.BodyRef` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from shared.bus.outcomes import TransientError
from shared.codec import compress
from shared.contracts import BodyRef
from shared.streams import bodies_bucket


class BodyStore(Protocol):
    """Where large bodies go (the tenant's Object Store bucket in production)."""

    async def put(self, bucket: str, name: str, data: bytes) -> None:
        """Store ``data`` under ``name``, replacing any object of that name.

        Raises:
            Exception: any failure (the caller turns it into a retry).
        """
        ...


@dataclass(frozen=True, slots=True)
class PackedBody:
    """A body ready for a :class:`~shared.contracts.FetchedPage`: ``inline`` bytes in
    ``encoding``, or empty with ``ref`` set."""

    encoding: Literal["identity", "zlib"]
    inline: bytes
    ref: BodyRef | None


async def pack_body(body: bytes, *, tenant: str, job: str, fingerprint: str,
                    store: BodyStore, inline_max_bytes: int) -> PackedBody:
    """Compress ``body``; store it if the compressed size exceeds ``inline_max_bytes``.

    An empty body is ``b""`` with encoding ``identity`` (nothing to inflate).

    Raises:
        TransientError: the body store failed (the fetch is retried).
    """
    if not body:
        return PackedBody("identity", b"", None)
    packed = compress(body)
    if len(packed) <= inline_max_bytes:
        return PackedBody("zlib", packed, None)
    bucket, name = bodies_bucket(tenant), f"{job}/{fingerprint}"
    try:
        await store.put(bucket, name, packed)
    except Exception as failure:
        raise TransientError(f"storing body {bucket}/{name}: {failure!r}") from None
    return PackedBody("zlib", b"", BodyRef(bucket=bucket, name=name, stored_bytes=len(packed)))
