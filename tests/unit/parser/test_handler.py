"""The parser handler: one parsed page and one links message per fetched page, always."""

from __future__ import annotations

import threading

import pytest

from services.parser import handler as handler_module
from services.parser.handler import BodyUnavailableError, ParserHandler
from services.parser.html import PageLimits
from shared import subjects
from shared.bus.loop import Delivery
from shared.codec import compress, encode
from shared.contracts import (
    BodyRef,
    DiscoveredLinks,
    ExtractionRule,
    FetchedPage,
    Link,
    LinkOrigin,
    ParsedPage,
)
from shared.streams import bodies_bucket

TENANT, JOB, FP = "ATESTTENANT", "0190aa00bb11cc22", "0123456789abcdef0123456789abcdef"

ARTICLE = b"""<!DOCTYPE html><html><head><meta charset="utf-8">
<title>Release 2.4 | Widgets</title>
<meta name="description" content="What changed in Widgets 2.4.">
<link rel="canonical" href="/releases/2.4">
</head><body><h1>Widgets 2.4</h1>
<a href="2.3.html">Previous</a> <a href="/docs/">Docs</a>
<a rel="nofollow" href="https://tracker.example/issues?q=2.4">Issues</a>
<a href="mailto:team@widgets.example">Mail</a></body></html>"""


class FakeBodies:
    def __init__(self, objects: dict[str, bytes] | None = None, failure: Exception | None = None) -> None:
        self.objects = objects or {}
        self.failure = failure

    async def read(self, ref: BodyRef) -> bytes:
        if self.failure is not None:
            raise self.failure
        if ref.name not in self.objects:
            raise BodyUnavailableError(f"{ref.bucket}/{ref.name} not found")
        return self.objects[ref.name]


class FakeRules:
    def __init__(self, *rules: ExtractionRule) -> None:
        self._rules = rules
        self.asked: list[tuple[str, str]] = []

    async def rules(self, tenant: str, job: str) -> tuple[ExtractionRule, ...]:
        self.asked.append((tenant, job))
        return self._rules


def fetched(html: bytes = ARTICLE, **fields: object) -> FetchedPage:
    values: dict[str, object] = {
        "tenant": TENANT, "job_id": JOB, "url": "https://widgets.example/releases/2.4.html",
        "final_url": "https://widgets.example/releases/2.4.html", "fingerprint": FP, "depth": 2,
        "status": 200, "content_type": "text/html; charset=utf-8", "body_bytes": len(html),
        "body_encoding": "zlib", "body": compress(html),
    }
    values.update(fields)
    return FetchedPage.model_validate(values)


DELIVERY = Delivery(subject=subjects.fetched(TENANT, JOB), headers={}, delivered=1,
                    stream_seq=7, tenant=TENANT, job=JOB)


async def run(message: FetchedPage, bodies: FakeBodies | None = None, rules: FakeRules | None = None,
              limits: PageLimits = PageLimits()) -> tuple[ParsedPage, DiscoveredLinks]:
    handler = ParserHandler(bodies or FakeBodies(), rules or FakeRules(), limits)
    outputs = await handler.handle(message, DELIVERY)
    assert [out.subject for out in outputs] == [subjects.parsed(TENANT, JOB), subjects.links(TENANT, JOB)]
    assert [out.msg_id for out in outputs] == [
        subjects.msg_id("parser", TENANT, JOB, FP), subjects.msg_id("parser", TENANT, JOB, f"links-{FP}"),
    ]
    page, links = outputs[0].message, outputs[1].message
    assert isinstance(page, ParsedPage) and isinstance(links, DiscoveredLinks)
    assert (links.origin, links.depth, links.source_fingerprint) == (LinkOrigin.OUTLINKS, 3, FP)
    assert links.source_url == message.url
    return page, links


async def test_html_page_gives_fields_links_and_extracted_values() -> None:
    rules = FakeRules(ExtractionRule(name="heading", css="h1"),
                      ExtractionRule(name="broken", xpath="//h1["))

    page, links = await run(fetched(), rules=rules)

    assert page.title == "Release 2.4 | Widgets"
    assert page.description == "What changed in Widgets 2.4."
    assert page.canonical_url == "https://widgets.example/releases/2.4"
    assert page.extracted == {"heading": "Widgets 2.4", "broken": None}
    assert page.error is None and page.status == 200 and page.depth == 2
    assert links.links == (
        Link(url="https://widgets.example/releases/2.3.html"),
        Link(url="https://widgets.example/docs/"),
        Link(url="https://tracker.example/issues?q=2.4", nofollow=True),
    )
    assert page.links_found == 3
    assert rules.asked == [(TENANT, JOB)]


