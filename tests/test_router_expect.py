"""Requests that announce their body before sending it, against the router as a process: `Expect:
100-continue` (curl sends it for large bodies) gets `100 Continue` only once the body is
wanted; a request refused on its head alone (a wrong key, a declared length past the cap, a media
type or a content coding the router does not read) is answered without it, and the connection is
closed after that answer, as the body it announced may or may not follow. A compressed body
(`Content-Encoding: gzip`) is 415 with nothing written."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Iterator

import httpx
import orjson
import pytest

from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, WRITE, board_name
from tests.test_router_server import Server

MAX_BODY = 4096
PATIENCE_S = 15


@pytest.fixture(scope="module")
def server(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(
        cluster.url,
        tmp_path_factory.mktemp("expect") / "router.log",
        SHARDLB_MAX_BODY_BYTES=str(MAX_BODY),
        SHARDLB_READ_RATE="0",
    )
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def board(server: Server) -> Iterator[str]:
    name = board_name("expect")
    assert httpx.put(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN).status_code == 201
    yield name
    httpx.delete(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN)


def _scores(n: int, match: str) -> bytes:
    """``n`` scores of ``match``, each for a player of its own (``<match>-<i>``)."""
    return orjson.dumps(
        {"scores": [{"player_id": f"{match}-{i}", "points": i + 1, "match_id": match} for i in range(n)]}
    )


def _head(path: str, length: int, key: str = WRITE, method: str = "POST", **extra: str) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: router.test",
        f"Authorization: Bearer {key}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        "Expect: 100-continue",
        *(f"{name.replace('_', '-')}: {value}" for name, value in extra.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next response (an interim 100 included): status, headers (lower-cased names), body."""

    async def read() -> tuple[int, dict[str, str], bytes]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(head[0].split()[1]), headers, body

    return await asyncio.wait_for(read(), PATIENCE_S)


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), PATIENCE_S) == b""
    except ConnectionError:
        return True


async def test_a_post_that_expects_100_continue_gets_it_then_its_answer(server: Server, board: str) -> None:
    body = _scores(30, "expect-ok")
    assert len(body) > 1024  # what older curl sent with Expect
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(_head(f"/v1/boards/{board}/scores", len(body)))
        await writer.drain()
        assert (await _answer(reader))[0] == 100
        writer.write(body)
        status, _, answer = await _answer(reader)
        assert status == 200, answer
        assert [r["status"] for r in orjson.loads(answer)["results"]] == ["improved"] * 30
        # The connection goes on: the next request is read as one.
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: router.test\r\n\r\n")
        assert (await _answer(reader))[0] == 200
    finally:
        writer.close()


@pytest.mark.parametrize(
    "case",
    ["wrong key", "declared too large", "form type", "gzip", "board settings too large"],
)
async def test_a_request_refused_on_its_head_is_answered_without_100_continue(
    server: Server, board: str, case: str
) -> None:
    match = "expect-" + case.replace(" ", "-")
    body = _scores(30, match)
    path = f"/v1/boards/{board}/scores"
    head, want = {
        "wrong key": (_head(path, len(body), key="not-a-key-000000"), (401, "unauthorized")),
        "declared too large": (_head(path, MAX_BODY + 1), (413, "body_too_large")),
        "form type": (
            _head(path, len(body)).replace(b"application/json", b"application/x-www-form-urlencoded"),
            (415, "unsupported_media_type"),
        ),
        "gzip": (_head(path, len(body), Content_Encoding="gzip"), (415, "unsupported_media_type")),
        "board settings too large": (
            _head(f"/v1/boards/{board}", MAX_BODY + 1, key=AS_ADMIN["Authorization"][7:], method="PUT"),
            (413, "body_too_large"),
        ),
    }[case]
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(head)
        await writer.drain()
        status, headers, answer = await _answer(reader)  # the first thing back: no 100 Continue
        assert (status, orjson.loads(answer)["error"]["code"]) == want
        # The body may or may not follow (the client decides on the final answer): the
        # connection is closed, so nothing the client sends next is read as that body.
        assert headers.get("connection") == "close"
        assert await _closed(reader)
    finally:
        writer.close()
    assert httpx.get(f"{server.url}/v1/boards/{board}/players/{match}-0").status_code == 404


async def test_a_gzip_body_is_415_and_writes_nothing(server: Server, board: str) -> None:
    body = _scores(3, "gzip-1")
    for encoding in ("gzip", "deflate", "br", "gzip, identity"):
        answer = httpx.post(
            f"{server.url}/v1/boards/{board}/scores",
            content=gzip.compress(body),
            headers={**AS_WRITER, "Content-Type": "application/json", "Content-Encoding": encoding},
        )
        assert answer.status_code == 415, answer.text
        error = answer.json()["error"]
        assert error["code"] == "unsupported_media_type" and "Content-Encoding" in error["message"]
        assert answer.headers["accept-encoding"] == "identity"
    assert httpx.get(f"{server.url}/v1/boards/{board}/players/gzip-1-0").status_code == 404
    # identity is no coding at all
    plain = httpx.post(
        f"{server.url}/v1/boards/{board}/scores",
        content=body,
        headers={**AS_WRITER, "Content-Type": "application/json", "Content-Encoding": "identity"},
    )
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("path", ["scores", "players:query"])
async def test_a_transfer_coding_other_than_chunked_is_415_and_writes_nothing(
    server: Server, board: str, path: str
) -> None:
    """``Transfer-Encoding: gzip, chunked`` frames the body in chunks of gzip data. The parser takes
    the chunks off and leaves the gzip coding to the app, which read the chunks as JSON: gzip was a
    400 malformed_body, and a sender whose coding did nothing to its bytes had them applied (the
    write below answered 200). A transfer coding the router does not apply is refused as a content
    coding is (RFC 9112 6.1), on the head, and nothing is written."""
    match = f"te-{path.replace(':', '-')}"
    plain = _scores(2, match) if path == "scores" else orjson.dumps({"player_ids": [f"{match}-0"]})
    for coding, body in (("gzip", gzip.compress(plain)), ("gzip", plain), ("deflate", plain)):
        head = (
            f"POST /v1/boards/{board}/{path} HTTP/1.1\r\nHost: router.test\r\n"
            f"Authorization: Bearer {WRITE}\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: {coding}, chunked\r\n\r\n"
        ).encode()
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(head + chunked)
            await writer.drain()
            status, _, answer = await _answer(reader)
            error = orjson.loads(answer)["error"]
            assert (status, error["code"]) == (415, "unsupported_media_type"), (coding, answer)
            assert "Transfer-Encoding" in error["message"]
        finally:
            writer.close()
    assert httpx.get(f"{server.url}/v1/boards/{board}/players/{match}-0").status_code == 404
