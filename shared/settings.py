"""Mesh-wide settings, read from ``CRAWLMESH_*`` environment variables.

Every service reads :class:`MeshSettings`; a service with settings of its own keeps them in
``services/<name>/settings.py`` under its own prefix (``CRAWLMESH_FETCHER_*``, ...).
Durations are seconds (``*_s``), sizes are bytes (``*_bytes``). Nothing here is hard-coded
elsewhere: stream replicas, limits, retention, duplicate windows and consumer retry
schedules all come from these fields, so moving to a three-node cluster is
``CRAWLMESH_REPLICAS=3``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError


def default_home() -> Path:
    """The crawlmesh home folder: ``$CRAWLMESH_HOME`` or ``~/.crawlmesh``."""
    return Path.home() / ".crawlmesh"


class MeshSettings(BaseSettings):
    """Connection, stream and consumer settings shared by every process of the mesh.

    Raises:
        pydantic.ValidationError: on an invalid value, e.g. a backoff schedule longer than
            ``max_deliver`` (JetStream refuses such a consumer).
    """

    model_config = SettingsConfigDict(env_prefix="CRAWLMESH_", extra="ignore", frozen=True)

    home: Path = Field(default_factory=default_home, description="State folder (config, store).")
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated.")
    nats_creds: Path | None = Field(None, description="Optional NATS user creds file (operator mode).")
    nats_connect_timeout_s: float = 5.0

    # Streams
    replicas: int = Field(1, ge=1, le=5, description="Replicas of every mesh stream (3 on a cluster).")
    storage: Literal["file", "memory"] = "file"
    stage_max_bytes: int = Field(1 << 30, description="Max bytes held by each internal stage stream.")
    stage_max_msgs_per_subject: int = Field(
        1000, description="Cap on messages one tenant+job may queue in each of the LINKS, FETCHED "
        "and PARSED streams, enforced by the server (max_msgs_per_subject, discard_new_per_subject); "
        "a publisher finding it full waits for room (back-pressure). -1: no cap.",
    )
    dlq_max_age_s: float = Field(14 * 86400, description="How long dead letters are kept.")
    results_max_age_s: float = Field(7 * 86400, description="How long tenant results are kept.")
    tenant_results_max_bytes: int = Field(1 << 30, description="RESULTS stream size per tenant.")
    body_inline_max_bytes: int = Field(
        512 * 1024, description="Compressed bodies above this go to the tenant's Object Store."
    )
    body_ttl_s: float = Field(86400, description="TTL of bodies kept in the Object Store.")

    tenant_creds_ttl_s: float = Field(
        365 * 86400, gt=0, description="Life of a tenant user's creds (JWT expiry), seconds."
    )

    # Consumers
    max_deliver: int = Field(5, ge=1, description="Deliveries before a message is dead-lettered.")
    backoff_s: Annotated[tuple[float, ...], NoDecode] = Field(
        (2.0, 5.0, 15.0, 30.0),
        description="Redelivery delays by attempt (seconds); the first is the ack wait.",
    )
    fetcher_ack_wait_s: float = Field(
        10.0, gt=0, description="Least ack wait (and redelivery delay) of the fetcher's frontier "
        "consumers, seconds: a redelivered frontier entry is a second request to a host, so a busy "
        "fetcher whose in_progress heartbeat runs late must not see its entries redelivered.",
    )
    max_ack_pending: int = Field(256, ge=1)
    fetch_batch: int = Field(32, ge=1, description="Messages pulled per fetch request.")
    concurrency: int = Field(16, ge=1, description="Handlers running at once per service.")
    shutdown_grace_s: float = Field(10.0, description="How long SIGTERM waits for in-flight work.")

    # Telemetry (shared.telemetry.http): /metrics, /healthz and /readyz of one service process
    metrics_port: int = Field(
        0, ge=0, le=65535, description="This process's metrics/health HTTP port (0: no endpoint)."
    )
    metrics_host: str = Field("127.0.0.1", description="Address the metrics endpoint listens on.")
    metrics_base_port: int = Field(
        9460, ge=0, le=65535,
        description=(
            "`crawlmesh up`: first metrics port; seeder..sink get base..base+4, extra "
            "replicas the ports after (0: no metrics endpoints)."
        ),
    )
    metrics_refresh_s: float = Field(
        5.0, gt=0, description="Seconds between refreshes of the JetStream gauges (the sink)."
    )

    # Testing
    fault_inject: str | None = Field(
        None,
        description=(
            "Fault injection for tests and chaos runs, '<stage>:<regex>': that stage's "
            "handler fails on every message whose payload matches. Off by default."
        ),
    )

    @field_validator("backoff_s", mode="before")
    @classmethod
    def _parse_backoff(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip().strip("[]()")
            return tuple(float(part) for part in text.split(",") if part.strip())
        return value

    @field_validator("stage_max_msgs_per_subject")
    @classmethod
    def _check_stage_cap(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be -1 (no cap) or at least 1 (JetStream reads 0 as no cap)")
        return value

    @model_validator(mode="after")
    def _check_schedule(self) -> MeshSettings:
        if not self.backoff_s:
            raise ValueError("backoff_s needs at least one delay (the ack wait)")
        if len(self.backoff_s) > self.max_deliver:
            raise ValueError(
                f"backoff_s has {len(self.backoff_s)} delays but max_deliver is "
                f"{self.max_deliver}; JetStream requires len(backoff) <= max_deliver"
            )
        return self

    @property
    def ack_wait_s(self) -> float:
        """Seconds before an unacknowledged delivery is redelivered (first backoff step)."""
        return self.backoff_s[0]

    def delay_after(self, delivered: int) -> float:
        """Delay in seconds before attempt ``delivered + 1``, from the backoff schedule."""
        index = min(max(delivered, 1), len(self.backoff_s)) - 1
        return self.backoff_s[index]

    @property
    def redelivery_horizon_s(self) -> float:
        """Longest time from first delivery to last: every backoff step, up to max_deliver."""
        steps = [self.delay_after(n) for n in range(1, self.max_deliver + 1)]
        return sum(steps)

    @property
    def duplicate_window_s(self) -> float:
        """Duplicate window of every stage stream: at least the redelivery horizon, >= 2 min."""
        return max(120.0, 2 * self.redelivery_horizon_s)

    @property
    def creds_path(self) -> Path | None:
        """Creds file of the services' NATS user: ``nats_creds`` if set, else the MESH user's
        ``<home>/creds/mesh.creds`` if ``crawlmesh init`` wrote one, else None (no auth)."""
        if self.nats_creds is not None:
            return self.nats_creds
        default = self.home / "creds" / "mesh.creds"
        return default if default.exists() else None

    @property
    def store_dir(self) -> Path:
        """JetStream store folder of the embedded nats-server."""
        return self.home / "jetstream"


def settings_models() -> tuple[type[BaseSettings], ...]:
    """Every settings model a process of the mesh reads (the mesh's and each service's)."""
    from services.fetcher.settings import FetcherSettings
    from services.parser.settings import ParserSettings

    return (MeshSettings, FetcherSettings, ParserSettings)


def check_settings() -> None:
    """Read every settings model from the environment now, so a bad value stops a command
    (or the launcher) at once instead of a service failing later in its own log.

    Raises:
        SettingsProblem: one line per bad variable, naming it.
    """
    problems = []
    for model in settings_models():
        try:
            model()
        except (ValidationError, SettingsError) as error:
            problems.extend(describe_settings_error(model, error))
    if problems:
        raise SettingsProblem("; ".join(problems))


class SettingsProblem(ValueError):
    """A ``CRAWLMESH_*`` environment variable has a value its settings model refuses."""


def describe_settings_error(model: type[BaseSettings], error: Exception) -> list[str]:
    """``["CRAWLMESH_X: why (got 'value')", ...]`` for a settings model's error."""
    prefix = str(model.model_config.get("env_prefix", "")).upper()
    if not isinstance(error, ValidationError):  # SettingsError: a value that is not JSON
        field = re.search(r'field "(\w+)"', str(error))
        if field is None:
            return [f"{prefix}*: {error}"]
        name = f"{prefix}{field.group(1).upper()}"
        return [f"{name}: not valid JSON (got {os.environ.get(name)!r})"]
    lines = []
    for problem in error.errors():
        field = str(problem["loc"][0]) if problem["loc"] else ""
        name = f"{prefix}{field.upper()}" if field else f"{prefix}*"
        value = os.environ.get(name) if field else None
        got = f" (got {value!r})" if value is not None else ""
        lines.append(f"{name}: {problem['msg']}{got}")
    return lines
