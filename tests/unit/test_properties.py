"""Property-based tests (hypothesis): URL canonicalisation and the wire contracts.

- :func:`shared.urls.canonical_url` never raises anything but :class:`UrlError`, whatever
  the string; its output is ASCII and canonical again (idempotent); spellings of one URL
  (case of scheme and host, the default port, the order of query arguments, a fragment,
  surrounding whitespace, a trailing dot on the host) give one canonical URL and one
  fingerprint.
- Every top-level message of :data:`shared.contracts.MESSAGES`, generated valid, survives
  :func:`shared.codec.encode` then :func:`shared.codec.decode` unchanged; and ``decode``
  of any bytes raises nothing but :class:`DecodeError`.
"""

from __future__ import annotations

import string
from datetime import UTC, datetime, timedelta, timezone

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.codec import DecodeError, decode, encode
from shared.contracts import (
    MESSAGES,
    BodyRef,
    Contract,
    CrawlRequest,
    DeadLetter,
    DiscoveredLinks,
    ExtractionRule,
    FetchedPage,
    FrontierEntry,
    JobCounters,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    LedgerEntry,
    Link,
    LinkOrigin,
    Outcome,
    PageExpanded,
    PageResult,
    ParsedPage,
    Scope,
    ScopeMode,
    SeedReply,
)
from shared.urls import UrlError, canonical_url, fingerprint

PROFILE = settings(max_examples=100, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])

# ---- URLs --------------------------------------------------------------------------------

LABEL = st.text(string.ascii_letters + string.digits, min_size=1, max_size=12)
HOSTS = st.one_of(
    st.lists(LABEL, min_size=1, max_size=4).map(".".join),
    st.tuples(*[st.integers(0, 255)] * 4).map(lambda o: ".".join(map(str, o))),
    st.sampled_from(["[::1]", "[2001:db8::1]", "[fe80::a:b]"]),
    st.sampled_from(["bücher.example", "例え.テスト", "xn--bcher-kva.example"]),
)
PATH_CHARS = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@/% é€😀"
SEGMENT = st.text(PATH_CHARS, max_size=12)
QUERY_TEXT = st.text(string.ascii_letters + string.digits + "-._~+% é/", max_size=8)


@st.composite
def urls(draw: st.DrawFn) -> str:
    """An absolute http(s) URL (some with odd but legal parts)."""
    scheme = draw(st.sampled_from(["http", "https", "HTTP", "HttpS"]))
    host = draw(HOSTS)
    port = draw(st.one_of(st.none(), st.integers(1, 65535)))
    path = "/".join(draw(st.lists(SEGMENT, max_size=4)))
    pairs = draw(st.lists(st.tuples(QUERY_TEXT, QUERY_TEXT), max_size=4))
    query = "&".join(f"{k}={v}" for k, v in pairs)
    fragment = draw(st.one_of(st.none(), SEGMENT))
    return (f"{scheme}://{host}{'' if port is None else f':{port}'}/{path}"
            f"{'?' + query if query else ''}{'' if fragment is None else '#' + fragment}")


@PROFILE
@given(st.text())
def test_canonical_url_raises_only_url_error_on_any_string(text: str) -> None:
    for candidate in (text, "http://" + text, "https://example.org/" + text):
        try:
            canonical = canonical_url(candidate)
        except UrlError:
            continue
        assert canonical.isascii() and canonical.startswith(("http://", "https://"))
        assert canonical_url(canonical) == canonical


@PROFILE
@given(urls())
def test_canonical_url_is_idempotent(url: str) -> None:
    try:
        canonical = canonical_url(url)
    except UrlError:  # e.g. a host that IDNA refuses: documented, fine
        return
    assert canonical_url(canonical) == canonical
    assert len(fingerprint(canonical)) == 32


@st.composite
def spellings(draw: st.DrawFn) -> tuple[str, str]:
    """Two spellings of one URL: the second with its scheme and host case changed, the
    default port written out, query arguments reordered, a fragment and whitespace added."""
    scheme = draw(st.sampled_from(["http", "https"]))
    host = draw(st.lists(LABEL, min_size=1, max_size=3).map(".".join))
    path = "/".join(draw(st.lists(st.text(string.ascii_letters + "-_.~", max_size=8),
                                  max_size=3)))
    keys = draw(st.lists(st.text(string.ascii_lowercase, min_size=1, max_size=5),
                         unique=True, max_size=4))
    pairs = [(k, draw(st.text(string.ascii_letters + string.digits, max_size=5))) for k in keys]
    shuffled = draw(st.permutations(pairs))
    port = {"http": 80, "https": 443}[scheme]
    query = "&".join(f"{k}={v}" for k, v in pairs)
    other_query = "&".join(f"{k}={v}" for k, v in shuffled)
    first = f"{scheme}://{host}/{path}" + (f"?{query}" if query else "")
    second = (f"  {scheme.upper()}://{host.upper()}.:{port}/{path}"
              + (f"?{other_query}" if other_query else "")
              + f"#{draw(st.text(string.ascii_letters, max_size=6))} \n")
    return first, second


