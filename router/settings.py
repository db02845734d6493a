"""The router's settings: one frozen dataclass built from ``SHARDLB_*`` environment variables.

Every variable is read and checked in ``Settings.from_env``; a bad value raises SettingsError with a
message that names the variable, so a misconfigured deployment fails at start-up, not on a request.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from router.budget import LANES, READ_PIPELINES, RESERVE, connections_needed
from shardlb.board import JOURNAL_MAX_ENTRIES, JOURNAL_MAX_RESULTS
from shardlb.connection import READ_FROM, has_password, parse_url, postgres_url_error
from shardlb.errors import InvalidInput
from shardlb.fanout import ACK_LEVELS
from shardlb.settlement import webhook_url

MIB = 1024 * 1024
KIB = 1024
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class SettingsError(ValueError):
    """A SHARDLB_* variable has a value the router cannot run with."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


@dataclass(frozen=True)
class Settings:
    """Everything the router reads from its environment. Field ``x`` comes from ``SHARDLB_X``."""

    # Out of repr() as the keys are: a URL may carry a password (logs show it redacted).
    redis_url: str = field(default="redis://127.0.0.1:7000", repr=False)
    # The cluster's password when the URL carries none (kept out of the URL, and of repr()).
    redis_password: str | None = field(default=None, repr=False)
    # "replica": a write is answered once a replica of its primary has it (WAIT), else 503.
    ack: str = "primary"
    ack_timeout_ms: int = 500
    # Where board reads go: "primary", "replicas" (each primary's replicas in turn) or "any" (the
    # primary and its replicas in turn). Replica reads may miss the last moments' writes.
    read_from: str = "primary"
    # Board reads started in the same turn of the event loop share one pipeline per node
    # (shardlb/fanout.py, SharedRounds); false: each read sends its own.
    shared_reads: bool = True
    # The archive (shardlb/archive.py): rebuilds, settlement and history, bans and their audit, and
    # resharding journaled boards use it; unset, those answer 409 and closed periods are read live.
    postgres_url: str = field(default="", repr=False)
    # Settlement webhooks (shardlb/settlement_delivery.py): the secret signing every body, and the
    # URL used when a settle request names none (none: no webhook unless a request names one).
    webhook_secret: str = field(default="", repr=False)
    settlement_webhook_url: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    # Liveness on a listener of its own (router/liveness.py), out of reach of the connection caps:
    # 0 for none; its address is SHARDLB_HOST unless set (Kubernetes: the pod's IP).
    probe_port: int = 0
    probe_host: str = ""
    workers: int = 1
    # Out of the repr, as the webhook secret: a logged or printed Settings must not show a key.
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    write_keys: tuple[str, ...] = field(default=(), repr=False)
    read_keys: tuple[str, ...] = field(default=(), repr=False)
    reads_require_key: bool = False
    # With no admin or write key at all, the router refuses to start unless this is set: then every
    # request may do everything (a laptop, never a shared network).
    insecure_dev: bool = False
    # Reads a second per client without a key (its address); keyed clients have their own rate, off
    # by default: the operator handed those keys out and can take them back.
    # Per address, without a key: a player polls a few reads a second, a shared NAT or a test client
    # many more; one address still gets well under a worker's share of uncached reads.
    read_rate: float = 300.0
    read_burst: int = 0
    key_read_rate: float = 0.0
    rate_clients: int = 100_000
    # Peers whose X-Forwarded-For names the client (an ingress, a load balancer); nobody by default.
    trusted_proxies: tuple[Network, ...] = ()
    # Requests handled at once by a worker; past it, 503 at once (router/middleware.py).
    max_requests: int = 1000
    coalesce_delay_ms: float = 1.5
    coalesce_max_batch: int = 500
    coalesce_inflight: int = 1
    queue_limit: int = 20_000
    node_concurrency: int = 16
    script_concurrency: int = 8
    read_concurrency: int = 16
    read_queue: int = 2_000
    queue_wait_s: float = 0.5
    redis_max_connections: int = 64
    redis_timeout_s: float = 2.0
    startup_timeout_s: float = 30.0
    drain_seconds: float = 10.0
    max_body_bytes: int = MIB
    journal_max_entries: int = JOURNAL_MAX_ENTRIES
    journal_max_results: int = JOURNAL_MAX_RESULTS
    # Read bodies (players:query) are public: 1000 ids of 64 characters need about 70 KB as JSON.
    max_read_body_bytes: int = 96 * KIB
    # Slow and oversized clients (router/http.py): the longest a request's body may take to arrive
    # once its headers have (408 past it), the longest a connection may take to send a request line
    # and headers (408 or closed), the bytes they may take (431 past it), and the connections a
    # worker keeps open at once (one more is closed at once).
    body_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * KIB
    # ... and the header fields they may hold, a chunked body's trailers counted with them (431 past it).
    max_header_fields: int = 100
    # Each open connection may hold about 64 KiB of body in uvicorn's buffer plus, read ahead by the
    # access middleware, up to max_read_body_bytes: 2048 of them about 320 MiB at worst per worker.
    max_connections: int = 2048
    # ... and of them, what one client address (an IPv6 /64) may hold; trusted proxies are not
    # counted (router/http.py).
    max_client_connections: int = 512
    top_refresh_s: float = 1.0
    top_idle_s: float = 60.0
    # What the top cache and the rank estimates keep at most, in rows and samples of all their views
    # together (about 390 and 180 bytes each): callers choose the views, so the bound is in bytes.
    top_cache_rows: int = 100_000
    histogram_samples: int = 1024
    histogram_refresh_s: float = 5.0
    histogram_cache_samples: int = 200_000
    access_log: bool = False
    log_level: str = "info"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read and check every ``SHARDLB_*`` variable; raise SettingsError naming a bad one."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = "SHARDLB_" + f.name.upper()
            raw = env.get(name)
            if raw is None:
                continue
            values[f.name] = _PARSERS[f.name](name, raw.strip())
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field checks and ranges; raise SettingsError naming the variable at fault."""
        try:
            parse_url(self.redis_url)
        except InvalidInput as e:
            raise SettingsError("SHARDLB_REDIS_URL", e.message) from e
        if self.redis_password is not None and has_password(self.redis_url):
            raise SettingsError(
                "SHARDLB_REDIS_PASSWORD", "SHARDLB_REDIS_URL carries a password already: give it once"
            )
        if self.postgres_url:
            _postgres_url(self.postgres_url)
        if self.settlement_webhook_url:
            try:
                webhook_url(self.settlement_webhook_url)  # what a settle request's URL must be
            except InvalidInput as e:
                raise SettingsError("SHARDLB_SETTLEMENT_WEBHOOK_URL", e.message) from e
        if self.ack not in ACK_LEVELS:
            raise SettingsError("SHARDLB_ACK", f"must be one of {', '.join(ACK_LEVELS)}, got {self.ack!r}")
        _range("SHARDLB_ACK_TIMEOUT_MS", self.ack_timeout_ms, 1, 60_000)
        if self.read_from not in READ_FROM:
            raise SettingsError(
                "SHARDLB_READ_FROM", f"must be one of {', '.join(READ_FROM)}, got {self.read_from!r}"
            )
        _range("SHARDLB_PORT", self.port, 1, 65535)
        _range("SHARDLB_PROBE_PORT", self.probe_port, 0, 65535)
        if self.probe_port == self.port:
            raise SettingsError("SHARDLB_PROBE_PORT", f"must not be SHARDLB_PORT ({self.port})")
        _range("SHARDLB_WORKERS", self.workers, 1, 256)
        _range("SHARDLB_READ_RATE", self.read_rate, 0, 1e9)
        _range("SHARDLB_READ_BURST", self.read_burst, 0, 10**9)
        _range("SHARDLB_KEY_READ_RATE", self.key_read_rate, 0, 1e9)
        _range("SHARDLB_MAX_REQUESTS", self.max_requests, 1, 10**7)
        _range("SHARDLB_RATE_CLIENTS", self.rate_clients, 1, 10**8)
        _range("SHARDLB_COALESCE_DELAY_MS", self.coalesce_delay_ms, 0, 1000)
        _range("SHARDLB_COALESCE_MAX_BATCH", self.coalesce_max_batch, 1, 10_000)
        _range("SHARDLB_COALESCE_INFLIGHT", self.coalesce_inflight, 1, 8)
        _range("SHARDLB_QUEUE_LIMIT", self.queue_limit, 1000, 10**8)
        _range("SHARDLB_REDIS_MAX_CONNECTIONS", self.redis_max_connections, 4, 10_000)
        _range("SHARDLB_NODE_CONCURRENCY", self.node_concurrency, 1, self.redis_max_connections // 2)
        _range("SHARDLB_SCRIPT_CONCURRENCY", self.script_concurrency, 1, self.redis_max_connections // 2)
        _range("SHARDLB_READ_CONCURRENCY", self.read_concurrency, 1, self.redis_max_connections // 2)
        _range("SHARDLB_READ_QUEUE", self.read_queue, 0, 10**7)
        _range("SHARDLB_QUEUE_WAIT_S", self.queue_wait_s, 0.001, 60)
        # A full redis-py pool fails at once (and its pipelines then reset the whole client), so the
        # router's own bounds must add up to no more than the pool: see router/budget.py.
        needed = connections_needed(self.node_concurrency, self.script_concurrency, self.read_concurrency)
        if needed > self.redis_max_connections:
            raise SettingsError(
                "SHARDLB_REDIS_MAX_CONNECTIONS",
                f"must be at least NODE_CONCURRENCY + SCRIPT_CONCURRENCY + {READ_PIPELINES} x "
                f"READ_CONCURRENCY + {LANES + RESERVE} = {needed} (connections per primary the router "
                f"may use at once), got {self.redis_max_connections}",
            )
        _range("SHARDLB_REDIS_TIMEOUT_S", self.redis_timeout_s, 0.05, 60)
        _range("SHARDLB_STARTUP_TIMEOUT_S", self.startup_timeout_s, 0, 3600)
        _range("SHARDLB_DRAIN_SECONDS", self.drain_seconds, 0, 3600)
        _range("SHARDLB_MAX_BODY_BYTES", self.max_body_bytes, 1024, 1024 * MIB)
        _range("SHARDLB_JOURNAL_MAX_ENTRIES", self.journal_max_entries, 1, 10**8)
        _range("SHARDLB_JOURNAL_MAX_RESULTS", self.journal_max_results, 1, 10**9)
        _range("SHARDLB_MAX_READ_BODY_BYTES", self.max_read_body_bytes, 1024, 1024 * MIB)
        _range("SHARDLB_BODY_TIMEOUT_S", self.body_timeout_s, 0.1, 3600)
        _range("SHARDLB_HEADER_TIMEOUT_S", self.header_timeout_s, 0.1, 3600)
        _range("SHARDLB_MAX_HEADER_BYTES", self.max_header_bytes, 1024, 16 * MIB)
        _range("SHARDLB_MAX_HEADER_FIELDS", self.max_header_fields, 8, 100_000)
        _range("SHARDLB_MAX_CONNECTIONS", self.max_connections, 1, 10**7)
        _range("SHARDLB_MAX_CLIENT_CONNECTIONS", self.max_client_connections, 1, 10**7)
        _range("SHARDLB_TOP_REFRESH_S", self.top_refresh_s, 0.05, 3600)
        _range("SHARDLB_TOP_IDLE_S", self.top_idle_s, 1, 86_400)
        _range("SHARDLB_HISTOGRAM_SAMPLES", self.histogram_samples, 2, 100_000)
        _range("SHARDLB_HISTOGRAM_REFRESH_S", self.histogram_refresh_s, 0.05, 3600)
        _range("SHARDLB_TOP_CACHE_ROWS", self.top_cache_rows, 1, 10**9)
        _range("SHARDLB_HISTOGRAM_CACHE_SAMPLES", self.histogram_cache_samples, 1, 10**9)
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError("SHARDLB_LOG_LEVEL", "must be one of debug, info, warning, error")
        for name, keys in (
            ("SHARDLB_ADMIN_KEYS", self.admin_keys),
            ("SHARDLB_WRITE_KEYS", self.write_keys),
            ("SHARDLB_READ_KEYS", self.read_keys),
        ):
            for key in keys:
                # ASCII only: a header's bytes reach the app as Latin-1, so a key of other letters
                # could only be presented in an encoding nobody would send it in.
                if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
                    raise SettingsError(name, "keys are printable ASCII characters without spaces")
        if not (self.admin_keys or self.write_keys) and not self.insecure_dev:
            raise SettingsError(
                "SHARDLB_ADMIN_KEYS",
                "no admin or write key is configured, so anybody could write and delete boards; set "
                "SHARDLB_ADMIN_KEYS and SHARDLB_WRITE_KEYS, or SHARDLB_INSECURE_DEV=true on a "
                "development machine to run without keys",
            )
        if self.reads_require_key and not (self.read_keys or self.write_keys or self.admin_keys):
            raise SettingsError("SHARDLB_READS_REQUIRE_KEY", "reads require a key but no key is configured")

    @property
    def open_access(self) -> bool:
        """No keys at all, explicitly allowed: every request gets the admin scope."""
        return self.insecure_dev and not (self.admin_keys or self.write_keys or self.read_keys)

    @property
    def burst(self) -> int:
        """Read bucket size: SHARDLB_READ_BURST, or five seconds of SHARDLB_READ_RATE when unset."""
        return self.read_burst or max(1, int(5 * self.read_rate))

    @property
    def key_burst(self) -> int:
        """Bucket size of a keyed client: one second of SHARDLB_KEY_READ_RATE."""
        return max(1, int(self.key_read_rate))


# A key shorter than this could be guessed; the tests' and examples' short keys still start a router.
KEY_WARN_BELOW = 16
_NAMES = tuple("SHARDLB_" + f.name.upper() for f in fields(Settings))
# `make bench`'s own settings (bench/run.py), which the routers it starts inherit: never a misspelling
# of a router setting, though SHARDLB_BENCH_READ_CONCURRENCY is near one.
_BENCH_PREFIX = "SHARDLB_BENCH_"


def warnings(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """What the router starts with but the operator should hear of (``shardlb serve`` logs each at
    start-up): a ``SHARDLB_*`` variable that is not a setting but nearly the name of one (a
    misspelling, ignored; of bench/ and k8s/'s own ``SHARDLB_*`` variables only the Locust test's
    ADMIN_KEY, WRITE_KEY, READ_KEY and TARGET_READS are near one, `make bench`'s SHARDLB_BENCH_*
    are never said), a trusted proxy block that holds every address, an admin or write key that is
    short."""
    out = []
    named = (n for n in environ if n.startswith("SHARDLB_") and not n.startswith(_BENCH_PREFIX))
    for name in sorted(n for n in named if n not in _NAMES):
        near = difflib.get_close_matches(name, _NAMES, n=1, cutoff=0.85)
        if near:
            out.append(f"{name} is not a router setting and is ignored: did you mean {near[0]}?")
    everyone = [str(n) for n in settings.trusted_proxies if n.prefixlen == 0]
    if everyone:
        out.append(
            f"SHARDLB_TRUSTED_PROXIES: {', '.join(everyone)} trusts every peer, so any client can name "
            "its own address in X-Forwarded-For and step around the per-client limits"
        )
    for name, keys in (
        ("SHARDLB_ADMIN_KEYS", settings.admin_keys),
        ("SHARDLB_WRITE_KEYS", settings.write_keys),
    ):
        if any(len(key) < KEY_WARN_BELOW for key in keys):
            out.append(f"{name}: a key shorter than {KEY_WARN_BELOW} characters could be guessed")
    return out


def _postgres_url(url: str) -> None:
    """A postgresql:// (or postgres://) URL libpq can read, with numeric ports: psycopg would only
    refuse it at the first request that needs the archive."""
    message = "must be a postgresql://user:password@host:port/database URL"
    if not url.startswith(("postgresql://", "postgres://")):
        raise SettingsError("SHARDLB_POSTGRES_URL", message)
    try:
        parts = conninfo_to_dict(url)
    except psycopg.Error as e:
        raise SettingsError("SHARDLB_POSTGRES_URL", f"{message} ({postgres_url_error(e, url)})") from e
    ports = str(parts.get("port", "")).split(",")
    if any(p and not (p.isdigit() and 0 < int(p) < 65536) for p in ports):
        raise SettingsError("SHARDLB_POSTGRES_URL", f"{message}: a port is 1 to 65535")


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise SettingsError(name, f"must be between {lo:g} and {hi:g}, got {value:g}")


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError as e:
        raise SettingsError(name, f"expected an integer, got {raw!r}") from e


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError as e:
        raise SettingsError(name, f"expected a number, got {raw!r}") from e
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingsError(name, f"expected a finite number, got {raw!r}")
    return value


def _bool(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise SettingsError(name, f"expected true or false, got {raw!r}")


def _keys(name: str, raw: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k.strip() for k in raw.split(",") if k.strip()))


def _networks(name: str, raw: str) -> tuple[Network, ...]:
    """Comma-separated addresses or CIDR blocks (``10.0.0.0/8, 192.168.1.7, fd00::/8``)."""
    out = []
    for part in raw.split(","):
        if part.strip():
            try:
                out.append(ipaddress.ip_network(part.strip(), strict=False))
            except ValueError as e:
                raise SettingsError(name, f"expected addresses or CIDR blocks, got {part.strip()!r}") from e
    return tuple(out)


def _text(name: str, raw: str) -> str:
    if not raw:
        raise SettingsError(name, "must not be empty")
    return raw


def _lower(name: str, raw: str) -> str:
    return _text(name, raw).lower()


def _parsers() -> dict[str, Callable[[str, str], Any]]:
    by_type: dict[str, Callable[[str, str], Any]] = {
        "int": _int,
        "float": _float,
        "bool": _bool,
        "str": _text,
        "tuple[str, ...]": _keys,
        "tuple[Network, ...]": _networks,
    }
    out = {f.name: by_type[str(f.type)] for f in fields(Settings) if f.name != "redis_password"}
    out["log_level"] = _lower
    out["ack"] = _lower
    out["redis_password"] = _text
    return out


_PARSERS = _parsers()
