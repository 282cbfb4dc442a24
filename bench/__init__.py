"""Benchmarks of crawlmesh against Scrapy and a bare asyncio loop (see docs/benchmarks.md)."""