@PROFILE
@given(spellings())
def test_spellings_of_one_url_have_one_fingerprint(pair: tuple[str, str]) -> None:
    first, second = (canonical_url(url) for url in pair)
    assert first == second
    assert fingerprint(first) == fingerprint(second)


@PROFILE
@given(urls(), urls())
def test_different_canonical_urls_have_different_fingerprints(a: str, b: str) -> None:
    try:
        ca, cb = canonical_url(a), canonical_url(b)
    except UrlError:
        return
    assert (ca == cb) == (fingerprint(ca) == fingerprint(cb))


# ---- Contracts ---------------------------------------------------------------------------

TOKENS = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
TEXT = st.text(max_size=40)  # any Unicode but surrogates (JSON cannot carry lone ones)
OPT_TEXT = st.none() | TEXT
SAFE_INT = st.integers(0, 2**53)
WHEN = st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30),
                    timezones=st.just(UTC))
OPT_WHEN = st.none() | WHEN
FP = st.text("0123456789abcdef", min_size=32, max_size=32)
HTTP_URLS = urls().filter(lambda u: len(u) <= 2048)
EXTRACTED = st.dictionaries(TEXT, st.none() | TEXT | st.lists(TEXT, max_size=3), max_size=3)
COUNTERS = st.builds(JobCounters, admitted=SAFE_INT, finished=SAFE_INT, failed=SAFE_INT,
                     seeded=st.booleans())
RULES = st.builds(
    lambda name, css, selector, every: ExtractionRule(
        name=name, all=every, **({"css": selector} if css else {"xpath": selector})),
    st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,20}\Z"), st.booleans(), TEXT, st.booleans())
REQUESTS = st.builds(
    CrawlRequest,
    seeds=st.lists(HTTP_URLS, min_size=1, max_size=3).map(tuple),
    job_id=st.none() | TOKENS, label=st.none() | st.text(max_size=200),
    scope=st.builds(Scope, mode=st.sampled_from(ScopeMode),
                    allow=st.lists(st.sampled_from(["^/a", "x+", r"\.html$"]), max_size=2)
                    .map(tuple)),
    max_depth=st.integers(0, 100), max_pages=st.integers(1, 10_000_000),
    max_pages_per_host=st.integers(0, 10**9), rules=st.lists(RULES, max_size=2).map(tuple),
    reply_to=st.none() | st.from_regex(r"\A_INBOX\.[A-Za-z0-9_.-]{1,20}\Z"),
)
LINKS = st.builds(Link, url=TEXT, nofollow=st.booleans())

