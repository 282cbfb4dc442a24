"""Pushing account JWTs to nats-server's full resolver, validated first.

The full resolver answers 200 to JWTs it should reject (signed by a key the operator does
not trust, or not newer than the JWT it holds) and stores them (DESIGN.md, hazards), so
:func:`validate_account_jwt` checks the issuer and the issue time before
:class:`ClaimsResolver` sends anything on ``$SYS.REQ.CLAIMS.UPDATE``.
"""

from __future__ import annotations

from typing import Any

import orjson
from nats.aio.client import Client

from shared.accounts.jwt import JwtError, KeyPair, decode, encode

UPDATE = "$SYS.REQ.CLAIMS.UPDATE"
DELETE = "$SYS.REQ.CLAIMS.DELETE"
LOOKUP = "$SYS.REQ.ACCOUNT.{account}.CLAIMS.LOOKUP"


class ClaimsError(RuntimeError):
    """The server refused an account JWT, or did not answer."""


def validate_account_jwt(
    token: str, trusted_issuers: set[str], current: str | None,
) -> dict[str, Any]:
    """Check an account JWT before it is pushed; return its claims.

    Rules: the signature verifies; it is an ``account`` JWT; its issuer is one of
    ``trusted_issuers`` (the operator key and its signing keys); and if the server holds a
    JWT for the account (``current``), the new one's ``iat`` is strictly greater.

    Raises:
        JwtError: saying which rule failed.
    """
    claims = decode(token, claim_type="account")
    if claims["iss"] not in trusted_issuers:
        raise JwtError(f"account JWT for {claims.get('sub')} is signed by {claims['iss']}, "
                       "which is not the operator or one of its signing keys")
    if current:
        previous = decode(current, claim_type="account")
        if previous.get("sub") != claims.get("sub"):
            raise JwtError(f"the current JWT is for account {previous.get('sub')}, "
                           f"not {claims.get('sub')}")
        if int(claims["iat"]) <= int(previous["iat"]):
            raise JwtError(
                f"account JWT for {claims.get('sub')} was issued at {claims['iat']}, not after "
                f"the current one ({previous['iat']}): refusing to push an older or equal JWT")
    return claims


class ClaimsResolver:
    """Looks up, updates and deletes account JWTs through a SYS-account connection."""

    def __init__(self, sys_nc: Client, trusted_issuers: set[str], timeout_s: float = 5.0) -> None:
        self.nc = sys_nc
        self.trusted = trusted_issuers
        self.timeout_s = timeout_s

    async def lookup(self, account: str) -> str | None:
        """The account JWT the server holds, or None if it holds none (an empty answer).

        Fails closed: :meth:`push` compares issue times against this answer, so a lookup
        that gets no answer must not pass for "no JWT yet" (an older JWT would then be
        pushed unchecked).

        Raises:
            ClaimsError: no answer, or an answer that is neither empty nor a JWT.
        """
        subject = LOOKUP.format(account=account)
        try:
            reply = await self.nc.request(subject, b"", timeout=self.timeout_s)
        except Exception as error:
            raise ClaimsError(f"no answer on {subject}: {error!r}") from error
        text = reply.data.decode(errors="replace").strip()
        if not text:
            return None
        if text.count(".") != 2 or text.startswith("{"):
            raise ClaimsError(f"unexpected answer on {subject}: {text[:200]!r}")
        return text

    async def push(self, token: str) -> None:
        """Validate ``token`` (:func:`validate_account_jwt`) and push it.

        Raises:
            JwtError: it failed validation; nothing was sent.
            ClaimsError: the current JWT could not be looked up (nothing was sent), or the
                server answered the update with an error, or not at all.
        """
        claims = decode(token, claim_type="account")
        validate_account_jwt(token, self.trusted, await self.lookup(claims["sub"]))
        await self._request(UPDATE, token.encode())

    async def delete(self, accounts: list[str], operator: KeyPair) -> None:
        """Delete ``accounts`` from the resolver (an operator-signed generic claim).

        Raises:
            ClaimsError: the server refused.
        """
        token = encode({"sub": operator.public_key,
                        "nats": {"type": "generic", "accounts": accounts}}, operator)
        await self._request(DELETE, token.encode())

    async def _request(self, subject: str, payload: bytes) -> None:
        try:
            reply = await self.nc.request(subject, payload, timeout=self.timeout_s)
        except Exception as error:
            raise ClaimsError(f"no answer on {subject}: {error!r}") from error
        try:
            body = orjson.loads(reply.data)
        except orjson.JSONDecodeError:
            raise ClaimsError(f"unexpected answer on {subject}: {reply.data[:200]!r}") from None
        if body.get("error"):
            raise ClaimsError(f"{subject} refused: {body['error']}")
