"""NATS JWTs (shared.accounts.jwt), the claims crawlmesh issues (shared.accounts.claims) and
the checks made before a JWT is pushed (shared.accounts.resolver)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import nats.errors
import orjson
import pytest

from shared.accounts import claims
from shared.accounts.jwt import (
    HEADER,
    JwtError,
    KeyPair,
    creds_file,
    decode,
    encode,
    read_creds_jwt,
    verify_key,
)
from shared.accounts.resolver import UPDATE, ClaimsError, ClaimsResolver, validate_account_jwt


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _parts(token: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    header, body, signature = token.split(".")
    pad = lambda text: text + "=" * (-len(text) % 4)  # noqa: E731
    return (orjson.loads(base64.urlsafe_b64decode(pad(header))),
            orjson.loads(base64.urlsafe_b64decode(pad(body))), signature)


OPERATOR = KeyPair.create("O")
SIGNING = KeyPair.create("O")
ACCOUNT = KeyPair.create("A")
TRUSTED = {OPERATOR.public_key, SIGNING.public_key}


def _account_jwt(signer: KeyPair = SIGNING, iat: int = 1_700_000_000,
                 account: KeyPair = ACCOUNT) -> str:
    return encode(claims.tenant_account_claims(
        account.public_key, "a", claims.TenantQuota(), KeyPair.create("A").public_key,
        KeyPair.create("A").public_key), signer, issued_at=iat)


# ---- keys ----------------------------------------------------------------------------------


def test_key_pairs_have_nkeys_prefixes() -> None:
    assert OPERATOR.public_key.startswith("O") and OPERATOR.seed.startswith(b"SO")
    assert ACCOUNT.public_key.startswith("A") and ACCOUNT.seed.startswith(b"SA")
    user = KeyPair.create("U")
    assert user.public_key.startswith("U") and len(user.public_key) == 56


def test_verify_key_rejects_bad_public_keys() -> None:
    verify_key(ACCOUNT.public_key)
    corrupted = ACCOUNT.public_key[:-1] + ("A" if ACCOUNT.public_key[-1] != "A" else "B")
    for bad in ("", "not-a-key", corrupted, ACCOUNT.public_key[:-4]):
        with pytest.raises(JwtError, match="invalid public key"):
            verify_key(bad)


# ---- encode / decode -----------------------------------------------------------------------


def test_round_trip_keeps_claims_and_sets_iss_iat_jti_version() -> None:
    original = {"sub": ACCOUNT.public_key, "name": "a",
                "nats": {"type": "account", "limits": {"conn": -1}}}
    token = encode(original, SIGNING, issued_at=1_700_000_123)
    header, body, _ = _parts(token)
    assert header == HEADER
    decoded = decode(token, claim_type="account")
    assert decoded == body
    assert decoded["sub"] == ACCOUNT.public_key and decoded["name"] == "a"
    assert decoded["nats"] == {"type": "account", "limits": {"conn": -1}, "version": 2}
    assert decoded["iss"] == SIGNING.public_key and decoded["iat"] == 1_700_000_123
    # jti: unpadded base32 SHA-256 of the claims serialised with jti empty (nats-io/jwt v2)
    digest = hashlib.sha256(orjson.dumps({**decoded, "jti": ""})).digest()
    assert decoded["jti"] == base64.b32encode(digest).rstrip(b"=").decode()
    assert "version" not in original["nats"]  # the input is not modified


def test_default_issue_time_is_now() -> None:
    import time

    before = int(time.time())
    iat = decode(encode({"sub": "x", "nats": {"type": "generic"}}, OPERATOR))["iat"]
    assert before <= iat <= int(time.time())


def test_decode_checks_the_claim_type() -> None:
    token = encode(claims.user_claims(KeyPair.create("U").public_key, "u"), ACCOUNT)
    assert decode(token, claim_type="user")["nats"]["type"] == "user"
    with pytest.raises(JwtError, match="expected a account JWT, got 'user'"):
        decode(token, claim_type="account")


def _resign_body(token: str, body: dict[str, Any], signer: KeyPair | None = None) -> str:
    header, _, signature = token.split(".")
    new_body = _b64(orjson.dumps(body))
    if signer is None:
        return f"{header}.{new_body}.{signature}"
    signing_input = f"{header}.{new_body}"
    return f"{signing_input}.{_b64(signer.sign(signing_input.encode()))}"


def test_tampered_claims_fail_verification() -> None:
    token = _account_jwt()
    _, body, _ = _parts(token)
    richer = {**body, "nats": {**body["nats"], "limits": {"disk_storage": -1}}}
    with pytest.raises(JwtError, match="signature does not verify"):
        decode(_resign_body(token, richer))


def test_claiming_another_issuer_fails_verification() -> None:
    """Signed by a rogue key but naming the operator's signing key as issuer."""
    token = _account_jwt()
    _, body, _ = _parts(token)
    forged = _resign_body(token, body, signer=KeyPair.create("O"))
    with pytest.raises(JwtError, match="signature does not verify"):
        decode(forged)


