"""router/server.py: the router as a process (`python -m router.server`): start-up checks,
schemathesis against its own /openapi.json, the SIGTERM drain, and readiness through a cluster
outage."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from shardlb.cluster import LocalCluster
from shardlb.store import BoardStore
from tests.ports import node_ports, server_port
from tests.router_support import ADMIN, AS_ADMIN, AS_WRITER, READ, WRITE, board_name, running

ROOT = Path(__file__).resolve().parent.parent


@schemathesis.deserializer("application/msgpack")
def _unpack(ctx: Any, response: Any) -> Any:
    return msgpack.unpackb(response.content)


def _pack(ctx: Any, value: Any) -> bytes:
    try:
        return bytes(msgpack.packb(value))
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"  # not representable (an integer past 64 bits): send a byte msgpack never uses


schemathesis.serializer("application/msgpack")(_pack)


def free_port() -> int:
    """A free TCP port of this process's own, below the ephemeral range (tests/ports.py)."""
    return server_port()


class Server:
    """``python -m router.server serve`` in a child process.

    A port handed out by tests/ports.py is checked free, not held: a process of another session
    whose slice is this one's (by its pid) can take it before the router binds it (a CI run of
    2026-12-06 lost a test so, beside helpers' own test runs). A router that exits on a port found
    in use is started again on the next port, unless the caller named the port.

    ``probe=True`` gives the router a liveness port too (SHARDLB_PROBE_PORT, ``self.probe_port``),
    picked afresh for each start as the API port is: the router binds it first, in its start-up, so
    a probe port taken meanwhile exits it with the same "address already in use". A test that named
    the probe port itself could not start again (a full run of 2026-12-07 lost
    test_liveness_is_answered_at_the_connection_caps so)."""

    TRIES = 3  # starts on ports of our own choosing, when a port was taken meanwhile

    def __init__(
        self, url: str, log: Path, workers: int = 1, port: int | None = None, probe: bool = False, **env: str
    ) -> None:
        self.log = log
        self.probe_port: int | None = None
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLB_", "PROMETHEUS_"))}
        environ.update(
            {
                "SHARDLB_REDIS_URL": url,
                "SHARDLB_ADMIN_KEYS": ADMIN,
                "SHARDLB_WRITE_KEYS": WRITE,
                "SHARDLB_READ_KEYS": READ,
                **env,
            }
        )
        for tries_left in range(1 if port else self.TRIES, 0, -1):
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            if probe:
                self.probe_port = free_port()
                environ["SHARDLB_PROBE_PORT"] = str(self.probe_port)
            if self._start(environ, workers) or tries_left == 1:
                break
        self._wait_ready()

    def _start(self, environ: dict[str, str], workers: int) -> bool:
        """Start the router on ``self.port``; False when it exited at once on that port in use."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router.server",
                    "serve",
                    "--port",
                    str(self.port),
                    "--workers",
                    str(workers),
                ],
                cwd=ROOT,
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return "address already in use" not in self.log.read_text()
            if self._ready():
                return True
            time.sleep(0.1)
        return True  # _wait_ready says what is wrong

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            if self._ready():
                return
            time.sleep(0.1)
        raise AssertionError(f"router not ready:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running_server = Server(cluster.url, tmp_path_factory.mktemp("router") / "router.log")
    yield running_server
    assert running_server.stop() == 0


@pytest.mark.cluster
def test_a_port_taken_before_the_router_binds_it_is_left_for_another(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test helper's own start: a port handed out free and taken by another process before the
    router binds it (CI of 2026-12-06: `address already in use`, exit 3) costs a start, not the test."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    ports = iter([held])
    monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(ports, None) or server_port())
    try:
        server = Server(cluster.url, tmp_path / "router.log")
    finally:
        taken.close()
    try:
        assert server.port != held
        assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.cluster
def test_a_probe_port_taken_before_the_router_binds_it_is_left_for_another(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the API port: a liveness port handed out free and taken before the router's start-up binds
    it (exit 3, `address already in use`) costs a start on other ports, not the test."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    ports = iter([server_port(), held])  # the first start's API port, then its probe port
    monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(ports, None) or server_port())
    try:
        server = Server(cluster.url, tmp_path / "router.log", probe=True, SHARDLB_PROBE_HOST="127.0.0.1")
    finally:
        taken.close()
    try:
        assert server.probe_port not in (None, held)
        assert httpx.get(f"http://127.0.0.1:{server.probe_port}/healthz", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0


def test_bad_settings_exit_2_naming_the_variable() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLB_")}
    for extra, variable in (
        ({"SHARDLB_WRITE_KEYS": "k", "SHARDLB_QUEUE_LIMIT": "many"}, "SHARDLB_QUEUE_LIMIT"),
        ({}, "SHARDLB_ADMIN_KEYS"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "router.server", "serve"],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2
        assert done.stderr.startswith(f"shardlb serve: error: {variable}: ")


def _no_cluster_env(startup_timeout_s: str) -> tuple[dict[str, str], int]:
    """The environment of a router whose cluster address has nothing behind it, and its dead port."""
    with socket.socket() as held, socket.socket() as other:  # ports with nothing behind them
        held.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        dead, port = held.getsockname()[1], other.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLB_")}
    env.update(
        SHARDLB_REDIS_URL=f"redis://127.0.0.1:{dead}",
        SHARDLB_ADMIN_KEYS="a" * 20,
        SHARDLB_STARTUP_TIMEOUT_S=startup_timeout_s,
        SHARDLB_PORT=str(port),
    )
    return env, dead


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_that_cannot_start_exits_3_with_any_number_of_workers(workers: int) -> None:
    """A router whose app cannot start (no Redis to reach) exits 3, so a supervisor (systemd's
    Restart=on-failure, a pod's restart policy) sees a failure. With more than one worker uvicorn's
    parent stopped on its worker's start failure and exited 0, as after an orderly SIGTERM."""
    env, dead = _no_cluster_env("0")
    done = subprocess.run(
        [sys.executable, "-m", "router.server", "serve", "--workers", str(workers)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    # Why, in one line of the router's own (README: a command says why on one line), not a
    # traceback of redis-py's internals that an operator must read to the bottom.
    lines = [orjson.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    said = [x["message"] for x in lines if x["level"] == "error"]
    assert f"router cannot start: no cluster at redis://127.0.0.1:{dead}" in "\n".join(said), said
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_waiting_for_the_cluster_stops_the_router(workers: int) -> None:
    """A router waiting for its cluster at start (up to SHARDLB_STARTUP_TIMEOUT_S; 240 s in k8s/,
    where the routers of a first deploy wait for the bootstrap Job) that got SIGTERM went on
    waiting: uvicorn only notes a signal while the app starts. A rollout or a scale-down then waited
    for the kubelet's SIGKILL at the end of the grace period. It stops at once now, with status 0."""
    env, _ = _no_cluster_env("3600")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.server", "serve", "--workers", str(workers)],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:  # the workers are waiting for the cluster once they say so
            said.append(line)
            if sum("cluster not reachable yet" in x for x in said) == workers:
                break
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the router kept waiting for its cluster after SIGTERM")
        assert code == 0, "".join(said) + proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


FRAMING = frozenset({"content-length", "transfer-encoding", "host", "connection"})


@pytest.mark.cluster
def test_doubtful_settings_are_warned_about_at_start(cluster: LocalCluster, tmp_path: Path) -> None:
    """A misspelled variable and a proxy list that trusts everyone start the router (they are not
    errors), each named in a warning line (router/settings.py, warnings)."""
    log = tmp_path / "router.log"
    started = Server(cluster.url, log, SHARDLB_WRITE_KEY="x" * 20, SHARDLB_TRUSTED_PROXIES="0.0.0.0/0")
    assert started.stop() == 0
    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.strip()]
    said = [x["message"] for x in lines if x["level"] == "warning" and x["logger"] == "shardlb.router"]
    assert any("SHARDLB_WRITE_KEY " in m for m in said), said
    assert any(m.startswith("SHARDLB_TRUSTED_PROXIES: ") for m in said), said


def test_schemathesis_finds_no_5xx_and_no_schema_break(server: Server) -> None:
    """Every operation of /openapi.json, 30 valid and 15 invalid generated requests each, with an admin
    key; half the valid ones aimed at a board that has players so reads get past 404."""
    main = board_name("st")
    assert httpx.put(f"{server.url}/v1/boards/{main}", headers=AS_ADMIN).status_code == 201
    players = [{"player_id": f"p{i}", "points": i * 10, "match_id": "m"} for i in range(30)]
    httpx.post(f"{server.url}/v1/boards/{main}/scores", json={"scores": players}, headers=AS_WRITER)
    before = {b["board"] for b in httpx.get(f"{server.url}/v1/boards").json()["boards"]}

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        response_headers_conformance,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13  # schemathesis leaves out the document's own path
    try:
        for operation in operations:
            for mode, examples in ((GenerationMode.POSITIVE, 30), (GenerationMode.NEGATIVE, 15)):

                @settings(
                    max_examples=examples,
                    deadline=None,
                    database=None,
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=operation.as_strategy(generation_mode=mode), aim=st.booleans(), data=st.data())
                def check(case: Any, aim: bool, data: st.DataObject) -> None:
                    # A generated framing header (a Content-Length of "-'[9") makes the request
                    # invalid HTTP: uvicorn answers its own plain-text 400 before any app runs.
                    assume(not FRAMING.intersection(k.lower() for k in case.headers or {}))
                    if aim and case.method != "DELETE" and "board" in (case.path_parameters or {}):
                        case.path_parameters["board"] = main
                        if "player" in case.path_parameters:
                            case.path_parameters["player"] = data.draw(
                                st.sampled_from(["p1", "p29", "nobody"])
                            )
                    response = case.call(base_url=server.url, headers=AS_ADMIN, timeout=10)
                    case.validate_response(response, checks=checks)

                try:
                    check()
                except Unsatisfiable:
                    # No parameter and no body: there is nothing to make invalid.
                    assert mode is GenerationMode.NEGATIVE, operation.label
    finally:
        for board in {b["board"] for b in httpx.get(f"{server.url}/v1/boards").json()["boards"]} - before | {
            main
        }:
            httpx.delete(f"{server.url}/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_sigterm_drains_accepted_writes(
    cluster: LocalCluster, store: BoardStore, tmp_path: Path
) -> None:
    """Writers keep posting while the router (two workers) gets SIGTERM: every acknowledged score is
    on the board, later writes are refused or find the port closed, and the process exits 0."""
    server = await asyncio.to_thread(
        Server,
        cluster.url,
        tmp_path / "router.log",
        2,
        SHARDLB_COALESCE_DELAY_MS="50",
        SHARDLB_DRAIN_SECONDS="5",
    )
    name = board_name()
    acknowledged: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.url, headers=AS_WRITER, timeout=20) as client:
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201

        async def writer(w: int) -> None:
            for n in range(10_000):
                scores = [{"player_id": f"w{w}-{n}-{i}", "points": w + 1, "match_id": "m"} for i in range(20)]
                try:
                    r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores})
                except httpx.TransportError:
                    return  # the listening socket is gone: the router is on its way out
                if r.status_code != 200:
                    assert r.status_code == 503, r.text
                    return
                acknowledged.update((s["player_id"], s["points"]) for s in scores)

        async def terminate() -> None:
            await asyncio.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)

        await asyncio.gather(terminate(), *(writer(w) for w in range(8)))
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    assert len(acknowledged) > 100
    assert server.log.read_text().count('"scores_not_applied":0') == 2
    board = await store.get(name)
    found = await board.scores(list(acknowledged))
    assert {player: board.codec.decode(value)[0] for player, value in found.items()} == acknowledged
    await store.delete(name)


