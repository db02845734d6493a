"""The benches README and bench/README.md give as `make bench-*` commands, run tiny as a user starts
them (`python -m bench.X`, each on a cluster and a PostgreSQL of its own): every one ends with its
figures, exit status 0. Until 2026-12-06 `make bench-settle` stopped at once (its PostgreSQL had no
archive schema when the rebuilder connected: ArchiveUnprepared) and nothing noticed, since no test
ran it; `make bench-rebuild` had the set-up and ran."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TINY = {
    "bench.settle": {"SHARDLB_SETTLE_PLAYERS": "300", "SHARDLB_SETTLE_SHARDS": "3"},
    "bench.rebuild": {"SHARDLB_REBUILD_PLAYERS": "300", "SHARDLB_REBUILD_SHARDS": "3"},
}
# A line each run ends its figures with.
LAST_FIGURE = {
    "bench.settle": "peak memory of the settling process",
    "bench.rebuild": "peak memory of the rebuilding process",
}


@pytest.mark.parametrize("module", sorted(TINY))
def test_a_tiny_run_ends_with_its_figures(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDLB_REDIS_URL", "SHARDLB_POSTGRES_URL")}
    env.update(TINY[module])
    run = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert LAST_FIGURE[module] in run.stdout, out[-3000:]