@pytest.mark.parametrize("mangle", [
    lambda h, b, s: f"{h}.{b}.{s[:-4]}AAAA",    # flipped signature bytes
    lambda h, b, s: f"{h}.{b}.{s[:20]}",        # truncated signature
    lambda h, b, s: f"{h}.{b}.",                # no signature
    lambda h, b, s: f"{h}.{b}",                 # two parts
    lambda h, b, s: f"{h}.{b}.{s}.{s}",         # four parts
    lambda h, b, s: f"{h}.!!!.{s}",             # not base64
    lambda h, b, s: f"{h}.{_b64(b'not json')}.{s}",
    lambda h, b, s: f"{h}.{_b64(b'[1, 2]')}.{s}",  # claims not an object
    lambda h, b, s: f"{_b64(b'[]')}.{b}.{s}",      # header not an object
    lambda h, b, s: f"{_b64(orjson.dumps({'typ': 'JWT', 'alg': 'none'}))}.{b}.{s}",
    lambda h, b, s: "",
])
def test_malformed_or_badly_signed_tokens_raise_jwt_error(mangle: Any) -> None:
    h, b, s = _account_jwt().split(".")
    with pytest.raises(JwtError):
        decode(mangle(h, b, s))


@pytest.mark.parametrize("body", [
    {"sub": "x", "iat": 1, "nats": {"type": "account"}},                       # no issuer
    {"sub": "x", "iat": 1, "iss": 42, "nats": {"type": "account"}},            # not a string
    {"sub": "x", "iat": 1, "iss": "OBOGUS", "nats": {"type": "account"}},      # not a key
    {"sub": "x", "iat": 1, "iss": SIGNING.public_key, "nats": "account"},      # nats not an object
    {"sub": "x", "iat": 1, "iss": SIGNING.public_key},                         # no nats claims
    {"sub": "x", "iat": "1", "iss": SIGNING.public_key, "nats": {"type": "account"}},  # iat
])
def test_claims_without_a_valid_issuer_nats_object_or_iat_raise_jwt_error(
    body: dict[str, Any],
) -> None:
    """Signed correctly (by SIGNING), but claims crawlmesh must not act on."""
    signing_input = f"{_b64(orjson.dumps(HEADER))}.{_b64(orjson.dumps(body))}"
    signature = _b64(SIGNING.sign(signing_input.encode()))
    with pytest.raises(JwtError):
        decode(f"{signing_input}.{signature}")


def test_creds_file_round_trip() -> None:
    user = KeyPair.create("U")
    token = encode(claims.user_claims(user.public_key, "u"), ACCOUNT)
    text = creds_file(token, user.seed)
    assert read_creds_jwt(text) == token
    assert user.seed.decode() in text
    with pytest.raises(JwtError):
        read_creds_jwt("no jwt here")


# ---- validate_account_jwt ------------------------------------------------------------------