MESSAGE_STRATEGIES: dict[type[Contract], st.SearchStrategy[Contract]] = {
    CrawlRequest: REQUESTS,
    SeedReply: st.builds(SeedReply, tenant=TOKENS, accepted=st.booleans(),
                         job_id=st.none() | TOKENS, reason=OPT_TEXT),
    JobRecord: st.builds(JobRecord, tenant=TOKENS, job_id=TOKENS, request=REQUESTS,
                         state=st.sampled_from(JobState), created_at=WHEN,
                         finished_at=OPT_WHEN, counters=st.none() | COUNTERS),
    DiscoveredLinks: st.builds(
        DiscoveredLinks, tenant=TOKENS, job_id=TOKENS, origin=st.sampled_from(LinkOrigin),
        depth=SAFE_INT, source_url=OPT_TEXT, source_fingerprint=st.none() | FP,
        links=st.lists(LINKS, max_size=5).map(tuple), part=SAFE_INT,
        parts=st.integers(1, 2**53)),
    FrontierEntry: st.builds(
        FrontierEntry, tenant=TOKENS, job_id=TOKENS, url=TEXT, fingerprint=FP, host=TEXT,
        depth=SAFE_INT, generation=SAFE_INT, not_before=OPT_WHEN, admitted_at=WHEN),
    FetchedPage: st.builds(
        FetchedPage, tenant=TOKENS, job_id=TOKENS, url=TEXT, final_url=TEXT, fingerprint=FP,
        depth=SAFE_INT, status=st.integers(0, 999), content_type=OPT_TEXT, fetched_at=WHEN,
        elapsed_ms=st.floats(0, 1e9, allow_nan=False), body_bytes=SAFE_INT,
        body_encoding=st.sampled_from(["identity", "zlib"]), body=st.binary(max_size=300),
        body_ref=st.none() | st.builds(BodyRef, bucket=TEXT, name=TEXT, stored_bytes=SAFE_INT),
        error=OPT_TEXT),
    ParsedPage: st.builds(
        ParsedPage, tenant=TOKENS, job_id=TOKENS, url=TEXT, final_url=TEXT, fingerprint=FP,
        depth=SAFE_INT, status=st.integers(0, 999), content_type=OPT_TEXT, fetched_at=WHEN,
        title=OPT_TEXT, description=OPT_TEXT, canonical_url=OPT_TEXT, links_found=SAFE_INT,
        extracted=EXTRACTED, error=OPT_TEXT),
    PageExpanded: st.builds(
        PageExpanded, tenant=TOKENS, job_id=TOKENS, fingerprint=st.none() | FP,
        links_seen=SAFE_INT, admitted=SAFE_INT,
        admitted_fingerprints=st.lists(FP, max_size=3).map(tuple)),
    LedgerEntry: st.builds(
        LedgerEntry, tenant=TOKENS, job_id=TOKENS,
        kind=st.sampled_from(["admitted", "finished", "failed", "seeded"]),
        fingerprint=st.none() | FP),
    PageResult: st.builds(
        PageResult, tenant=TOKENS, job_id=TOKENS, url=TEXT, final_url=OPT_TEXT, fingerprint=FP,
        outcome=st.sampled_from(Outcome), status=st.none() | st.integers(0, 999),
        content_type=OPT_TEXT, depth=SAFE_INT, title=OPT_TEXT, description=OPT_TEXT,
        canonical_url=OPT_TEXT, fetched_at=OPT_WHEN, extracted=EXTRACTED, error=OPT_TEXT,
        replay_of=OPT_TEXT),
    JobEvent: st.builds(JobEvent, tenant=TOKENS, job_id=TOKENS,
                        kind=st.sampled_from(JobEventKind), at=WHEN, counters=COUNTERS,
                        reason=OPT_TEXT),
    DeadLetter: st.builds(
        DeadLetter, id=TEXT, tenant=TOKENS, job_id=TOKENS, stage=TEXT, reason=TEXT,
        delivery_count=SAFE_INT, subject=TEXT, stream=TEXT, stream_seq=SAFE_INT,
        headers=st.dictionaries(TEXT, TEXT, max_size=3), dead_at=WHEN,
        original=st.binary(max_size=300)),
}


def test_every_message_has_a_strategy() -> None:
    assert set(MESSAGE_STRATEGIES) == set(MESSAGES)


@PROFILE
@given(st.one_of(*MESSAGE_STRATEGIES.values()))
def test_contracts_round_trip_through_the_codec(message: Contract) -> None:
    assert decode(encode(message), type(message)) == message


@PROFILE
@given(st.sampled_from(MESSAGES), st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=40).map(lambda tail: b"CMB1" + tail),
    st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | TEXT,
                 lambda inner: st.lists(inner, max_size=3)
                 | st.dictionaries(TEXT, inner, max_size=3), max_leaves=10)
    .map(orjson.dumps),
))
def test_decode_raises_only_decode_error_on_any_bytes(model: type[Contract], payload: bytes) -> None:
    try:
        decoded = decode(payload, model)
    except DecodeError:
        return
    assert isinstance(decoded, model)


@PROFILE
@given(st.sampled_from([m for m in MESSAGES if m.BINARY_FIELD]), st.binary(max_size=60),
       st.integers(0, 2**32 - 1))
def test_envelope_with_any_length_raises_only_decode_error(
    model: type[Contract], tail: bytes, length: int
) -> None:
    payload = b"CMB1" + length.to_bytes(4, "big") + tail
    try:
        decode(payload, model)
    except DecodeError:
        pass


def test_naive_datetimes_are_refused_and_others_become_utc() -> None:
    plus_two = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    event = JobEvent(tenant="T", job_id="j", kind=JobEventKind.STARTED, at=plus_two)
    assert event.at.tzinfo is UTC and decode(encode(event), JobEvent) == event


@pytest.mark.parametrize("url", [
    "http://\\", "http://a b/", "http://\x80/", "http://a\x00b/", "http://\u3002/",
    "http://ex%41mple.org/", "http://a|b/", "https://a^b:8080/",
])
def test_hosts_no_fetch_could_use_are_refused(url: str) -> None:
    with pytest.raises(UrlError, match="invalid host"):
        canonical_url(url)


@pytest.mark.parametrize(("url", "canonical"), [
    ("http://[2001:DB8::1]:80/a", "http://[2001:db8::1]/a"),
    ("http://bücher.example/", "http://xn--bcher-kva.example/"),
    ("https://a_b.example./x?b=2&a=1#f", "https://a_b.example/x?a=1&b=2"),
])
def test_unusual_but_valid_hosts_are_kept(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical
