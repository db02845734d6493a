"""How long to wait before the next attempt: exponential backoff with full jitter, at least Retry-After.

Full jitter (a uniform draw between 0 and the exponential bound) spreads the retries of many clients
that failed together, which a fixed schedule would bring back together. When the server names a
``Retry-After``, the wait is that plus the jitter: never sooner than the server asked, and still
spread, so a thousand clients told "1 second" do not all return in the same millisecond.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    """``base`` seconds bound the first retry's jitter; the bound doubles per attempt up to ``cap``."""

    base: float = 0.05
    cap: float = 2.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """The wait after failed attempt number ``attempt`` (1 for the first)."""
        bound = min(self.cap, self.base * 2 ** min(attempt - 1, 60))
        return (retry_after or 0.0) + self.rng.uniform(0.0, bound)