def test_validate_accepts_operator_or_signing_key_and_a_newer_iat() -> None:
    current = _account_jwt(iat=100)
    assert validate_account_jwt(_account_jwt(iat=101), TRUSTED, current)["iat"] == 101
    assert validate_account_jwt(_account_jwt(OPERATOR, iat=200), TRUSTED, current)
    assert validate_account_jwt(_account_jwt(iat=5), TRUSTED, None)  # nothing held yet


@pytest.mark.parametrize("signer", [KeyPair.create("O"), ACCOUNT, KeyPair.create("A")])
def test_validate_refuses_issuers_the_operator_does_not_trust(signer: KeyPair) -> None:
    with pytest.raises(JwtError, match="not the operator or one of its signing keys"):
        validate_account_jwt(_account_jwt(signer, iat=101), TRUSTED, _account_jwt(iat=100))


@pytest.mark.parametrize("iat", [100, 99, 0])
def test_validate_refuses_a_jwt_not_strictly_newer(iat: int) -> None:
    with pytest.raises(JwtError, match="not after the current one"):
        validate_account_jwt(_account_jwt(iat=iat), TRUSTED, _account_jwt(iat=100))


def test_validate_refuses_other_claim_types_and_tampering() -> None:
    user = encode(claims.user_claims(KeyPair.create("U").public_key, "u"), SIGNING)
    with pytest.raises(JwtError, match="expected a account JWT"):
        validate_account_jwt(user, TRUSTED, None)
    _, body, _ = _parts(_account_jwt(iat=101))
    with pytest.raises(JwtError, match="signature does not verify"):
        validate_account_jwt(_resign_body(_account_jwt(iat=101), {**body, "iat": 999}),
                             TRUSTED, None)


def test_validate_refuses_when_the_current_jwt_is_another_account() -> None:
    other = _account_jwt(iat=50, account=KeyPair.create("A"))
    with pytest.raises(JwtError, match="current JWT is for account"):
        validate_account_jwt(_account_jwt(iat=101), TRUSTED, other)


# ---- ClaimsResolver (no server: a recording stand-in for the SYS connection) ---------------


class _Reply:
    def __init__(self, data: bytes) -> None:
        self.data = data


class _FakeSys:
    """Answers lookups with ``held`` (or raises ``lookup_error``) and updates with ok."""

    def __init__(self, held: bytes = b"", lookup_error: Exception | None = None) -> None:
        self.held = held
        self.lookup_error = lookup_error
        self.sent: list[tuple[str, bytes]] = []

    async def request(self, subject: str, payload: bytes, timeout: float) -> _Reply:  # noqa: ASYNC109
        if subject.endswith(".CLAIMS.LOOKUP"):
            if self.lookup_error:
                raise self.lookup_error
            return _Reply(self.held)
        self.sent.append((subject, payload))
        return _Reply(b'{"data": {"code": 200}}')


async def test_push_sends_a_valid_jwt() -> None:
    sys_nc = _FakeSys(held=_account_jwt(iat=100).encode())
    token = _account_jwt(iat=101)
    await ClaimsResolver(sys_nc, TRUSTED).push(token)  # type: ignore[arg-type]
    assert sys_nc.sent == [(UPDATE, token.encode())]


@pytest.mark.parametrize("token", [
    _account_jwt(KeyPair.create("O"), iat=101), _account_jwt(iat=100), _account_jwt(iat=1)])
async def test_push_sends_nothing_for_a_refused_jwt(token: str) -> None:
    sys_nc = _FakeSys(held=_account_jwt(iat=100).encode())
    with pytest.raises(JwtError):
        await ClaimsResolver(sys_nc, TRUSTED).push(token)  # type: ignore[arg-type]
    assert sys_nc.sent == []


