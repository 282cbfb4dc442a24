"""NATS JWTs (version 2): encoding, signing, decoding and verification, and creds files.

A NATS JWT is ``base64url(header) . base64url(claims) . base64url(signature)`` without
padding; the header is ``{"typ": "JWT", "alg": "ed25519-nkey"}``; the signature is the
ed25519 signature of ``header.claims`` (both base64url) by the issuer's nkey; ``jti`` is the
unpadded base32 SHA-256 of the claims serialised with ``jti`` empty (nats-io/jwt v2,
``ClaimsData.hash`` and ``Encode``). Claim types used here: ``operator``, ``account``,
``user``, ``activation`` and ``generic`` (claims deletion).

We encode these ourselves on top of ``nkeys`` (the signing library): the one Python JWT
package on PyPI (``nats-jwt`` 0.2) has no activation tokens, which tenant exports need, and
calls itself untested.
"""

from __future__ import annotations

import base64
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys
import orjson

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
VERSION = 2

_PREFIXES = {
    "O": nkeys.PREFIX_BYTE_OPERATOR,
    "A": nkeys.PREFIX_BYTE_ACCOUNT,
    "U": nkeys.PREFIX_BYTE_USER,
}


class JwtError(ValueError):
    """A JWT that is malformed, badly signed, of the wrong type or from the wrong issuer."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class KeyPair:
    """An nkeys key pair from its seed (``S`` + kind letter + base32).

    Attributes:
        seed: the private seed, bytes as nkeys encodes them (``SO…``, ``SA…``, ``SU…``).
    """

    seed: bytes

    @classmethod
    def create(cls, kind: str) -> KeyPair:
        """A new random key pair; ``kind`` is ``"O"`` (operator), ``"A"`` or ``"U"``."""
        import os

        return cls(nkeys.encode_seed(os.urandom(32), _PREFIXES[kind]))

    @property
    def public_key(self) -> str:
        return nkeys.from_seed(bytearray(self.seed)).public_key.decode()

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def verify_key(public_key: str) -> nacl.signing.VerifyKey:
    """The ed25519 verify key inside an nkeys public key (prefix byte + 32 bytes + CRC16).

    Raises:
        JwtError: not a valid public nkey.
    """
    try:
        raw = base64.b32decode(public_key + "=" * (-len(public_key) % 8))
    except (ValueError, TypeError) as error:
        raise JwtError(f"invalid public key {public_key!r}") from error
    if len(raw) != 35 or nkeys.crc16_checksum(raw[:-2]) != raw[-2:]:
        raise JwtError(f"invalid public key {public_key!r}")
    return nacl.signing.VerifyKey(raw[1:33])


def encode(claims: dict[str, Any], signer: KeyPair, *, issued_at: int | None = None) -> str:
    """Sign ``claims`` with ``signer`` and return the JWT.

    ``iss`` is set to the signer's public key, ``iat`` to ``issued_at`` (default: now, in
    whole seconds since the epoch) and ``jti`` to the claims' hash. ``claims["nats"]`` must
    hold ``type``; ``version`` is set to 2.
    """
    body = dict(claims)
    body["nats"] = {**body["nats"], "version": VERSION}
    body["iss"] = signer.public_key
    body["iat"] = int(issued_at if issued_at is not None else time.time())
    body["jti"] = ""
    digest = hashlib.sha256(orjson.dumps(body)).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    signing_input = f"{_b64(orjson.dumps(HEADER))}.{_b64(orjson.dumps(body))}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def decode(token: str, *, claim_type: str | None = None) -> dict[str, Any]:
    """Decode ``token``, verify its signature against its own ``iss`` and return the claims.

    Raises:
        JwtError: malformed, signature invalid, or not of ``claim_type``.
    """
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JwtError("not a JWT: expected three dot-separated parts")
    try:
        header = orjson.loads(_unb64(parts[0]))
        claims = orjson.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except (ValueError, orjson.JSONDecodeError) as error:
        raise JwtError(f"not a JWT: {error}") from error
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise JwtError("not a JWT: header and claims must be JSON objects")
    if header.get("alg") != HEADER["alg"]:
        raise JwtError(f"unsupported JWT algorithm {header.get('alg')!r}")
    issuer = claims.get("iss")
    if not isinstance(issuer, str):
        raise JwtError("JWT has no issuer")
    try:
        verify_key(issuer).verify(f"{parts[0]}.{parts[1]}".encode(), signature)
    except nacl.exceptions.CryptoError:  # bad signature, or one of the wrong length
        raise JwtError("JWT signature does not verify against its issuer") from None
    nats_claims = claims.get("nats")
    if not isinstance(nats_claims, dict):
        raise JwtError("JWT has no nats claims object")
    if not isinstance(claims.get("iat"), int):
        raise JwtError("JWT has no integer issue time (iat)")
    kind = nats_claims.get("type")
    if claim_type is not None and kind != claim_type:
        raise JwtError(f"expected a {claim_type} JWT, got {kind!r}")
    return claims


def creds_file(user_jwt: str, user_seed: bytes) -> str:
    """The text of a NATS ``.creds`` file holding a user JWT and its nkey seed."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user_seed.decode()}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def read_creds_jwt(text: str) -> str:
    """The user JWT inside a ``.creds`` file's text.

    Raises:
        JwtError: no JWT block.
    """
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("-----BEGIN NATS USER JWT") and index + 1 < len(lines):
            return lines[index + 1].strip()
    raise JwtError("no user JWT in creds file")
