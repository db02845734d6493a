"""The processes a bench run starts besides the cluster: the HTTP router and headless Locust.

Ports: every server here listens below 32768 (Linux's ephemeral range starts there), and the
cluster's bus ports (node port + 10000) too, so node ports stay below 22768.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.commandstats import CommandMeter
from bench.procs import CpuMeter
from shardlb.cluster import LocalCluster
from shardlb.postgres import LocalPostgres

ROOT = Path(__file__).resolve().parent.parent
ROUTER_MODULE = ROOT / "router" / "server.py"
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
MAX_NODE_PORT = 22767


def up_together(*servers: LocalCluster | LocalPostgres | None) -> None:
    """Start the servers given (each one's ``up``; None: taken from the environment) at once, on
    threads: each mostly waits (a cluster's nodes agreeing, initdb's writes). A failure to start
    raises here, once every start is done (bench.rebuild, bench.settle)."""
    with ThreadPoolExecutor(max(len(servers), 1)) as pool:
        started = [pool.submit(server.up) for server in servers if server]
    for future in started:
        future.result()


def free_port(start: int, stop: int = 32767) -> int:
    """The first port from ``start`` that nobody listens on (it may still be taken before we bind)."""
    for port in range(start, stop + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{stop}")


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group ``proc`` leads (a router drains, an archiver ends its round), then
    SIGKILL it if it is still there after 15 s. Nothing to do when it already ended."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def router_missing() -> str | None:
    """None when the router can be started, else why it cannot (the summary prints it)."""
    if not ROUTER_MODULE.exists():
        return f"{ROUTER_MODULE.relative_to(ROOT)} does not exist yet: HTTP phases skipped"
    return None


BENCH_ROUTER_ENV = {"SHARDLB_MAX_CLIENT_CONNECTIONS": "100000"}


@dataclass
class Router:
    """``python -m router.server`` with ``workers`` processes, on its own process group."""

    redis_url: str
    port: int
    workers: int
    log: Path
    env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    # Another checkout's router (bench/versus_reads.py): run by that tree's .venv python, with its
    # code first on PYTHONPATH. None: this checkout's, by this interpreter.
    tree: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 40.0) -> Router:
        # A bench's load comes from one address (Locust's users, the pacer's, wrk's connections:
        # a thousand at the ramp's top): the per-address connection cap would refuse most of it.
        env = {**os.environ, "SHARDLB_REDIS_URL": self.redis_url, **BENCH_ROUTER_ENV, **self.env}
        if self.tree is not None:
            env["PYTHONPATH"] = str(self.tree)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable if self.tree is None else str(self.tree / ".venv" / "bin" / "python"),
                    "-m",
                    "router.server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--workers",
                    str(self.workers),
                ],
                cwd=self.tree or ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}; see {self.log}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as r,
            ):
                if r.status == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"router not ready on {self.url}/readyz within {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM the router's process group (it drains), SIGKILL it after 15 s."""
        stop_group(self.proc)

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _processes(count: int) -> list[str]:
    if count <= 1:
        return []
    # The forked workers find the master on --master-port; both default to 5557, maybe taken.
    port = str(free_port(22600))
    return ["--processes", str(count), "--master-bind-port", port, "--master-port", port]


@dataclass
class LocustRun:
    """What one headless Locust run left behind."""

    prefix: Path
    returncode: int
    seconds: float
    cpu: dict[str, object]
    warnings: list[str]

    @property
    def stats(self) -> Path:
        return Path(f"{self.prefix}_stats.csv")

    @property
    def history(self) -> Path:
        return Path(f"{self.prefix}_stats_history.csv")


def run_locust(
    prefix: Path,
    host: str,
    users: Sequence[str],
    env: Mapping[str, str],
    processes: int,
    args: Sequence[str],
    meter_groups: Mapping[str, list[int]],
    timeout: float,
    store_url: str | None = None,
) -> LocustRun:
    """Run Locust headless with CSV (full history) and HTML output under ``prefix``.

    ``meter_groups`` are the other processes whose CPU to count over the run; Locust's own tree is
    added as ``locust``. With ``store_url``, the commands the cluster ran over the run too
    (``cpu["commands"]``, bench/commandstats.py). Locust exits 1 when any request failed: that is a
    result, not an error here.
    """
    log = Path(f"{prefix}.log")
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _locust_command(prefix, host, users, processes, args),
            cwd=ROOT,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        commands = CommandMeter(store_url).start() if store_url else None
        meter = CpuMeter({**meter_groups, "locust": [proc.pid]}).start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(10)
        cpu = meter.stop()
        if commands is not None:
            cpu["commands"] = commands.stop()
    text = log.read_text(errors="replace")
    warnings = sorted({line.strip()[:240] for line in text.splitlines() if "CPU usage" in line})
    return LocustRun(prefix, code, time.monotonic() - started, cpu, warnings)


def _locust_command(
    prefix: Path, host: str, users: Sequence[str], processes: int, args: Sequence[str]
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        host,
        "--csv",
        str(prefix),
        "--csv-full-history",
        "--html",
        f"{prefix}.html",
        "--only-summary",
        "--loglevel",
        "WARNING",
        "--stop-timeout",
        "3",
        "--exit-code-on-error",
        "0",
        *_processes(processes),
        *args,
        *users,
    ]