@pytest.mark.parametrize("error", [nats.errors.TimeoutError(), nats.errors.NoRespondersError()])
async def test_push_fails_closed_when_the_current_jwt_cannot_be_looked_up(
    error: Exception,
) -> None:
    """A lookup without an answer must not pass for "no JWT yet": the issue-time check would
    be skipped and an older JWT pushed."""
    sys_nc = _FakeSys(lookup_error=error)
    with pytest.raises(ClaimsError, match="no answer"):
        await ClaimsResolver(sys_nc, TRUSTED).push(_account_jwt(iat=1))  # type: ignore[arg-type]
    assert sys_nc.sent == []


async def test_lookup_answers() -> None:
    held = _account_jwt(iat=100)
    assert await ClaimsResolver(_FakeSys(held=held.encode()), TRUSTED).lookup("A") == held  # type: ignore[arg-type]
    assert await ClaimsResolver(_FakeSys(held=b""), TRUSTED).lookup("A") is None  # type: ignore[arg-type]
    with pytest.raises(ClaimsError, match="unexpected answer"):
        await ClaimsResolver(_FakeSys(held=b'{"error": "x"}'), TRUSTED).lookup("A")  # type: ignore[arg-type]


# ---- claims --------------------------------------------------------------------------------


def test_tenant_exports_all_require_an_activation_token() -> None:
    exports = claims.tenant_exports()
    assert {e["subject"] for e in exports} == {
        "crawl.results.>", "crawl.events.>",
        "$JS.API.STREAM.INFO.RESULTS", "$JS.API.STREAM.INFO.EVENTS"}
    assert all(e["token_req"] and e["type"] == "service" for e in exports)


def test_mesh_intake_export_is_scoped_by_account_token() -> None:
    mesh = claims.mesh_account_claims("AMESH", {})
    assert mesh["nats"]["exports"] == [{"name": "intake", "subject": "crawl.seeds.*",
                                        "type": "service", "account_token_position": 3}]


def test_tenant_account_imports_only_its_own_intake_slot() -> None:
    quota = claims.TenantQuota(storage_bytes=1 << 20, max_streams=3, max_consumers=4)
    account = claims.tenant_account_claims("ATENANT", "t", quota, "ASIGN", "AMESH",
                                           revoke_users_before=123)
    nats_ = account["nats"]
    assert nats_["imports"] == [{"name": "intake", "subject": "crawl.seeds.ATENANT",
                                 "account": "AMESH", "type": "service",
                                 "local_subject": "crawl.seeds"}]
    assert nats_["limits"]["disk_storage"] == 1 << 20 and nats_["limits"]["mem_storage"] == 0
    assert (nats_["limits"]["streams"], nats_["limits"]["consumer"]) == (3, 4)
    assert nats_["revocations"] == {"*": 123}
    assert "revocations" not in claims.tenant_account_claims(
        "ATENANT", "t", quota, "ASIGN", "AMESH")["nats"]


def test_tenant_users_cannot_touch_their_streams_configuration_or_mesh() -> None:
    perms = claims.tenant_user_permissions()
    assert set(perms["pub"]["allow"]) == {
        "crawl.seeds", "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "_INBOX.>"}
    for stream in ("RESULTS", "EVENTS"):
        for verb in ("CREATE", "UPDATE", "DELETE"):
            assert f"$JS.API.STREAM.{verb}.{stream}" in perms["pub"]["deny"]
    assert {"crawl.results.>", "crawl.events.>"} <= set(perms["pub"]["deny"])
    assert not [s for s in perms["pub"]["allow"] if s.startswith(("mesh", "$SYS", "_R_"))]


def test_mesh_imports_every_tenant_export_with_its_token() -> None:
    tokens = {e["subject"]: f"tok-{e['subject']}" for e in claims.tenant_exports()}
    mesh = claims.mesh_account_claims("AMESH", {"ATENANT": tokens})
    imports = {i["local_subject"]: i for i in mesh["nats"]["imports"]}
    assert set(imports) == {"tenant.ATENANT.results.>", "tenant.ATENANT.events.>",
                            "tenant.ATENANT.api.results", "tenant.ATENANT.api.events"}
    for item in imports.values():
        assert item["account"] == "ATENANT" and item["token"] == tokens[item["subject"]]
