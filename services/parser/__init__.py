"""Parser: parses fetched HTML into page fields and outlinks."""
