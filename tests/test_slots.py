"""Slot move plans (shardlb/slots.py): pure, no server."""

from __future__ import annotations

from collections import Counter

import pytest

from shardlb.cluster import master_slots
from shardlb.keys import SLOTS
from shardlb.slots import Move, followed, owner_map, plan, shards_by_master


def layout(masters: int, first_port: int = 7000) -> dict[int, list[int]]:
    return {first_port + i: list(range(a, b + 1)) for i, (a, b) in enumerate(master_slots(masters))}


def after(owners: dict[int, list[int]], moves: list[Move]) -> dict[int, set[int]]:
    held = {p: set(s) for p, s in owners.items()}
    for m in moves:
        held[m.source].remove(m.slot)  # a move takes a slot from the master that holds it
        held.setdefault(m.target, set()).add(m.slot)
    return held


@pytest.mark.parametrize(("masters", "added"), [(3, 1), (1, 2), (4, 3)])
def test_a_rebalance_onto_new_masters_leaves_equal_shares_and_moves_only_what_it_must(
    masters: int, added: int
) -> None:
    owners: dict[int, list[int]] = {**layout(masters), **{8000 + i: [] for i in range(added)}}
    moves = plan(owners, owners)
    held = after(owners, moves)
    assert sum(len(s) for s in held.values()) == SLOTS
    assert max(len(s) for s in held.values()) - min(len(s) for s in held.values()) <= 1
    assert len(moves) == SLOTS - sum(min(len(owners[p]), len(held[p])) for p in owners)
    assert plan({p: sorted(s) for p, s in held.items()}, held) == []  # balanced: nothing to move


def test_draining_a_master_spreads_its_slots_over_the_others() -> None:
    owners = layout(4)
    moves = plan(owners, [7001, 7002, 7003])
    held = after(owners, moves)
    assert held[7000] == set()
    assert sorted(len(held[p]) for p in (7001, 7002, 7003)) == [5461, 5461, 5462]
    assert {m.source for m in moves} == {7000}


def test_a_plan_needs_a_master_to_hold_the_slots() -> None:
    with pytest.raises(ValueError, match="at least one master"):
        plan(layout(2), [])


def test_shards_are_counted_on_the_master_serving_their_slot() -> None:
    owner = owner_map({7000: [(0, 8191)], 7001: [(8192, SLOTS - 1)]})
    prefixes = {"a": ["x{265b}:", "x{3d43}:"], "b": ["x{265b}:"]}  # slots 0 and 16383
    assert shards_by_master(prefixes, owner) == {7000: Counter(a=1, b=1), 7001: Counter(a=1)}


def test_a_master_is_waited_for_while_the_cluster_lists_a_replica_of_it_even_one_marked_failed() -> None:
    def known(*nodes: tuple[str, str, str]) -> list[dict[str, str]]:  # CLUSTER NODES as redis-py parses it
        return [{"node_id": i, "flags": f, "master_id": m} for i, f, m in nodes]

    masters = [("a", "myself,master", "-"), ("b", "master", "-"), ("c", "master", "-"), ("d", "master", "-")]
    replicas = [
        ("ra", "slave", "a"),  # in sync
        ("rb", "slave,fail?", "b"),  # suspected by one node: may be back in a moment
        ("rc", "slave,fail", "c"),  # marked failed by the masters: may come back and be promoted
        ("rd1", "slave,fail", "d"),  # one of two gone: the other still confirms
        ("rd2", "slave", "d"),
    ]
    assert followed(known(*masters, *replicas)) == {"a", "b", "c", "d"}
    assert followed(known(*masters)) == set()
