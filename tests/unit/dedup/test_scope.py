"""Job scope: same-host, same-domain (public suffix list, offline), patterns, URL length."""

from __future__ import annotations

import socket

import pytest

from services.dedup import scope as scope_module
from services.dedup.scope import (
    DENIED,
    NOT_ALLOWED,
    OFF_DOMAIN,
    OFF_HOST,
    TOO_LONG,
    JobScope,
    registrable_domain,
)
from shared.contracts import CrawlRequest
from shared.urls import canonical_url


def job_scope(*seeds: str, mode: str = "same-host", allow: tuple[str, ...] = (),
              deny: tuple[str, ...] = (), **kwargs: int) -> JobScope:
    request = CrawlRequest.model_validate(
        {"seeds": seeds, "scope": {"mode": mode, "allow": allow, "deny": deny}}
    )
    return JobScope(request, **kwargs)


def check(scope: JobScope, url: str) -> str | None:
    return scope.check(canonical_url(url))


def test_same_host() -> None:
    scope = job_scope("https://docs.example.com/guide/")
    assert check(scope, "https://docs.example.com/api/") is None
    assert check(scope, "http://docs.example.com/") is None  # scheme does not matter
    assert check(scope, "https://DOCS.example.com:443/x") is None  # default port dropped
    assert check(scope, "https://example.com/") == OFF_HOST
    assert check(scope, "https://www.docs.example.com/") == OFF_HOST
    assert check(scope, "https://docs.example.com:8443/") == OFF_HOST


def test_same_host_with_a_non_default_port() -> None:
    scope = job_scope("http://127.0.0.1:8000/")
    assert check(scope, "http://127.0.0.1:8000/a") is None
    assert check(scope, "http://127.0.0.1:8001/a") == OFF_HOST
    assert check(scope, "http://127.0.0.1/a") == OFF_HOST


def test_same_host_with_several_seeds() -> None:
    scope = job_scope("https://a.example.org/", "https://b.example.net/")
    assert check(scope, "https://b.example.net/page") is None
    assert check(scope, "https://c.example.org/") == OFF_HOST


def test_same_domain_uses_the_public_suffix_list() -> None:
    scope = job_scope("https://a.example.co.uk/", mode="same-domain")
    assert check(scope, "https://b.example.co.uk/") is None
    assert check(scope, "https://example.co.uk/") is None
    assert check(scope, "https://deep.b.example.co.uk:8080/") is None  # ports do not matter
    assert check(scope, "https://example.com/") == OFF_DOMAIN
    assert check(scope, "https://other.co.uk/") == OFF_DOMAIN
    assert check(scope, "https://example.uk/") == OFF_DOMAIN


def test_same_domain_respects_private_suffixes() -> None:
    scope = job_scope("https://alice.github.io/blog/", mode="same-domain")
    assert check(scope, "https://alice.github.io/about") is None
    assert check(scope, "https://bob.github.io/") == OFF_DOMAIN


def test_same_domain_for_ip_hosts_is_the_same_address() -> None:
    scope = job_scope("http://192.0.2.10:8080/", "http://[2001:db8::1]/", mode="same-domain")
    assert check(scope, "http://192.0.2.10/other") is None
    assert check(scope, "http://192.0.2.11/") == OFF_DOMAIN
    assert check(scope, "http://[2001:db8::1]:8443/") is None
    assert check(scope, "http://[2001:db8::2]/") == OFF_DOMAIN


@pytest.mark.parametrize(
    ("host", "domain"),
    [
        ("a.example.co.uk", "example.co.uk"),
        ("WWW.Example.COM.", "example.com"),
        ("city.kawasaki.jp", "city.kawasaki.jp"),  # a PSL exception rule
        ("co.uk", "co.uk"),  # itself a public suffix
        ("localhost", "localhost"),
        ("a.b.intranet", "b.intranet"),  # no rule: the default rule "*"
        ("10.1.2.3", "10.1.2.3"),
        ("[::1]", "::1"),
        ("xn--mnchen-3ya.de", "xn--mnchen-3ya.de"),
    ],
)
def test_registrable_domain(host: str, domain: str) -> None:
    assert registrable_domain(host) == domain


def test_public_suffix_list_is_never_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the public suffix list must not be fetched")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    scope_module._public_suffixes.cache_clear()
    try:
        assert registrable_domain("shop.example.com.au") == "example.com.au"
    finally:
        scope_module._public_suffixes.cache_clear()


def test_any_mode_only_applies_patterns_and_length() -> None:
    scope = job_scope("https://example.com/", mode="any", deny=(r"\.pdf$",))
    assert check(scope, "https://elsewhere.example.org/") is None
    assert check(scope, "https://elsewhere.example.org/paper.pdf") == DENIED


def test_deny_and_allow_patterns() -> None:
    scope = job_scope(
        "https://shop.example/", allow=(r"/products/", r"/categories/"),
        deny=(r"[?&]sort=", r"/products/.*/reviews"),
    )
    assert check(scope, "https://shop.example/products/kettle") is None
    assert check(scope, "https://shop.example/categories/kitchen?page=2") is None
    assert check(scope, "https://shop.example/categories/kitchen?sort=price") == DENIED
    assert check(scope, "https://shop.example/products/kettle/reviews") == DENIED
    assert check(scope, "https://shop.example/cart") == NOT_ALLOWED
    assert check(scope, "https://other.example/products/x") == OFF_HOST


def test_patterns_search_the_canonical_url() -> None:
    scope = job_scope("https://shop.example/", allow=(r"^https://shop\.example/\?a=1&b=2$",))
    assert check(scope, "https://shop.example/?b=2&a=1") is None  # canonical: sorted query


def test_seeds_are_always_in_scope() -> None:
    scope = job_scope("https://shop.example/", allow=(r"/products/",), deny=(r"shop",))
    assert check(scope, "https://shop.example/") is None
    assert check(scope, "https://shop.example/products/a") == DENIED


def test_too_long() -> None:
    scope = job_scope("https://example.com/", max_url_chars=60)
    assert check(scope, "https://example.com/" + "a" * 40) is None
    assert check(scope, "https://example.com/" + "a" * 41) == TOO_LONG
    assert check(job_scope("https://example.com/"), "https://example.com/" + "a" * 2100) == TOO_LONG
