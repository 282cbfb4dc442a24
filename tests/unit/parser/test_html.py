"""Reading real-looking HTML: encodings, XML declarations, page fields, outlinks."""

from __future__ import annotations

import pytest

from services.parser.html import PageLimits, decode_html, detect_encoding, is_html, read_page
from shared.contracts import Link

POSTGRES_DOCS = b"""<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"
  "http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">
<html xmlns="http://www.w3.org/1999/xhtml"><head>
<meta http-equiv="Content-Type" content="text/html; charset=UTF-8" />
<title>PostgreSQL: Documentation: 17: 8.5.\xc2\xa0Date/Time Types</title>
<link rel="canonical" href="https://www.postgresql.org/docs/current/datatype-datetime.html" />
<meta name="description" content="8.5.&#160;Date/Time Types  PostgreSQL supports the full set" />
</head><body>
<div class="navheader"><a accesskey="p" href="datatype-boolean.html" title="8.6.">Prev</a>
<a accesskey="u" href="datatype.html">Up</a>
<a href="../16/datatype-datetime.html">16</a>
<a href="datatype-datetime.html#DATATYPE-DATETIME-INPUT">8.5.1. Date/Time Input</a>
<a href="mailto:pgsql-docs@lists.postgresql.org">Report a documentation issue</a></div>
<h1 class="title">8.5.\xc2\xa0Date/Time Types</h1><p>Caf\xc3\xa9 \xe2\x80\x94 \xc3\xbcber</p>
</body></html>"""

WINDOWS_1252 = (
    b"<!DOCTYPE html>\n<html lang=\"fr\"><head>"
    b"<meta charset=\"windows-1252\">"
    b"<title>Caf\xe9 \x93cr\xe8me\x94 \x96 na\xefve \x80 5</title>"
    b"</head><body><p>D\xe9j\xe0 vu</p><a href=\"/menu/cr\xe8me-br\xfbl\xe9e\">dessert</a></body></html>"
)


def test_is_html_reads_the_media_type_only() -> None:
    assert is_html("text/html; charset=ISO-8859-1")
    assert is_html("Application/XHTML+XML")
    assert not is_html("application/pdf")
    assert not is_html("text/plain; charset=utf-8")
    assert not is_html(None)


def test_page_with_xml_declaration_parses_as_html() -> None:
    page = read_page(POSTGRES_DOCS, "text/html",
                     "https://www.postgresql.org/docs/17/datatype-datetime.html")

    assert page.title == "PostgreSQL: Documentation: 17: 8.5. Date/Time Types"
    assert page.description == "8.5. Date/Time Types PostgreSQL supports the full set"
    assert page.canonical_url == "https://www.postgresql.org/docs/current/datatype-datetime.html"
    assert page.links == (
        Link(url="https://www.postgresql.org/docs/17/datatype-boolean.html"),
        Link(url="https://www.postgresql.org/docs/17/datatype.html"),
        Link(url="https://www.postgresql.org/docs/16/datatype-datetime.html"),
        Link(url="https://www.postgresql.org/docs/17/datatype-datetime.html"),
    )


def test_xml_declaration_is_removed_before_parsing() -> None:
    text = decode_html(POSTGRES_DOCS, "application/xhtml+xml")
    assert text.startswith("\n<!DOCTYPE html")
    assert "Café — über" in text


def test_xml_declaration_encoding_is_honoured() -> None:
    body = b'<?xml version="1.0" encoding="ISO-8859-1"?>\n<html><head><title>Caf\xe9</title></head></html>'
    assert read_page(body, "text/html", "http://example.com/").title == "Café"


def test_meta_charset_windows_1252() -> None:
    page = read_page(WINDOWS_1252, "text/html", "http://bistro.example/")
    assert page.title == "Café \u201ccrème\u201d \u2013 naïve \u20ac 5"
    assert page.links == (Link(url="http://bistro.example/menu/crème-brûlée"),)


def test_http_header_charset_wins_over_meta() -> None:
    body = '<meta charset="windows-1252"><title>Ünïcödé</title>'.encode()
    assert read_page(body, "text/html; charset=utf-8", "http://x.example/").title == "Ünïcödé"


def test_byte_order_mark_wins_over_everything() -> None:
    body = b"\xef\xbb\xbf" + '<meta charset="iso-8859-1"><title>Grüße</title>'.encode()
    assert read_page(body, "text/html; charset=iso-8859-1", "http://x.example/").title == "Grüße"


def test_document_declared_utf16_without_bom_is_read_as_utf8() -> None:
    body = '<?xml version="1.0" encoding="UTF-16"?><html><title>Grüße</title></html>'.encode()
    assert read_page(body, "text/html", "http://x.example/").title == "Grüße"


def test_utf16_body_with_bom() -> None:
    body = "<html><title>Grüße</title><a href='/x'>x</a></html>".encode("utf-16")
    page = read_page(body, "text/html", "http://x.example/")
    assert page.title == "Grüße"
    assert page.links == (Link(url="http://x.example/x"),)


