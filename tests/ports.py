"""Where a test process starts looking for free ports (this module holds no tests).

Every server a test starts takes the first free ports from a start of its own: ``free_port_block``
and the ``free_port`` helpers check that a port is free now, not that another process will not take
it before the server binds it. Test processes running side by side therefore start from different
blocks: two sessions by their pids, and the xdist workers of one run (``make test`` runs three) by their
worker numbers, which keeps them apart even where their pids would land in the same block.
"""

from __future__ import annotations

import os
import zlib

BLOCK = 10  # ports per block: more than any one search here takes


def search_start(base: int, blocks: int) -> int:
    """``base`` plus one of ``blocks`` blocks of ``BLOCK`` ports, chosen for this process: by its pid,
    or under xdist from one start per run (PYTEST_XDIST_TESTRUNUID) plus the worker's number, so the
    workers of a run (up to ``blocks`` of them) never share a block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        index = os.getpid()
    else:
        run = zlib.crc32(os.environ.get("PYTEST_XDIST_TESTRUNUID", "").encode())
        index = run + int(worker.removeprefix("gw"))
    return base + index % blocks * BLOCK
