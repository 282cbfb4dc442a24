"""The claims of every JWT crawlmesh issues: operator, accounts, users and activations.

Pure functions from inputs to claim dictionaries (signed by :func:`shared.accounts.jwt.encode`),
so what each account may do is readable in one place (DESIGN.md "Accounts and subjects"):

- **MESH** exports the intake service ``crawl.seeds.*`` with the account token at position 3:
  an account can import only ``crawl.seeds.<its own id>``, and the server stamps the sender.
- **A tenant** imports its own intake slot as the local subject ``crawl.seeds``, and exports
  ``crawl.results.>``, ``crawl.events.>`` (where its ``RESULTS`` and ``EVENTS`` streams
  listen) and the stream-info API of those two streams, each with ``token_req``: only an
  account holding an activation token signed by the tenant may import them, and crawlmesh
  issues those to MESH alone. MESH imports them as ``tenant.<id>.results.>``,
  ``tenant.<id>.events.>`` and ``tenant.<id>.api.results`` / ``.api.events``.
- **Tenant users** may publish seeds and use the JetStream API of their own account, but
  may not create, update or delete ``RESULTS``/``EVENTS`` nor publish into them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

NO_LIMIT = -1
GiB = 1 << 30

RESULTS_STREAM = "RESULTS"
EVENTS_STREAM = "EVENTS"
TENANT_STREAMS = (RESULTS_STREAM, EVENTS_STREAM)

_UNLIMITED_CORE = {
    "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT, "imports": NO_LIMIT,
    "exports": NO_LIMIT, "wildcards": True, "conn": NO_LIMIT, "leaf": NO_LIMIT,
}
_UNLIMITED_JETSTREAM = {
    "mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT, "streams": NO_LIMIT,
    "consumer": NO_LIMIT, "max_ack_pending": NO_LIMIT,
}


class TenantQuota(BaseModel):
    """A tenant's limits. The JetStream ones are enforced by nats-server from the account
    JWT; the crawl ones by crawlmesh at submission (they are also tagged on the JWT).

    Attributes:
        storage_bytes: JetStream file storage of the account (all its streams), bytes.
        max_streams: streams the account may hold (RESULTS and EVENTS count).
        max_consumers: consumers each stream of the account may hold (nats-server applies
            the JWT's ``consumer`` limit per stream, not per account: the account can hold
            ``max_streams * max_consumers``; ephemeral consumers count).
        max_ack_pending: cap on any consumer's max_ack_pending in the account.
        max_pages_per_job: largest ``max_pages`` a submission may ask for.
        max_concurrent_jobs: jobs of the tenant running at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage_bytes: int = Field(GiB, ge=1)  # 0 in the JWT would mean "no JetStream at all"
    max_streams: int = Field(10, ge=2)
    max_consumers: int = Field(100, ge=1)
    max_ack_pending: int = Field(10_000, ge=1)
    max_pages_per_job: int = Field(100_000, ge=1)
    max_concurrent_jobs: int = Field(10, ge=1)


def operator_claims(operator_key: str, signing_key: str, system_account: str) -> dict[str, Any]:
    """The operator: accounts are signed by ``signing_key``; ``system_account`` is SYS."""
    return {
        "sub": operator_key, "name": "crawlmesh",
        "nats": {"type": "operator", "signing_keys": [signing_key],
                 "system_account": system_account},
    }


def system_account_claims(account: str) -> dict[str, Any]:
    """The system account (``$SYS`` subjects; used to push account JWTs)."""
    return {"sub": account, "name": "SYS",
            "nats": {"type": "account", "limits": dict(_UNLIMITED_CORE)}}


def results_import_subject(tenant: str) -> str:
    """MESH-side subject prefix whose messages land in the tenant's RESULTS stream."""
    return f"tenant.{tenant}.results.>"


def events_import_subject(tenant: str) -> str:
    return f"tenant.{tenant}.events.>"


def stream_info_subject(tenant: str, stream: str) -> str:
    """MESH-side request subject answering ``$JS.API.STREAM.INFO.<stream>`` of the tenant."""
    return f"tenant.{tenant}.api.{stream.lower()}"


def tenant_exports() -> list[dict[str, Any]]:
    """What a tenant account exports: each requires an activation token (``token_req``)."""
    exports = [
        {"name": "results", "subject": "crawl.results.>", "type": "service", "token_req": True},
        {"name": "events", "subject": "crawl.events.>", "type": "service", "token_req": True},
    ]
    for stream in TENANT_STREAMS:
        exports.append({"name": f"{stream.lower()}-info",
                        "subject": f"$JS.API.STREAM.INFO.{stream}",
                        "type": "service", "token_req": True})
    return exports


