"""The control plane: tenants added, changed, suspended, resumed and removed at run time.

Every change re-issues JWTs and pushes them through ``$SYS.REQ.CLAIMS.UPDATE`` (no server
restart). MESH's JWT imports every tenant's exports, so it changes with every tenant: all
changes run under an exclusive lock (``<home>/control.lock``) and each new JWT is issued
strictly after the one it replaces, so two concurrent ``crawlmesh tenant`` commands cannot
lose each other's change. JWTs are validated (issuer, issue time) before they are pushed
(:mod:`shared.accounts.resolver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from shared import streams
from shared.accounts import claims
from shared.accounts.claims import TenantQuota
from shared.accounts.jwt import KeyPair, decode, encode
from shared.accounts.keystore import MESH, OPERATOR, OPERATOR_SIGNING, KeyStore, write_private
from shared.accounts.resolver import ClaimsResolver
from shared.bus.connection import connect
from shared.settings import MeshSettings
from shared.tenancy import TenantError, TenantRecord, TenantRegistry, TenantStatus, check_name

ADMIN_TTL_S = 300.0
"""Life of the short-lived tenant admin user the control plane connects with (seconds)."""


def _signing_name(tenant: str) -> str:
    return f"{tenant}.signing"


class TenantControl:
    """Tenant administration. Use :meth:`open`; every method holds the control lock.

    Raises (every method):
        TenantError: unknown tenant, name taken, or wrong state for the operation.
        shared.accounts.jwt.JwtError: a JWT failed validation (nothing was pushed).
        shared.accounts.resolver.ClaimsError: the server refused a JWT.
    """

    def __init__(self, settings: MeshSettings, keys: KeyStore, mesh_nc: Client,
                 sys_nc: Client) -> None:
        self.settings = settings
        self.keys = keys
        self.mesh_nc = mesh_nc
        self.js = mesh_nc.jetstream()
        self.registry = TenantRegistry(self.js)
        self.resolver = ClaimsResolver(sys_nc, keys.operator_keys)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, settings: MeshSettings) -> AsyncIterator[TenantControl]:
        """Connect as MESH and SYS (creds from the home folder) and hold the control lock."""
        keys = KeyStore(settings.home)
        if not keys.initialised():
            raise TenantError(f"no operator in {settings.home}: run `crawlmesh init` first")
        lock_path = settings.home / "control.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a+") as lock:
            await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
            try:
                mesh_nc = await connect(settings, "crawlmesh-control", persistent=False)
                try:
                    sys_nc = await connect(settings, "crawlmesh-control-sys", persistent=False,
                                           creds=keys.sys_creds)
                    try:
                        yield cls(settings, keys, mesh_nc, sys_nc)
                    finally:
                        await sys_nc.close()
                finally:
                    await mesh_nc.close()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # ---- JWT issuing -------------------------------------------------------------------

    def _issued_at(self, name: str) -> int:
        """Now, or one second after the JWT stored as ``name`` if that is not earlier."""
        now = int(time.time())
        try:
            previous = int(decode(self.keys.jwt(name))["iat"])
        except (FileNotFoundError, ValueError):
            return now
        return max(now, previous + 1)

    async def _push(self, name: str, claims_: dict[str, Any]) -> str:
        token = encode(claims_, self.keys.key(OPERATOR_SIGNING), issued_at=self._issued_at(name))
        await self.resolver.push(token)
        self.keys.save_jwt(name, token)
        return token

    async def _push_tenant(self, record: TenantRecord, revoke_before: int | None = None) -> None:
        signing = self.keys.key(_signing_name(record.id))
        mesh = self.keys.key(MESH).public_key
        if revoke_before is None and record.status == TenantStatus.SUSPENDED:
            previous = decode(self.keys.jwt(record.id))
            revoke_before = (previous["nats"].get("revocations") or {}).get("*")
        await self._push(record.id, claims.tenant_account_claims(
            record.id, record.name, record.quota, signing.public_key, mesh, revoke_before))

    async def _push_mesh(self, tenants: list[TenantRecord]) -> None:
        mesh = self.keys.key(MESH).public_key
        imports: dict[str, dict[str, str]] = {}
        for record in tenants:
            signing = self.keys.key(_signing_name(record.id))
            imports[record.id] = {
                export["subject"]: encode(
                    claims.activation_claims(mesh, export["subject"], record.id), signing)
                for export in claims.tenant_exports()
            }
        await self._push(MESH, claims.mesh_account_claims(mesh, imports))

    # ---- tenant connections --------------------------------------------------------------

    def _user_creds(self, record: TenantRecord, name: str, *, admin: bool,
                    ttl_s: float | None) -> str:
        account = self.keys.key(record.id)
        return self.keys.user_creds(
            account, name, signer=self.keys.key(_signing_name(record.id)),
            permissions=None if admin else claims.tenant_user_permissions(), ttl_s=ttl_s)

    @contextlib.asynccontextmanager
    async def tenant_connection(self, record: TenantRecord) -> AsyncIterator[Client]:
        """A short-lived admin connection inside the tenant's account (in-memory creds)."""
        from shared.accounts.jwt import read_creds_jwt

        text = self._user_creds(record, "crawlmesh-admin", admin=True, ttl_s=ADMIN_TTL_S)
        seed = text.split("-----BEGIN USER NKEY SEED-----\n", 1)[1].split("\n", 1)[0].encode()
        nc = await connect(self.settings, f"crawlmesh-admin-{record.name}", persistent=False,
                           user=(read_creds_jwt(text), seed))
        try:
            yield nc
        finally:
            await nc.close()

    def write_tenant_creds(self, record: TenantRecord, path: Path | None = None,
                           ttl_s: float | None = None) -> Path:
        """Write a new tenant user's creds file (0600); return its path."""
        target = path or self.keys.tenant_creds(record.name)
        ttl = ttl_s if ttl_s is not None else self.settings.tenant_creds_ttl_s
        write_private(target, self._user_creds(record, record.name, admin=False, ttl_s=ttl))
        return target

    # ---- operations ----------------------------------------------------------------------

    async def ensure_mesh_jwt(self) -> None:
        """Re-push MESH's JWT with every registered tenant's imports (after a restart the
        server holds it already; this is a no-op in effect but keeps the two in step)."""
        await self._push_mesh(await self.registry.records())

    async def add(self, name: str, quota: TenantQuota | None = None) -> TenantRecord:
        """Create tenant ``name``: account, signing key, JWT, MESH imports, intake, RESULTS
        and EVENTS, and a creds file for its user (:meth:`KeyStore.tenant_creds`)."""
        check_name(name)
        existing = await self.registry.all()
        if name in existing:
            raise TenantError(f"tenant {name!r} exists ({existing[name]})")
        account = KeyPair.create("A")
        self.keys.save_key(account.public_key, account)
        self.keys.save_key(_signing_name(account.public_key), KeyPair.create("A"))
        record = TenantRecord(name=name, id=account.public_key, quota=quota or TenantQuota())
        await self._push_tenant(record)
        await self.registry.put(record)
        await self._push_mesh(await self.registry.records())
        await self._ensure_streams(record)
        self.write_tenant_creds(record)
        return record

    async def _ensure_streams(self, record: TenantRecord) -> None:
        await streams.ensure_tenant(self.js, record.id, self.settings)
        async with self.tenant_connection(record) as nc:
            await streams.ensure_tenant_streams(nc.jetstream(), self.settings,
                                                record.quota.storage_bytes)

    async def ensure(self, name: str, quota: TenantQuota | None = None) -> TenantRecord:
        """Tenant ``name``, added if it does not exist (``crawlmesh init``: ``default``)."""
        try:
            record = await self.registry.get(name)
        except TenantError:
            return await self.add(name, quota)
        await self._ensure_streams(record)
        if not self.keys.tenant_creds(record.name).exists():
            self.write_tenant_creds(record)
        return record

    async def update(self, name: str, **changes: int) -> TenantRecord:
        """Change quota fields (``storage_bytes``, ``max_streams``…) live.

        Raising storage: the account JWT first, then RESULTS grows. Lowering: RESULTS
        shrinks first (messages are kept; new ones are refused until use falls), then the JWT.
        """
        record = await self.registry.get(name)
        quota = record.quota.model_copy(update={k: v for k, v in changes.items() if v is not None})
        quota = TenantQuota.model_validate(quota.model_dump())
        new = record.model_copy(update={"quota": quota, "updated_at": datetime.now(UTC)})
        growing = quota.storage_bytes >= record.quota.storage_bytes
        if growing:
            await self._push_tenant(new)
        async with self.tenant_connection(new) as nc:
            await streams.ensure_tenant_streams(nc.jetstream(), self.settings, quota.storage_bytes)
        if not growing:
            await self._push_tenant(new)
        await self.registry.put(new)
        return new

    async def suspend(self, name: str) -> TenantRecord:
        """Revoke every user of the tenant (their connections are closed by the server) and
        mark it suspended: its running jobs pause (nothing more is admitted or fetched)."""
        record = await self.registry.get(name)
        new = record.model_copy(update={"status": TenantStatus.SUSPENDED,
                                        "updated_at": datetime.now(UTC)})
        await self._push_tenant(new, revoke_before=int(time.time()) + 1)
        await self.registry.put(new)
        return new

    async def resume(self, name: str) -> TenantRecord:
        """Lift the revocation and the pause. (Creds revoked by ``suspend`` work again; use
        ``rotate_creds`` if they leaked.)"""
        record = await self.registry.get(name)
        new = record.model_copy(update={"status": TenantStatus.ACTIVE,
                                        "updated_at": datetime.now(UTC)})
        await self._push_tenant(new)
        await self.registry.put(new)
        return new

    async def rotate_creds(self, name: str, path: Path | None = None) -> Path:
        """Issue the tenant user a new creds file; users issued before now are revoked.

        The new creds always replace the home folder's copy (:meth:`KeyStore.tenant_creds`,
        which ``crawl``/``status`` on the mesh host use); ``path`` gets a copy as well.
        Returns ``path`` if given, else the home folder's file.
        """
        record = await self.registry.get(name)
        await self._push_tenant(record, revoke_before=int(time.time()))
        await asyncio.sleep(1.0)  # JWT iat has one-second resolution: issue after the cut
        home_copy = self.write_tenant_creds(record)
        if path is None:
            return home_copy
        write_private(path, home_copy.read_bytes())
        return path

    async def remove(self, name: str) -> TenantRecord:
        """Cancel the tenant's jobs and delete everything it has: MESH-side streams,
        consumers, stage messages, dead letters, parked results, ledger, job and page KV
        keys, bodies, its RESULTS and EVENTS, MESH's imports, then the account."""
        from shared.jobs import JobStore

        record = await self.registry.get(name)
        jobs = JobStore(self.js)
        await jobs.cancel_all(record.id, reason=f"tenant {record.name} removed")
        with contextlib.suppress(Exception):
            async with self.tenant_connection(record) as nc:
                tjs = nc.jetstream()
                for stream in (streams.RESULTS, streams.EVENTS):
                    with contextlib.suppress(Exception):
                        await tjs.delete_stream(stream)
        await streams.remove_tenant(self.js, record.id)
        await jobs.delete_all(record.id)
        await self.registry.delete(record)
        with contextlib.suppress(Exception):  # the sink's pause marker, if any
            await (await self.js.key_value(streams.TENANTS_BUCKET)).purge(f"paused.{record.id}")
        await self._push_mesh(await self.registry.records())
        await self.resolver.delete([record.id], self.keys.key(OPERATOR))
        for key in (record.id, _signing_name(record.id)):
            self.keys.remove_key(key)
        self.keys.remove_jwt(record.id)
        self.keys.tenant_creds(record.name).unlink(missing_ok=True)
        return record

    async def usage(self, name: str) -> dict[str, Any]:
        """The tenant's JetStream use: account info (bytes stored, streams, consumers) and
        RESULTS/EVENTS message counts."""
        record = await self.registry.get(name)
        async with self.tenant_connection(record) as nc:
            reply = await nc.request("$JS.API.INFO", b"", timeout=5)
            import orjson

            info = orjson.loads(reply.data)
            out: dict[str, Any] = {
                "storage_used_bytes": info.get("storage", 0),
                "storage_limit_bytes": record.quota.storage_bytes,
                "streams": info.get("streams", 0), "consumers": info.get("consumers", 0),
            }
            tjs = nc.jetstream()
            for stream in (streams.RESULTS, streams.EVENTS):
                try:
                    state = (await tjs.stream_info(stream)).state
                    out[stream] = {"messages": state.messages, "bytes": state.bytes}
                except Exception:
                    out[stream] = None
        return out
