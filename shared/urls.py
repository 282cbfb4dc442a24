"""Canonical URLs and their fingerprints (the identity of a page within a job).

Canonicalisation is w3lib's ``canonicalize_url`` (query arguments sorted, percent-encoding
normalised, fragment dropped), plus a lower-cased scheme and host and the default port
removed (WHATWG URL §4.4: the default port of a special scheme is serialised as null).

The canonical form must itself be a usable URL with a host: one whose host is not ASCII
after IDNA (w3lib keeps a host IDNA refuses as it was) or holds a forbidden domain code
point (WHATWG URL §3.2: C0 controls, space, ``#%/:<>?@[\\]^|``, DEL) is refused, as is one
whose host vanishes in canonicalisation (``http://\\`` becomes ``http:////``).
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import urlsplit, urlunsplit

from w3lib.url import canonicalize_url

_DEFAULT_PORTS = {"http": 80, "https": 443}
_FORBIDDEN_DOMAIN = re.compile(r"[\x00-\x20#%/:<>?@\[\\\]^|\x7f]")
"""WHATWG URL §3.2 forbidden domain code points, looked for in host names (not IPv6 literals)."""


class UrlError(ValueError):
    """A string that cannot be canonicalised as an http(s) URL."""


def canonical_url(url: str) -> str:
    """The canonical form of an absolute http(s) URL (see module docstring).

    Raises:
        UrlError: not an absolute http(s) URL with a host, or unparseable.
    """
    try:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise UrlError(f"not an absolute http(s) URL: {url!r}")
        host = parts.hostname.lower().rstrip(".")
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        port = parts.port
        netloc = host if port in (None, _DEFAULT_PORTS[scheme]) else f"{host}:{port}"
        if parts.username or parts.password:
            raise UrlError(f"URL with credentials refused: {url!r}")
        rebuilt = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
        canonical = canonicalize_url(rebuilt, keep_fragments=False)
        final = urlsplit(canonical)
        name = final.hostname or ""
        literal = final.netloc.startswith("[")
        if not name or not canonical.isascii() or (not literal and _FORBIDDEN_DOMAIN.search(name)):
            raise UrlError(f"invalid host in URL {url!r}")
        return canonical
    except UrlError:
        raise
    except (ValueError, UnicodeError) as error:
        raise UrlError(f"invalid URL {url!r}: {error}") from None


def fingerprint(canonical: str) -> str:
    """32 hex digits of BLAKE2b-128 over the canonical URL: a page's id within a job."""
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def host_of(url: str) -> str:
    """``host[:port]`` of a canonical URL (the politeness key)."""
    return urlsplit(url).netloc
