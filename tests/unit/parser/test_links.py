"""Outlinks: base URL, schemes, fragments, nofollow, duplicates."""

from __future__ import annotations

from parsel import Selector

from services.parser.links import document_base, outlinks, resolve
from shared.contracts import Link

BLOG_POST = """<!DOCTYPE html>
<html lang="en"><head>
  <meta charset="utf-8">
  <base href="../../">
  <title>Tuning autovacuum | Example Engineering</title>
</head><body>
  <nav><a href="index.html">Home</a> <a href="posts/">All posts</a></nav>
  <article>
    <p>See <a href="https://www.postgresql.org/docs/current/routine-vacuuming.html#VACUUM-BASICS">the
       manual</a> and <a href="posts/2023/bloat.html#measuring">our bloat post</a>.</p>
    <p>Sponsored: <a rel="sponsored nofollow" href="https://ads.example/click?id=7">buy</a>.</p>
    <p>Questions? <a href="mailto:eng@example.com">Email us</a>,
       <a href="tel:+44-20-7946-0000">call</a>, or <a href="javascript:openChat()">chat</a>.
       <a href="data:text/plain,hello">data</a> <a href="ftp://files.example/x">ftp</a></p>
    <img usemap="#m"><map name="m"><area shape="rect" coords="0,0,9,9" href="about/team.html"></map>
    <a href="#top">Back to top</a>
    <a href="  posts/  ">All posts again</a>
    <a>no href</a> <a href="">empty</a>
    <a href="//cdn.example/asset.css">protocol-relative</a>
    <a href="http://[::1">broken</a> <a href="http://example.com:99999/">bad port</a>
  </article>
</body></html>"""

PAGE_URL = "https://blog.example/2024/05/tuning-autovacuum.html"


def test_relative_base_href_resolves_against_the_page_url() -> None:
    selector = Selector(text=BLOG_POST)
    assert document_base(selector, PAGE_URL) == "https://blog.example/"


def test_outlinks_of_a_blog_post() -> None:
    selector = Selector(text=BLOG_POST)
    links = outlinks(selector, document_base(selector, PAGE_URL))
    assert links == (
        Link(url="https://blog.example/index.html"),
        Link(url="https://blog.example/posts/"),
        Link(url="https://www.postgresql.org/docs/current/routine-vacuuming.html"),
        Link(url="https://blog.example/posts/2023/bloat.html"),
        Link(url="https://ads.example/click?id=7", nofollow=True),
        Link(url="https://blog.example/about/team.html"),
        Link(url="https://blog.example/"),  # "#top" and "" are the base itself
        Link(url="https://cdn.example/asset.css"),
    )


def test_without_base_links_resolve_against_the_page() -> None:
    selector = Selector(text='<a href="next.html">next</a>')
    assert outlinks(selector, document_base(selector, PAGE_URL)) == (
        Link(url="https://blog.example/2024/05/next.html"),
    )


def test_unusable_base_is_ignored() -> None:
    selector = Selector(text='<base href="javascript:alert(1)"><a href="x">x</a>')
    assert document_base(selector, PAGE_URL) == PAGE_URL


def test_first_base_with_href_wins() -> None:
    selector = Selector(text='<base target="_blank"><base href="/a/"><base href="/b/">')
    assert document_base(selector, PAGE_URL) == "https://blog.example/a/"


def test_followable_occurrence_wins_over_nofollow() -> None:
    selector = Selector(
        text='<a rel="nofollow" href="/x">1</a><a href="/x#y">2</a><a rel="nofollow" href="/z">'
    )
    assert outlinks(selector, PAGE_URL) == (
        Link(url="https://blog.example/x"), Link(url="https://blog.example/z", nofollow=True),
    )


def test_resolve() -> None:
    assert resolve(PAGE_URL, "\n  ../img/a b.png\t") == "https://blog.example/2024/img/a b.png"
    assert resolve(PAGE_URL, "HTTPS://Other.Example/Path") == "https://Other.Example/Path"
    assert resolve(PAGE_URL, "http:///nohost") is None
    assert resolve(PAGE_URL, "/" + "a" * 3000) is None
