# Everyday tasks. `just` comes from PyPI (`pip install rust-just`, in the test extras);
# `just --list` shows these recipes.

set shell := ["bash", "-euo", "pipefail", "-c"]

python := "python3"

# Create .venv and install crawlmesh with its test dependencies (what CI does).
install:
    {{python}} -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[test]'

# The production topology in Docker: NATS, init, the five services, Prometheus, Grafana.
up *ARGS:
    docker compose up -d {{ARGS}}

# The same with the cluster profile: three NATS servers, every stream with three replicas.
up-cluster *ARGS:
    docker compose --env-file compose/cluster.env up -d {{ARGS}}

# Stop the containers (volumes, and so keys and data, are kept).
down:
    docker compose down

# Crawl URLs with the embedded mesh (or a running one) and wait: `just crawl https://example.org/`.
crawl +URLS:
    crawlmesh crawl --wait --output results.jsonl {{URLS}}

# Lint and the whole test suite (`just test tests/unit` for part of it).
test *ARGS: lint
    python -m pytest -q {{ARGS}}

# ruff over the repository.
lint:
    ruff check .

# The benchmarks over the local corpus: politeness with 1-3 fetchers, two tenants' quotas.
bench:
    ../shared/corpus/serve start
    PYTHONPATH=. python tests/benchmarks/politeness.py
    PYTHONPATH=. python tests/benchmarks/two_tenants.py

# Regenerate proto/ (JSON Schemas and the AsyncAPI document) from the models.
schemas:
    crawlmesh schemas

# Check docker-compose.yml as Docker Compose reads it, for both topologies (Docker's compose
# plugin, or else the `docker-compose` binary the test extras install: no daemon needed).
compose-config:
    #!/usr/bin/env bash
    set -euo pipefail
    if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
    "${compose[@]}" config --quiet
    "${compose[@]}" --env-file compose/cluster.env config --quiet
    echo "docker-compose.yml: both topologies valid ($("${compose[@]}" version --short))"