def test_undecodable_bytes_do_not_fail() -> None:
    page = read_page(b"<title>ok \xff\xfe\x00 there</title>\x00\x00", "text/html", "http://x.example/")
    assert page.title is not None and page.title.startswith("ok")


def test_empty_and_binary_bodies_give_an_empty_page() -> None:
    for body in (b"", b"   \n", bytes(range(256)) * 4, b"<?xml version='1.0'?>"):
        page = read_page(body, "text/html", "http://x.example/")
        assert page.title is None and page.links == ()


def test_title_collapses_whitespace_and_ignores_svg_titles() -> None:
    body = b"<html><head><title>\n  Release\t notes \n</title></head></html>"
    assert read_page(body, "text/html", "http://x.example/").title == "Release notes"
    svg_only = b"<html><body><svg><title>icon</title></svg></body></html>"
    assert read_page(svg_only, "text/html", "http://x.example/").title is None


def test_missing_or_blank_fields_are_none() -> None:
    body = b"<html><head><title>  </title><meta name='description' content=''></head></html>"
    page = read_page(body, "text/html", "http://x.example/")
    assert (page.title, page.description, page.canonical_url) == (None, None, None)


def test_canonical_resolves_against_base_and_ignores_other_schemes() -> None:
    body = b'<base href="https://cdn.example/a/"><link rel="canonical" href="b.html#top">'
    assert read_page(body, "text/html", "http://x.example/").canonical_url == "https://cdn.example/a/b.html"
    ftp = b'<link rel="canonical" href="ftp://x.example/file">'
    assert read_page(ftp, "text/html", "http://x.example/").canonical_url is None


def test_meta_robots_nofollow_marks_every_link() -> None:
    body = b'<meta name="ROBOTS" content="noindex, NoFollow"><a href="/a">a</a><a href="/b">b</a>'
    page = read_page(body, "text/html", "http://x.example/")
    assert [link.nofollow for link in page.links] == [True, True]


def test_links_are_capped_at_max_links() -> None:
    anchors = "".join(f'<li><a href="/item/{n}">Item {n}</a></li>' for n in range(20_000))
    body = f"<html><body><ul>{anchors}</ul></body></html>".encode()

    page = read_page(body, "text/html", "https://shop.example/catalogue/")

    assert len(page.links) == 10_000
    assert page.links[0].url == "https://shop.example/item/0"
    assert page.links[-1].url == "https://shop.example/item/9999"
    capped = read_page(body, "text/html", "https://shop.example/", limits=PageLimits(max_links=5))
    assert [link.url for link in capped.links][-1] == "https://shop.example/item/4"


def test_links_stop_before_the_message_budget() -> None:
    long_path = "x" * 1000
    anchors = "".join(f'<a href="/{long_path}/{n}">n</a>' for n in range(2_000))
    page = read_page(anchors.encode(), "text/html", "https://x.example/",
                     limits=PageLimits(budget_bytes=100_000))
    assert 90 <= len(page.links) < 100


# --- charset precedence: BOM > Content-Type > <meta> > detection (charset-normalizer) ---

RUSSIAN = ("<html><head><title>Привет, мир: новости и статьи</title></head><body><p>Это "
           "страница на русском языке, написанная без объявления кодировки. Поисковый робот "
           "должен определить её сам.</p></body></html>")
JAPANESE = ("<html><head><title>日本語のページ</title></head><body><p>これは文字コードの宣言が"
            "ないページです。クローラーは自動的に判別しなければなりません。</p></body></html>")


def test_bom_wins_over_header_and_meta() -> None:
    body = b"\xef\xbb\xbf<meta charset=windows-1252><title>caf\xc3\xa9</title>"
    assert "café" in decode_html(body, "text/html; charset=iso-8859-1")


def test_header_wins_over_meta() -> None:
    body = "<meta charset=utf-8><title>café</title>".encode("cp1252")
    assert "café" in decode_html(body, "text/html; charset=windows-1252")


def test_meta_wins_over_detection() -> None:
    body = '<meta http-equiv="Content-Type" content="text/html; charset=iso-8859-15"><p>\xa4</p>'
    assert "€" in decode_html(body.encode("latin-1"), "text/html")


def test_undeclared_utf8_is_utf8() -> None:
    assert detect_encoding("<p>café</p>".encode()) == "utf-8"
    assert "café" in decode_html("<p>café</p>".encode(), None)


@pytest.mark.parametrize(("text", "encoding"), [(RUSSIAN, "cp1251"), (JAPANESE, "shift_jis")])
def test_undeclared_legacy_encoding_is_detected(text: str, encoding: str) -> None:
    body = text.encode(encoding)
    assert detect_encoding(body) is not None
    assert decode_html(body, "text/html") == text
