"""Parser settings: ``CRAWLMESH_PARSER_*`` variables, turned into page limits."""

from __future__ import annotations

import pytest

from services.parser.html import PageLimits
from services.parser.settings import ParserSettings


def test_defaults_fit_in_one_message() -> None:
    settings = ParserSettings()
    assert settings.limits() == PageLimits()
    assert settings.max_links_per_page == 10_000
    assert settings.output_budget_bytes < 1 << 20


def test_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRAWLMESH_PARSER_MAX_LINKS_PER_PAGE", "250")
    monkeypatch.setenv("CRAWLMESH_MAX_BODY_BYTES", "1")  # not ours: the parser has its own
    limits = ParserSettings().limits()
    assert limits.max_links == 250
    assert limits.max_body_bytes == 32 << 20