def activation_claims(importer: str, subject: str, tenant: str) -> dict[str, Any]:
    """An activation token letting account ``importer`` (MESH) import the tenant's service
    export ``subject``; signed by the tenant's signing key, ``issuer_account`` the tenant."""
    return {"sub": importer, "name": subject,
            "nats": {"type": "activation", "subject": subject, "kind": "service",
                     "issuer_account": tenant}}


def mesh_account_claims(
    account: str, tenant_imports: dict[str, dict[str, str]],
) -> dict[str, Any]:
    """MESH: unlimited JetStream, the intake export, and per tenant the imports of its
    exports. ``tenant_imports`` maps tenant id -> {export subject: activation token}."""
    imports: list[dict[str, Any]] = []
    for tenant, tokens in sorted(tenant_imports.items()):
        local = {
            "crawl.results.>": results_import_subject(tenant),
            "crawl.events.>": events_import_subject(tenant),
        }
        for stream in TENANT_STREAMS:
            local[f"$JS.API.STREAM.INFO.{stream}"] = stream_info_subject(tenant, stream)
        for subject, local_subject in local.items():
            imports.append({
                "name": f"{tenant}:{subject}", "subject": subject, "account": tenant,
                "type": "service", "local_subject": local_subject, "token": tokens[subject],
            })
    return {
        "sub": account, "name": "MESH",
        "nats": {
            "type": "account",
            "limits": {**_UNLIMITED_CORE, **_UNLIMITED_JETSTREAM},
            "exports": [{"name": "intake", "subject": "crawl.seeds.*", "type": "service",
                         "account_token_position": 3}],
            "imports": imports,
        },
    }


def quota_tags(quota: TenantQuota) -> list[str]:
    """The crawl limits as JWT tags (the JetStream ones are in ``limits``)."""
    return [f"crawlmesh-max-pages-per-job:{quota.max_pages_per_job}",
            f"crawlmesh-max-concurrent-jobs:{quota.max_concurrent_jobs}"]


def tenant_account_claims(
    tenant: str, name: str, quota: TenantQuota, signing_key: str, mesh: str,
    revoke_users_before: int | None = None,
) -> dict[str, Any]:
    """A tenant account: its JetStream quota, its intake import, its exports.

    ``revoke_users_before`` (seconds since the epoch) revokes every user JWT issued before
    it (``revocations: {"*": t}``): how ``tenant suspend`` locks the tenant out.
    """
    nats: dict[str, Any] = {
        "type": "account",
        "limits": {
            **_UNLIMITED_CORE,
            "mem_storage": 0,
            "disk_storage": quota.storage_bytes,
            "streams": quota.max_streams,
            "consumer": quota.max_consumers,
            "max_ack_pending": quota.max_ack_pending,
        },
        "signing_keys": [signing_key],
        "imports": [{"name": "intake", "subject": f"crawl.seeds.{tenant}", "account": mesh,
                     "type": "service", "local_subject": "crawl.seeds"}],
        "exports": tenant_exports(),
        "tags": quota_tags(quota),
    }
    if revoke_users_before is not None:
        nats["revocations"] = {"*": revoke_users_before}
    return {"sub": tenant, "name": name, "nats": nats}


def tenant_user_permissions() -> dict[str, Any]:
    """What a tenant's users may publish: seeds, and the JetStream API of their own account
    except creating, updating or deleting RESULTS and EVENTS, or publishing into them."""
    deny = ["crawl.results.>", "crawl.events.>"]
    for stream in TENANT_STREAMS:
        for verb in ("CREATE", "UPDATE", "DELETE"):
            deny.append(f"$JS.API.STREAM.{verb}.{stream}")
    return {
        "pub": {"allow": ["crawl.seeds", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>"],
                "deny": deny},
        "sub": {"allow": [">"]},
    }


def user_claims(
    user: str, name: str, *, issuer_account: str | None = None,
    permissions: dict[str, Any] | None = None, expires_at: int | None = None,
) -> dict[str, Any]:
    """A user JWT's claims. ``issuer_account`` is set when a signing key (not the account's
    own key) signs it; ``expires_at`` is seconds since the epoch."""
    nats: dict[str, Any] = {"type": "user", "subs": NO_LIMIT, "data": NO_LIMIT,
                            "payload": NO_LIMIT, **(permissions or {})}
    if issuer_account:
        nats["issuer_account"] = issuer_account
    claims: dict[str, Any] = {"sub": user, "name": name, "nats": nats}
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    return claims


def delete_claims(operator_key: str, accounts: list[str]) -> dict[str, Any]:
    """Generic claims asking the full resolver to delete ``accounts``
    (``$SYS.REQ.CLAIMS.DELETE``; the server needs ``allow_delete: true``)."""
    return {"sub": operator_key, "nats": {"type": "generic", "accounts": accounts}}
