"""Dedup: canonicalises discovered links and admits each URL once per job."""
