"""A `shardlb` command stopped by Ctrl-C says so in one line, exits 130, and leaves what a re-run
finishes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster


async def test_ctrl_c_in_a_reshard_is_one_line_and_resume_finishes_it(
    store: BoardStore, cluster_url: str
) -> None:
    """Ctrl-C exited 130 with nothing on stderr: a terminal showed the prompt again, a cron mail or
    a CI log showed nothing to tell an interruption from a crash."""
    tries = []
    for attempt in range(3):
        missed = await _interrupted_then_resumed(store, cluster_url, f"cli-interrupted-{attempt}")
        if missed is None:
            return
        tries.append(missed)
    pytest.fail("the reshard finished before Ctrl-C reached it three times in a row: " + "; ".join(tries))


async def _interrupted_then_resumed(store: BoardStore, cluster_url: str, board_id: str) -> str | None:
    """One try: None when it proved its point; else what happened, when the reshard was over before
    the signal came (its wait for routers is 5 s from its start, which a very busy machine may spend
    copying), so the try proved nothing. Run without PYTHONUNBUFFERED, as from a shell: the command
    writes its lines to the pipe as it says them (until 2026-12-06 Python held them in its buffer
    until the exit, and the wait's line, read then, came too late for any Ctrl-C)."""
    config = BoardConfig.from_dict(
        board_id, {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    )
    board, _ = await store.create(config)
    try:
        await board.submit([Score(f"p{i}", i, "m1") for i in range(50)])
        command = [sys.executable, "-m", "shardlb", "reshard", config.id, "--redis", cluster_url]
        process = subprocess.Popen(
            [*command, "--shards", "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        )
        try:
            assert process.stdout is not None
            deadline = time.monotonic() + 60
            line = b""
            while b"waiting" not in line:  # the reshard waits there for routers to learn of it
                assert time.monotonic() < deadline and process.poll() is None, line
                line = await asyncio.to_thread(process.stdout.readline)
            read_at = time.monotonic()
            ended_before = process.poll() is not None
            process.send_signal(signal.SIGINT)
            out, err = await asyncio.to_thread(process.communicate, timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        if process.returncode == 0:
            took = read_at - (deadline - 60)
            ended = "ended before the signal" if ended_before else "still ran when signalled"
            return f"{ended}, its wait line read {took:.1f} s after the start; last output {out[-200:]!r}"
        assert process.returncode == 130
        assert err.decode().strip().splitlines() == ["shardlb: interrupted"], err
        # The resume waits for no router's copy of the board (none keeps it): 6 s saved
        # (SHARDLB_RESHARD_CACHE_S, a test-only setting; the interrupted run above waits as in production).
        resumed = await asyncio.to_thread(
            subprocess.run,
            [*command, "--resume"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SHARDLB_RESHARD_CACHE_S": "0"},
        )
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout.strip().splitlines()[-1])["shards"] == 3
        assert len(await (await store.get(config.id)).top(100)) == 50
        return None
    finally:
        await store.delete(config.id)
