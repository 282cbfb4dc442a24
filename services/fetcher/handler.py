"""The fetcher handler: a frontier entry in, a fetched page (or fetch error) out."""

from __future__ import annotations

import time

import httpx

from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.codec import compress
from shared.contracts import FetchedPage, FrontierEntry
from shared.subjects import Stage

MAX_BODY_BYTES = 10 * 1024 * 1024


class FetcherHandler:
    """Fetches one URL with httpx and reports the outcome."""

    def __init__(self, client: httpx.AsyncClient, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.client = client
        self.max_body_bytes = max_body_bytes

    async def handle(self, message: FrontierEntry, delivery: Delivery) -> list[Outbound]:
        started = time.perf_counter()
        error: str | None = None
        status, content_type, final_url, body = 0, None, message.url, b""
        try:
            async with self.client.stream("GET", message.url) as response:
                status = response.status_code
                content_type = response.headers.get("content-type")
                final_url = str(response.url)
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        error = f"body larger than {self.max_body_bytes} bytes"
                        break
                    chunks.append(chunk)
                body = b"".join(chunks) if error is None else b""
        except httpx.HTTPError as failure:
            error = f"{type(failure).__name__}: {failure}"
        page = FetchedPage(
            tenant=message.tenant, job_id=message.job_id, url=message.url, final_url=final_url,
            fingerprint=message.fingerprint, depth=message.depth, status=status,
            content_type=content_type, elapsed_ms=(time.perf_counter() - started) * 1000,
            body_bytes=len(body), body_encoding="zlib", body=compress(body), error=error,
        )
        return [Outbound(
            subjects.fetched(message.tenant, message.job_id), page,
            subjects.msg_id(Stage.FETCHER, message.tenant, message.job_id, message.fingerprint,
                            message.generation),
        )]
