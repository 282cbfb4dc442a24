"""Content decoding with a cap on the decompressed size (gzip bombs stop at the cap).

httpx's own decoders inflate a whole network chunk at once; this decoder inflates at most
``max_bytes`` (+1, to notice the excess) in total, whatever the compression ratio, so a
small compressed body can never allocate more than the cap.
"""

from __future__ import annotations

import zlib

ACCEPT_ENCODING = "gzip, deflate"
"""The only content codings the fetcher asks for (and decodes)."""


class ContentDecodingError(Exception):
    """A body in an unsupported or corrupt content coding."""


class BoundedDecoder:
    """Decodes one body per its ``Content-Encoding``, keeping at most ``max_bytes``.

    Feed raw chunks with :meth:`feed`; stop when :attr:`truncated` becomes True (the body
    exceeded the cap; what was kept is its first ``max_bytes`` bytes); call :meth:`finish`.

    Raises (from the constructor, :meth:`feed`, :meth:`finish`):
        ContentDecodingError: a coding other than gzip, deflate or identity; corrupt data.
    """

    def __init__(self, content_encoding: str | None, max_bytes: int) -> None:
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1 or (codings and codings[0] not in ("gzip", "x-gzip", "deflate")):
            raise ContentDecodingError(f"unsupported Content-Encoding {content_encoding!r}")
        self.coding = codings[0] if codings else "identity"
        self.max_bytes = max_bytes
        self.truncated = False
        self._parts: list[bytes] = []
        self._size = 0
        self._first = True
        wbits = zlib.MAX_WBITS | 16 if self.coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._inflater = zlib.decompressobj(wbits) if self.coding != "identity" else None

    def feed(self, data: bytes) -> None:
        """Decode ``data`` (raw bytes off the wire) into the body, up to the cap."""
        if self.truncated or not data:
            return
        room = self.max_bytes - self._size
        if self._inflater is None:
            self._keep(data, room)
            return
        try:
            out = self._inflater.decompress(data, room + 1)
        except zlib.error as error:
            if not (self._first and self.coding == "deflate"):
                raise ContentDecodingError(f"corrupt {self.coding} body: {error}") from None
            # "deflate" sent raw (no zlib header), as some servers do.
            self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
            self._first = False
            self.feed(data)
            return
        self._first = False
        self._keep(out, room)

    def finish(self) -> bytes:
        """The decoded body (its first ``max_bytes`` bytes if :attr:`truncated`)."""
        if self._inflater is not None and not self.truncated:
            try:
                tail = self._inflater.flush()
            except zlib.error as error:
                raise ContentDecodingError(f"corrupt {self.coding} body: {error}") from None
            self._keep(tail, self.max_bytes - self._size)
        return b"".join(self._parts)

    def _keep(self, data: bytes, room: int) -> None:
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        if data:
            self._parts.append(data)
            self._size += len(data)
