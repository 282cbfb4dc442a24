"""Extraction rules: CSS and XPath, first or all matches, failing rules, size budget."""

from __future__ import annotations

import orjson
from parsel import Selector

from services.parser.rules import extract
from shared.contracts import ExtractionRule

PRODUCT = """<html><head><title>Kettle</title></head><body>
<div class="product" data-sku="KT-100">
  <h1 class="name">  Stainless   <em>Kettle</em>
  </h1>
  <span class="price">\u00a329.99</span>
  <ul class="tags"><li>kitchen</li><li>  </li><li>steel</li></ul>
  <a class="review" href="/reviews/1">Great</a><a class="review" href="/reviews/2">Loud</a>
</div></body></html>"""

BUDGET = 768 << 10


def rule(name: str, **kwargs: object) -> ExtractionRule:
    return ExtractionRule.model_validate({"name": name, **kwargs})


def test_css_and_xpath_first_match() -> None:
    rules = [
        rule("name", css="h1.name"),
        rule("price", xpath="//span[@class='price']/text()"),
        rule("sku", css="div.product::attr(data-sku)"),
        rule("reviews", xpath="count(//a[@class='review'])"),
        rule("first_review", css="a.review::attr(href)"),
    ]
    assert extract(Selector(text=PRODUCT), rules, BUDGET) == {
        "name": "Stainless Kettle",
        "price": "£29.99",
        "sku": "KT-100",
        "reviews": "2.0",
        "first_review": "/reviews/1",
    }


def test_all_matches_skip_empty_texts() -> None:
    rules = [rule("tags", css="ul.tags li", all=True),
             rule("reviews", xpath="//a[@class='review']/@href", all=True),
             rule("nothing", css="table td", all=True)]
    assert extract(Selector(text=PRODUCT), rules, BUDGET) == {
        "tags": ["kitchen", "steel"],
        "reviews": ["/reviews/1", "/reviews/2"],
        "nothing": [],
    }


def test_no_match_is_none() -> None:
    assert extract(Selector(text=PRODUCT), [rule("rating", css=".stars")], BUDGET) == {"rating": None}


def test_failing_rules_give_none_and_spoil_nothing() -> None:
    rules = [
        rule("bad_css", css="div[data-sku"),
        rule("bad_pseudo", css="a::nope"),
        rule("bad_xpath", xpath="//div[@class="),
        rule("unknown_function", xpath="foo:bar(//a)"),
        rule("bad_all", css="li:nth-child(", all=True),
        rule("name", css="h1 em::text"),
    ]
    assert extract(Selector(text=PRODUCT), rules, BUDGET) == {
        "bad_css": None, "bad_pseudo": None, "bad_xpath": None, "unknown_function": None,
        "bad_all": None, "name": "Kettle",
    }


def test_values_are_cut_to_the_budget() -> None:
    items = "".join(f"<li>{'word ' * 20}{n}</li>" for n in range(1000))
    paragraph = "long text " * 1000
    selector = Selector(text=f"<ul>{items}</ul><p>{paragraph}</p>")
    rules = [rule("items", css="li", all=True), rule("para", css="p")]

    extracted = extract(selector, rules, 10_000)

    kept, para = extracted["items"], extracted["para"]
    assert isinstance(kept, list) and 80 < len(kept) < 100
    assert kept == [f"{'word ' * 20}{n}" for n in range(len(kept))]
    assert isinstance(para, str) and 0 < len(para) < 200 and paragraph.startswith(para)
    assert len(orjson.dumps(kept)) + len(orjson.dumps(para)) <= 10_000
