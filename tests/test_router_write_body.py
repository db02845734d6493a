"""How the write endpoint reads a body (router/scores.py): whole in one message, in several chunks,
past the cap, or cut short by the client. Nothing here reaches a cluster: a body that is refused is
refused before any board is looked up; a body read to the end reaches the lookup, which the stub
service answers as a board that does not exist (404)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from router.auth import Keys
from router.scores import ScoresEndpoint
from router.settings import Settings
from shardlb.errors import BoardNotFound

KEY = "write-key"
BODY = orjson.dumps({"scores": [{"player_id": "p1", "points": 5, "match_id": "m1"}]})


class _NoBoards:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def cached(self, board_id: str) -> Any:
        return None  # none kept: the write asks ``get``

    async def get(self, board_id: str) -> Any:
        self.asked.append(board_id)
        raise BoardNotFound(f"no board {board_id!r}", "board")


def _scope(length: int | None, limit: int = 1024) -> dict[str, Any]:
    settings = Settings(redis_url="redis://127.0.0.1:1", write_keys=(KEY,), max_body_bytes=limit)
    service = SimpleNamespace(keys=Keys(settings), settings=settings, draining=False, boards=_NoBoards())
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/boards/b/scores",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "path_params": {"board": "b"},
        "app": SimpleNamespace(state=SimpleNamespace(service=service)),
    }


async def _answer(scope: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    queue = list(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ScoresEndpoint()(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    return sent[0]["status"], orjson.loads(sent[1]["body"])


def _chunk(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


@pytest.mark.parametrize(
    "messages",
    [
        [{"type": "http.disconnect"}],  # gone before any of the body
        [_chunk(BODY[:10], True), {"type": "http.disconnect"}],  # gone in the middle of it
    ],
    ids=["at-once", "midway"],
)
async def test_a_client_gone_before_its_body_ended_gets_400_and_nothing_is_written(
    messages: list[dict[str, Any]],
) -> None:
    scope = _scope(len(BODY))
    status, body = await _answer(scope, messages)
    assert status == 400 and body["error"]["code"] == "malformed_body"
    assert _boards(scope).asked == []


@pytest.mark.parametrize(
    ("length", "messages"),
    [
        (2048, [_chunk(BODY, False)]),  # declared past the cap, whatever came
        (None, [_chunk(b"x" * 1500, False)]),  # one message past the cap
        (None, [_chunk(b"x" * 600, True), _chunk(b"x" * 600, False)]),  # chunks past it together
    ],
    ids=["declared", "whole", "chunked"],
)
async def test_a_body_past_the_cap_is_413(length: int | None, messages: list[dict[str, Any]]) -> None:
    scope = _scope(length)
    status, body = await _answer(scope, messages)
    assert status == 413 and body["error"]["code"] == "body_too_large"
    assert _boards(scope).asked == []


@pytest.mark.parametrize(
    "messages",
    [[_chunk(BODY, False)], [_chunk(BODY[:7], True), _chunk(b"", True), _chunk(BODY[7:], False)]],
    ids=["whole", "chunked"],
)
async def test_a_whole_or_chunked_body_is_read_to_the_end(messages: list[dict[str, Any]]) -> None:
    scope = _scope(len(BODY))
    status, body = await _answer(scope, messages)
    assert status == 404 and body["error"]["code"] == "board_not_found"
    assert _boards(scope).asked == ["b"]


def _boards(scope: dict[str, Any]) -> _NoBoards:
    boards: _NoBoards = scope["app"].state.service.boards
    return boards
