"""Fetcher: fetches frontier entries over HTTP."""
