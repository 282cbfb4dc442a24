"""The egress policy: refused addresses are never connected to, on any hop."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpcore
import pytest

from services.fetcher.egress import EgressPolicy
from services.fetcher.handler import EGRESS_REFUSES
from shared.contracts import FetchedPage
from tests.sites import Site
from tests.unit.fetcher.conftest import MakeHandler, delivery, entry, respond


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's real socket backend, recording every address it is asked to connect to."""

    def __init__(self) -> None:
        self.inner = httpcore.AnyIOBackend()
        self.connects: list[str] = []

    async def connect_tcp(  # ``timeout``: httpcore's interface
        self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None, socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.connects.append(host)
        return await self.inner.connect_tcp(host, port, timeout=timeout,
                                            local_address=local_address,
                                            socket_options=socket_options)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "169.254.1.1",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "224.0.1.1", "240.0.0.1", "255.255.255.255",
    "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1",
    "::ffff:127.0.0.1", "2002:7f00:1::", "64:ff9b::7f00:1",
])
def test_default_policy_refuses_non_public_addresses(address: str) -> None:
    assert EgressPolicy().refuses(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.215.14", "2606:4700:4700::1111"])
def test_default_policy_allows_public_addresses(address: str) -> None:
    assert not EgressPolicy().refuses(address)


def test_allowlist() -> None:
    loopback = EgressPolicy(["127.0.0.0/8"])
    assert not loopback.refuses("127.0.0.1")
    assert loopback.refuses("10.0.0.1")
    assert loopback.refuses("::1")
    everything = EgressPolicy(["0.0.0.0/0"])
    assert not everything.refuses("10.0.0.1")
    assert everything.refuses("169.254.169.254")  # metadata: only when listed by itself
    assert not EgressPolicy(["169.254.169.254/32"]).refuses("169.254.169.254")


async def test_loopback_is_refused_without_an_allowlist(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/a": (200, "text/html", b"<html>a</html>")}
    url = site.url("/a")
    (out,) = await make_handler(egress_allow=[]).handle(entry(url), delivery())
    page = out.message
    assert isinstance(page, FetchedPage)
    assert page.status == 0
    assert page.error == f"{EGRESS_REFUSES} 127.0.0.1 for {url}"
    assert site.requests == []  # not even robots.txt


async def test_metadata_address_is_refused_before_any_connection(make_handler: MakeHandler) -> None:
    backend = RecordingBackend()
    url = "http://169.254.169.254/latest/meta-data/"
    (out,) = await make_handler(network_backend=backend).handle(entry(url), delivery())
    assert out.message.error == f"{EGRESS_REFUSES} 169.254.169.254 for {url}"
    assert backend.connects == []


async def test_host_names_are_checked_on_their_resolved_addresses(
    site: Site, make_handler: MakeHandler
) -> None:
    backend = RecordingBackend()
    port = site.base.rsplit(":", 1)[1]
    url = f"http://localhost:{port}/a"
    (out,) = await make_handler(egress_allow=[], network_backend=backend).handle(entry(url), delivery())
    error = out.message.error
    assert error is not None and error.startswith(EGRESS_REFUSES) and error.endswith(f"for {url}")
    assert backend.connects == [] and site.requests == []


async def test_ssrf_through_a_redirect_is_refused(site: Site, make_handler: MakeHandler) -> None:
    """A redirect to a refused address literal is refused at once: not requested, not even
    handed to dedup."""
    backend = RecordingBackend()
    site.routes["/go"] = lambda req: respond(req, 302, Location="http://169.254.169.254/x")
    (out,) = await make_handler(network_backend=backend).handle(entry(site.url("/go")), delivery())
    assert out.message.error == f"{EGRESS_REFUSES} 169.254.169.254 for http://169.254.169.254/x"
    assert out.message.final_url == "http://169.254.169.254/x"
    assert set(backend.connects) == {"127.0.0.1"}
    assert site.requests == ["/robots.txt", "/go"]


async def test_ssrf_through_a_redirect_to_a_name_is_refused_at_connect_time(
    site: Site, make_handler: MakeHandler
) -> None:
    """A redirect to a host name goes back through dedup; when its entry is fetched the
    name's resolved address is checked at connect time (loopback, refused by a fetcher
    without an allowlist) and nothing is connected."""
    backend = RecordingBackend()
    port = site.base.rsplit(":", 1)[1]
    target = f"http://localhost:{port}/internal"
    site.routes["/go"] = lambda req: respond(req, 302, Location=target)
    links, _page = await make_handler().handle(entry(site.url("/go")), delivery())
    assert [link.url for link in links.message.links] == [target]
    (out,) = await make_handler(egress_allow=[], network_backend=backend).handle(entry(target), delivery())
    error = out.message.error
    assert error is not None and error.startswith(EGRESS_REFUSES) and error.endswith(f"for {target}")
    assert backend.connects == [] and "/internal" not in site.requests
