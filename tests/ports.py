"""Where test processes take the ports of the servers they start (this module holds no tests).

Every port a test needs for a server of its own comes from here, never from a start of its own:
``node_ports`` for Redis nodes, ``server_port`` for everything else (routers, PostgreSQL, stub HTTP
servers, an address where nothing listens). Two rules keep test processes running side by side
(the xdist workers of ``make test``, three of them, and sessions of other checkouts) off each
other's ports:

- Two disjoint ranges, both below Linux's ephemeral range (32768 and up, where the kernel picks the
  local ports of outgoing connections): Redis nodes take ``NODES`` (20000-22767), so their bus ports
  (+10000) are 30000-32767; every other server takes ``SERVERS`` (23000-29999). A router can then
  never take a node's port or its bus port, which a module that kills a node and starts it again on
  its port relies on (a CI run of 2026-12-05 found a router's search on a killed replica's port).
- Each range is cut into ``SLOTS`` slices, and a process takes ports from its own slice only: the
  workers of one run have slices of their own (the run's start plus the worker's number), other
  sessions one by their pid. Within the slice, ports are handed out in turn (``_Slice``): a port
  given once is not given again until the slice wraps, so a node killed and started again keeps its
  port against this process's own later servers too, and ``LocalCluster.add_node`` finds free ports
  right after a cluster's last node (``SPARE``).

A port is checked free when it is handed out, not held: that is enough against processes that
take ports from other slices. Two sessions' processes can share a slice (by their pids), so a
server of this process takes a bound socket instead (``server_socket``), and a helper that starts
a server process on a port of its own choosing starts it again on another when the port was taken
(tests/test_router_server.py's ``Server``).
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Callable

from shardlb.nodes import ports_free

NODES = range(20000, 22768)  # Redis nodes: bus ports (+10000) end at 32767
SERVERS = range(23000, 30000)  # everything else: below the nodes' bus ports
SLOTS = 8  # slices per range: more than the workers of a run, so two sessions rarely share one
SPARE = 4  # ports left free after a block of nodes, for the nodes a test adds after them


def slot() -> int:
    """This process's slice: by the xdist worker's number from one start per run (the workers of
    a run, up to ``SLOTS``, never share one), else by the pid."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return os.getpid() % SLOTS
    run = zlib.crc32(os.environ.get("PYTEST_XDIST_TESTRUNUID", "").encode())
    return (run + int(worker.removeprefix("gw"))) % SLOTS


class _Slice:
    """One process's slice of a range, handed out in turn from where the last search ended."""

    def __init__(self, ports: range, spare: int) -> None:
        size = len(ports) // SLOTS
        self.start = ports.start + slot() * size
        self.stop = self.start + size
        self.spare = spare
        self.next = self.start

    def take(self, count: int, free: Callable[[int], bool]) -> int:
        """The first of ``count`` consecutive ports, all ``free``, from where the last search ended
        (once round the slice at most)."""
        base, tried = self.next, 0
        while tried < self.stop - self.start:
            if base + count > self.stop:  # wrap: a block never straddles the slice's end
                tried += self.stop - base
                base = self.start
                continue
            taken = next((p for p in range(base, base + count) if not free(p)), None)
            if taken is None:
                self.next = base + count + self.spare
                if self.next >= self.stop:
                    self.next = self.start
                return base
            tried += taken + 1 - base
            base = taken + 1
        raise RuntimeError(f"no {count} free ports in {self.start}-{self.stop - 1}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR (uvicorn, redis-server, PostgreSQL): TIME_WAIT leftovers do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_nodes = _Slice(NODES, SPARE)
_servers = _Slice(SERVERS, 0)


def node_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports for Redis nodes, their bus ports free too (on
    ``host``; "0.0.0.0": on every address)."""
    return _nodes.take(count, lambda port: ports_free(host, port))


def server_port() -> int:
    """A free port for any other server (or for an address where nothing may listen)."""
    return _servers.take(1, _bindable)


def server_socket() -> socket.socket:
    """A socket bound to a port of this process's slice, and held: for a server of this process
    (uvicorn's ``Server.serve(sockets=...)``), which listens on it. A port from ``server_port`` is
    free when checked and bound later, and a process of another slice's session that shares this
    one's (by its pid) could take it in between; this one's check is its bind."""
    held: list[socket.socket] = []

    def bind(port: int) -> bool:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
        try:
            sock.bind(("127.0.0.1", port))
            # Listening at once: Linux lets another socket with SO_REUSEADDR (every server's) bind a
            # port that nothing listens on, and the later of the two listens fails.
            sock.listen()
        except OSError:
            sock.close()
            return False
        held.append(sock)
        return True

    _servers.take(1, bind)
    return held[0]
