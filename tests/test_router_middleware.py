"""router/middleware.py: the error body it sends itself when nothing else answered."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, board_name, running, service_of


@pytest.mark.cluster
async def test_a_last_resort_500_is_in_the_format_the_client_asked_for(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug under a Starlette route escapes every handler; the middleware answers it, in MessagePack
    when Accept asks for it (api.md: the response format follows Accept), with its length."""
    async with running(cluster.url) as (app, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201

        async def broken(*_: Any) -> Any:
            raise RuntimeError("a bug in the router")

        monkeypatch.setattr(service_of(app).tops, "top", broken)
        packed = await client.get(f"/v1/boards/{name}/top", headers={"Accept": "application/msgpack"})
        assert packed.status_code == 500 and packed.headers["content-type"] == "application/msgpack"
        assert msgpack.unpackb(packed.content)["error"]["code"] == "internal_error"
        assert int(packed.headers["content-length"]) == len(packed.content)
        assert packed.headers["x-request-id"]
        plain = await client.get(f"/v1/boards/{name}/top")
        assert plain.status_code == 500 and plain.headers["content-type"] == "application/json"
        assert plain.json()["error"]["code"] == "internal_error"
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
