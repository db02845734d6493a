"""The settings of shardlb's connections to PostgreSQL (shardlb/pgconn.py): the defaults, a URL's own
settings over them, and the parameters the archiver's and a rebuild's connections really have."""

from __future__ import annotations

import pytest
from psycopg.conninfo import make_conninfo

from shardlb import pgconn, rebuild
from shardlb.archive import connect_db

DEFAULTS = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "60000",
}


def test_a_url_without_settings_gets_every_default() -> None:
    got = pgconn.options("postgresql://shardlb@db.example:5432/shardlb")
    assert {name: str(value) for name, value in got.items()} == DEFAULTS


def test_a_urls_own_settings_win_over_the_defaults_and_a_callers() -> None:
    url = "postgresql://db.example/shardlb?keepalives=0&tcp_user_timeout=5000&connect_timeout=3"
    got = pgconn.options(url, connect_timeout=5, keepalives_idle=60)
    assert got == {"keepalives_idle": 60, "keepalives_interval": 10, "keepalives_count": 3}
    assert pgconn.options("host=db.example keepalives_count=9")["keepalives_idle"] == 30


@pytest.mark.cluster
async def test_the_archivers_connection_notices_a_vanished_server(postgres_url: str) -> None:
    """Without TCP keepalives (nor a user timeout), a query whose server vanished without a FIN
    waited for ever: the archiver hung, and the journals filled to their bound. The effective
    parameters of its connection (the router's moderation uses the same) say it now has them."""
    db = await connect_db(postgres_url)
    try:
        params = db.info.get_parameters()
        assert {name: params.get(name) for name in DEFAULTS} == DEFAULTS
    finally:
        await db.close()
    own = make_conninfo(postgres_url, keepalives_idle="7", connect_timeout="3")
    db = await connect_db(own)
    try:
        params = db.info.get_parameters()
        assert (params["keepalives_idle"], params["connect_timeout"]) == ("7", "3")
        assert (params["keepalives_count"], params["tcp_user_timeout"]) == ("3", "60000")
    finally:
        await db.close()


@pytest.mark.cluster
async def test_a_rebuilds_connection_notices_a_vanished_server(cluster_url: str, postgres_url: str) -> None:
    async with rebuild.connected(cluster_url, postgres_url) as (rebuilder, _):
        params = rebuilder.db.info.get_parameters()
        assert {name: params.get(name) for name in DEFAULTS} == DEFAULTS
