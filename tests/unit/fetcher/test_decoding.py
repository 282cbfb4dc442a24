"""Content codings against real loopback sites: gzip, deflate, brotli and zstd decoded with
the size cap applied as bytes are produced (bombs stop at the cap, memory stays bounded);
truncated and corrupt bodies are failures, not pages."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

import brotli
import pytest
import zstandard

from services.fetcher.decoding import ACCEPT_ENCODING, BoundedDecoder, ContentDecodingError
from services.fetcher.handler import FetcherHandler
from shared.bus.outcomes import TransientError
from shared.codec import decode, decompress, encode
from shared.contracts import FetchedPage
from tests.sites import Site
from tests.unit.fetcher.conftest import MakeHandler, delivery, entry, gzipped, respond

HTML = b"<html><head><title>t</title></head><body>" + b"hello " * 500 + b"</body></html>"
MIB = 1 << 20
BOMB_BYTES = 1 << 30  # 1 GiB of zeros once decompressed
CAP = 10 * MIB


async def fetch(handler: FetcherHandler, url: str, delivered: int = 1) -> FetchedPage:
    (out,) = await handler.handle(entry(url), delivery(delivered))
    return decode(encode(out.message), FetchedPage)


def gzip_bomb() -> bytes:
    """1 GiB of zeros as gzip (~1 MiB): one sync-flushed deflate block of 1 MiB of zeros,
    repeated (each copy only refers to bytes it produced itself), then the trailer."""
    zeros = b"\0" * MIB
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflater.compress(zeros) + deflater.flush(zlib.Z_SYNC_FLUSH)
    crc = 0
    for _ in range(BOMB_BYTES // MIB):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    trailer = struct.pack("<II", crc, BOMB_BYTES & 0xFFFFFFFF)
    return header + block * (BOMB_BYTES // MIB) + b"\x03\x00" + trailer


def brotli_bomb() -> bytes:
    compressor = brotli.Compressor(quality=4)
    zeros = b"\0" * MIB
    parts = [compressor.process(zeros) for _ in range(BOMB_BYTES // MIB)]
    return b"".join(parts) + compressor.finish()


def zstd_bomb() -> bytes:
    compressor = zstandard.ZstdCompressor(level=1).compressobj()
    zeros = b"\0" * MIB
    parts = [compressor.compress(zeros) for _ in range(BOMB_BYTES // MIB)]
    return b"".join(parts) + compressor.flush()


BOMBS: dict[str, Callable[[], bytes]] = {"gzip": gzip_bomb, "br": brotli_bomb, "zstd": zstd_bomb}
ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzipped,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
}


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {coding: make() for coding, make in BOMBS.items()}


def test_only_decoded_codings_are_advertised() -> None:
    assert {c.strip() for c in ACCEPT_ENCODING.split(",")} == set(ENCODERS)
    for coding in ENCODERS:
        BoundedDecoder(coding, 10)  # each advertised coding has a decoder
    with pytest.raises(ContentDecodingError):
        BoundedDecoder("compress", 10)
    with pytest.raises(ContentDecodingError):
        BoundedDecoder("gzip, br", 10)  # stacked codings are refused


async def test_accept_encoding_is_sent(site: Site, make_handler: MakeHandler) -> None:
    seen: list[str] = []

    def record(req: BaseHTTPRequestHandler) -> None:
        seen.append(req.headers.get("Accept-Encoding", ""))
        respond(req, 200, HTML)

    site.routes["/a"] = record
    await fetch(make_handler(), site.url("/a"))
    assert seen == [ACCEPT_ENCODING]


@pytest.mark.parametrize("coding", sorted(ENCODERS))
async def test_each_coding_is_decoded(site: Site, make_handler: MakeHandler, coding: str) -> None:
    body = ENCODERS[coding](HTML)
    site.routes["/z"] = lambda req: respond(req, 200, body, Content_Encoding=coding)
    page = await fetch(make_handler(), site.url("/z"))
    assert page.error is None and decompress(page.body, "zlib") == HTML


def test_raw_deflate_is_tolerated() -> None:
    deflater = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw = deflater.compress(HTML) + deflater.flush()
    decoder = BoundedDecoder("deflate", 1 << 20)
    decoder.feed(raw)
    assert decoder.finish() == HTML


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_cap_holds_whatever_the_chunking(coding: str) -> None:
    body = ENCODERS[coding](b"a" * 100_000)
    for size in (1, 7, 4096, len(body)):
        decoder = BoundedDecoder(coding, 30_000)
        for i in range(0, len(body), size):
            decoder.feed(body[i:i + size])
            if decoder.truncated:
                break
        assert decoder.truncated and decoder.finish() == b"a" * 30_000


@pytest.mark.parametrize("coding", sorted(BOMBS))
def test_one_bomb_chunk_never_inflates_past_the_cap(bombs: dict[str, bytes], coding: str) -> None:
    """The whole compressed bomb in ONE feed: output stops at the cap as it is produced."""
    decoder = BoundedDecoder(coding, CAP)
    tracemalloc.start()
    try:
        decoder.feed(bombs[coding])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert decoder.truncated and len(decoder.finish()) == CAP
    assert peak < CAP + 6 * MIB, f"{coding}: peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("coding", sorted(BOMBS))
async def test_bomb_over_http_stops_at_the_cap(
    site: Site, make_handler: MakeHandler, bombs: dict[str, bytes], coding: str,
) -> None:
    bomb = bombs[coding]
    site.routes["/bomb"] = lambda req: respond(req, 200, bomb, Content_Encoding=coding)
    handler = make_handler(max_body_bytes=CAP)
    tracemalloc.start()
    try:
        page = await fetch(handler, site.url("/bomb"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert page.status == 0 and page.body_bytes == 0
    assert page.error == f"body exceeds {CAP} bytes (decompressed)"
    # the kept parts and their join (2 x the cap), the bomb read off the wire, small change;
    # nowhere near the 1 GiB it inflates to
    assert peak < 2 * CAP + 2 * len(bomb) + 8 * MIB, f"{coding}: peak {peak / MIB:.1f} MiB"


def short_body(req: BaseHTTPRequestHandler) -> None:
    """Announces 10000 bytes, sends 100, closes."""
    req.send_response(200)
    req.send_header("Content-Type", "text/html")
    req.send_header("Content-Length", "10000")
    req.end_headers()
    req.wfile.write(b"<html>" + b"x" * 94)
    req.close_connection = True


def cut_chunked(req: BaseHTTPRequestHandler) -> None:
    """A chunked body without its last (empty) chunk."""
    req.protocol_version = "HTTP/1.1"
    req.send_response(200)
    req.send_header("Content-Type", "text/html")
    req.send_header("Transfer-Encoding", "chunked")
    req.end_headers()
    req.wfile.write(b"64\r\n" + b"x" * 100 + b"\r\n")
    req.close_connection = True


def cut_gzip(req: BaseHTTPRequestHandler) -> None:
    """A complete HTTP message whose gzip stream stops before its end."""
    respond(req, 200, gzipped(HTML)[:-20], Content_Encoding="gzip")


@pytest.mark.parametrize("route", [short_body, cut_chunked, cut_gzip], ids=lambda r: r.__name__)
async def test_truncated_body_is_a_failure_not_a_page(
    site: Site, make_handler: MakeHandler, route: Callable[[BaseHTTPRequestHandler], None],
) -> None:
    site.routes["/t"] = route
    handler = make_handler(http_retries=1)
    with pytest.raises(TransientError):  # transient: a retry may get the whole body
        await fetch(handler, site.url("/t"), 1)
    page = await fetch(handler, site.url("/t"), 2)
    assert page.status == 0 and page.body_bytes == 0
    assert page.error is not None and "truncated" in page.error


@pytest.mark.parametrize("coding", ["br", "zstd"])
def test_truncated_brotli_and_zstd_streams_are_errors(coding: str) -> None:
    decoder = BoundedDecoder(coding, 1 << 20)
    decoder.feed(ENCODERS[coding](HTML)[:-8])
    with pytest.raises(ContentDecodingError, match="truncated"):
        decoder.finish()


async def test_corrupt_coding_is_permanent(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/c"] = lambda req: respond(req, 200, b"not gzip at all", Content_Encoding="gzip")
    page = await fetch(make_handler(http_retries=2), site.url("/c"), 1)  # no retry
    assert page.status == 0 and page.error is not None and "corrupt gzip body" in page.error
    assert site.requests.count("/c") == 1
