"""A local Redis Cluster for development, tests and benchmarks: start, form, check and stop it.

`LocalCluster.up()` starts one `redis-server` per node on loopback, forms the cluster itself
(MEET, ADDSLOTSRANGE, REPLICATE) and returns only once every node agrees it is healthy. The pids
go to a JSON state file in the cluster's directory, so `status()` and `down()` work from any
process, and `down()` stops exactly those processes.

A durable cluster (`durable=True`, `shardlb cluster up --durable`) keeps its data: every node
writes an append-only file (fsync every second) and keeps it, with its nodes.conf, across a stop.
`up()` then starts the stopped nodes from their files, and they rejoin the cluster they were in.

A running cluster grows and shrinks: `add_node()` starts one more master (and its replicas) on free
ports and joins it with CLUSTER MEET; `rebalance()` moves slots so every master holds an equal share
(shardlb/slots.py); `remove_node(port)` moves a master's slots to the others, has every other node
FORGET it and its replicas, and stops them. The state file records the nodes added and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shardlb import slots as slot_moves
from shardlb.keys import SLOTS
from shardlb.nodes import (
    BUS_PORT_OFFSET,
    RESERVED_PORT,
    STATE_FILE,
    ClusterError,
    children,
    find_redis_server,
    free_port_block,
    is_node_process,
    ports_free,
    read_state,
    write_state,
)

__all__ = [
    "STATE_FILE",
    "ClusterError",
    "ClusterStatus",
    "LocalCluster",
    "free_port_block",
    "master_slots",
]

_POLL_INTERVAL = 0.1
_STOP_TIMEOUT = 10.0

# A node's view of the slot map: (first slot, last slot, master port, replica ports) per range.
SlotMap = tuple[tuple[int, int, int, tuple[int, ...]], ...]


def master_slots(masters: int) -> list[tuple[int, int]]:
    """Slot range (first, last) of each master: the 16384 slots split evenly, in order."""
    return [(i * SLOTS // masters, (i + 1) * SLOTS // masters - 1) for i in range(masters)]


@dataclass
class NodeStatus:
    """One node as seen by itself; fields past `running` are None or empty when it is unreachable."""

    port: int
    pid: int | None
    running: bool
    role: str | None = None  # "master" or "replica"
    master_port: int | None = None  # a replica's master
    link: str | None = None  # a replica's master_link_status: "up" once in sync
    slots: list[tuple[int, int]] = field(default_factory=list)  # ranges it serves as master
    cluster_state: str | None = None  # "ok" or "fail"
    known: int | None = None  # cluster_known_nodes: the nodes it knows, itself included


@dataclass
class ClusterStatus:
    """Every node of a local cluster, and what (if anything) keeps the cluster from being ok."""

    nodes: list[NodeStatus]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """All nodes run, report cluster_state ok, agree on the slot map, and replicas are in sync."""
        return not self.problems

    def __str__(self) -> str:
        nodes, masters = len(self.nodes), sum(n.role == "master" for n in self.nodes)
        counted = f"{nodes} node{'' if nodes == 1 else 's'}, {masters} master{'' if masters == 1 else 's'}"
        head = f"cluster ok: {counted}" if self.ok else "cluster NOT ok"
        lines = [head, *(f"  ! {p}" for p in self.problems)]
        lines.append(f"  {'port':<6} {'pid':<8} {'process':<8} {'role':<8} {'state':<6} serves")
        for n in self.nodes:
            if n.role == "replica":
                serves = f"replica of {n.master_port} (link {n.link})"
            else:
                serves = ", ".join(f"slots {a}-{b}" for a, b in n.slots) or "-"
            lines.append(
                f"  {n.port:<6} {n.pid or '-'!s:<8} {'running' if n.running else 'stopped':<8} "
                f"{n.role or '-':<8} {n.cluster_state or '-':<6} {serves}"
            )
        return "\n".join(lines)


@dataclass
class LocalCluster:
    """A Redis Cluster of `masters` masters with `replicas` replicas each on consecutive ports.

    Masters take the first ports (master i on port + i) and own the slots of `master_slots`;
    replica j of master i is on port + masters + i * replicas + j. Each node lives in
    `dir/node-<port>/` (redis.conf, nodes.conf, redis.log, appendonlydir/ when durable);
    `dir/state.json` records the pids. With `password`, every node requires it (requirepass, and
    masterauth for its replication link) and `url` carries it.
    """

    masters: int = 3
    replicas: int = 1
    port: int = 7000
    dir: Path = Path(".shardlb/cluster")
    host: str = "127.0.0.1"
    durable: bool = False
    password: str | None = field(default=None, repr=False)
    # Nodes added to the layout (port -> the port of its master, None for a master), and nodes of
    # the layout removed from the cluster: both kept in the state file.
    added: dict[int, int | None] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dir = Path(self.dir)
        if self.masters < 1 or self.replicas < 0:
            raise ClusterError(f"need masters >= 1 and replicas >= 0, got {self.masters}, {self.replicas}")
        if self.port < 1 or self.ports[-1] + BUS_PORT_OFFSET > 65535:
            raise ClusterError(
                f"ports {self.port}-{self.ports[-1]} (+{BUS_PORT_OFFSET} for the bus) out of range"
            )
        if RESERVED_PORT in self.ports:
            raise ClusterError(
                f"ports {self.port}-{self.ports[-1]} include {RESERVED_PORT}; pick another --port"
            )

    @classmethod
    def from_state(cls, dir: Path) -> LocalCluster:
        """The cluster last started in dir, rebuilt from its state file."""
        state = read_state(Path(dir))
        if state is None:
            raise ClusterError(f"no cluster state in {dir} (start one with `shardlb cluster up --dir {dir}`)")
        local = cls(
            state["masters"],
            state["replicas"],
            state["port"],
            Path(dir),
            state["host"],
            state.get("durable", False),
            state.get("password"),
        )
        local._adopt(state)
        return local

    def _adopt(self, state: dict[str, Any]) -> None:
        """Take the nodes added and removed since the layout was formed from a state file."""
        self.added = {int(p): m for p, m in state.get("added", {}).items()}
        self.removed = set(state.get("removed", []))

    @property
    def ports(self) -> list[int]:
        """Every node's port: the layout's masters first, then its replicas, then the nodes added."""
        layout = range(self.port, self.port + self.masters * (1 + self.replicas))
        return [p for p in layout if p not in self.removed] + sorted(self.added)

    @property
    def url(self) -> str:
        """All nodes as one URL: redis://[:password@]host:port,host:port,..."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}" + ",".join(f"{self.host}:{p}" for p in self.ports)

    def up(self, timeout: float = 60.0) -> ClusterStatus:
        """Start and form the cluster, or return the status of the one already running healthy in dir.

        Nodes left over from an earlier start where some died are stopped and the cluster is
        formed afresh (its data is not kept), unless the cluster is durable: then the stopped
        nodes start again from their files. Raises ClusterError when redis-server is missing, a
        port is taken, the directory keeps a durable cluster of another layout, or the cluster is
        not healthy within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._lock():
            state = read_state(self.dir)
            if state is not None:
                alive = self._live_pids(state)
                same = self._layout() == {k: state.get(k, False) for k in self._layout()}
                if same:
                    self._adopt(state)
                if alive and not same:
                    raise ClusterError(
                        f"{self.dir} holds a running cluster with another layout; "
                        f"run `shardlb cluster down --dir {self.dir}` first"
                    )
                if alive and len(alive) == len(self.ports):
                    return self._wait_healthy(
                        deadline,
                        f"the cluster already running in {self.dir} to become healthy "
                        f"(`shardlb cluster down --dir {self.dir}` stops it)",
                    )
                if state.get("durable") and self._kept(state):
                    if not same:
                        raise ClusterError(
                            f"{self.dir} keeps the data of a durable cluster of another layout "
                            f"({state['masters']} masters, {state['replicas']} replicas from port "
                            f"{state['port']}, durable); start it with that layout, or remove the "
                            "directory to start afresh"
                        )
                    return self._resume(deadline, alive)
                self._stop(alive)
            return self._start(deadline)

    def status(self) -> ClusterStatus:
        """Ask every node how it sees the cluster (no process is started or stopped)."""
        state = read_state(self.dir)
        pids = self._recorded_pids(state) if state is not None else {}
        probes = [self._probe(port, pids.get(port)) for port in self.ports]
        nodes = [node for node, _, _ in probes]
        problems = [problem for _, problem, _ in probes if problem]
        views = {view for _, _, view in probes if view is not None}
        if len(views) > 1:
            problems.append("nodes disagree on the slot map")
        elif views:
            (view,) = views
            covered = sum(last - first + 1 for first, last, _, _ in view)
            members = {m for *_, master, replicas in view for m in (master, *replicas)}
            if covered != SLOTS:
                problems.append(f"{covered} of {SLOTS} slots assigned")
            # A master that serves no slot (just added, or drained) is not in CLUSTER SLOTS.
            empty = {n.port for n in nodes if n.role == "master" and not n.slots}
            empty |= {n.port for n in nodes if n.role == "replica" and n.master_port in empty}
            if missing := sorted(set(self.ports) - members - empty):
                problems.append(f"nodes missing from the slot map: {missing}")
        strangers = sorted(n.port for n in nodes if n.known is not None and n.known != len(self.ports))
        if strangers:
            problems.append(f"nodes that do not know exactly the {len(self.ports)} nodes: {strangers}")
        return ClusterStatus(nodes, problems)

    def down(self) -> int:
        """Stop the processes recorded in dir's state file that are still ours; remove no files.
        Returns how many were running."""
        with self._lock():
            state = read_state(self.dir)
            if state is None:
                return 0
            alive = self._live_pids(state)
            self._stop(alive)
            return len(alive)

    def add_node(self, replicas: int = 0, timeout: float = 60.0) -> int:
        """Start one more master (and ``replicas`` replicas of it) on free ports after the last
        node's, join it with CLUSTER MEET, and return its port once the cluster is healthy. It
        serves no slot until ``rebalance`` gives it some."""
        if replicas < 0:  # no node to start: the master's port was recorded, never started
            raise ClusterError(f"need replicas >= 0, got {replicas}")
        deadline = time.monotonic() + timeout
        server = find_redis_server()
        with self._lock():
            pids = self._running_pids()
            port = free_port_block(1 + replicas, start=max(self.ports) + 1)
            new = list(range(port, port + 1 + replicas))
            started: dict[int, int] = {}
            try:
                for p in new:
                    started[p] = pids[p] = self._spawn(server, p, keep=False)
                self.added.update({port: None, **dict.fromkeys(new[1:], port)})
                self._record(pids)
                for p, pid in started.items():
                    self._wait_for(f"node {p} to accept", deadline, p, pid, lambda c: bool(c.ping()))
                with self._client(self._member(exclude=new)) as member:
                    for p in new:
                        _command(member, "CLUSTER MEET", self.host, p)
                with self._client(port) as c:
                    master_id = str(_command(c, "CLUSTER MYID"))
                for p in new[1:]:
                    self._attach(p, started[p], port, master_id, deadline)
                self._load_scripts(new)
                self._wait_healthy(deadline, f"node {port} to join the cluster")
            except BaseException:
                try:
                    self._forget(new)
                finally:  # whatever the forgetting met, the nodes started here do not stay
                    self._stop(started)
                    for p in new:
                        self.added.pop(p, None)
                    self._record({p: pid for p, pid in pids.items() if p not in started})
                raise
        return port

    def _load_scripts(self, ports: list[int]) -> None:
        """Load the board's Lua scripts (shardlb/scripts/) on new nodes before they serve a slot, as
        ``Scripts.load`` does on every primary at start-up: a master starts with an empty script
        cache, and a write sent there would answer NOSCRIPT until one reload found it."""
        sources = [
            f.read_text() for f in resources.files("shardlb.scripts").iterdir() if f.name.endswith(".lua")
        ]
        for p in ports:
            with self._client(p) as c:
                for source in sources:
                    _command(c, "SCRIPT LOAD", source)

    def rebalance(
        self, keys_per_migrate: int = 100, pause_s: float = 0.0, timeout: float = 60.0
    ) -> slot_moves.MoveReport:
        """Move slots, keys and all, until every master serves an equal share (shardlb/slots.py);
        return once every node sees the new slot map (replicas learn it by gossip, after the masters)."""
        with self._lock(), self._client(self._member()) as c:
            masters = self._masters(c)
        moves = slot_moves.plan({m.port: m.slots for m in masters}, [m.port for m in masters])
        report = self._move(moves, keys_per_migrate, pause_s)
        self._wait_healthy(time.monotonic() + timeout, "every node to see the rebalanced slots")
        return report

    def remove_node(
        self, port: int, timeout: float = 60.0, keys_per_migrate: int = 100, pause_s: float = 0.0
    ) -> slot_moves.MoveReport:
        """Take the node on ``port`` out of the cluster: a master's slots go to the other masters
        first (in equal shares), then every other node FORGETs it and its replicas, and they are
        stopped. Returns what the slot moves did."""
        deadline = time.monotonic() + timeout
        if port not in self.ports:
            raise ClusterError(f"no node on port {port} in this cluster (its nodes: {self.ports})")
        with self._client(port) as c:
            known = slot_moves.nodes(c)
        me = known[port]
        going = [port, *sorted(p for p, n in known.items() if n["master_id"] == me["node_id"])]
        report = slot_moves.MoveReport()
        if "master" in me["flags"]:
            with self._client(port) as c:
                masters = self._masters(c)
            stay = [m.port for m in masters if m.port != port]
            if not stay:
                raise ClusterError(f"node {port} is the only master: nothing could take its slots")
            owners = {m.port: m.slots for m in masters}
            report = self._move(slot_moves.plan(owners, stay), keys_per_migrate, pause_s)
        with self._lock():
            pids = self._running_pids()
            self._forget(going)
            self._stop({p: pid for p, pid in pids.items() if p in going})
            for p in going:
                if self.added.pop(p, "layout") == "layout":
                    self.removed.add(p)
            self._record({p: pid for p, pid in pids.items() if p not in going})
            self._wait_healthy(deadline, f"the cluster without {going}")
        return report

    def _move(
        self, moves: list[slot_moves.Move], keys_per_migrate: int, pause_s: float
    ) -> slot_moves.MoveReport:
        def connect(port: int) -> redis.Redis:
            return redis.Redis(host=self.host, port=port, password=self.password, decode_responses=True)

        return slot_moves.move(connect, self.host, moves, self.password, keys_per_migrate, pause_s)

    def _masters(self, client: redis.Redis) -> list[slot_moves.Master]:
        """The masters as ``client``'s node sees them, less any node that is a replica by its own
        account (a node that has just been made a replica is still listed as a master a while)."""
        replicas = {n.port for n in self.status().nodes if n.role == "replica"}
        return [m for m in slot_moves.masters(client) if m.port not in replicas]

    def _forget(self, ports: list[int]) -> None:
        """CLUSTER FORGET each of ``ports`` on every other node that runs (within the minute that
        FORGET bans a node from gossip, or it would be introduced again)."""
        ids = {}
        for p in ports:
            with contextlib.suppress(redis.RedisError), self._client(p) as c:
                ids[p] = str(_command(c, "CLUSTER MYID"))
        for other in self.ports:
            if other in ports:
                continue
            with self._client(other) as c:
                for node_id in ids.values():
                    with contextlib.suppress(redis.ResponseError):  # it never met that node
                        _command(c, "CLUSTER FORGET", node_id)

    def _running_pids(self) -> dict[int, int]:
        state = read_state(self.dir)
        if state is None:
            raise ClusterError(f"no cluster state in {self.dir}")
        return self._live_pids(state)

    def _member(self, exclude: list[int] | None = None) -> int:
        """A running master of the cluster (not one of ``exclude``)."""
        for node in self.status().nodes:
            if node.running and node.role == "master" and node.port not in (exclude or []):
                return node.port
        raise ClusterError(f"no running master in {self.dir}")

    def _layout(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "masters": self.masters,
            "replicas": self.replicas,
            "durable": self.durable,
        }

    def _kept(self, state: dict[str, Any]) -> bool:
        """Whether every node of the recorded cluster left its nodes.conf to start again from."""
        return all((self.dir / f"node-{n['port']}" / "nodes.conf").exists() for n in state["nodes"])

    def _record(self, pids: dict[int, int]) -> None:
        state = {**self._layout(), "nodes": [{"port": p, "pid": pid} for p, pid in sorted(pids.items())]}
        if self.added or self.removed:
            state["added"] = {str(p): m for p, m in sorted(self.added.items())}
            state["removed"] = sorted(self.removed)
        if self.password:
            state["password"] = self.password  # for `status` from another process; the file is 0600
        write_state(self.dir, state)

    def _node_dir(self, port: int) -> Path:
        return self.dir / f"node-{port}"

    def _recorded_pids(self, state: dict[str, Any]) -> dict[int, int]:
        return {int(n["port"]): int(n["pid"]) for n in state["nodes"]}

    def _live_pids(self, state: dict[str, Any]) -> dict[int, int]:
        return {
            port: pid
            for port, pid in self._recorded_pids(state).items()
            if is_node_process(pid, self._node_dir(port))
        }

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Two `up`s on one dir at once would start two sets of nodes on the same ports.
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _client(self, port: int) -> Iterator[redis.Redis]:
        # No client retries: every caller polls on its own deadline.
        client = redis.Redis(
            host=self.host,
            port=port,
            password=self.password,
            socket_timeout=2.0,
            socket_connect_timeout=1.0,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            yield client
        finally:
            client.close()

    def _start(self, deadline: float) -> ClusterStatus:
        server = find_redis_server()
        self.added, self.removed = {}, set()  # a cluster formed afresh has the layout's nodes only
        for port in self.ports:
            if not ports_free(self.host, port):
                raise ClusterError(
                    f"port {port} or its bus port {port + BUS_PORT_OFFSET} on {self.host} is taken "
                    "by another process; pick another --port"
                )
        pids: dict[int, int] = {}
        try:
            for port in self.ports:
                pids[port] = self._spawn(server, port, keep=False)
            self._record(pids)
            for port, pid in pids.items():
                self._wait_for(
                    f"node {port} to accept connections", deadline, port, pid, lambda c: bool(c.ping())
                )
            self._form(deadline, pids)
            return self._wait_healthy(deadline, "the new cluster to become healthy")
        except BaseException:
            # Leave nothing half-formed behind: the next up() starts from a clean slate.
            self._stop(pids)
            raise

    def _resume(self, deadline: float, alive: dict[int, int]) -> ClusterStatus:
        """Start the stopped nodes of a durable cluster from their files; they rejoin by nodes.conf."""
        server = find_redis_server()
        # Its nodes.conf files name these ports: the cluster cannot move to others as it is.
        for port in self.ports:
            if port not in alive and not ports_free(self.host, port):
                raise ClusterError(
                    f"port {port} or its bus port {port + BUS_PORT_OFFSET} on {self.host} is taken by "
                    f"another process, and the durable cluster in {self.dir} keeps its data on ports "
                    f"{self.ports[0]}-{self.ports[-1]}: free the port, or remove {self.dir} to start "
                    "an empty cluster"
                )
        pids = dict(alive)
        started: dict[int, int] = {}
        try:
            for port in self.ports:
                if port not in pids:
                    pids[port] = started[port] = self._spawn(server, port, keep=True)
            self._record(pids)
            for port, pid in started.items():
                # A node answers LOADING until its append-only file is read: polled like a refusal.
                self._wait_for(f"node {port} to load its data", deadline, port, pid, lambda c: bool(c.ping()))
            return self._wait_healthy(deadline, f"the durable cluster in {self.dir} to become healthy")
        except BaseException:
            self._stop(started)  # their files stay: the next up() tries again
            raise

    def _spawn(self, server: str, port: int, keep: bool) -> int:
        node_dir = self._node_dir(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        if not keep:
            # Start empty: an old nodes.conf would rejoin a cluster that no longer exists, and a
            # replica must hold no data before it may replicate.
            for leftover in ("nodes.conf", "dump.rdb"):
                (node_dir / leftover).unlink(missing_ok=True)
            shutil.rmtree(node_dir / "appendonlydir", ignore_errors=True)
        auth = (
            f"requirepass {_quoted(self.password)}\nmasterauth {_quoted(self.password)}\n"
            if self.password
            else ""
        )
        # Durable: every write goes to the append-only file, fsynced once a second (a crash of the
        # machine loses at most that second; a crash of the process alone loses nothing).
        persistence = "appendonly yes\nappendfsync everysec\n" if self.durable else "appendonly no\n"
        conf = node_dir / "redis.conf"
        conf.touch(mode=0o600)  # it may hold the password
        conf.write_text(
            "# Written by shardlb.cluster on every start; edits are lost.\n"
            f"port {port}\n"
            f"bind {self.host}\n"
            "dir .\n"
            "daemonize no\n"
            'logfile ""\n'
            "cluster-enabled yes\n"
            "cluster-config-file nodes.conf\n"
            "cluster-node-timeout 5000\n"
            'save ""\n'
            f"{persistence}{auth}"
            # Replicas would otherwise wait 5 s for their first full sync,
            "repl-diskless-sync-delay 0\n"
            # and write it to a dump.rdb they do not need.
            "repl-diskless-load on-empty-db\n"
            # CLUSTER SLOTS lists a replica only once its offset moves, which on an idle master
            # takes a ping to the replicas: every 10 s by default.
            "repl-ping-replica-period 1\n"
        )
        with open(node_dir / "redis.log", "ab") as log:
            proc = subprocess.Popen(
                [server, "redis.conf"],
                cwd=node_dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives the CLI and does not get its Ctrl-C
            )
        children[proc.pid] = proc
        return proc.pid

    def _form(self, deadline: float, pids: dict[int, int]) -> None:
        ports = self.ports
        ids: dict[int, str] = {}
        for epoch, port in enumerate(ports, start=1):
            with self._client(port) as c:
                # Distinct epochs up front spare the nodes a round of epoch-collision resolution.
                _command(c, "CLUSTER SET-CONFIG-EPOCH", epoch)
                ids[port] = _command(c, "CLUSTER MYID")
        with self._client(ports[0]) as first:
            for port in ports[1:]:
                _command(first, "CLUSTER MEET", self.host, port)
        for port, (first_slot, last_slot) in zip(
            ports[: self.masters], master_slots(self.masters), strict=True
        ):
            with self._client(port) as c:
                _command(c, "CLUSTER ADDSLOTSRANGE", first_slot, last_slot)
        for i, master in enumerate(ports[: self.masters]):
            for j in range(self.replicas):
                replica = self.port + self.masters + i * self.replicas + j
                self._attach(replica, pids[replica], master, ids[master], deadline)

    def _attach(self, replica: int, pid: int, master: int, master_id: str, deadline: float) -> None:
        # REPLICATE fails with "Unknown node" until gossip has introduced the master to the replica.
        self._wait_for(
            f"node {replica} to replicate {master}",
            deadline,
            replica,
            pid,
            lambda c: bool(_command(c, "CLUSTER REPLICATE", master_id)),
        )

    def _wait_for(
        self, what: str, deadline: float, port: int, pid: int, check: Callable[[redis.Redis], bool]
    ) -> None:
        """Poll check against the node on port until it is true; fail fast if the node died."""
        last_error = ""
        while True:
            proc = children.get(pid)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(
                    f"redis-server on port {port} exited with code {proc.returncode}\n{self._log_tail(port)}"
                )
            try:
                with self._client(port) as c:
                    if check(c):
                        return
            except redis.RedisError as e:
                last_error = f" (last error: {e})"
            if time.monotonic() >= deadline:
                raise ClusterError(f"timed out waiting for {what}{last_error}\n{self._log_tail(port)}")
            time.sleep(_POLL_INTERVAL)

    def _wait_healthy(self, deadline: float, what: str) -> ClusterStatus:
        while True:
            status = self.status()
            if status.ok:
                return status
            if time.monotonic() >= deadline:
                bad = next(
                    (n.port for n in status.nodes if not n.running or n.cluster_state != "ok"), self.port
                )
                raise ClusterError(
                    f"timed out waiting for {what}: {'; '.join(status.problems)}\n{self._log_tail(bad)}"
                )
            time.sleep(_POLL_INTERVAL)

    def _probe(self, port: int, pid: int | None) -> tuple[NodeStatus, str | None, SlotMap | None]:
        """The node on port, what is wrong with it if anything, and the slot map it sees."""
        node = NodeStatus(port, pid, pid is not None and is_node_process(pid, self._node_dir(port)))
        if not node.running:
            return node, f"node {port}: not running", None
        try:
            with self._client(port) as c:
                info = _command(c, "CLUSTER INFO")
                replication = c.info("replication")
                slots = _command(c, "CLUSTER SLOTS")
        except redis.RedisError as e:
            return node, f"node {port}: unreachable ({e})", None
        node.cluster_state = info.get("cluster_state")
        node.known = int(info["cluster_known_nodes"])
        node.role = "replica" if replication["role"] == "slave" else "master"
        if node.role == "replica":
            node.master_port = int(replication["master_port"])
            node.link = replication["master_link_status"]
        # One entry per range: (first, last, master port, replica ports); replica order varies by node.
        view: SlotMap = tuple(
            sorted((r[0], r[1], int(r[2][1]), tuple(sorted(int(x[1]) for x in r[3:]))) for r in slots)
        )
        node.slots = [(first, last) for first, last, master, _ in view if master == port]
        if node.cluster_state != "ok":
            return node, f"node {port}: cluster_state {node.cluster_state}", view
        if node.role == "replica" and node.link != "up":
            return node, f"node {port}: replica link to {node.master_port} is {node.link}", view
        return node, None, view

    def _stop(self, pids: dict[int, int]) -> None:
        """SIGTERM the given nodes, SIGKILL those still there after a grace period, wait for all."""
        for sig, grace in ((signal.SIGTERM, _STOP_TIMEOUT), (signal.SIGKILL, _STOP_TIMEOUT)):
            pids = {p: pid for p, pid in pids.items() if is_node_process(pid, self._node_dir(p))}
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + grace
            while pids and time.monotonic() < end:
                pids = {p: pid for p, pid in pids.items() if is_node_process(pid, self._node_dir(p))}
                time.sleep(_POLL_INTERVAL / 2)
            if not pids:
                return
        raise ClusterError(f"could not stop redis-server pids {sorted(pids.values())}")

    def _log_tail(self, port: int, lines: int = 15) -> str:
        log = self._node_dir(port) / "redis.log"
        try:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"  (no log at {log})"
        return f"  last lines of {log}:\n" + "\n".join(f"  | {line}" for line in tail)


def _quoted(value: str) -> str:
    """A redis.conf argument in double quotes, whatever it holds."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _command(client: redis.Redis, *args: str | int) -> Any:
    # redis-py leaves execute_command untyped; this is the one place that has to say so.
    return client.execute_command(*args)  # type: ignore[no-untyped-call]
