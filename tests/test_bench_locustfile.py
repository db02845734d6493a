"""bench/locustfile.py under real Locust: users started together send their first requests spread
over their period (SHARDLB_USER_PHASE, default ``spread``), not as one herd, against a small HTTP
server of the test's own that notes when each request arrives."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
USERS = 24
RPS = 0.5  # a period of 2 s: a spread start puts each user's first request anywhere in it


class Arrivals(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    times: ClassVar[list[float]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.lock:
            self.times.append(time.monotonic())
        body = b'{"results": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _first_requests(phase: str, tmp_path: Path) -> list[float]:
    """Arrival times of the first USERS requests of USERS GameServer users spawned at once."""
    Arrivals.times = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Arrivals)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "SHARDLB_USER_PHASE": phase,
        "SHARDLB_USER_RPS": str(RPS),
        "SHARDLB_PLAYERS": "1000",
        "SHARDLB_BOARD": "phase-t",
        "SHARDLB_ADMIN_KEY": "",
        "SHARDLB_SHAPE": "",
    }
    locust = Path(sys.executable).parent / "locust"
    try:
        done = subprocess.run(
            [
                *(str(locust), "-f", str(ROOT / "bench" / "locustfile.py"), "--headless"),
                *("-u", str(USERS), "-r", str(USERS), "-t", "5s", "--only-summary"),
                *("--host", f"http://127.0.0.1:{server.server_port}", "GameServer"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert len(Arrivals.times) >= USERS, done.stderr[-2000:]
    return sorted(Arrivals.times)[:USERS]


def _close_pairs(times: list[float], within: float = 0.005) -> int:
    """Consecutive first requests less than ``within`` seconds apart."""
    return sum(1 for a, b in itertools.pairwise(times) if b - a < within)


@pytest.mark.skipif(not (Path(sys.executable).parent / "locust").exists(), reason="locust is not installed")
def test_users_started_together_spread_their_first_requests_over_their_period(tmp_path: Path) -> None:
    together = _first_requests("together", tmp_path)
    spread = _first_requests("spread", tmp_path)
    # Locust starts the users in a clump or a few (all of them, or as many as it dispatches at
    # once): their first requests come within a millisecond of each other. Each waiting a uniform
    # share of its 2 s period first, 24 first requests are ~83 ms apart on average, and a gap under
    # 5 ms has a chance of about 6%: 12 of the 23 gaps that short, about 1e-9.
    assert _close_pairs(together) >= 12
    assert _close_pairs(spread) < 12
