"""The tenant registry: tenant names mapped to opaque ids shaped like NATS account keys.

A tenant id is the public key of an nkeys account key pair (``A`` + 55 base32 characters),
so the tenant can become a real NATS account (its JWT subject) without renaming any subject.
The registry lives in the ``tenants`` KV bucket (keys ``name.<name>`` -> id and
``id.<id>`` -> name). The account's private seed is written to
``<home>/keys/<id>.nk`` with mode 0600 and never leaves that folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nkeys
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError

from shared.streams import TENANTS_BUCKET

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class TenantError(ValueError):
    """An unknown tenant or an invalid tenant name."""


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid tenant name (``[a-z0-9][a-z0-9_-]{0,62}``).

    Raises:
        TenantError: saying why.
    """
    if not _NAME.match(name):
        raise TenantError(f"invalid tenant name {name!r}: use lowercase letters, digits, - and _")
    return name


def mint_account_key() -> tuple[str, bytes]:
    """A new ed25519 account key pair: ``(public key, private seed)`` in nkeys encoding."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    pair = nkeys.from_seed(bytearray(seed))
    return pair.public_key.decode(), seed


class TenantRegistry:
    """Maps tenant names to ids, in the ``tenants`` KV bucket."""

    def __init__(self, js: JetStreamContext, home: Path | None = None) -> None:
        self.js = js
        self.home = home

    async def _kv(self):  # type: ignore[no-untyped-def]
        return await self.js.key_value(TENANTS_BUCKET)

    async def ensure(self, name: str) -> str:
        """Return the id of tenant ``name``, registering it first if it is new.

        Concurrent callers agree on one id (create-if-absent on ``name.<name>``).

        Raises:
            TenantError: invalid name.
        """
        check_name(name)
        kv = await self._kv()
        try:
            return (await kv.get(f"name.{name}")).value.decode()  # type: ignore[union-attr]
        except KeyNotFoundError:
            pass
        tenant_id, seed = mint_account_key()
        try:
            await kv.create(f"name.{name}", tenant_id.encode())
        except KeyWrongLastSequenceError:
            return (await kv.get(f"name.{name}")).value.decode()  # type: ignore[union-attr]
        await kv.put(f"id.{tenant_id}", name.encode())
        if self.home is not None:
            keys = self.home / "keys"
            keys.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = keys / f"{tenant_id}.nk"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(seed)
        return tenant_id

    async def resolve(self, name_or_id: str) -> str:
        """The id of a tenant given its name or id.

        Raises:
            TenantError: no such tenant.
        """
        kv = await self._kv()
        key = f"id.{name_or_id}" if name_or_id.startswith("A") and len(name_or_id) == 56 else None
        if key:
            try:
                await kv.get(key)
                return name_or_id
            except KeyNotFoundError:
                pass
        try:
            return (await kv.get(f"name.{name_or_id}")).value.decode()  # type: ignore[union-attr]
        except KeyNotFoundError:
            raise TenantError(f"unknown tenant {name_or_id!r}") from None

    async def all(self) -> dict[str, str]:
        """Every registered tenant as ``{name: id}``."""
        kv = await self._kv()
        try:
            keys = await kv.keys()
        except NoKeysError:
            return {}
        out: dict[str, str] = {}
        for key in keys:
            if not key.startswith("name."):
                continue
            entry = await kv.get(key)
            out[key.removeprefix("name.")] = (entry.value or b"").decode()
        return out