@pytest.mark.cluster
async def test_outage_is_503_and_not_ready(tmp_path: Path) -> None:
    """A cluster of its own, stopped under a running router: reads, writes and /readyz answer 503."""
    small = LocalCluster(
        masters=1,
        replicas=0,
        port=node_ports(1),
        dir=tmp_path / "cluster",
    )
    small.up()
    try:
        async with running(small.url, redis_timeout_s=0.2) as (_, client):
            name = board_name()
            assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
            body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
            assert (
                await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
            ).status_code == 200
            assert (await client.get("/readyz")).status_code == 200
            small.down()
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
            assert int(ready.headers["retry-after"]) >= 1
            read = await client.get(f"/v1/boards/{name}/players/p")
            assert read.status_code == 503 and read.json()["error"]["code"] == "cluster_unavailable"
            write = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
            assert write.status_code == 503
            assert (await client.get("/healthz")).status_code == 200
    finally:
        small.down()


@pytest.mark.cluster
async def test_a_write_cut_off_by_the_shutdown_deadline_is_answered_503_not_a_plain_500(
    cluster: LocalCluster, store: BoardStore, tmp_path: Path
) -> None:
    """uvicorn cancels the requests still running when its graceful wait (SHARDLB_DRAIN_SECONDS,
    here 0) is over, and answers a cancelled request that has not begun its answer with a plain-text
    500. A write waiting for its tick then gets the API's 503 shutting_down with Retry-After (retry
    elsewhere), and the scores it handed in are still applied by the coalescer's drain."""
    server = await asyncio.to_thread(
        Server,
        cluster.url,
        tmp_path / "router.log",
        1,
        SHARDLB_COALESCE_DELAY_MS="1000",
        SHARDLB_DRAIN_SECONDS="0",
    )
    name = board_name()
    async with httpx.AsyncClient(base_url=server.url, headers=AS_WRITER, timeout=20) as client:
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        scores = [{"player_id": f"p{i}", "points": 5, "match_id": "m"} for i in range(10)]
        posted = asyncio.create_task(client.post(f"/v1/boards/{name}/scores", json={"scores": scores}))
        await asyncio.sleep(0.3)  # accepted, waiting for the coalescer's 1 s tick
        server.proc.send_signal(signal.SIGTERM)
        response = await posted
    assert await asyncio.to_thread(server.proc.wait, 30) == 0
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
    assert int(response.headers["retry-after"]) >= 1
    board = await store.get(name)
    assert await board.size() == 10  # accepted before the deadline: applied by the drain
    await store.delete(name)
