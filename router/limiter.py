"""Per-client token buckets for reads, in bounded memory, and who the client is behind a proxy.

A client gets a bucket of ``burst`` tokens refilled at ``rate`` a second; a read takes one (a
players:query one more per 100 ids, or per 8 KiB of body if more: router/routes.py,
QUERY_IDS_PER_TOKEN and QUERY_BYTES_PER_TOKEN). At most
``max_clients`` buckets are kept: the least recently seen client is forgotten first, which only ever
lets that client start again with a full bucket. A client is its key when it sends one, else its
address: the peer's, or the one a trusted proxy put in X-Forwarded-For (``client_address``), an
IPv6 address counted by its /64 (``router.auth.client_network``).
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Sequence

from router.auth import KEY_CLIENT
from router.settings import Network, Settings

# What a /metrics scrape takes of its address's read budget, whatever key it carries (router/probes.py):
# rendering the page costs a worker about what 25 cached tops do (3.7 ms of CPU against 160 us, one
# worker on the 2-core VM). It takes no key, and nothing else bounded it: one address could take a
# worker's core with scrapes.
SCRAPE_READS = 25
# X-Forwarded-For hops read, from the right: a chain of trusted proxies is a few deep.
FORWARDED_HOPS = 16


class RateLimiter:
    """Token buckets keyed by client id. ``rate`` 0 turns limiting off."""

    def __init__(self, rate: float, burst: int, max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = float(max(1, burst))
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def wait(self, client: str, now: float | None = None) -> float:
        """The seconds until ``client`` has a token (0.0: it has one now), taking nothing."""
        if not self.enabled or client not in self._buckets:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets[client]
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def take(self, client: str, now: float | None = None, cost: float = 1.0) -> float:
        """Take ``cost`` tokens (at most the burst, so any cost can be met) for ``client``: 0.0 when
        allowed, else the seconds until they are available (nothing taken then)."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        cost = min(cost, self.burst)
        tokens, last = self._buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= cost:
            tokens -= cost
        else:
            wait = (cost - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


class ReadLimits:
    """The read limits of one worker: clients without a key by address (SHARDLB_READ_RATE, on by
    default), clients with a key by key (SHARDLB_KEY_READ_RATE, off by default)."""

    def __init__(self, anonymous: RateLimiter, keyed: RateLimiter) -> None:
        self.anonymous = anonymous
        self.keyed = keyed

    @classmethod
    def of(cls, settings: Settings) -> ReadLimits:
        return cls(
            RateLimiter(settings.read_rate, settings.burst, settings.rate_clients),
            RateLimiter(settings.key_read_rate, settings.key_burst, settings.rate_clients),
        )

    def take(self, client: str, cost: float = 1.0) -> float:
        """``cost`` tokens for ``client`` (an id from ``router.auth.Caller``): 0.0, or the seconds to wait."""
        return (self.keyed if client.startswith(KEY_CLIENT) else self.anonymous).take(client, cost=cost)

    def take_more(self, client: str, extra: float) -> float:
        """``extra`` tokens more for a read that took its first already (``take``): at most the burst
        less that one, so the read can pass with a full bucket whatever the burst."""
        limiter = self.keyed if client.startswith(KEY_CLIENT) else self.anonymous
        extra = min(extra, limiter.burst - 1.0)
        return limiter.take(client, cost=extra) if extra > 0 else 0.0


def client_address(peer: str, forwarded: str | None, proxies: Sequence[Network]) -> str:
    """The client's address: ``peer``, unless the peer is a trusted proxy and sent X-Forwarded-For
    (``forwarded``, its values joined by commas). Then it is the right-most address of that list
    that is not itself a trusted proxy: each proxy appends the address it saw, so everything left of
    the first untrusted hop may be the client's own invention. With every hop trusted, the left-most.
    An entry that is not an address (a proxy passing garbage on) leaves the peer's own address.
    Only the right-most FORWARDED_HOPS hops are read: the client sends what is left of them, and
    64 KiB of it (8,000 hops, 0.8 ms of a worker's CPU to split and strip) were read whole until
    2026-12-06; with all of them trusted, the left-most of those read."""
    if not proxies or not forwarded or not trusted(peer, proxies):
        return peer
    hops = [hop.strip() for hop in forwarded.rsplit(",", FORWARDED_HOPS)[-FORWARDED_HOPS:]]
    for hop in reversed(hops):
        if hop and not trusted(hop, proxies):
            return hop if _address(hop) is not None else peer
    return next((hop for hop in hops if hop), peer)


def trusted(host: str, proxies: Sequence[Network]) -> bool:
    """Whether ``host`` is an address within one of ``proxies``."""
    address = _address(host)
    return address is not None and any(address in network for network in proxies)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an address (an IPv4 address written as IPv6, ::ffff:a.b.c.d, as IPv4: so a
    dual-stack listener's peers match the IPv4 networks of SHARDLB_TRUSTED_PROXIES), else None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
