"""Per-client token buckets for reads, in bounded memory.

A client (its key, else its IP address) gets a bucket of ``burst`` tokens refilled at ``rate`` a
second; a read takes one. At most ``max_clients`` buckets are kept: the least recently seen client
is forgotten first, which only ever lets that client start again with a full bucket.
"""

from __future__ import annotations

import time
from collections import OrderedDict


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

    def take(self, client: str, now: float | None = None) -> float:
        """Take a token for ``client``: 0.0 when allowed, else the seconds until one is available."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait
