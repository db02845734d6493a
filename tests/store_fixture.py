"""Fixtures of the library's test modules: ``store`` (a BoardStore on the session cluster), ``raw`` (a
client that leaves replies undecoded, for journals) and ``rebuilder`` (shardlb/rebuild.py).

``store``'s client and the event loop are the session's: every library module that runs on the same
xdist worker shares them. A task a module leaves running on them (a reader loop, an archiver, a lease's
refresher, a write still in flight) or a thread it leaves alive works on in the modules after it and
opens connections there that their tests do not expect. ``_module_leaves_nothing_running`` fails such
a module by name and cancels what it left. (The client's pools still carry over from module to
module: a test that needs to know its connections takes a client of its own, as test_fanout.py's
``own_store``.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest

from shardlb.cluster import LocalCluster
from shardlb.connection import Scripts, connect
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore

SHARED = ("store", "raw", "rebuilder")  # the fixtures that make a module one of the library's

# How long a module's leftovers get to finish on their own: a task cancelled without being awaited (the
# reshard lease's refresher) needs a few turns of the loop, a thread told to stop a moment.
GRACE_S = 0.5


@pytest.fixture(scope="session")
async def store(cluster: LocalCluster) -> AsyncIterator[BoardStore]:
    client = connect(cluster.url)
    scripts = Scripts.register(client)
    await scripts.load(client)
    yield BoardStore(client, scripts)
    await client.aclose()


@pytest.fixture
async def raw(cluster: LocalCluster) -> AsyncIterator[Any]:
    client = connect(cluster.url, decode=False)
    yield client
    await client.aclose()


@pytest.fixture
async def rebuilder(raw: Any, postgres_url: str) -> AsyncIterator[Rebuilder]:
    db = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    yield Rebuilder(raw, Scripts.register(raw).rebuild, db)
    await db.close()


async def forget_others_restored(store: BoardStore, own: Callable[[str], bool] = lambda _: False) -> None:
    """Delete again every board in the registry still marked as being rebuilt (``Board.rebuilding``)
    that is not the test's own (``own``, a test on its id). A restore (``Rebuilder.restore``) brings
    back every board its PostgreSQL archived and the registry lacks: on the suite's database, or an
    archiver's own that archived what other modules left on the worker's cluster, that is boards other
    tests deleted without their deletion being archived. Since 2026-12-06 such a board comes back
    marked until rebuilt (503 ``board_rebuilding``), and a ban of every board made by a later test
    on the worker met it (CI of 2026-12-06 failed two tests of test_bans_recreated.py so). Every
    restore of a test that does not rebuild all it restored calls this after it. (Not from the
    module fixture below: asking for the async ``store`` there broke every module's set-up.)"""
    for board in await store.boards():
        if board.rebuilding and not own(board.config.id):
            await store.delete(board.config.id, board.incarnation)


@pytest.fixture(scope="module", autouse=True)
async def _module_leaves_nothing_running(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """After each library module (one whose tests use ``SHARED``): the asyncio tasks still pending on
    the session's loop and the threads still alive that were not there before it fail the module,
    named with what they run. The tasks are cancelled and awaited first, so the modules after it
    start clean. Autouse and module-scoped, it is set up before the module's own module fixtures and
    torn down after them (a module's servers and clients are closed by then).

    Only the library's modules: the others (router, bench, k8s) were not checked when this was added
    and keep servers of their own; extending ``SHARED`` or dropping the condition covers them."""
    items = [i for i in request.session.items if i.module is request.module]
    if not any(name in item.fixturenames for item in items for name in SHARED):
        yield
        return
    tasks, threads = asyncio.all_tasks(), set(threading.enumerate())
    yield
    here = asyncio.current_task()  # pytest-asyncio tears down in a task of its own
    deadline = time.monotonic() + GRACE_S
    while True:
        new_tasks = [t for t in asyncio.all_tasks() if t is not here and t not in tasks and not t.done()]
        new_threads = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
        new_threads = [t for t in new_threads if not _pooled(t)]
        if not (new_tasks or new_threads) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    if not (new_tasks or new_threads):
        return
    left = [f"task {t!r}" for t in new_tasks] + [f"thread {t!r}" for t in new_threads]
    for task in new_tasks:
        task.cancel()
    if new_tasks:
        await asyncio.wait(new_tasks, timeout=5)
    pytest.fail(f"{request.module.__name__} left running after its last test:\n  " + "\n  ".join(left))


def _pooled(thread: threading.Thread) -> bool:
    """A thread of the loop's default executor (``asyncio.to_thread``): kept for the next call, and
    idle once the task that awaited it is done (that task would be listed)."""
    return thread.name.startswith("asyncio_")
