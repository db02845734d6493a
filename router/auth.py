"""Bearer keys and their scopes: admin > write > read, each including the ones below it.

Keys come from SHARDLB_ADMIN_KEYS / SHARDLB_WRITE_KEYS / SHARDLB_READ_KEYS. A presented key is
hashed and compared with every configured key's hash by ``hmac.compare_digest``, all of them every
time, so neither the timing of a comparison nor the position of a match tells an attacker anything.
What a header of a key's length presents is kept (``Keys._kept``): a write asks twice, the access
middleware and then the route, and the hash and comparisons are made once.
Each wrong key (or malformed Authorization) costs its client a token of a small bucket
(AUTH_FAILURE_BURST, refilled at AUTH_FAILURE_RATE a second); while it has none, every request of
that client presenting a key is 429, a right key included, so keys cannot be guessed at the
router's speed. A request without a key is not concerned (the read budget is its limit).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from enum import IntEnum
from typing import NamedTuple

from router.errors import ApiError
from router.settings import Settings


class Scope(IntEnum):
    READ = 1
    WRITE = 2
    ADMIN = 3


class Caller(NamedTuple):
    """Who sent a request: the scope granted and a stable id for rate limiting (no key material).
    A tuple: every request makes one, and a frozen dataclass takes three times as long to build."""

    scope: Scope | None
    client: str


# Scope by value, 0 for none: ``Scope(value)`` goes through the enum's Python-level lookup.
_SCOPES: tuple[Scope | None, ...] = (None, *Scope)


# Rate-limiting ids of keyed clients start with this; clients without a key are "ip:<address>"
# (``client_network``).
KEY_CLIENT = "key:"
ANONYMOUS_CLIENT = "ip:"
# Wrong keys a client (address; IPv6 /64) may present in a burst, and again per second: past them,
# every request of that client presenting a key is 429 until a token is back.
AUTH_FAILURE_BURST = 20
AUTH_FAILURE_RATE = 1.0
_CHALLENGE = {"www-authenticate": 'Bearer realm="shardlb"'}


class Keys:
    """The configured keys, hashed, and the checks each route asks for."""

    def __init__(self, settings: Settings) -> None:
        self.open_access = settings.open_access
        self.reads_require_key = settings.reads_require_key
        granted: dict[bytes, Scope] = {}
        longest = 0
        for scope, keys in (
            (Scope.READ, settings.read_keys),
            (Scope.WRITE, settings.write_keys),
            (Scope.ADMIN, settings.admin_keys),
        ):
            for key in keys:
                longest = max(longest, len(key))
                digest = _digest(key)
                granted[digest] = max(scope, granted.get(digest, scope))  # a key in two lists: the higher
        self._keys = list(granted.items())
        # ``may_write`` is asked of every write's header before the route checks it again
        # (``require``): what a header presents is kept (a wrong key's too), for headers no longer
        # than one that presents the longest key, so the key is hashed and compared once, not twice
        # a write. Anybody's header is asked about, before any key is checked: kept whatever their
        # size, 4096 of them held up to 4096 x SHARDLB_MAX_HEADER_BYTES.
        self._kept = functools.lru_cache(maxsize=4096)(self._presented)
        self._kept_chars = len("Bearer ") + longest
        from router.limiter import RateLimiter  # (router.limiter imports this module)

        self.failures = RateLimiter(AUTH_FAILURE_RATE, AUTH_FAILURE_BURST, settings.rate_clients)

    def scope_of(self, key: str) -> Scope | None:
        """The scope of ``key``, or None when it is not configured. Constant time in the key."""
        return self._scope_of_digest(_digest(key))

    def _scope_of_digest(self, presented: bytes) -> Scope | None:
        found = 0
        for digest, scope in self._keys:
            # No early exit: every configured key is compared, whichever matches.
            found |= int(scope) * hmac.compare_digest(digest, presented)
        return _SCOPES[found]

    def may_write(self, header: str) -> bool:
        """Whether the Authorization ``header`` presents a key of the write scope or above: the
        keys of game servers and operators, whom the access middleware lets hold a slot while
        their body arrives (router/middleware.py). Counts no wrong key: the route's ``require``
        does, when it checks the same header."""
        if self.open_access:
            return True
        caller = self._caller(header)
        return caller is not None and (caller.scope or 0) >= Scope.WRITE

    def _caller(self, header: str) -> Caller | None:
        """``_presented``, kept for headers of a key's length (``_kept``)."""
        return self._kept(header) if len(header) <= self._kept_chars else self._presented(header)

    def _presented(self, header: str) -> Caller | None:
        """Who the Authorization ``header`` says is asking: None when it is not of the form ``Bearer
        <key>``; a scope of None when the key is not configured."""
        key = presented(header)
        if key is None:
            return None
        digest = _digest(key)
        return Caller(self._scope_of_digest(digest), KEY_CLIENT + digest[:12].hex())

    def require(self, header: str | None, peer: str, need: Scope) -> Caller:
        """Check the Authorization header's key against ``need``: 401 without a valid key, 403 with
        too small a scope."""
        if self.open_access:
            return Caller(Scope.ADMIN, ANONYMOUS_CLIENT + client_network(peer))
        if header is None:
            if need is Scope.READ and not self.reads_require_key:
                return Caller(None, ANONYMOUS_CLIENT + client_network(peer))
            raise ApiError(
                401,
                "unauthorized",
                f"this call needs {'an' if need is Scope.ADMIN else 'a'} {need.name.lower()} key: "
                "send 'Authorization: Bearer <key>'",
                headers=_CHALLENGE,
            )
        if len(self.failures):  # a client that presented wrong keys lately: is it out of tries?
            wait = self.failures.wait(ANONYMOUS_CLIENT + client_network(peer))
            if wait > 0:
                raise ApiError(
                    429, "rate_limited", "too many wrong keys from this client; slow down", retry_after=wait
                )
        caller = self._caller(header)
        if caller is None:
            self.failures.take(ANONYMOUS_CLIENT + client_network(peer))
            raise ApiError(
                401, "unauthorized", "the Authorization header must be 'Bearer <key>'", headers=_CHALLENGE
            )
        scope = caller.scope
        if scope is None:
            self.failures.take(ANONYMOUS_CLIENT + client_network(peer))
            raise ApiError(401, "unauthorized", "this key is not valid", headers=_CHALLENGE)
        if scope < need:
            raise ApiError(
                403,
                "forbidden",
                f"a {scope.name.lower()} key may not do this; it needs the {need.name.lower()} scope",
            )
        return caller


def presented(header: str) -> str | None:
    """The key of an Authorization header ``Bearer <key>`` (the scheme in any case), or None when
    the header is not of that form."""
    kind, _, key = header.partition(" ")
    key = key.strip()
    return key if kind.lower() == "bearer" and key else None


@functools.lru_cache(maxsize=4096)
def client_network(address: str) -> str:
    """Whom a client without a key is counted as, for its read budget and its body slots: an IPv4
    address (also when a dual-stack listener writes it as IPv6, ::ffff:a.b.c.d), or an IPv6
    address's /64: one subscriber's network holds 2^64 addresses, and a budget per address would
    give it a fresh one on every request. Written canonically (one spelling per client); anything
    that is not an address, as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