async def test_redirected_page_resolves_links_against_the_final_url() -> None:
    message = fetched(url="http://widgets.example/latest",
                      final_url="https://widgets.example/v2/releases/2.4.html")
    page, links = await run(message)
    assert links.links[0].url == "https://widgets.example/v2/releases/2.3.html"
    assert (page.url, page.final_url) == (message.url, message.final_url)


async def test_identity_encoded_body() -> None:
    _, links = await run(fetched(body_encoding="identity", body=ARTICLE))
    assert len(links.links) == 3


async def test_body_from_the_object_store() -> None:
    ref = BodyRef(bucket=bodies_bucket(TENANT), name=f"{JOB}.{FP}", stored_bytes=10)
    bodies = FakeBodies({ref.name: compress(ARTICLE)})
    page, links = await run(fetched(body=b"", body_ref=ref), bodies=bodies)
    assert page.title == "Release 2.4 | Widgets" and len(links.links) == 3


async def test_expired_body_is_a_page_error() -> None:
    ref = BodyRef(bucket=bodies_bucket(TENANT), name="gone", stored_bytes=10)
    page, links = await run(fetched(body=b"", body_ref=ref))
    assert page.error is not None and page.error.startswith("body unavailable")
    assert links.links == () and page.title is None


async def test_body_in_another_tenants_bucket_is_refused() -> None:
    ref = BodyRef(bucket=bodies_bucket("OTHERTENANT"), name="x", stored_bytes=10)
    bodies = FakeBodies({"x": compress(ARTICLE)})
    page, links = await run(fetched(body=b"", body_ref=ref), bodies=bodies)
    assert page.error is not None and "not the tenant's" in page.error
    assert links.links == ()


async def test_transient_store_failure_propagates_for_a_retry() -> None:
    ref = BodyRef(bucket=bodies_bucket(TENANT), name="x", stored_bytes=10)
    handler = ParserHandler(FakeBodies(failure=TimeoutError("store timed out")), FakeRules())
    with pytest.raises(TimeoutError):
        await handler.handle(fetched(body=b"", body_ref=ref), DELIVERY)


async def test_corrupt_body_is_a_page_error() -> None:
    page, links = await run(fetched(body=b"this is not zlib"))
    assert page.error is not None and page.error.startswith("undecodable body: corrupt zlib body")
    assert links.links == ()


async def test_body_over_the_size_limit_is_a_page_error() -> None:
    page, _ = await run(fetched(), limits=PageLimits(max_body_bytes=100))
    assert page.error == "undecodable body: body inflates beyond 100 bytes"


async def test_parser_crash_is_a_page_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("lxml fell over")

    monkeypatch.setattr(handler_module, "read_page", explode)
    page, links = await run(fetched())
    assert page.error == "unparseable HTML: RuntimeError: lxml fell over"
    assert links.links == ()


async def test_parsing_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    original = handler_module.read_page

    def spy(*args: object, **kwargs: object) -> object:
        threads.append(threading.get_ident())
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(handler_module, "read_page", spy)
    await run(fetched())
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"content_type": "application/pdf"}, None),
        ({"content_type": None}, None),
        ({"status": 404}, None),
        ({"status": 0, "content_type": None, "body": b"", "body_bytes": 0,
          "error": "ConnectTimeout: timed out"}, "ConnectTimeout: timed out"),
        ({"body": b"", "body_bytes": 0, "error": "body larger than 10485760 bytes"},
         "body larger than 10485760 bytes"),
        ({"status": 204, "body": compress(b""), "body_bytes": 0}, None),
    ],
)
async def test_pages_not_parsed_pass_through(fields: dict[str, object], error: str | None) -> None:
    rules = FakeRules()
    message = fetched(**fields)
    page, links = await run(message, rules=rules)
    assert (page.status, page.content_type, page.error) == (message.status, message.content_type, error)
    assert page.title is None and page.extracted == {} and page.links_found == 0
    assert links.links == ()
    assert rules.asked == []


async def test_huge_page_still_fits_in_one_message() -> None:
    anchors = "".join(
        f'<a href="/catalogue/category/books/fiction-and-literature/item-{n:06d}/index.html?ref=list">'
        f"{n}</a>" for n in range(20_000)
    )
    page, links = await run(fetched(f"<html><body>{anchors}</body></html>".encode()))
    assert 0 < len(links.links) <= 10_000
    assert page.links_found == len(links.links)
    assert len(encode(links)) < 1 << 20
