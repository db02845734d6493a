"""router/metrics.py in multiprocess mode: each process writes its own values, also after a fork,
and /metrics sums them; the process id that check uses is kept, not asked of the kernel per update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os, sys
from prometheus_client import values
from router import metrics

assert values.ValueClass is not values.MutexValue
route = "/v1/boards/{board}/top"
metrics.RESPONSES.labels(route, "200").inc()
child = os.fork()
if child == 0:
    metrics.RESPONSES.labels(route, "200").inc(2)
    os._exit(0)
os.waitpid(child, 0)
metrics.RESPONSES.labels(route, "200").inc(4)
body, _ = metrics.render()
line = [x for x in body.decode().splitlines() if x.startswith("shardlb_http_responses_total{")][0]
print(line.rsplit(" ", 1)[1], len(os.listdir(sys.argv[1])))
"""


def test_a_forked_process_counts_apart_and_the_scrape_sums_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    total, files = done.stdout.split()
    assert float(total) == 7.0
    assert int(files) >= 2  # one counter file per process
