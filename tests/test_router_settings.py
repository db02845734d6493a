"""router/settings.py: settings from SHARDLB_* variables, checked at start-up (no cluster)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from bench.run import Settings as BenchSettings
from router.settings import MIB, Settings, SettingsError, warnings

KEYED = {"SHARDLB_ADMIN_KEYS": "adm", "SHARDLB_WRITE_KEYS": "wr1, wr2 ,,"}


def test_defaults_and_every_variable() -> None:
    s = Settings.from_env(KEYED)
    assert (s.redis_url, s.host, s.port, s.workers) == ("redis://127.0.0.1:7000", "127.0.0.1", 8000, 1)
    assert s.admin_keys == ("adm",) and s.write_keys == ("wr1", "wr2") and s.read_keys == ()
    assert (s.coalesce_delay_ms, s.coalesce_max_batch, s.drain_seconds, s.max_body_bytes) == (
        1.5,
        500,
        10.0,
        MIB,
    )
    assert (s.top_refresh_s, s.access_log, s.reads_require_key, s.read_rate) == (1.0, False, False, 300.0)
    assert (s.burst, s.key_read_rate, s.trusted_proxies, s.max_requests) == (1500, 0.0, (), 1000)
    assert s.max_read_body_bytes == 96 * 1024
    env = {
        **KEYED,
        "SHARDLB_REDIS_URL": "redis://10.0.0.1:7000,10.0.0.2:7001",
        "SHARDLB_HOST": "0.0.0.0",
        "SHARDLB_PORT": "9000",
        "SHARDLB_WORKERS": "4",
        "SHARDLB_READ_KEYS": "r",
        "SHARDLB_READS_REQUIRE_KEY": "TRUE",
        "SHARDLB_READ_RATE": "50",
        "SHARDLB_READ_BURST": "100",
        "SHARDLB_COALESCE_DELAY_MS": "2",
        "SHARDLB_COALESCE_MAX_BATCH": "1000",
        "SHARDLB_COALESCE_INFLIGHT": "2",
        "SHARDLB_QUEUE_LIMIT": "5000",
        "SHARDLB_DRAIN_SECONDS": "15",
        "SHARDLB_MAX_BODY_BYTES": "2048",
        "SHARDLB_TOP_REFRESH_S": "0.5",
        "SHARDLB_ACCESS_LOG": "on",
        "SHARDLB_STARTUP_TIMEOUT_S": "240",
        "SHARDLB_KEY_READ_RATE": "1000.5",
        "SHARDLB_TRUSTED_PROXIES": " 10.0.0.0/8, 192.168.1.7 ,fd00::/8,",
        "SHARDLB_MAX_REQUESTS": "64",
        "SHARDLB_MAX_READ_BODY_BYTES": "4096",
        "SHARDLB_JOURNAL_MAX_ENTRIES": "70000",
        "SHARDLB_JOURNAL_MAX_RESULTS": "2500000",
    }
    s = Settings.from_env(env)
    assert (s.journal_max_entries, s.journal_max_results) == (70_000, 2_500_000)
    assert (s.host, s.port, s.workers, s.read_keys, s.reads_require_key) == ("0.0.0.0", 9000, 4, ("r",), True)
    assert (s.read_rate, s.burst, s.coalesce_delay_ms, s.coalesce_max_batch, s.queue_limit) == (
        50.0,
        100,
        2.0,
        1000,
        5000,
    )
    assert s.coalesce_inflight == 2
    assert (s.drain_seconds, s.max_body_bytes, s.top_refresh_s, s.access_log, s.startup_timeout_s) == (
        15.0,
        2048,
        0.5,
        True,
        240.0,
    )
    assert (s.key_read_rate, s.key_burst, s.max_requests, s.max_read_body_bytes) == (1000.5, 1000, 64, 4096)
    assert [str(n) for n in s.trusted_proxies] == ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]
    assert Settings.from_env({**KEYED, "SHARDLB_READ_RATE": "20"}).burst == 100  # five seconds
    assert Settings.from_env({**KEYED, "SHARDLB_READ_RATE": "0"}).read_rate == 0.0  # off


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SHARDLB_PORT", "http"),
        ("SHARDLB_PORT", "70000"),
        ("SHARDLB_WORKERS", "0"),
        ("SHARDLB_REDIS_URL", "http://localhost:7000"),
        ("SHARDLB_REDIS_URL", "redis://host:port"),
        ("SHARDLB_READS_REQUIRE_KEY", "maybe"),
        ("SHARDLB_READ_RATE", "-1"),
        ("SHARDLB_READ_RATE", "nan"),
        ("SHARDLB_COALESCE_DELAY_MS", "fast"),
        ("SHARDLB_COALESCE_MAX_BATCH", "0"),
        ("SHARDLB_COALESCE_INFLIGHT", "0"),
        ("SHARDLB_COALESCE_INFLIGHT", "9"),
        ("SHARDLB_QUEUE_LIMIT", "10"),
        ("SHARDLB_DRAIN_SECONDS", "-5"),
        ("SHARDLB_MAX_BODY_BYTES", "1"),
        ("SHARDLB_JOURNAL_MAX_ENTRIES", "0"),
        ("SHARDLB_JOURNAL_MAX_RESULTS", "0"),
        ("SHARDLB_JOURNAL_MAX_RESULTS", "1e12"),
        ("SHARDLB_TOP_REFRESH_S", "0"),
        ("SHARDLB_ACCESS_LOG", "sometimes"),
        ("SHARDLB_HOST", ""),
        ("SHARDLB_ADMIN_KEYS", "has space"),
        ("SHARDLB_WRITE_KEYS", "schl\u00fcssel"),  # a header holds it as Latin-1, never as UTF-8
        ("SHARDLB_NODE_CONCURRENCY", "1000"),
        ("SHARDLB_SCRIPT_CONCURRENCY", "0"),
        ("SHARDLB_READ_CONCURRENCY", "40"),
        ("SHARDLB_QUEUE_WAIT_S", "0"),
        ("SHARDLB_REDIS_MAX_CONNECTIONS", "40"),
        ("SHARDLB_LOG_LEVEL", "loud"),
        ("SHARDLB_KEY_READ_RATE", "-2"),
        ("SHARDLB_TRUSTED_PROXIES", "10.0.0.0/8, ingress"),
        ("SHARDLB_TRUSTED_PROXIES", "10.0.0.0/33"),
        ("SHARDLB_MAX_REQUESTS", "0"),
        ("SHARDLB_MAX_READ_BODY_BYTES", "100"),
        # Checked as the settle endpoint checks a request's webhook_url (shardlb/settlement.py).
        ("SHARDLB_SETTLEMENT_WEBHOOK_URL", "not a url"),
        ("SHARDLB_SETTLEMENT_WEBHOOK_URL", "ftp://hooks.example/paid"),
        ("SHARDLB_SETTLEMENT_WEBHOOK_URL", "javascript:alert(1)"),
        ("SHARDLB_SETTLEMENT_WEBHOOK_URL", "https://hooks.example:99999/paid"),
        ("SHARDLB_POSTGRES_URL", "not a url"),
        ("SHARDLB_POSTGRES_URL", "mysql://shardlb@db/shardlb"),
        ("SHARDLB_POSTGRES_URL", "postgresql://shardlb@db:notaport/shardlb"),
    ],
)
def test_a_bad_value_names_its_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env({**KEYED, variable: value})
    assert e.value.variable == variable
    assert str(e.value).startswith(f"{variable}: ")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://shardlb:s3cret@[::1/shardlb", "IPv6 host"),  # libpq quotes the whole URL
        ("postgresql://shardlb:s3%zzcret@db/shardlb", "percent-encoded"),  # and the password's token
        ("postgres://shardlb:s3cret@db/shardlb?sslmode", "query parameter"),
    ],
)
def test_a_bad_postgres_url_is_refused_without_its_password(url: str, reason: str) -> None:
    """The message is printed at start-up, into the pod's log: libpq's reason stays, the password
    not (until 2026-12-05 it was there, quoted by libpq)."""
    with pytest.raises(SettingsError) as e:
        Settings.from_env({**KEYED, "SHARDLB_POSTGRES_URL": url})
    assert e.value.variable == "SHARDLB_POSTGRES_URL"
    assert "s3" not in str(e.value) and "cret" not in str(e.value), str(e.value)
    assert reason in str(e.value)  # libpq's, which says what to fix


def test_no_keys_refuses_to_start_unless_insecure_dev() -> None:
    with pytest.raises(SettingsError) as e:
        Settings.from_env({})
    assert e.value.variable == "SHARDLB_ADMIN_KEYS" and "SHARDLB_INSECURE_DEV" in str(e.value)
    assert Settings.from_env({"SHARDLB_INSECURE_DEV": "true"}).open_access
    assert not Settings.from_env({**KEYED, "SHARDLB_INSECURE_DEV": "true"}).open_access
    with pytest.raises(SettingsError) as e:
        Settings.from_env({"SHARDLB_INSECURE_DEV": "true", "SHARDLB_READS_REQUIRE_KEY": "true"})
    assert e.value.variable == "SHARDLB_READS_REQUIRE_KEY"


def test_archive_and_webhook_urls_that_work() -> None:
    for url in (
        "postgresql://shardlb:secret@db:5432/shardlb?sslmode=require",
        "postgres://shardlb@127.0.0.1/shardlb",
    ):
        assert Settings.from_env({**KEYED, "SHARDLB_POSTGRES_URL": url}).postgres_url == url
    hook = "https://hooks.example/paid?game=1"
    assert Settings.from_env({**KEYED, "SHARDLB_SETTLEMENT_WEBHOOK_URL": hook}).settlement_webhook_url == hook


def test_make_bench_settings_are_no_misspellings() -> None:
    """`make bench`'s routers inherit its SHARDLB_BENCH_* settings (bench/services.py), which are
    another program's, as router/README.md says; SHARDLB_BENCH_READ_CONCURRENCY (the raw and
    textbook reads in flight) was still called a misspelling of SHARDLB_READ_CONCURRENCY in every
    bench router's log where it was set (found 2026-12-06 checking the README's list of bench/'s
    variables near a setting, which missed it: bench/run.py builds the names from its fields)."""
    env = {**KEYED, **{f"SHARDLB_BENCH_{f.name.upper()}": "1" for f in fields(BenchSettings)}}
    assert "SHARDLB_BENCH_READ_CONCURRENCY" in env
    assert [w for w in warnings(Settings.from_env(env), env) if "SHARDLB_BENCH_" in w] == []


def test_doubtful_values_are_warned_about_not_refused() -> None:
    env = {
        **KEYED,
        "SHARDLB_WRITE_KEY": "x" * 20,  # SHARDLB_WRITE_KEYS misspelled: ignored, so said
        "SHARDLB_BENCH_PLAYERS": "1000",  # another program's (bench/): not the router's business
        "SHARDLB_TRUSTED_PROXIES": "10.0.0.0/8, ::/0",
    }
    said = warnings(Settings.from_env(env), env)
    assert any("SHARDLB_WRITE_KEY " in w and "SHARDLB_WRITE_KEYS" in w for w in said), said
    assert not any("SHARDLB_BENCH_PLAYERS" in w for w in said), said
    assert any(w.startswith("SHARDLB_TRUSTED_PROXIES: ") and "::/0" in w for w in said), said
    # "adm" and "wr1": keys anyone could guess
    assert any(w.startswith("SHARDLB_ADMIN_KEYS: ") for w in said), said
    assert any(w.startswith("SHARDLB_WRITE_KEYS: ") for w in said), said
    long_keys = {"SHARDLB_ADMIN_KEYS": "a" * 16, "SHARDLB_WRITE_KEYS": "w" * 32}
    assert warnings(Settings.from_env(long_keys), long_keys) == []
