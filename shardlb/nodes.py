"""The processes and files behind local cluster nodes: free ports, the redis-server binary, telling a
node's process from a reused pid, and the cluster's state file. ``cluster.LocalCluster`` drives them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
# Redis Cluster's node-to-node bus listens on port + 10000; it must be free as well.
BUS_PORT_OFFSET = 10000
# Somebody else's plain Redis usually lives on the default port: never start a node there.
RESERVED_PORT = 6379

# The nodes this process started. Holding the Popen objects lets us reap them (no zombies that
# still look alive) and keeps subprocess from warning that a child outlived its handle.
children: dict[int, subprocess.Popen[bytes]] = {}


class ClusterError(Exception):
    """The local cluster could not be started, formed, checked or stopped."""


def free_port_block(count: int, start: int = 20000) -> int:
    """Return the lowest base port >= start with `count` consecutive free ports on 127.0.0.1.

    Each port's cluster bus port (port + 10000) must be free too. A block never contains 6379.
    Free means a bind succeeds now; another process can still take a port before a node binds it.
    """
    base = start
    while base + count - 1 + BUS_PORT_OFFSET <= 65535:
        block = range(base, base + count)
        if RESERVED_PORT in block:
            base = RESERVED_PORT + 1
            continue
        taken = next((p for p in block if not ports_free("127.0.0.1", p)), None)
        if taken is None:
            return base
        base = taken + 1
    raise ClusterError(f"no block of {count} free ports from {start} on 127.0.0.1")


def ports_free(host: str, port: int) -> bool:
    """Whether a node could listen on port and its bus port (bound the way redis-server binds)."""
    for p in (port, port + BUS_PORT_OFFSET):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # redis-server sets SO_REUSEADDR, so TIME_WAIT leftovers do not stop it: ignore them too.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, p))
            except OSError:
                return False
    return True


def find_redis_server() -> str:
    server = shutil.which("redis-server")
    if server is None:
        raise ClusterError("redis-server not found on PATH; install Redis 7 or newer (`make redis-server`)")
    version = subprocess.run([server, "--version"], capture_output=True, text=True, check=False).stdout
    major = version.partition("v=")[2].partition(".")[0]
    if not major.isdigit() or int(major) < 7:
        raise ClusterError(
            f"need redis-server 7.0 or newer for CLUSTER ADDSLOTSRANGE, found: {version.strip()}"
        )
    return server


def is_node_process(pid: int, node_dir: Path) -> bool:
    """Whether pid is a live redis-server running in node_dir: a bare pid may have been reused."""
    child = children.get(pid)
    if child is not None:
        # Our own child cannot have a reused pid before we reap it, and poll() is the only check
        # that is right while it exits (procfs drops its cwd before the pid is gone).
        if child.poll() is None:
            return True
        del children[pid]
        return False
    proc = Path("/proc", str(pid))
    if not Path("/proc/self").exists():  # no procfs (macOS): the pid alone has to do
        try:
            os.kill(pid, 0)
        except OSError:  # gone, or another user's process: not a node we started either way
            return False
        return True
    try:
        stat = (proc / "stat").read_text()
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        # A zombie keeps its pid until reaped, but it is no longer serving anything.
        return (
            name == "redis-server"
            and state not in "ZX"
            and Path(os.readlink(proc / "cwd")) == node_dir.resolve()
        )
    except (OSError, ValueError, IndexError):
        return False


def read_state(dir: Path) -> dict[str, Any] | None:
    path = dir / STATE_FILE
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read {path}: {e}") from e
    return state


def write_state(dir: Path, state: dict[str, Any]) -> None:
    tmp = dir / (STATE_FILE + ".tmp")
    # Owner only: it holds the cluster's password when there is one.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(json.dumps(state, indent=2) + "\n")
    tmp.replace(dir / STATE_FILE)  # atomic: a reader never sees half a file
