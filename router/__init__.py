"""The shardlb HTTP router: a Starlette app in front of the shardlb library."""

from __future__ import annotations

from router.app import create_app
from router.settings import Settings

__all__ = ["Settings", "create_app"]
