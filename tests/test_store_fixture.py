"""tests/store_fixture.py's check that a library module leaves no task or thread running on the
session's loop and client, run on small modules in a pytest session of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = session
asyncio_default_test_loop_scope = session
filterwarnings = error
"""

# ``store`` of its own here (None): what makes a module one of the library's is that its tests use
# the fixture, and these need no cluster.
LEAKS = """
import asyncio, threading
import pytest

@pytest.fixture
def store():
    return None

async def test_leaves_a_loop_and_a_thread(store):
    async def polls_forever():
        while True:
            await asyncio.sleep(0.01)

    asyncio.get_running_loop().create_task(polls_forever())
    threading.Thread(target=threading.Event().wait, name="stuck", daemon=True).start()

def test_a_plain_one(store):
    pass
"""

AFTER = """
import asyncio
import pytest

@pytest.fixture
def store():
    return None

async def test_the_loop_is_clean_again(store):
    assert not [t for t in asyncio.all_tasks() if "polls_forever" in repr(t)]
"""

CLEAN = """
import asyncio, threading
import pytest

@pytest.fixture
def store():
    return None

async def test_awaits_what_it_starts(store):
    stop = asyncio.Event()
    task = asyncio.create_task(stop.wait())
    thread = threading.Thread(target=stop.is_set)
    thread.start()
    stop.set()
    await task
    thread.join()
    assert await asyncio.to_thread(lambda: 1) == 1  # the executor's threads stay, as they should
"""


def test_a_module_that_leaves_a_task_or_a_thread_fails_by_name_and_the_next_starts_clean(
    tmp_path: Path,
) -> None:
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "test_a_leaks.py").write_text(LEAKS)
    (tmp_path / "test_b_after.py").write_text(AFTER)
    (tmp_path / "test_c_clean.py").write_text(CLEAN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.store_fixture"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "4 passed, 1 error" in out, out
    assert "ERROR test_a_leaks.py::test_a_plain_one" in out, out  # the teardown of its last test
    assert "test_a_leaks left running after its last test" in out, out
    assert "polls_forever" in out and "Thread(stuck" in out, out
