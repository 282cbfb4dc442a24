"""Parser settings, read from ``CRAWLMESH_PARSER_*`` environment variables.

They sit beside :class:`shared.settings.MeshSettings` (``CRAWLMESH_*``), which the parser
reads too, as the fetcher's do. Sizes are bytes (``*_bytes``).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.parser.html import PageLimits


class ParserSettings(BaseSettings):
    """Limits of one parsed page."""

    model_config = SettingsConfigDict(env_prefix="CRAWLMESH_PARSER_", extra="ignore", frozen=True)

    max_links_per_page: int = Field(10_000, ge=0, description="Outlinks kept per page, in page order.")
    max_body_bytes: int = Field(
        32 << 20, gt=0,
        description="Largest decompressed body parsed (larger is a page error); at least the "
                    "fetcher's CRAWLMESH_FETCHER_MAX_BODY_BYTES.",
    )
    output_budget_bytes: int = Field(
        768 << 10, ge=1024,
        description="Most JSON bytes a page's outlinks, and separately its extracted values, "
                    "may take in one message (below the server's max payload, 1 MiB by default).",
    )

    def limits(self) -> PageLimits:
        return PageLimits(max_links=self.max_links_per_page, max_body_bytes=self.max_body_bytes,
                          budget_bytes=self.output_budget_bytes)
