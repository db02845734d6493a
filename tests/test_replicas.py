"""Which primaries a replica-confirmed write waits on (shardlb/replicas.py), from a parsed
CLUSTER NODES: pure functions, no server."""

from __future__ import annotations

from typing import Any

from shardlb.keys import SLOTS
from shardlb.replicas import BARE, FOLLOWED, UNKNOWN, followed, marks


def known(*nodes: tuple[str, str, str, list[list[str]]]) -> dict[str, dict[str, Any]]:
    """CLUSTER NODES as redis-py parses it: by address, each node's id, flags, master and slots."""
    return {
        f"127.0.0.1:{7000 + i}": {"node_id": n, "flags": f, "master_id": m, "slots": s}
        for i, (n, f, m, s) in enumerate(nodes)
    }


def test_a_master_is_waited_for_while_it_has_a_replica_the_cluster_has_not_marked_failed() -> None:
    masters = [
        ("a", "myself,master", "-", [["0", "99"]]),
        ("b", "master", "-", [["100", "199"]]),
        ("c", "master", "-", [["200", "299"]]),
        ("d", "master", "-", [["300", "399"], ["500"]]),
        ("e", "master", "-", []),  # serves no slot: never said to be without a replica
    ]
    replicas = [
        ("ra", "slave", "a", []),  # in sync
        ("rb", "slave,fail?", "b", []),  # suspected by one node: may be back in a moment
        ("rc", "slave,fail", "c", []),  # marked failed by the masters: gone
        ("rd1", "slave,fail", "d", []),  # one of two gone: the other still confirms
        ("rd2", "slave", "d", []),
    ]
    nodes = known(*masters, *replicas)
    assert followed(nodes.values()) == {"a", "b", "d"}
    slots, bare = marks(nodes)
    assert bare == {"127.0.0.1:7002"}  # c
    got = [slots[s] for s in (0, 99, 150, 200, 299, 300, 500)]
    assert got == [FOLLOWED, FOLLOWED, FOLLOWED, BARE, BARE, FOLLOWED, FOLLOWED]
    assert slots[400] == slots[SLOTS - 1] == UNKNOWN  # no master claims them: writes there wait

    alone = known(("a", "myself,master", "-", [["0", str(SLOTS - 1)]]))  # a master without replicas
    slots, bare = marks(alone)
    assert bare == {"127.0.0.1:7000"} and set(slots) == {BARE}
