"""Reading an HTML page: its text, title, description, canonical link, outlinks and rules.

The character encoding is found as browsers find it (WHATWG HTML §13.2.3.1 "Determining the
character encoding", with the prescan of §13.2.3.2; WHATWG Encoding §6 "decode" for the BOM),
by w3lib's ``html_to_unicode``, in this order of precedence:

1. a byte order mark (UTF-8, UTF-16 LE/BE, UTF-32);
2. the ``charset`` of the ``Content-Type`` header;
3. a ``<meta charset>``, ``<meta http-equiv=Content-Type content="...; charset=...">`` or
   XML declaration in the document (the prescan);
4. detection (:func:`detect_encoding`): UTF-8 if the body is valid UTF-8, else
   charset-normalizer's best guess over the first :data:`DETECT_BYTES` bytes;
5. UTF-8 (undecodable bytes become U+FFFD).

As in the HTML prescan (§13.2.3.2), a UTF-16 or UTF-32 charset declared *inside* the
document, with no byte order mark, is read as UTF-8: a document that could be prescanned
as ASCII is not UTF-16.

The document is always parsed as HTML (also ``application/xhtml+xml`` and documents that
start with an XML declaration, such as the PostgreSQL manual): a leading XML declaration is
removed from the decoded text first, since it no longer describes its encoding.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from charset_normalizer import from_bytes
from parsel import Selector
from w3lib.encoding import html_to_unicode, http_content_type_encoding, read_bom, to_unicode

from services.parser.links import document_base, outlinks, resolve
from services.parser.rules import Extracted, collapse, extract
from shared.contracts import ExtractionRule, Link

HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
"""Media types parsed as HTML; everything else passes through unparsed."""

MAX_TEXT_CHARS = 4096
"""Longest title or description kept, in characters (longer ones are cut)."""

DETECT_BYTES = 64 * 1024
"""Bytes of an undeclared, non-UTF-8 body that charset-normalizer looks at."""

_XML_DECLARATION = re.compile(r"\A\s*<\?xml\b[^>]*>")


@dataclass(frozen=True, slots=True)
class PageLimits:
    """Bounds on one page: outlinks kept, decompressed body size, output message size.

    ``budget_bytes`` bounds the JSON of the outlinks, and separately of the extracted values,
    so that neither message exceeds the server's max payload (1 MiB by default).
    """

    max_links: int = 10_000
    max_body_bytes: int = 32 << 20
    budget_bytes: int = 768 << 10


@dataclass(frozen=True, slots=True)
class PageContent:
    """What a page says about itself, and the links it holds (absolute, in page order)."""

    title: str | None = None
    description: str | None = None
    canonical_url: str | None = None
    links: tuple[Link, ...] = ()
    extracted: Extracted = field(default_factory=dict)


def is_html(content_type: str | None) -> bool:
    """True if the ``Content-Type`` header value names an HTML media type."""
    if not content_type:
        return False
    return content_type.split(";", 1)[0].strip().lower() in HTML_TYPES


def decode_html(body: bytes, content_type: str | None) -> str:
    """The text of an HTML body (see the module docstring for how its encoding is found).

    Undecodable bytes become U+FFFD; this never raises for any ``body``.
    """
    encoding, text = html_to_unicode(content_type, body, auto_detect_fun=detect_encoding)
    if _is_wide(encoding) and read_bom(body)[0] is None \
            and not _is_wide(http_content_type_encoding(content_type or "")):
        text = to_unicode(body, "utf-8")
    return _XML_DECLARATION.sub("", text, count=1)


def detect_encoding(body: bytes) -> str | None:
    """Step 4 of the precedence (module docstring): ``utf-8`` for a valid UTF-8 body, else
    charset-normalizer's best guess over its first :data:`DETECT_BYTES` bytes (None if it
    has none)."""
    try:
        body.decode("utf-8")
        return "utf-8"
    except UnicodeDecodeError:
        pass
    best = from_bytes(body[:DETECT_BYTES]).best()
    return best.encoding if best is not None else None


def read_page(
    body: bytes, content_type: str | None, page_url: str,
    rules: Sequence[ExtractionRule] = (), limits: PageLimits = PageLimits(),
) -> PageContent:
    """Parse an HTML body and read its fields, outlinks and extraction rules.

    Args:
        body: the decompressed body.
        content_type: the ``Content-Type`` header value (for its charset), or None.
        page_url: the URL the body was served from (the final URL after redirects); relative
            links resolve against it, or against the document's ``<base href>``.
        rules: the job's extraction rules; one that fails to evaluate yields None.
        limits: outlinks kept and output size (see :class:`PageLimits`).

    Raises:
        ValueError: only if lxml refuses the decoded text outright (rare; callers turn it
            into a page error).
    """
    selector = Selector(text=decode_html(body, content_type), type="html", base_url=page_url)
    base = document_base(selector, page_url)
    robots = _meta_tokens(selector, "robots")
    return PageContent(
        title=_cut(collapse(selector.xpath("string((//title[not(ancestor::svg)])[1])").get())),
        description=_cut(collapse(_meta_content(selector, "description"))),
        canonical_url=_canonical_link(selector, base),
        links=outlinks(selector, base, page_nofollow=bool(robots & {"nofollow", "none"}),
                       max_links=limits.max_links, budget_bytes=limits.budget_bytes),
        extracted=extract(selector, rules, limits.budget_bytes),
    )


def _is_wide(encoding: str | None) -> bool:
    if not encoding:
        return False
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return False
    return name.startswith(("utf-16", "utf-32"))


def _cut(text: str | None) -> str | None:
    return text[:MAX_TEXT_CHARS] if text else None


def _meta_content(selector: Selector, name: str) -> str | None:
    """``content`` of the first ``<meta name=...>`` (name compared case-insensitively)."""
    for meta in selector.root.iter("meta"):
        if (meta.get("name") or "").strip().lower() == name and meta.get("content") is not None:
            return str(meta.get("content"))
    return None


def _meta_tokens(selector: Selector, name: str) -> set[str]:
    """Comma-separated directives of every ``<meta name=...>``, lower-cased (robots meta)."""
    tokens: set[str] = set()
    for meta in selector.root.iter("meta"):
        if (meta.get("name") or "").strip().lower() == name:
            tokens.update(t.strip().lower() for t in (meta.get("content") or "").split(","))
    return tokens


def _canonical_link(selector: Selector, base: str) -> str | None:
    """The first ``<link rel=canonical href>``, absolute (RFC 6596 §3), or None."""
    for link in selector.root.iter("link"):
        rel = (link.get("rel") or "").lower().split()
        href = link.get("href")
        if "canonical" in rel and href is not None:
            return resolve(base, href)
    return None
