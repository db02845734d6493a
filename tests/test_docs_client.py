"""README.md's client example ("For game developers") runs as written against the real router, and
prints what README.md says it prints: the example a game developer copies first is a test."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from shardlb.client import AsyncClient, BoardNotFound
from tests.client_support import served_router
from tests.router_support import ADMIN, WRITE

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## For game developers"


def _example() -> tuple[str, list[str]]:
    """The section's Python example and the lines README.md says it prints."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    printed = re.search(r"it prints:\n\n```\n(.*?)```", section, re.S)
    assert code is not None and printed is not None
    return code[1], printed[1].splitlines()


@pytest.mark.cluster
async def test_the_readme_client_example_prints_what_the_readme_says(cluster: Any) -> None:
    code, printed = _example()
    async with served_router(cluster.url) as served, AsyncClient(served.url, ADMIN) as admin:
        with contextlib.suppress(BoardNotFound):  # left by another test of this cluster
            await admin.delete_board("demo")
        # What `make run` makes (scripts/dev-run.sh), without the post of its "Try it".
        await admin.put_board("demo", periods=["total", "daily", "weekly", "monthly"])
        env = {**os.environ, "SHARDLB_API_URL": served.url, "SHARDLB_WRITE_KEYS": WRITE}
        run = await asyncio.create_subprocess_exec(
            sys.executable,
            "-W",
            "error",
            "-c",
            code,
            env=env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(run.communicate(), 120)
        await admin.delete_board("demo")
    assert run.returncode == 0 and not err, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == len(printed)
    # The request id differs on every run; the last line is 350 or 351 (README.md says when).
    request_id = re.compile(r"[0-9a-f]{32}")
    for got, want in zip(lines[:-1], printed[:-1], strict=True):
        assert request_id.sub("ID", got) == request_id.sub("ID", want)
    assert lines[-1] in ("350", "351")
