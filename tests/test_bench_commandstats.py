"""The store's own account of a phase (bench/commandstats.py), read off the suite's real cluster."""

from __future__ import annotations

import time
from typing import Any

import redis.cluster

from bench import commandstats, read_goals
from shardlb.cluster import LocalCluster


def test_nodes_of_a_cluster_url() -> None:
    assert commandstats.nodes("redis://127.0.0.1:7000,127.0.0.1:7001") == [
        ("127.0.0.1", 7000, None),
        ("127.0.0.1", 7001, None),
    ]
    assert commandstats.nodes("redis://:p%40ss@10.0.0.1:7000") == [("10.0.0.1", 7000, "p@ss")]


def test_a_phase_counts_the_commands_it_ran_and_only_those(cluster: LocalCluster) -> None:
    client = redis.cluster.RedisCluster(host=cluster.host, port=cluster.ports[0])
    try:
        key = "{commandstats-test}z"
        client.delete(key)
        # TOUCH, which nothing else sends, just before the start and just after the stop: the
        # suite's cluster is shared, and a DEL counted here was another client's (a CI run, 2026-12-06)
        client.touch(key)
        meter = commandstats.CommandMeter(cluster.url).start()
        for i in range(50):
            client.zadd(key, {f"m{i}": i})
        for _ in range(7):
            assert client.zcard(key) == 50
        script = client.register_script("return redis.call('ZSCORE', KEYS[1], ARGV[1])")
        for i in range(5):
            assert float(script(keys=[key], args=[f"m{i}"])) == i
        deadline = time.monotonic() + 10
        ran = meter.stop()
        while ran["zadd"]["calls"] < 100 and time.monotonic() < deadline:  # the replica catching up
            time.sleep(0.05)
            ran = meter.stop()
        client.touch(key)
        client.delete(key)
    finally:
        client.close()
    # Replicas run the master's writes too: each ZADD is counted once on the master and once on
    # its replica. Reads run on the master only.
    assert ran["zadd"]["calls"] == 100
    assert ran["zcard"]["calls"] == 7
    assert ran["zscore"]["calls"] == 5  # called by the script, counted under its own name
    assert ran["evalsha"]["calls"] + ran.get("eval", {"calls": 0})["calls"] >= 5
    assert all(v["usec"] >= 0 for v in ran.values())
    assert "touch" not in ran  # before the start and after the stop


def test_profile_lines_show_the_costliest_commands_per_operation() -> None:
    http = {"evalsha": {"calls": 700, "usec": 21000}, "zadd": {"calls": 10000, "usec": 9000}}
    raw = {"evalsha": {"calls": 100, "usec": 12000}, "zadd": {"calls": 10000, "usec": 8000}}
    lines = commandstats.profile_lines(
        [("HTTP", http, 1000, 31.5), ("raw", raw, 1000, 20.4), ("none", None, 5, 1)]
    )
    assert lines[0] == "| command: µs (calls) per operation | HTTP | raw |"
    assert lines[2] == "| evalsha (the commands it calls included) | 21.00 (0.70) | 12.00 (0.10) |"
    assert lines[3] == "| zadd | 9.00 (10.00) | 8.00 (10.00) |"
    assert lines[-1] == "| store CPU µs per operation (/proc) | 31.5 | 20.4 |"
    assert commandstats.profile_lines([("x", {}, 10, None)]) == []


def test_the_summary_shows_the_store_profiles_of_the_phases_that_have_them() -> None:
    def phase(commands: dict[str, dict[str, int]], store_s: float) -> dict[str, Any]:
        return {"cpu": {"cpu_s": {"redis masters": store_s, "redis replicas": 0.0}, "commands": commands}}

    reads = {
        **phase({"zrevrank": {"calls": 3000, "usec": 9000}}, 0.5),
        "endpoints": {"Aggregated": {"requests": 1000}},
    }
    summary = {
        "http": {
            "reads": reads,
            "writes": {**phase({"evalsha": {"calls": 10, "usec": 50}}, 0.2), "scores_written": 100},
        },
        "raw": {"reads": {**phase({"zrevrank": {"calls": 100, "usec": 200}}, 0.01), "items": 100}},
        "textbook": {"writes": {"cpu": {"cpu_s": {}}, "items": 5}},  # metered without commands: no column
    }
    lines = read_goals.store_profiles(summary)
    text = "\n".join(lines)
    assert "#### Profile: the store per read of the mix" in text
    assert "| command: µs (calls) per operation | HTTP, 16 shards | raw library |" in lines
    assert "| zrevrank | 9.00 (3.00) | 2.00 (1.00) |" in lines
    assert "| store CPU µs per operation (/proc) | 500.0 | 100.0 |" in lines
    assert "| evalsha (the commands it calls included) | 0.50 (0.10) |" in lines
    assert read_goals.store_profiles({}) == []
