"""`shardlb cluster` commands that fail part way leave no node running that the cluster lacks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from shardlb.cli import main
from shardlb.cluster import LocalCluster
from tests.test_cluster import _free_ports, _wait_until

pytestmark = pytest.mark.cluster


def test_add_node_to_a_cluster_with_a_dead_master_stops_the_node_it_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Undoing a failed add-node sent CLUSTER FORGET to every recorded node, the dead one too: its
    ConnectionError broke off the undo before the new redis-server was stopped, which was left
    running outside the cluster."""
    local = LocalCluster(masters=1, replicas=0, port=_free_ports(3), dir=tmp_path / "c")
    try:
        [master] = local.up().nodes
        assert master.pid is not None
        os.kill(master.pid, signal.SIGKILL)
        _wait_until(lambda: not local.status().nodes[0].running)
        assert main(["cluster", "add-node", "--dir", str(local.dir)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("shardlb: error:") and len(err.strip().splitlines()) == 1, err
        running = [n.port for n in LocalCluster.from_state(local.dir).status().nodes if n.running]
        assert running == [], running
    finally:
        LocalCluster.from_state(local.dir).down()
