"""Content decoding with a cap on the decompressed size, applied as bytes are produced.

httpx's own decoders inflate a whole network chunk at once, and one chunk of brotli or
zstd can expand to gigabytes. This decoder asks each decompressor for at most what is
left of ``max_bytes`` (+1, to notice the excess), :data:`OUTPUT_STEP` at a time, so a small
compressed body can never allocate much more than the cap:

* gzip / deflate: ``zlib.decompressobj().decompress(data, max_length)``; the rest of the
  input waits in ``unconsumed_tail``.
* brotli: ``brotli.Decompressor().process(data, output_buffer_limit=...)`` (Brotli >= 1.2);
  while ``can_accept_more_data()`` is False, more output is drained with empty input.
* zstd: ``zstandard`` has no output limit per call, so the input is fed in slices of
  :data:`ZSTD_SLICE` bytes: a zstd block yields at most 128 KiB and needs at least 3
  bytes of input, so one slice yields at most ~1.4 MiB.

A compressed stream that ends before its end marker (gzip trailer, deflate final block,
brotli last meta-block, zstd frame end) is a :class:`ContentDecodingError`: a truncated
body is a failure, not a page. Only the codings listed in :data:`ACCEPT_ENCODING` are
advertised and decoded; a stack of codings (``gzip, br``) is refused.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import brotli
import zstandard

ACCEPT_ENCODING = "gzip, deflate, br, zstd"
"""The only content codings the fetcher asks for (and decodes)."""

OUTPUT_STEP = 256 * 1024
"""Most output asked of a decompressor in one call (then asked again for more)."""

ZSTD_SLICE = 32
"""Input bytes given to the zstd decompressor per call (bounds its output, see above)."""

_ALIASES = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate", "br": "br", "zstd": "zstd"}


class ContentDecodingError(Exception):
    """A body in an unsupported or corrupt content coding, or a truncated compressed stream."""


class _Inflater(Protocol):
    def feed(self, data: bytes, limit: int) -> bytes:
        """Output of ``data`` (at most ``limit`` bytes; more may come from :meth:`more`)."""
        ...

    def more(self, limit: int) -> bytes:
        """Output still pending from earlier input, at most ``limit`` bytes (b"" if none)."""
        ...

    def finished(self) -> bool:
        """Whether the stream's end marker was seen."""
        ...


class _Zlib:
    def __init__(self, coding: str) -> None:
        self.coding = coding
        wbits = zlib.MAX_WBITS | 16 if coding == "gzip" else zlib.MAX_WBITS
        self._obj = zlib.decompressobj(wbits)
        self._first = True

    def feed(self, data: bytes, limit: int) -> bytes:
        try:
            out = self._obj.decompress(data, limit)
        except zlib.error:
            if not (self._first and self.coding == "deflate"):
                raise
            # "deflate" sent raw (no zlib header), as some servers do.
            self._obj = zlib.decompressobj(-zlib.MAX_WBITS)
            out = self._obj.decompress(data, limit)
        self._first = False
        return out

    def more(self, limit: int) -> bytes:
        if self._obj.eof:
            return b""
        # Output can also be pending inside zlib with no input left: empty input drains it.
        return self._obj.decompress(self._obj.unconsumed_tail, limit)

    def finished(self) -> bool:
        return self._obj.eof


class _Brotli:
    def __init__(self) -> None:
        self._obj = brotli.Decompressor()

    def feed(self, data: bytes, limit: int) -> bytes:
        return self._obj.process(data, output_buffer_limit=max(limit, 1))

    def more(self, limit: int) -> bytes:
        if self._obj.can_accept_more_data():
            return b""
        return self._obj.process(b"", output_buffer_limit=max(limit, 1))

    def finished(self) -> bool:
        return self._obj.is_finished()


class _Zstd:
    def __init__(self) -> None:
        self._obj = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""

    def feed(self, data: bytes, limit: int) -> bytes:
        self._pending += data
        return self.more(limit)

    def more(self, limit: int) -> bytes:
        out: list[bytes] = []
        size = 0
        view = memoryview(self._pending)
        used = 0
        while used < len(view) and size < limit and not self._obj.eof:
            piece = self._obj.decompress(view[used:used + ZSTD_SLICE].tobytes())
            used += ZSTD_SLICE
            out.append(piece)
            size += len(piece)
        self._pending = b"" if self._obj.eof else view[used:].tobytes()
        return b"".join(out)

    def finished(self) -> bool:
        return self._obj.eof


class BoundedDecoder:
    """Decodes one body per its ``Content-Encoding``, keeping at most ``max_bytes``.

    Feed raw chunks with :meth:`feed`; stop when :attr:`truncated` becomes True (the body
    exceeded the cap; what was kept is its first ``max_bytes`` bytes); call :meth:`finish`.

    Raises (from the constructor, :meth:`feed`, :meth:`finish`):
        ContentDecodingError: a coding other than gzip, deflate, br, zstd or identity;
            corrupt data; a compressed stream cut short (from :meth:`finish`).
    """

    def __init__(self, content_encoding: str | None, max_bytes: int) -> None:
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        if len(codings) > 1 or (codings and codings[0] not in _ALIASES):
            raise ContentDecodingError(f"unsupported Content-Encoding {content_encoding!r}")
        self.coding = _ALIASES[codings[0]] if codings else "identity"
        self.max_bytes = max_bytes
        self.truncated = False
        self._parts: list[bytes] = []
        self._size = 0
        self._inflater: _Inflater | None = None
        if self.coding in ("gzip", "deflate"):
            self._inflater = _Zlib(self.coding)
        elif self.coding == "br":
            self._inflater = _Brotli()
        elif self.coding == "zstd":
            self._inflater = _Zstd()

    def feed(self, data: bytes) -> None:
        """Decode ``data`` (raw bytes off the wire) into the body, up to the cap."""
        if self.truncated or not data:
            return
        if self._inflater is None:
            self._keep(data)
            return
        try:
            self._keep(self._inflater.feed(data, self._room()))
            while not self.truncated:
                out = self._inflater.more(self._room())
                if not out:
                    break
                self._keep(out)
        except (zlib.error, brotli.error, zstandard.ZstdError) as error:
            raise ContentDecodingError(f"corrupt {self.coding} body: {error}") from None

    def finish(self) -> bytes:
        """The decoded body (its first ``max_bytes`` bytes if :attr:`truncated`).

        Raises:
            ContentDecodingError: the compressed stream ended before its end marker.
        """
        if self._inflater is not None and not self.truncated and not self._inflater.finished():
            raise ContentDecodingError(f"truncated {self.coding} body (stream cut short)")
        return b"".join(self._parts)

    def _room(self) -> int:
        """Output asked for in one call: what is left of the cap (+1 to notice the
        excess), in steps of at most :data:`OUTPUT_STEP` bytes."""
        return min(self.max_bytes - self._size + 1, OUTPUT_STEP)

    def _keep(self, data: bytes) -> None:
        room = self.max_bytes - self._size
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        if data:
            self._parts.append(data)
            self._size += len(data)
