"""scripts/dev-run.sh and dev-stop.sh (`make run`, `make stop`): which servers they start and stop.

The scripts run as they are, from a copy of scripts/ in a temporary checkout whose .venv/bin/python
is a stand-in: `shardlb cluster|postgres up|down` and `shardlb archive` only record that they were
called (and leave the state files the real ones leave), `router.server` is a small HTTP server that
answers /readyz and the `demo` board's PUT, and everything else (the scripts' own Python snippets)
runs in the real interpreter. No cluster or router is started; PostgreSQL only where a test needs a
real one: the private server that `make clean` must delete, and the suite's own as a server the user
names (`make run` checks that it answers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardlb.nodes import free_port_block
from shardlb.postgres import LocalPostgres
from tests.ports import server_port

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
# .venv/bin/python for tests/test_dev_scripts.py
if [ "$1" = -m ] && [ "$2" = shardlb ]; then
    echo "$3 $4" >>calls.log
    case "$3 $4" in
    "cluster up")
        if [ -n "$FAKE_CLUSTER_UP_ERROR" ]; then echo "shardlb: error: $FAKE_CLUSTER_UP_ERROR" >&2; exit 1; fi
        case " $* " in *" --port $FAKE_TAKEN_PORT "*)
            echo "shardlb: error: port $FAKE_TAKEN_PORT is taken by another process; pick another --port" >&2
            exit 1 ;;
        esac
        after=" $* " && after=${after#* --port } && echo "${after%% *}" >cluster-port
        mkdir -p .shardlb/cluster && echo '{}' >.shardlb/cluster/state.json
        echo "SHARDLB_REDIS_URL=redis://127.0.0.1:7000" ;;
    "postgres up")
        mkdir -p .shardlb/postgres && echo '{"port": 25432}' >.shardlb/postgres/postgres.json
        echo "SHARDLB_POSTGRES_URL=postgresql://shardlb@127.0.0.1:25432/postgres" ;;
    archive*)
        sleep 60 &
        trap 'kill $!; exit 0' TERM
        wait ;;
    esac
    exit 0
fi
if [ "$1" = -m ] && [ "$2" = router.server ]; then
    exec "$REAL_PYTHON" "$FAKE_ROUTER" "$@"
fi
exec "$REAL_PYTHON" "$@"
"""

FAKE_ROUTER = """import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        # dev.env as the first /readyz found it: what a shell sourcing it before then would read
        if self.path == "/readyz" and not os.path.exists("dev.env.at-readyz"):
            with open(".shardlb/dev.env") as env, open("dev.env.at-readyz", "w") as seen:
                seen.write(env.read())
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_PUT(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
HTTPServer((os.environ["SHARDLB_HOST"], int(os.environ["SHARDLB_PORT"])), Handler).serve_forever()
"""


def free_port() -> int:
    """A port of this process's own (tests/ports.py): each call hands out another one."""
    return server_port()


@pytest.fixture
def checkout(tmp_path: Path) -> Iterator[Path]:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    (tmp_path / "fake_router.py").write_text(FAKE_ROUTER)
    yield tmp_path
    subprocess.run(["bash", "scripts/dev-stop.sh"], cwd=tmp_path, env=environ(tmp_path), capture_output=True)


