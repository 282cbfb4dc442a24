"""A generated multi-host loopback site with a seeded link graph, and its reachable set.

For the chaos suite (issue 8): the pages the crawl must store are computed from the site's
own link graph under the job's limits, never from what the crawl happened to fetch.

Page ``/g<i>`` (``0 <= i < pages``) is served by host ``127.0.3.<1 + i mod hosts>``
(one :class:`tests.sites.Site` per host, all on their own free ports). Each page links to
its tree children ``/g<3i+1>`` .. ``/g<3i+3>`` (so the tree reaches every page whose
ancestors are all followed) and to ``extra_links`` pages drawn by ``random.Random(seed)``
(most of them seen before: dedup must refuse them). Some pages also link to:

- ``/missing<i>`` (404 on its host): a result with ``http_error``, nothing followed;
- ``/x<i>`` (the job's scope denies ``/x\\d+``): never fetched, so ``/hidden<i>``, linked
  only from ``/x<i>``, is not reachable although it is served.

The reachable set (:meth:`GraphSite.reachable`) is a breadth-first walk of that graph from
the seed, skipping denied URLs and not expanding non-pages: the URLs a correct crawl with
:meth:`GraphSite.request` stores, each exactly once. ``max_depth`` is never binding (it is
set above the tree's height): with depth limits the set would depend on which path
discovered a page first.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from shared.contracts import CrawlRequest, Scope, ScopeMode
from tests.sites import Site, html

DENY = r"/x\d+$"
"""The job's scope deny pattern (``re.search`` on the canonical URL)."""


@dataclass
class GraphSite:
    """``pages`` pages over ``hosts`` loopback hosts, links drawn from ``seed`` (see module)."""

    pages: int
    hosts: int = 4
    seed: int = 0
    extra_links: int = 3
    missing_ratio: float = 0.05
    denied_ratio: float = 0.05
    sites: list[Site] = field(default_factory=list)
    links: dict[str, list[str]] = field(default_factory=dict)
    """Outlinks (absolute URLs) of every URL the site serves as HTML."""

    side: Site = field(default_factory=lambda: Site(host="127.0.3.250"))
    """A host of its own for fault pages (:meth:`add_leaf` with ``own_host``): a page that
    hangs there holds no page of the graph back (politeness is per host)."""

    def __post_init__(self) -> None:
        self.sites = [Site(host=f"127.0.3.{n + 1}") for n in range(self.hosts)]

    def start(self, routes: dict[str, Callable[[BaseHTTPRequestHandler], None]] | None = None,
              ) -> GraphSite:
        """Start one server per host, then build the pages (URLs need the ports).

        ``routes``: ``{path: handler}`` served by host 0 instead of its page (fault pages);
        such a path is still linked as the graph says.
        """
        for site in (*self.sites, self.side):
            site.pages["/robots.txt"] = (404, "text/plain", b"")
            site.start()
        rng = random.Random(self.seed)
        for i in range(self.pages):
            out = [self.url(c) for c in range(3 * i + 1, min(3 * i + 4, self.pages))]
            out += [self.url(rng.randrange(self.pages)) for _ in range(self.extra_links)]
            if rng.random() < self.missing_ratio:
                out.append(self.host_of(i).url(f"/missing{i}"))
            if rng.random() < self.denied_ratio:
                denied = self.host_of(i).url(f"/x{i}")
                hidden = self.host_of(i).url(f"/hidden{i}")
                out.append(denied)
                self._serve(denied, [hidden])
                self._serve(hidden, [])
            self._serve(self.url(i), out)
        for path, route in (routes or {}).items():
            self.sites[0].routes[path] = route
            self.side.routes[path] = route
        return self

    def stop(self) -> None:
        for site in (*self.sites, self.side):
            site.stop()

    def host_of(self, page: int) -> Site:
        return self.sites[page % self.hosts]

    def url(self, page: int) -> str:
        return self.host_of(page).url(f"/g{page}")

    @property
    def seed_url(self) -> str:
        return self.url(0)

    @property
    def requests(self) -> int:
        """Requests served so far over every host."""
        return sum(len(site.requests) for site in (*self.sites, self.side))

    def request(self, **limits: object) -> CrawlRequest:
        """The crawl request the reachable set is computed for: from ``/g0``, any host,
        ``/x<i>`` denied, depth far above the tree's height, page budget above the site."""
        fields: dict[str, object] = {
            "seeds": (self.seed_url,), "scope": Scope(mode=ScopeMode.ANY, deny=(DENY,)),
            "max_depth": 100, "max_pages": self.pages * 3, **limits}
        return CrawlRequest(**fields)  # type: ignore[arg-type]

    def reachable(self) -> set[str]:
        """URLs a correct crawl of :meth:`request` stores: BFS from the seed over the link
        graph, denied URLs skipped, URLs the site does not serve (404) kept but not expanded."""
        deny = re.compile(DENY)
        seen, todo = {self.seed_url}, [self.seed_url]
        while todo:
            for link in self.links.get(todo.pop(), ()):
                if link not in seen and not deny.search(link):
                    seen.add(link)
                    todo.append(link)
        return seen

    def link(self, page_url: str, target: str) -> None:
        """Add a link from the served page ``page_url`` to ``target`` (before crawling)."""
        self.links[page_url].append(target)
        self._serve(page_url, self.links[page_url])

    def add_leaf(self, path: str, linked_from: int, body: bytes | None = None,
                 own_host: bool = False) -> str:
        """Serve ``path`` on host 0, or with ``own_host`` on :attr:`side` (``body``, or a
        route given to :meth:`start` when None) with no outlinks, linked from page
        ``linked_from``. Returns its URL."""
        host = self.side if own_host else self.sites[0]
        url = host.url(path)
        self.links[url] = []
        if body is not None:
            host.pages[path] = (200, "text/html", body)
        self.link(self.url(linked_from), url)
        return url

    def _serve(self, url: str, out: list[str]) -> None:
        self.links[url] = out
        site = next(s for s in (*self.sites, self.side) if url.startswith(s.base + "/"))
        path = url.removeprefix(site.base)
        body = " ".join(f'<a href="{target}">{n}</a>' for n, target in enumerate(out))
        site.pages[path] = (200, "text/html", html(body, path))
