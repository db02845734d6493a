"""`make bench-archive` on the suite's PostgreSQL, small: it archives through the archiver's own
upsert and measures what it stored, in a database it drops after."""

from __future__ import annotations

import psycopg
import pytest

from bench import archive_size


@pytest.mark.parametrize("kind", sorted(archive_size.MATCH_IDS))
async def test_the_bytes_per_archived_result_are_measured_on_the_rows_archived(
    postgres_url: str, kind: str
) -> None:
    found = await archive_size.measure(postgres_url, 2000, kind)
    assert found["rows"] == 2000
    indexes = {k: v for k, v in found.items() if k not in ("rows", "total", "heap")}
    assert {"match_results_pkey", "match_results_by_player"} <= set(indexes)
    assert found["total"] >= found["heap"] + sum(indexes.values()) > 0
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        cur = await db.execute("SELECT count(*) FROM pg_database WHERE datname LIKE 'archive_size_%'")
        assert await cur.fetchone() == (0,)
