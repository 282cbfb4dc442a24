"""A bounded-time fuzz of the parser on mutated real pages.

The pages are the HTML files of the real-world corpus (``../shared/corpus``: the Python,
PostgreSQL and Django documentation that its ``serve`` script serves, installed from Debian
packages under ``/usr/share/doc``; or any folder named by ``CRAWLMESH_FUZZ_CORPUS``). Each
round takes a page, applies one to four random mutations (byte flips, hostile snippets such
as NUL bytes, broken tags and entities, invalid UTF-8, deep nesting, deleted, duplicated or
spliced slices, a truncation, another declared charset, a corrupt zlib stream) and hands it
to :class:`ParserHandler` as the service does. Whatever the input, the handler must
return one parsed page and one links message, each within the server's max payload, with
only absolute http(s) links of bounded length, each once, in bounded time.

Runs for ``CRAWLMESH_FUZZ_S`` seconds (default 15); a longer run::

    CRAWLMESH_FUZZ_S=600 pytest tests/unit/parser/test_parser_fuzz.py -s

``CRAWLMESH_FUZZ_SEED`` replays a run (the seed is printed, and named in any failure).
Skipped when no corpus is installed.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from services.parser.handler import ParserHandler
from services.parser.html import PageLimits
from shared.codec import compress, encode
from shared.contracts import DiscoveredLinks, ExtractionRule, FetchedPage, ParsedPage
from shared.contracts.requests import MAX_URL_CHARS
from tests.unit.parser.test_handler import DELIVERY, FP, JOB, TENANT, FakeBodies, FakeRules

CORPUS_ROOTS = (
    Path("/usr/share/doc/python3.11/html"),
    Path("/usr/share/doc/postgresql-doc-15/html"),
    Path("/usr/share/doc/python-django-doc/html"),
)
"""Where ``../shared/corpus/serve`` finds its three sites (Debian packages)."""

MAX_PAYLOAD_BYTES = 1 << 20
"""nats-server's default max payload: every output must fit."""

MAX_HANDLE_S = 15.0
"""Longest one page may take (generous: this machine is shared; typical is < 0.1 s)."""

SNIPPETS = (
    b"\x00", b"\x00" * 64, b"<", b">", b"</", b"<a href=", b'<a href="', b"<a href='javascript:x'>",
    b'<a href="http://[::1">', b'<a href="http://a:99999/">', b'<a href="//\\\\evil/">',
    b'<base href="ftp://x/">', b'<base href="http://other.example/deep/">', b"<!--", b"-->",
    b"<![CDATA[", b"]]>", b"<script>", b"</script>", b"<style>", b"<title>", b"</title>",
    b"<svg><title>x</title>", b"<math><mi>", b"&", b"&#", b"&#x110000;", b"&#xD800;", b"&#0;",
    b"&amp", b"&nbsp", b"\xff\xfe", b"\xfe\xff", b"\xef\xbb\xbf", b"\xc3\x28", b"\xe2\x82",
    b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80", b"\x80\x81\x82", b"<meta charset=utf-16>",
    b'<meta http-equiv="Content-Type" content="text/html; charset=shift_jis">',
    b"<meta charset=bogus-charset>", b'<?xml version="1.0" encoding="utf-32"?>',
    b'<meta name="robots" content="nofollow">', b'<link rel=canonical href="::">',
    b"<table><tr><td>" * 50, b"<a href=" + b"x" * 5000 + b">", b"\r", b"\n" * 100,
    b'<a href="' + b"/%" * 1200 + b'">', b"<a title=" + b"'" * 300 + b">",
)
CHARSETS = (None, "text/html", "text/html; charset=utf-8", "text/html; charset=iso-8859-1",
            "text/html; charset=utf-16", "text/html; charset=shift_jis", "text/html; charset=x-no",
            "application/xhtml+xml", "text/html; charset=utf-7", "text/html;charset=")
RULES = (
    ExtractionRule(name="h1", css="h1::text"),
    ExtractionRule(name="links", css="a::attr(href)", all=True),
    ExtractionRule(name="heads", xpath="//h2//text()", all=True),
)


def corpus_pages() -> list[Path]:
    override = os.environ.get("CRAWLMESH_FUZZ_CORPUS")
    roots = [Path(override)] if override else [r for r in CORPUS_ROOTS if r.is_dir()]
    return sorted(p for root in roots for p in root.rglob("*.html"))


