"""A private PostgreSQL server for the archive, started the way the local Redis nodes are.

``make run``, the tests and the bench use ``SHARDLB_POSTGRES_URL`` when it is set, and otherwise a
server of their own: ``initdb`` once into a data directory, ``pg_ctl start`` on a free loopback port,
trust authentication on loopback only, ``pg_ctl stop`` at the end. PostgreSQL refuses to run as
root, so as root the server runs as the ``postgres`` user of the machine's PostgreSQL package, with
its data directory in a folder that user owns (the state file in our directory points at it): in its
home (``/var/lib/postgresql/shardlb-postgres-<name>``), or in ``/tmp`` for a ``fast`` server, which
keeps nothing across a crash anyway. Many machines empty ``/tmp`` at boot: until 2026-12-05 the
archive of ``make run`` was kept there too, and lost with it. Once a server has run, ``up`` never
makes an empty one in place of data that has gone: it says so, and the state file's removal is the
way to start afresh. Without a state file, data found under the directory's name is an earlier
directory's of the same path (a checkout deleted and cloned again): ``up`` deletes it and starts
an empty server.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from shardlb.nodes import ClusterError, free_port_block

INSTALL_HINT = (
    "PostgreSQL's server programs (initdb, pg_ctl) are not installed: install them "
    "(Debian/Ubuntu: apt-get install postgresql) or set SHARDLB_POSTGRES_URL to a server"
)
STATE = "postgres.json"
USER = "shardlb"
DATABASE = "postgres"


def binary(name: str) -> str:
    """``initdb`` or ``pg_ctl``: on PATH, or in the newest /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version)
    if not versions:
        raise ClusterError(INSTALL_HINT)
    return versions[-1]


def _version(path: str) -> float:
    try:
        return float(Path(path).parent.parent.name)
    except ValueError:
        return 0.0


class LocalPostgres:
    """One private server whose state lives in ``dir`` (see the module docstring)."""

    def __init__(self, dir: Path | str, port: int = 0, fast: bool = False) -> None:
        self.dir = Path(dir).resolve()
        self.port = port
        # Tests trade crash safety for speed; `make run` keeps fsync on: the archive is the truth.
        self.fast = fast
        self.owner = _server_user()
        if self.owner is None:
            self.data = self.dir / "postgres"
        else:
            digest = hashlib.sha1(str(self.dir).encode()).hexdigest()[:12]
            home = Path(self.owner.pw_dir)
            kept = not fast and home.is_dir() and home.stat().st_uid == self.owner.pw_uid
            self.data = (home if kept else Path("/tmp")) / f"shardlb-postgres-{digest}"
        recorded = self.dir / STATE
        if recorded.exists():  # where it was made, whatever the rule above says now
            self.data = Path(json.loads(recorded.read_text()).get("data", self.data))

    @property
    def url(self) -> str:
        return local_url(self.port)

    def up(self) -> str:
        """Start the server (initialising it the first time) and return its URL; idempotent."""
        self.dir.mkdir(parents=True, exist_ok=True)
        state = self.dir / STATE
        if state.exists() and not self.port:
            self.port = int(json.loads(state.read_text())["port"])
        if not state.exists() and (self.data / "PG_VERSION").exists():
            # No server of this directory was recorded: data under its name is an earlier one's (a
            # checkout deleted and cloned again at the same path, as root where the data lives
            # outside it). Kept, it would pass for this one's archive: bans, audit rows, results.
            self._forget_leftover()
        if self._running():
            return self.url
        if not (self.data / "PG_VERSION").exists():
            if state.exists():
                # A server ran here and its data went (as root: /tmp emptied at boot). A new empty
                # one would pass for the archive: `shardlb rebuild` from it empties the boards.
                raise ClusterError(
                    f"the data of the PostgreSQL recorded in {state} is gone from {self.data}, and "
                    f"the archive with it; remove {state} to start an empty server"
                )
            self._init()
        if not self.port or not _free(self.port):
            self.port = free_port_block(1, start=self.port or 25432)
        options = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1"
        if self.fast:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(binary("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.data / "server.log"),
                  "-w", "-t", "60", "start")  # fmt: skip
        state.write_text(json.dumps({"port": self.port, "data": str(self.data)}))
        return self.url

    def down(self) -> bool:
        """Stop the server if it runs (returns whether it did); the data stays for the next ``up``."""
        if not self._running():
            return False
        self._run(binary("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        return True

    def destroy(self) -> None:
        """Stop the server and remove its data."""
        self.down()
        shutil.rmtree(self.data, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.dir / STATE).unlink()

    def _forget_leftover(self) -> None:
        """Stop a server still running on data no state file records, and delete that data."""
        if self._running():
            self._run(binary("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.data, ignore_errors=True)

    def _init(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        if self.owner is not None:
            os.chown(self.data, self.owner.pw_uid, self.owner.pw_gid)
        self.data.chmod(0o700)
        self._run(binary("initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")  # fmt: skip

    def _running(self) -> bool:
        if not (self.data / "postmaster.pid").exists():
            return False
        done = subprocess.run(
            [binary("pg_ctl"), "-D", str(self.data), "status"], capture_output=True, **self._as_owner()
        )
        return done.returncode == 0

    def _run(self, *argv: str) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True, **self._as_owner())
        if done.returncode != 0:
            log = self.data / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise ClusterError(f"{Path(argv[0]).name} failed: {done.stderr.strip()}\n{tail}")

    def _as_owner(self) -> dict[str, Any]:
        if self.owner is None:
            return {}
        return {"user": self.owner.pw_uid, "group": self.owner.pw_gid, "cwd": "/tmp"}


def local_url(port: int) -> str:
    """The URL of the private server on ``port``."""
    return f"postgresql://{USER}@127.0.0.1:{port}/{DATABASE}"


def _server_user() -> pwd.struct_passwd | None:
    """Whom the server runs as: this user, or ``postgres`` when this is root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError as e:
        raise ClusterError(
            "PostgreSQL does not run as root and there is no 'postgres' user: install PostgreSQL's "
            "package (apt-get install postgresql) or set SHARDLB_POSTGRES_URL"
        ) from e


def _free(port: int) -> bool:
    return free_port_block(1, start=port) == port


def wait_until_ready(url: str, timeout_s: float = 30.0) -> None:
    """Block until the server at ``url`` accepts a connection."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with psycopg.connect(url, connect_timeout=2):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
