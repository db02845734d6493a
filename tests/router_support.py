"""Helpers shared by the router test modules (this module holds no tests).

``running`` starts the router app in this process on the suite's cluster, runs its lifespan (the
same start-up and SIGTERM drain as under uvicorn) and hands back an httpx client on ASGI transport.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import httpx
from starlette.applications import Starlette

from router.app import create_app
from router.errors import ApiError
from router.service import Service
from router.settings import Settings

ADMIN = "test-admin-key-000000"
WRITE = "test-write-key-000000"
READ = "test-read-key-0000000"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
AS_WRITER = {"Authorization": f"Bearer {WRITE}"}
AS_READER = {"Authorization": f"Bearer {READ}"}


def board_name(prefix: str = "rt") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def settings_for(url: str, check: bool = True, **overrides: Any) -> Settings:
    """Test settings: all three kinds of key, everything else default unless overridden. With
    ``check=False`` they may break the start-up checks (to provoke what those checks prevent)."""
    base = Settings(redis_url=url, admin_keys=(ADMIN,), write_keys=(WRITE,), read_keys=(READ,))
    settings = dataclasses.replace(base, **overrides)
    if check:
        settings.check()
    return settings


@asynccontextmanager
async def running(
    url: str, check: bool = True, **overrides: Any
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The app with its lifespan entered, and a client for it; the lifespan exits (drains) after."""
    app = create_app(settings_for(url, check, **overrides))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router.test", timeout=30
        ) as client:
            yield app, client


def service_of(app: Starlette) -> Service:
    service: Service = app.state.service
    return service


def calls_made(work: Callable[[], object]) -> int:
    """The function calls ``work`` makes, Python's and C's (an ApiError it raises taken): what it
    costs a worker, counted rather than timed."""
    calls = 0

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        with contextlib.suppress(ApiError):
            work()
    finally:
        sys.setprofile(previous)
    return calls
