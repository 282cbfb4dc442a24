"""The egress policy: which IP addresses the fetcher may connect to.

Tenants choose the URLs, so by default the fetcher refuses every address that is not
globally routable: private (RFC 1918, ULA), loopback, link-local, multicast, reserved,
unspecified, shared (100.64.0.0/10) addresses, IPv4 embedded in IPv6 (mapped, 6to4,
Teredo) that is one of those, and cloud metadata endpoints (169.254.169.254 and kin).
An operator allowlist of CIDRs lifts the refusal (tests use ``127.0.0.0/8``); a metadata
address is only allowed when listed as a single address (``/32``, ``/128``), never through
a wider network.

The check happens at connect time: :class:`GuardedNetworkBackend` resolves the host
itself, checks every address and connects to an allowed address (never re-resolving the
name), so DNS rebinding cannot slip a private address in between check and connect, and
every redirect hop and robots.txt request is checked the same way.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Any

import httpcore

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ip_address(a) for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean...
        "169.254.170.2",  # AWS ECS task metadata
        "100.100.100.200",  # Alibaba Cloud
        "fd00:ec2::254",  # AWS IMDS over IPv6
    )
)
"""Cloud instance metadata endpoints: refused unless allowlisted one by one."""


class EgressRefusedError(Exception):
    """The egress policy refuses to connect to ``ip`` (resolved from ``host``)."""

    def __init__(self, ip: IPAddress, host: str) -> None:
        super().__init__(f"egress policy refuses {ip} (host {host})")
        self.ip = ip
        self.host = host

    def describe(self, url: str) -> str:
        """The error a fetched page carries: ``egress policy refuses <ip> for <url>``."""
        return f"egress policy refuses {self.ip} for {url}"


class EgressPolicy:
    """Decides whether an address may be connected to (see module docstring)."""

    def __init__(self, allow: Iterable[IPNetwork | str] = ()) -> None:
        self.allow: tuple[IPNetwork, ...] = tuple(
            net if isinstance(net, IPv4Network | IPv6Network) else ip_network(net, strict=False)
            for net in allow
        )

    def refuses(self, ip: IPAddress | str) -> bool:
        """True if connecting to ``ip`` is not allowed."""
        address = ip_address(ip) if isinstance(ip, str) else ip
        if address in METADATA_ADDRESSES:
            return not any(
                address in net and net.num_addresses == 1 for net in self.allow
            )
        if any(address.version == net.version and address in net for net in self.allow):
            return False
        return _not_public(address)

    def refused_literal(self, host: str | None) -> IPAddress | None:
        """The address of ``host`` if it is an IP literal the policy refuses, else None
        (a name is only checked at connect time, on what it resolves to)."""
        try:
            address = ip_address((host or "").strip("[]"))
        except ValueError:
            return None
        return address if self.refuses(address) else None


def _not_public(address: IPAddress) -> bool:
    if isinstance(address, IPv6Address):
        embedded = [address.ipv4_mapped, address.sixtofour]
        if address.teredo:
            embedded.append(address.teredo[1])
        if any(v4 is not None and _not_public(v4) for v4 in embedded):
            return True
    return not address.is_global or address.is_multicast or address.is_reserved


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that applies an :class:`EgressPolicy` at connect time.

    It resolves ``host`` (``getaddrinfo``, within the connect timeout), drops refused
    addresses and connects to the first allowed one that answers, by IP, through
    ``inner`` (httpcore's default backend). TLS still verifies and sends SNI for the
    original host name (httpcore passes it to ``start_tls`` separately).

    Raises (from :meth:`connect_tcp`):
        EgressRefusedError: every resolved address is refused (nothing was connected).
        httpcore.ConnectError: the name does not resolve, or no allowed address answers.
        httpcore.ConnectTimeout: resolution took longer than the connect timeout.
    """

    def __init__(self, policy: EgressPolicy, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self.inner = inner or httpcore.AnyIOBackend()

    # ``timeout`` parameters: httpcore's backend interface, not our choice.
    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None, socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve(host, port, timeout)
        allowed = [a for a in addresses if not self.policy.refuses(a)]
        if not allowed:
            raise EgressRefusedError(addresses[0], host)
        failure: Exception | None = None
        for address in allowed:
            try:
                return await self.inner.connect_tcp(
                    str(address), port, timeout=timeout, local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                failure = error
        assert failure is not None
        raise failure

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are outside the egress policy")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def resolve(host: str, port: int, timeout_s: float | None) -> list[IPAddress]:
    """Every address of ``host`` (an IP literal resolves to itself), in resolver order.

    Raises:
        httpcore.ConnectError: the name does not resolve.
        httpcore.ConnectTimeout: resolution took longer than ``timeout_s``.
    """
    try:
        return [ip_address(host.strip("[]"))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
    except (socket.gaierror, UnicodeError) as error:
        raise httpcore.ConnectError(f"cannot resolve {host}: {error}") from None
    found: list[IPAddress] = []
    for *_, sockaddr in infos:
        address = ip_address(str(sockaddr[0]).split("%")[0])
        if address not in found:
            found.append(address)
    if not found:
        raise httpcore.ConnectError(f"cannot resolve {host}: no addresses")
    return found
