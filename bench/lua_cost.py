"""What one score costs Redis inside write.lua, counted in instructions rather than timed.

    python -m bench.lua_cost                      # the working tree's write.lua
    python -m bench.lua_cost --against f1c77a7    # beside the write.lua of another revision

Redis's CPU time per call swings by a third between runs on a shared VM, more than most changes to
a script are worth. ``valgrind --tool=callgrind`` counts the instructions a redis-server executes,
and the count repeats for the same binary and inputs whatever else the machine is doing. So each
variant gets its own standalone redis-server under callgrind (no cluster: every key of a call shares
one hash tag anyway), the same calls built by ``Board._script_call`` for a one-shard board with
daily and weekly periods, ``--warm`` calls to fill the sets, then the counters are zeroed
(``callgrind_control -z``) and ``--calls`` calls are counted.

``--durability journal`` counts the calls of a journaled board instead (each call then also appends
to the shard's journal and its count of results not archived; nothing archives meanwhile).

Shapes: board mode (best, incr) x results per call (1, 10, 30) x results sent with or without
``achieved_at`` (without one, a result looks for its first server time in the dedup window's pin
buckets). With ``--full-window``, one timeless call is made in each bucket of the past window first,
through the script under test, so its dedup and pin buckets are those of a board a day old;
otherwise only the buckets the calls themselves write exist.

The counts are of one redis-server process only: the kernel's share of a call (its system calls)
is not in them, so they compare scripts, not round trips. Results: a table on stdout and
``lua_cost.json`` in bench/results/lua-<time>/.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis

from bench.harness import log, run_dir
from bench.services import ROOT, free_port
from shardlb import keys
from shardlb.board import Board, Score
from shardlb.config import BoardConfig

SCRIPT = ROOT / "shardlb" / "scripts" / "write.lua"
NOW_MS = 1_780_000_000_000  # a fixed clock: the same bucket and period names in every run
PLAYERS = 100_000


@dataclass(frozen=True)
class Shape:
    mode: str
    per_call: int
    timed: bool

    @property
    def name(self) -> str:
        return f"{self.mode}, {self.per_call} per call, {'with' if self.timed else 'without'} achieved_at"


SHAPES = [Shape(m, n, t) for m in ("best", "incr") for n in (1, 10, 30) for t in (False, True)]


def missing_tools() -> str | None:
    """None when valgrind, callgrind_control and redis-server are on PATH, else what is missing."""
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            return (
                f"{tool} not found (Debian: apt-get install valgrind; redis-server: scripts/ensure-redis.sh)"
            )
    return None


@contextmanager
def counted_server(workdir: Path) -> Iterator[tuple[redis.Redis, int, Path]]:
    """A standalone redis-server under callgrind: its client, its pid and its output file."""
    port = free_port(26900)
    out = workdir / f"callgrind-{port}.out"
    proc = subprocess.Popen(
        [
            *("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"),
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
            # The server's timer (serverCron) runs hz times a second whatever the calls do: under
            # valgrind, on a busy machine, the counted window's wall time and so its count of timer
            # work would vary. Once a second it is a rounding error.
            *("--hz", "1", "--dynamic-hz", "no"),
            *("--dir", str(workdir)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = redis.Redis(port=port, socket_timeout=60)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server under valgrind did not start") from None
                time.sleep(0.2)
        yield client, proc.pid, out
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


def _control(flag: str, pid: int) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True)


def _total(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def as_taken(script: str, args: list[Any]) -> list[Any]:
    """``args`` as ``script`` takes them: a write.lua from before the header and items went as
    streams of MessagePack values (ARGV[1] and ARGV[2] were one array each) gets arrays."""
    if "{cmsgpack.unpack(ARGV[1])}" in script:
        return args
    header = list(msgpack.Unpacker(io.BytesIO(args[0])))
    stream = len(header) > 24 and header[24] == 1  # the header's 25th value says how the items go
    items = list(msgpack.Unpacker(io.BytesIO(args[1]))) if stream else msgpack.unpackb(args[1])
    return [msgpack.packb(header), msgpack.packb(items)]


def instructions_per_score(
    script: str, shape: Shape, warm: int, calls: int, full_window: bool, durability: str = "memory"
) -> float:
    """Instructions the server spent per score over ``calls`` calls of ``shape``, after ``warm``, on
    a board of that ``durability`` (``journal``: each call also appends its results to the journal,
    which nothing archives meanwhile)."""
    config = BoardConfig.from_dict(
        f"lua-{shape.mode}",
        {
            "mode": shape.mode,
            "durability": durability,
            "periods": ["daily", "weekly"],
            "sharding": {"shards": 1},
        },
    )
    board = Board(None, config, None)  # type: ignore[arg-type]  # only builds the calls' arguments
    # As a journaled board created since 2026-12-06 (whatever this one's durability): each call reads
    # the shard's sentinel (a script of before takes the header's last item for nothing)
    board.sentinels = True
    rng = random.Random(1)
    sent = 0

    def call(client: redis.Redis, sha: str) -> None:
        nonlocal sent
        scores = []
        for _ in range(shape.per_call):
            sent += 1
            achieved = NOW_MS - 1000 if shape.timed else None
            scores.append(Score(f"p{rng.randrange(PLAYERS)}", rng.randrange(1000), f"m{sent}", achieved))
        names, args = board._script_call(0, board.prepare(scores, NOW_MS), NOW_MS)
        client.evalsha(sha, len(names), *names, *as_taken(script, args))

    with (
        tempfile.TemporaryDirectory(prefix="lua-cost-") as tmp,
        counted_server(Path(tmp)) as (client, pid, out),
    ):
        sha = client.script_load(script)
        client.set(keys.sentinel_key(board.prefixes[0]), 1)
        if full_window:
            # One timeless call in each bucket of the past window, through the script itself: the
            # buckets it keeps (dedup sets, pin hashes) are then those of a board a day old, in the
            # layout of the script under test, listed in the key index as it lists them.
            bucket, window = config.dedup_bucket_ms, config.dedup_window_s * 1000
            for k in range((NOW_MS - window) // bucket, NOW_MS // bucket):
                at = k * bucket + bucket // 2
                sent += 1
                names, args = board._script_call(0, board.prepare([Score("x", 1, f"w{sent}", None)], at), at)
                client.evalsha(sha, len(names), *names, *as_taken(script, args))
        for _ in range(warm):
            call(client, sha)
        _control("-z", pid)
        for _ in range(calls):
            call(client, sha)
        _control("-d", pid)
        dumps = sorted(Path(tmp).glob(out.name + "*"), key=lambda p: p.stat().st_mtime)
        return _total(dumps[-1]) / (calls * shape.per_call)


def script_at(revision: str) -> str:
    """write.lua as of a git revision."""
    return subprocess.run(
        ["git", "show", f"{revision}:shardlb/scripts/write.lua"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def run(
    against: str | None,
    shapes: list[Shape],
    warm: int,
    calls: int,
    full_window: bool,
    durability: str = "memory",
) -> list[dict[str, Any]]:
    """One row per shape: instructions per score of the working tree's write.lua (and ``against``'s)."""
    variants = {"this": SCRIPT.read_text()}
    if against:
        variants[against] = script_at(against)
    rows = []
    for shape in shapes:
        row: dict[str, Any] = {**asdict(shape), "shape": shape.name}
        for label, text in variants.items():
            row[label] = round(instructions_per_score(text, shape, warm, calls, full_window, durability))
        log(f"lua cost: {shape.name}: " + ", ".join(f"{k} {row[k]:,}" for k in variants))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], against: str | None) -> list[str]:
    """The rows as a Markdown table: instructions per score, and the change against ``against``."""
    head = "| shape | this write.lua |" + (f" {against} | change |" if against else "")
    rule = "|---|---:|" + ("---:|---:|" if against else "")
    lines = [head, rule]
    for row in rows:
        line = f"| {row['shape']} | {row['this']:,} |"
        if against:
            line += f" {row[against]:,} | {100 * (row['this'] - row[against]) / row[against]:+.1f}% |"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lua_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--against", help="also count the write.lua of this git revision")
    parser.add_argument("--warm", type=int, default=200, help="calls before counting (default 200)")
    parser.add_argument("--calls", type=int, default=200, help="calls counted (default 200)")
    parser.add_argument(
        "--full-window", action="store_true", help="first a timeless call in each bucket of the past window"
    )
    parser.add_argument("--shapes", help="only these, as mode:per_call:timed (e.g. best:10:0,incr:30:1)")
    parser.add_argument(
        "--durability",
        choices=("memory", "journal"),
        default="memory",
        help="the board's durability (default memory; journal: each call journals its results too)",
    )
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"lua cost skipped: {missing}", file=sys.stderr)
        return 1
    shapes = SHAPES
    if args.shapes:
        shapes = []
        for item in args.shapes.split(","):
            mode, per_call, timed = item.split(":")
            shapes.append(Shape(mode, int(per_call), timed == "1"))
    rows = run(args.against, shapes, args.warm, args.calls, args.full_window, args.durability)
    out = run_dir("lua-" + time.strftime("%Y%m%d-%H%M%S"))
    settings = {
        "warm": args.warm,
        "calls": args.calls,
        "full_window": args.full_window,
        "durability": args.durability,
        "against": args.against,
    }
    (out / "lua_cost.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    print(
        f"Redis instructions per score in write.lua (callgrind; {os.path.relpath(out, ROOT)}/lua_cost.json)"
    )
    print("\n".join(table(rows, args.against)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
