"""Keys, JWTs and creds files in the crawlmesh home folder, and the operator-mode config.

Layout (every private file mode 0600, folders 0700)::

    <home>/keys/<name>.nk          nkey seeds: operator, operator-signing, SYS, MESH,
                                   <tenant id>, <tenant id>.signing
    <home>/jwt/<name>.jwt          the current JWT of the operator and of each account
    <home>/creds/sys.creds         a SYS user (pushes account JWTs)
    <home>/creds/mesh.creds        the MESH user every service connects with
    <home>/creds/tenants/<tenant name>.creds   a tenant user (``crawlmesh tenant add``)
    <home>/resolver/               the full resolver's JWT store (nats-server)

Seeds and creds are never logged and never put in a message.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from shared.accounts import claims
from shared.accounts.jwt import KeyPair, creds_file, encode

OPERATOR = "operator"
OPERATOR_SIGNING = "operator-signing"
SYS = "SYS"
MESH = "MESH"


def write_private(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` with mode 0600 (created so; never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(raw)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class KeyStore:
    """The operator's keys and JWTs under ``home``."""

    home: Path

    @property
    def keys_dir(self) -> Path:
        return self.home / "keys"

    @property
    def jwt_dir(self) -> Path:
        return self.home / "jwt"

    @property
    def resolver_dir(self) -> Path:
        return self.home / "resolver"

    @property
    def mesh_creds(self) -> Path:
        return self.home / "creds" / "mesh.creds"

    @property
    def sys_creds(self) -> Path:
        return self.home / "creds" / "sys.creds"

    def tenant_creds(self, name: str) -> Path:
        return self.home / "creds" / "tenants" / f"{name}.creds"

    def initialised(self) -> bool:
        return (self.jwt_dir / f"{OPERATOR}.jwt").exists() and self.mesh_creds.exists()

    # ---- keys ---------------------------------------------------------------------------

    def key(self, name: str) -> KeyPair:
        """The key pair stored as ``name``.

        Raises:
            FileNotFoundError: no such key (run ``crawlmesh init``).
        """
        return KeyPair((self.keys_dir / f"{name}.nk").read_bytes().strip())

    def has_key(self, name: str) -> bool:
        return (self.keys_dir / f"{name}.nk").exists()

    def save_key(self, name: str, pair: KeyPair) -> KeyPair:
        write_private(self.keys_dir / f"{name}.nk", pair.seed)
        return pair

    def remove_key(self, name: str) -> None:
        (self.keys_dir / f"{name}.nk").unlink(missing_ok=True)

    def jwt(self, name: str) -> str:
        return (self.jwt_dir / f"{name}.jwt").read_text().strip()

    def save_jwt(self, name: str, token: str) -> None:
        write_private(self.jwt_dir / f"{name}.jwt", token)

    def remove_jwt(self, name: str) -> None:
        (self.jwt_dir / f"{name}.jwt").unlink(missing_ok=True)

    # ---- operator -----------------------------------------------------------------------

    def init_operator(self) -> None:
        """Mint the operator (and its signing key), SYS and MESH, their JWTs, and the SYS and
        MESH users' creds, unless present. Idempotent: existing keys are kept."""
        for dir_ in (self.keys_dir, self.jwt_dir, self.resolver_dir, self.mesh_creds.parent):
            dir_.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.initialised():
            return
        operator = self.save_key(OPERATOR, KeyPair.create("O"))
        signing = self.save_key(OPERATOR_SIGNING, KeyPair.create("O"))
        sys_account = self.save_key(SYS, KeyPair.create("A"))
        mesh = self.save_key(MESH, KeyPair.create("A"))
        self.save_jwt(OPERATOR, encode(
            claims.operator_claims(operator.public_key, signing.public_key,
                                   sys_account.public_key), operator))
        self.save_jwt(SYS, encode(claims.system_account_claims(sys_account.public_key), signing))
        self.save_jwt(MESH, encode(claims.mesh_account_claims(mesh.public_key, {}), signing))
        write_private(self.sys_creds, self.user_creds(sys_account, "sys"))
        write_private(self.mesh_creds, self.user_creds(mesh, "mesh"))

    @property
    def operator_keys(self) -> set[str]:
        """Public keys allowed to sign account JWTs: the operator's and its signing key."""
        return {self.key(OPERATOR).public_key, self.key(OPERATOR_SIGNING).public_key}

    def user_creds(
        self, account: KeyPair, name: str, *, signer: KeyPair | None = None,
        permissions: dict[str, object] | None = None, ttl_s: float | None = None,
    ) -> str:
        """The text of a creds file for a new user of ``account``.

        Signed by ``signer`` (an account signing key; ``issuer_account`` is then set) or by
        the account key itself. ``ttl_s`` sets the JWT's expiry, in seconds from now.
        """
        user = KeyPair.create("U")
        expires = int(time.time() + ttl_s) if ttl_s else None
        token = encode(
            claims.user_claims(
                user.public_key, name,
                issuer_account=account.public_key if signer is not None else None,
                permissions=permissions, expires_at=expires,
            ),
            signer or account,
        )
        return creds_file(token, user.seed)

    def server_config(self) -> str:
        """The operator-mode part of nats-server's config: operator JWT, system account,
        the full resolver (deletions allowed) preloaded with SYS and MESH."""
        sys_key = self.key(SYS).public_key
        mesh_key = self.key(MESH).public_key
        return "\n".join([
            f"operator: {self.jwt(OPERATOR)}",
            f"system_account: {sys_key}",
            f'resolver {{ type: full, dir: "{self.resolver_dir}", allow_delete: true, '
            'interval: "2m", timeout: "5s" }',
            "resolver_preload {",
            f"  {sys_key}: {self.jwt(SYS)}",
            f"  {mesh_key}: {self.jwt(MESH)}",
            "}",
        ])
