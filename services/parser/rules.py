"""A job's extraction rules applied to a parsed page: named CSS or XPath selectors.

The text of a match is its string value (XPath 1.0 §5: all descendant text of an element;
the value of an attribute, text node or string result), with whitespace collapsed; empty
texts are skipped. A rule gives the first non-empty text (``str``) or None, or with
``all=True`` the list of every non-empty text. A rule that fails to evaluate (a bad
selector, an unknown XPath function or namespace prefix) gives None and spoils nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import orjson
from cssselect import SelectorError
from lxml import etree
from parsel import Selector

from shared.contracts import ExtractionRule

log = logging.getLogger(__name__)

Extracted = dict[str, str | list[str] | None]
"""Extracted values by rule name (``ParsedPage.extracted``)."""


def collapse(text: str | None) -> str | None:
    """``text`` stripped, every run of whitespace made one space; None stays None."""
    return None if text is None else " ".join(text.split())


def extract(selector: Selector, rules: Sequence[ExtractionRule], budget_bytes: int) -> Extracted:
    """Apply ``rules`` in order; values beyond ``budget_bytes`` of JSON are cut.

    Once the budget is spent, a list keeps the items that fit and a string is shortened
    to fit, so the parsed page always fits in one message.
    """
    extracted: Extracted = {}
    left = budget_bytes
    for rule in rules:
        try:
            matches = selector.css(rule.css) if rule.css is not None else selector.xpath(rule.xpath)
            texts = [text for text in map(_text_of, matches) if text]
        except (SelectorError, ValueError, etree.Error) as error:
            log.debug("rule %r failed: %s", rule.name, error)
            extracted[rule.name] = None
            continue
        value, left = _fit(texts if rule.all else (texts[0] if texts else None), left)
        extracted[rule.name] = value
    return extracted


def _text_of(match: Selector) -> str:
    root = match.root
    if isinstance(root, etree._Element):
        text = match.xpath("string()").get() or ""
    else:  # text node, attribute value, or an XPath string / number / boolean result
        text = match.get()
    return " ".join(str(text).split())


def _fit(value: str | list[str] | None, left: int) -> tuple[str | list[str] | None, int]:
    """``value`` cut to ``left`` bytes of JSON, and the bytes left after it."""
    if value is None:
        return None, left
    if isinstance(value, str):
        text = _shorten(value, left)
        return (text, left - _size(text)) if text else (None, left)
    kept: list[str] = []
    left -= 2  # the brackets
    for item in value:
        cost = _size(item) + 1  # the comma
        if cost > left:
            break
        kept.append(item)
        left -= cost
    return kept, max(left, 0)


def _shorten(text: str, limit: int) -> str:
    while text and _size(text) > limit:
        cut = max(limit - 2, 0)
        shorter = text.encode()[:cut].decode(errors="ignore")
        text = shorter if len(shorter) < len(text) else text[: len(text) // 2]
    return text


def _size(text: str) -> int:
    return len(orjson.dumps(text))
