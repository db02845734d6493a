"""The private PostgreSQL server of the archive (`shardlb/postgres.py`), on real servers."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from shardlb.nodes import ClusterError
from shardlb.postgres import LocalPostgres
from tests.ports import server_port


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalPostgres]:
    """A private server of the test's own, started once; stopped and deleted afterwards."""
    local = LocalPostgres(tmp_path / "postgres", port=server_port(), fast=True)
    local.up()
    yield local
    local.destroy()


def test_up_after_the_data_is_gone_says_so_instead_of_an_empty_archive(server: LocalPostgres) -> None:
    """As root the data lives under /tmp, which many machines empty at boot while .shardlb (the
    cluster's files) stays: up() used to run initdb again and give an empty archive as if nothing
    had been lost."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (n int)")
    server.down()
    shutil.rmtree(server.data)
    with pytest.raises(ClusterError, match="is gone") as raised:
        LocalPostgres(server.dir).up()
    assert str(server.dir / "postgres.json") in str(raised.value)
    assert not server.data.exists()


def test_the_data_of_a_server_that_keeps_it_lives_where_its_directory_does_or_outside_tmp(
    tmp_path: Path,
) -> None:
    """`make run`'s archive (fsync on) is the source of truth: as root, where the data cannot sit in
    the directory, it goes to the postgres user's home, not to /tmp, which many machines empty at
    boot (it went there until 2026-12-05)."""
    local = LocalPostgres(tmp_path / "postgres")
    assert local.data.is_relative_to(local.dir) or not local.data.is_relative_to("/tmp")


def test_a_recorded_data_directory_is_used_whatever_the_rule_for_new_ones(server: LocalPostgres) -> None:
    again = LocalPostgres(server.dir)  # not fast: a new server of this kind would go elsewhere as root
    assert again.data == server.data
    assert again.up() == server.url


def test_a_directory_made_again_gets_an_empty_server_not_the_data_of_the_one_deleted(
    tmp_path: Path,
) -> None:
    """As root the data lives outside the directory, under a name taken from its path: a checkout
    deleted and cloned again at the same path (its .shardlb gone, the state file with it) got the
    old checkout's archive back, bans and audit rows included. With no state file there is no
    server of this directory to keep: data left under that name is an earlier one's."""
    where = tmp_path / "postgres"
    first = LocalPostgres(where, port=server_port(), fast=True)
    first.up()
    try:
        with psycopg.connect(first.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE left_behind (n int)")
        first.down()
        shutil.rmtree(where)  # the checkout deleted: the data outside it (as root) stays
        again = LocalPostgres(where, port=first.port, fast=True)
        again.up()
        with psycopg.connect(again.url, autocommit=True) as conn:
            found = conn.execute("SELECT to_regclass('left_behind')").fetchone()
        assert found == (None,)
    finally:
        LocalPostgres(where).destroy()
        first.destroy()