def environ(checkout: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLB_")}
    return {
        **env,
        "PYTHONPATH": str(ROOT),
        "REAL_PYTHON": sys.executable,
        "FAKE_ROUTER": str(checkout / "fake_router.py"),
        **extra,
    }


def run(checkout: Path, script: str, **extra: str) -> str:
    done = subprocess.run(
        ["bash", f"scripts/{script}"],
        cwd=checkout,
        env=environ(checkout, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def postgres_calls(checkout: Path) -> list[str]:
    """The stand-in's `shardlb postgres ...` calls, in order."""
    lines = (checkout / "calls.log").read_text().splitlines()
    return [line for line in lines if line.startswith("postgres")]


def remembered(checkout: Path, name: str) -> str:
    lines = (checkout / ".shardlb" / "dev.env").read_text().splitlines()
    return next(line.split("=", 1)[1] for line in lines if line.startswith(f"{name}="))


def test_make_run_after_make_stop_starts_the_private_postgresql_again(checkout: Path) -> None:
    port = str(free_port())
    run(checkout, "dev-run.sh", SHARDLB_PORT=port)
    run(checkout, "dev-stop.sh")
    assert postgres_calls(checkout) == ["postgres up", "postgres down"]
    # dev.env now remembers the private server's URL: that is not a server the user named. (Another
    # port than the first: free_port hands out each port once.)
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()))
    assert postgres_calls(checkout) == ["postgres up", "postgres down", "postgres up"]
    assert remembered(checkout, "SHARDLB_POSTGRES_URL") == "postgresql://shardlb@127.0.0.1:25432/postgres"


def test_dev_env_keeps_the_router_url_of_the_port_make_run_took(checkout: Path) -> None:
    """README's first session sources dev.env and sends its curls to $SHARDLB_API_URL: with
    http://127.0.0.1:8000 written in, a router put on another port (SHARDLB_PORT, 8000 being taken)
    was never reached, and the router holding 8000 (another checkout's) answered 401."""
    port = str(free_port())
    run(checkout, "dev-run.sh", SHARDLB_PORT=port)
    assert remembered(checkout, "SHARDLB_API_URL") == f"http://127.0.0.1:{port}"
    other = str(free_port())
    run(checkout, "dev-run.sh", SHARDLB_PORT=other)
    assert remembered(checkout, "SHARDLB_API_URL") == f"http://127.0.0.1:{other}"


def first_session_urls(env_file: Path | None = None, **given: str) -> list[str]:
    """The router URLs README's and router/README.md's first sessions reach, their own lines run as
    they stand, in a shell that sourced ``env_file`` (when given) with ``given`` in its environment."""
    lines = [] if env_file is None else [f"set -a; . {env_file}; set +a"]
    for doc, start in ((ROOT / "README.md", "API="), (ROOT / "router" / "README.md", "U=")):
        lines.append(next(line for line in doc.read_text().splitlines() if line.startswith(start + "$")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLB_")} | given
    script = "\n".join([*lines, 'echo "$API $U"'])
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_a_shell_that_sources_dev_env_while_the_router_starts_reaches_this_router(checkout: Path) -> None:
    """A shell that sources dev.env while `make run` waits for its router (`make run &` in another
    terminal) sends the first sessions' curls to this run's router, which refuses them until it is
    ready. For part of 2026-12-07 the URL was written only once /readyz answered: a first run's
    dev.env then had none, and the sessions took :8000, another checkout's router when this one was
    put on another port (401, this key is not valid: what the URL was written for); a later run's
    named the router it had just stopped. The stand-in router copies dev.env as its first /readyz
    finds it."""
    for port in (free_port(), free_port()):  # a first run, then one on another port
        (checkout / "dev.env.at-readyz").unlink(missing_ok=True)
        run(checkout, "dev-run.sh", SHARDLB_PORT=str(port))
        url = f"http://127.0.0.1:{port}"
        assert first_session_urls(checkout / "dev.env.at-readyz") == [f"{url}/v1", url]
        assert remembered(checkout, "SHARDLB_API_URL") == url


def test_a_first_make_run_takes_its_cluster_ports_from_the_block_given(checkout: Path) -> None:
    """SHARDLB_CLUSTER_PORT in the environment of a first `make run` (no dev.env yet) is where its
    port block starts, as SHARDLB_PORT is the router's: it was overwritten by the first free block
    from 7000, so the cluster's ports could not be chosen. A later run keeps dev.env's block (the
    cluster keeps its data on it) and says that the one given is not taken."""
    given = free_port_block(6, 40000)
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()), SHARDLB_CLUSTER_PORT=str(given))
    assert remembered(checkout, "SHARDLB_CLUSTER_PORT") == str(given)
    done = subprocess.run(
        ["bash", "scripts/dev-run.sh"],
        cwd=checkout,
        env=environ(checkout, SHARDLB_PORT=str(free_port()), SHARDLB_CLUSTER_PORT=str(given + 100)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert remembered(checkout, "SHARDLB_CLUSTER_PORT") == str(given)
    assert f"SHARDLB_CLUSTER_PORT={given + 100} is not used" in done.stderr


def test_a_cluster_port_given_after_the_cluster_was_deleted_is_the_one_taken(checkout: Path) -> None:
    """dev.env keeps a block of ports whose cluster was deleted (README: "delete .shardlb/cluster
    for an empty cluster"), and another process holds that block now. `make run` given
    SHARDLB_CLUSTER_PORT said the port given was not used because the cluster keeps its data on
    the kept block (it had none), then moved to a block past the kept one, which the message
    before had not named and the port given had no part in. With no cluster to keep, the ports
    given are chosen afresh, and nothing is said of a block no longer used."""
    kept, given = free_port_block(6, 41000), free_port_block(6, 42000)
    (checkout / ".shardlb").mkdir()
    kept_keys = "SHARDLB_ADMIN_KEYS=admin_x\nSHARDLB_WRITE_KEYS=write_x\n"
    (checkout / ".shardlb" / "dev.env").write_text(f"{kept_keys}SHARDLB_CLUSTER_PORT={kept}\n")
    taken = {"FAKE_TAKEN_PORT": str(kept)}  # another process holds dev.env's block
    done = subprocess.run(
        ["bash", "scripts/dev-run.sh"],
        cwd=checkout,
        env=environ(checkout, SHARDLB_PORT=str(free_port()), SHARDLB_CLUSTER_PORT=str(given), **taken),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (checkout / "cluster-port").read_text().strip() == str(given)
    assert remembered(checkout, "SHARDLB_CLUSTER_PORT") == str(given)
    assert "is not used" not in done.stderr and "taken" not in done.stderr, done.stderr


def test_a_cluster_port_that_is_no_port_stops_make_run(checkout: Path) -> None:
    done = subprocess.run(
        ["bash", "scripts/dev-run.sh"],
        cwd=checkout,
        env=environ(checkout, SHARDLB_PORT=str(free_port()), SHARDLB_CLUSTER_PORT="7000x"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "SHARDLB_CLUSTER_PORT=7000x is not a port" in done.stderr
    assert not (checkout / "calls.log").exists()


def test_a_cluster_port_written_with_a_leading_zero_is_that_port(checkout: Path) -> None:
    """SHARDLB_CLUSTER_PORT=07000 passes the check as a port (bash reads it as 7000) and is that
    port: until 2026-12-06 the free block was looked for by a Python snippet that refuses 07000 (a
    leading zero), its failure went unseen inside the command substitution, and dev.env kept an
    empty SHARDLB_CLUSTER_PORT, which every later run then took for the cluster's kept port."""
    given = free_port_block(6, 9000)
    assert given < 10_000  # five digits with the zero, as the check allows
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()), SHARDLB_CLUSTER_PORT=f"0{given}")
    assert remembered(checkout, "SHARDLB_CLUSTER_PORT") == str(given)


def test_make_stop_stops_the_router_whatever_the_terminal_width(checkout: Path) -> None:
    """dev-stop.sh knows its router by the command line ps prints; with COLUMNS set (an exported
    terminal width, or pytest-xdist's workers) ps cut the line before `router.server`, and make stop
    left the router running (every .ci/run left the stand-ins of these tests behind)."""
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()))
    pid = int((checkout / ".shardlb" / "router.pid").read_text())
    run(checkout, "dev-stop.sh", COLUMNS="40")
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the stand-in ends on SIGTERM; a zombie is gone once reaped
            os.kill(pid, 0)
            time.sleep(0.1)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def test_make_stop_counts_a_router_that_exited_as_stopped_before_it_is_reaped(checkout: Path) -> None:
    """`make run`'s router outlives its shell; once it exits on SIGTERM it is a zombie until its
    parent (init) reaps it, which the init of some containers does only every second or two. make
    stop waited for that (kill -0 answers for a zombie): 1.7 s a process there, and for a parent that
    never reaps, its 30 s and a SIGKILL. Here the router is this test's child, not reaped until the
    end: make stop must say it stopped, at once."""
    (checkout / ".shardlb").mkdir()
    router = subprocess.Popen(
        [sys.executable, str(checkout / "fake_router.py"), "-m", "router.server", "serve"],
        env={**os.environ, "SHARDLB_HOST": "127.0.0.1", "SHARDLB_PORT": str(free_port())},
    )
    try:
        (checkout / ".shardlb" / "router.pid").write_text(f"{router.pid}\n")
        done = subprocess.run(
            ["bash", "scripts/dev-stop.sh"],
            cwd=checkout,
            env=environ(checkout),
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and "router stopped" in done.stdout, done.stdout + done.stderr
        assert "did not stop" not in done.stderr, done.stderr
        assert router.poll() is not None  # it had exited; reaped only now
    finally:
        router.kill()
        router.wait()


def test_make_run_in_a_shell_that_sourced_dev_env_starts_the_private_postgresql_again(
    checkout: Path,
) -> None:
    """README's first session sources dev.env into the shell, which then exports the private server's
    URL: make stop stops that server, and the next make run in that shell must start it again, not
    take the URL for a server the user named (the archiver was left retrying a stopped server)."""
    port = str(free_port())
    run(checkout, "dev-run.sh", SHARDLB_PORT=port)
    run(checkout, "dev-stop.sh")
    sourced = remembered(checkout, "SHARDLB_POSTGRES_URL")
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()), SHARDLB_POSTGRES_URL=sourced)
    assert postgres_calls(checkout) == ["postgres up", "postgres down", "postgres up"]


def test_make_run_uses_the_postgresql_the_user_names(checkout: Path, postgres_url: str) -> None:
    port = str(free_port())
    theirs = postgres_url  # a server that answers: make run checks it does
    run(checkout, "dev-run.sh", SHARDLB_PORT=port, SHARDLB_POSTGRES_URL=theirs)
    assert not postgres_calls(checkout)
    assert remembered(checkout, "SHARDLB_POSTGRES_URL") == theirs
    # the next run without it: the private server, not the URL dev.env kept from the last run
    run(checkout, "dev-run.sh", SHARDLB_PORT=str(free_port()))
    assert postgres_calls(checkout) == ["postgres up"]


def test_make_run_stops_when_the_postgresql_the_user_names_does_not_answer(checkout: Path) -> None:
    """A mistyped SHARDLB_POSTGRES_URL, or a server that is down: make run said shardlb was running
    while its archiver retried that server for ever (the results waiting in the journals)."""
    theirs = f"postgresql://app@127.0.0.1:{free_port()}/lb"  # nothing listens there
    done = subprocess.run(
        ["bash", "scripts/dev-run.sh"],
        cwd=checkout,
        env=environ(checkout, SHARDLB_PORT=str(free_port()), SHARDLB_POSTGRES_URL=theirs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"SHARDLB_POSTGRES_URL ({theirs}) does not answer" in done.stderr
    assert not (checkout / ".shardlb" / "router.pid").exists()
    assert not (checkout / ".shardlb" / "archive.pid").exists()


def test_make_run_does_not_move_a_durable_cluster_whose_port_is_taken(checkout: Path) -> None:
    """`cluster up` of a stopped durable cluster whose port another process took cannot move it (its
    nodes.conf files name its ports): make run passes the message on instead of recording a new port
    block, where the next `cluster up` would only refuse the directory's data as another layout."""
    (checkout / ".shardlb").mkdir()
    (checkout / ".shardlb" / "dev.env").write_text("SHARDLB_CLUSTER_PORT=7000\n")
    taken = (
        "port 7001 or its bus port 17001 on 127.0.0.1 is taken by another process, and the durable "
        "cluster in .shardlb/cluster keeps its data on ports 7000-7005: free the port, or remove "
        ".shardlb/cluster to start an empty cluster"
    )
    done = subprocess.run(
        ["bash", "scripts/dev-run.sh"],
        cwd=checkout,
        env=environ(checkout, SHARDLB_PORT=str(free_port()), FAKE_CLUSTER_UP_ERROR=taken),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert taken in done.stderr
    assert (checkout / "calls.log").read_text().splitlines() == ["cluster up"]
    assert remembered(checkout, "SHARDLB_CLUSTER_PORT") == "7000"


def test_make_clean_deletes_the_private_postgresql_data(tmp_path: Path) -> None:
    """README: make clean deletes "the private PostgreSQL's data". As root that data lives outside
    .shardlb (shardlb/postgres.py), and make clean left it there: the next make run's server came
    back with the old archive under a new, empty cluster."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    server = LocalPostgres(tmp_path / ".shardlb" / "postgres", port=free_port(), fast=True)
    server.up()
    try:
        done = subprocess.run(
            ["make", "clean"],
            cwd=tmp_path,
            env=environ(tmp_path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / ".shardlb").exists()
        assert not server.data.exists()
    finally:
        server.destroy()


def bin_dir(tmp_path: Path, uid: int, apt_get: str) -> Path:
    """A PATH of its own: `id -u` says uid, apt-get runs the given script, no redis-server."""
    path = tmp_path / "bin"
    path.mkdir()
    for tool in ("bash", "cat", "cp", "sed"):
        found = shutil.which(tool)
        assert found, tool
        (path / tool).symlink_to(found)
    for name, body in (("id", f"echo {uid}"), ("apt-get", apt_get)):
        (path / name).write_text(f"#!{shutil.which('bash')}\n{body}\n")
        (path / name).chmod(0o755)
    return path


def ensure_redis(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(path / "bash"), str(ROOT / "scripts" / "ensure-redis.sh")],
        env={"PATH": str(path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_redis_server_and_not_root_make_names_the_package(tmp_path: Path) -> None:
    done = ensure_redis(bin_dir(tmp_path, 1000, "exit 100"))
    assert done.returncode == 1
    assert "sudo apt-get install redis-server redis-tools" in done.stderr


def test_without_redis_server_as_root_a_failed_apt_get_still_names_the_package(tmp_path: Path) -> None:
    # README: make installs it with apt-get as root, "and otherwise stops with the exact package to
    # install"; an apt-get that cannot (no network, no such package) must not end it without that.
    done = ensure_redis(bin_dir(tmp_path, 0, 'echo "E: apt-get failed: $*" >&2; exit 100'))
    assert done.returncode == 1
    assert "sudo apt-get install redis-server redis-tools" in done.stderr


def test_without_redis_server_as_root_apt_get_installs_it(tmp_path: Path) -> None:
    packaged = tmp_path / "package"
    packaged.mkdir()
    for name in ("redis-server", "redis-cli"):
        (packaged / name).write_text(f"#!{shutil.which('bash')}\necho 'Redis server v=7.2.4 sha=0'\n")
        (packaged / name).chmod(0o755)
    path = tmp_path / "bin"
    installs = f'[ "$3" != install ] || cp {packaged}/redis-server {packaged}/redis-cli {path}/'
    done = ensure_redis(bin_dir(tmp_path, 0, installs))
    assert done.returncode == 0, done.stderr
    assert (path / "redis-server").exists()


def test_the_first_sessions_reach_port_8000_with_a_dev_env_of_before_its_router_url() -> None:
    """README's and router/README.md's first sessions take the router's URL from dev.env's
    SHARDLB_API_URL (since 2026-12-06). A dev.env written before has no such line until the next
    `make run`: the URL was then "/v1" alone, and every curl of the session failed with curl's "no
    host part". Without it they reach make run's default port, as they did before."""
    assert first_session_urls() == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"]
    given = first_session_urls(SHARDLB_API_URL="http://127.0.0.1:8001")
    assert given == ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8001"]