def mutate(rng: random.Random, body: bytes, other: bytes) -> tuple[bytes, list[str]]:
    """``body`` with one to four random mutations; also the list of what was done."""
    done: list[str] = []
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(body) + 1)
        kind = rng.randrange(8)
        if kind == 0:
            flips = bytearray(body)
            for _ in range(rng.randint(1, 32)):
                if flips:
                    flips[rng.randrange(len(flips))] = rng.randrange(256)
            body, note = bytes(flips), "flip bytes"
        elif kind == 1:
            snippet = rng.choice(SNIPPETS) * rng.choice((1, 1, 1, 10))
            body, note = body[:at] + snippet + body[at:], f"insert {snippet[:40]!r} at {at}"
        elif kind == 2:
            end = min(len(body), at + rng.randint(1, 20_000))
            body, note = body[:at] + body[end:], f"delete {at}:{end}"
        elif kind == 3:
            end = min(len(body), at + rng.randint(1, 4096))
            body, note = body[:end] + body[at:end] * rng.randint(1, 16) + body[end:], f"repeat {at}:{end}"
        elif kind == 4:
            body, note = body[:at], f"truncate at {at}"
        elif kind == 5:
            cut = rng.randrange(len(other) + 1)
            body, note = body[:at] + other[cut:], f"splice other[{cut}:] at {at}"
        elif kind == 6:
            depth = rng.choice((100, 1000, 5000))
            tag = rng.choice((b"<div>", b"<b>", b"<a href=x>", b"<table>", b"<span><i>"))
            body, note = body[:at] + tag * depth + body[at:], f"nest {tag!r} x{depth} at {at}"
        else:
            body, note = body.replace(b"utf-8", rng.choice((b"utf-16", b"latin-1", b"nope"))), \
                "swap declared charset"
        done.append(note)
    return body[:4 << 20], done


def fetched(rng: random.Random, body: bytes) -> tuple[FetchedPage, str]:
    """``body`` as the fetcher publishes it (zlib, sometimes identity, sometimes corrupt)."""
    content_type = rng.choice(CHARSETS)
    encoding, stored = "zlib", compress(body)
    roll = rng.random()
    if roll < 0.1:
        encoding, stored = "identity", body
    elif roll < 0.15 and stored:
        spoiled = bytearray(stored)
        spoiled[rng.randrange(len(spoiled))] ^= 0xFF
        stored = bytes(spoiled)
    page = FetchedPage(
        tenant=TENANT, job_id=JOB, url="https://docs.example/a/b/page.html",
        final_url="https://docs.example/a/b/page.html", fingerprint=FP, depth=1, status=200,
        content_type=content_type, body_bytes=len(body), body_encoding=encoding, body=stored,
    )
    return page, f"content type {content_type!r}, {encoding}{' (spoiled)' if roll < .15 else ''}"


def check(page: ParsedPage, links: DiscoveredLinks) -> None:
    assert len(encode(page)) <= MAX_PAYLOAD_BYTES
    assert len(encode(links)) <= MAX_PAYLOAD_BYTES
    urls = [link.url for link in links.links]
    assert len(urls) == len(set(urls)) == page.links_found
    for url in urls:
        assert url.startswith(("http://", "https://")) and len(url) <= MAX_URL_CHARS, url
    assert page.title is None or len(page.title) <= 4096


async def test_parser_survives_mutated_corpus_pages() -> None:
    pages = corpus_pages()
    if not pages:
        pytest.skip("no corpus installed (../shared/corpus/serve start installs it)")
    budget_s = float(os.environ.get("CRAWLMESH_FUZZ_S", "15"))
    seed = int(os.environ.get("CRAWLMESH_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
    rng = random.Random(seed)
    handler = ParserHandler(FakeBodies(), FakeRules(*RULES), PageLimits())
    started = time.monotonic()
    rounds, errors, slowest = 0, 0, (0.0, "")
    while time.monotonic() - started < budget_s:
        source, other = rng.choice(pages), rng.choice(pages)
        body, notes = mutate(rng, source.read_bytes(), other.read_bytes())
        message, how = fetched(rng, body)
        where = f"seed {seed}, round {rounds}: {source} ({how}; {'; '.join(notes)})"
        began = time.monotonic()
        outputs = await handler.handle(message, DELIVERY)
        took = time.monotonic() - began
        assert took < MAX_HANDLE_S, f"{took:.1f} s for {where}"
        slowest = max(slowest, (took, where))
        assert len(outputs) == 2, where
        page, links = outputs[0].message, outputs[1].message
        assert isinstance(page, ParsedPage) and isinstance(links, DiscoveredLinks), where
        try:
            check(page, links)
        except AssertionError as failure:
            raise AssertionError(f"{where}: {failure}") from None
        errors += page.error is not None
        rounds += 1
    print(f"\nparser fuzz: seed {seed}, {rounds} mutated pages of {len(pages)} in "
          f"{time.monotonic() - started:.1f} s, {errors} page errors; slowest "
          f"{slowest[0]:.2f} s ({slowest[1][:200]})")
    assert rounds > 0
