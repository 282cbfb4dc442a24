"""The ``crawlmesh`` command line."""
