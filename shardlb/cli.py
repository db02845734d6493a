"""The `shardlb` command line.

Each subcommand is added to the parser by its own `add_*_command` function and runs through the
handler it sets with `set_defaults(func=...)`: a function of the parsed arguments returning the
exit code. To add a subcommand, write both and call the adder from `build_parser`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import importlib
import json
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from shardlb import compat
from shardlb.cluster import STATE_FILE, ClusterError, ClusterStatus, LocalCluster
from shardlb.config import REBUILD_JOBS, check_id
from shardlb.connection import connection_arguments, postgres_url, seconds
from shardlb.errors import InvalidInput, ShardlbError
from shardlb.postgres import LocalPostgres

DEFAULT_CLUSTER_DIR = Path(".shardlb/cluster")
DEFAULT_POSTGRES_DIR = Path(".shardlb/postgres")

# Subcommands that live outside the library and own their own argument parsing. They are imported
# only when run, so the library never depends on the router or the bench code.
DELEGATED = {
    "serve": ("router.server", "run the HTTP router under uvicorn (see `shardlb serve --help`)"),
    "archive": (
        "shardlb.archive",
        "copy the boards' journals into PostgreSQL until stopped (see `shardlb archive --help`)",
    ),
    "cleanup": ("shardlb.moderation", "remove inactive players once (see `shardlb cleanup --help`)"),
    "prune": (
        "shardlb.prune",
        "remove the archived rows of boards deleted a grace ago, old refused results and audit rows if asked "
        "(see `shardlb prune --help`)",
    ),
    "erase": (
        "shardlb.erase",
        "remove a player's archived rows that no board reads any more (see `shardlb erase --help`)",
    ),
    "plan": (
        "bench.plan",
        "recommend masters, shards and routers from the last bench (see `shardlb plan --help`)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser for every `shardlb` subcommand."""
    parser = argparse.ArgumentParser(prog="shardlb", description="A sharded leaderboard on Redis Cluster.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_cluster_command(commands)
    add_postgres_command(commands)
    add_rebuild_command(commands)
    add_reconcile_command(commands)
    add_settle_command(commands)
    add_reshard_command(commands)
    add_bands_command(commands)
    for name, (_, text) in DELEGATED.items():
        commands.add_parser(name, help=text, add_help=False)
    return parser


# Exit statuses (README lists them). FAILED: the command could not be done (a server unreachable, no
# such board, drift found); USAGE: the command line is wrong, as argparse exits on its own errors,
# so that a script retrying on 1 does not retry a command that can never work.
FAILED, USAGE = 1, 2
INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports a command it stopped
TERMINATED = 143  # SIGTERM, likewise (128 + 15)
CLOSED_PIPE = 141  # the reader of its output went away (`| head`): as SIGPIPE would end it (128 + 13)
LONG_RUNNING = ("serve", "archive")  # they stop on SIGTERM themselves, and exit 0


def failed(e: ShardlbError) -> int:
    """The exit status of a library error: InvalidInput is a value of the command line the library
    refused (a --top-n, a reward table, a --redis URL, a shard or band count the board cannot
    take), a usage error; any other could not be done."""
    return USAGE if isinstance(e, InvalidInput) else FAILED


def add_cluster_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb cluster up|status|down|add-node|remove-node|rebalance`: the local Redis Cluster for
    development and tests."""
    cluster = commands.add_parser("cluster", help="start, check or stop a local Redis Cluster")
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")

    up = actions.add_parser(
        "up",
        help="start and form the cluster (nothing if it is up and healthy; a cluster that is not "
        "--durable and has a dead node is formed afresh, its data lost)",
    )
    up.add_argument("--masters", type=int, default=3, help="number of masters (default 3)")
    up.add_argument("--replicas", type=int, default=1, help="replicas per master (default 1)")
    up.add_argument(
        "--port", type=int, default=7000, help="first port; nodes take consecutive ports (default 7000)"
    )
    up.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for a healthy cluster (default 60)"
    )
    up.add_argument(
        "--durable",
        action="store_true",
        help="append-only files (fsync every second) kept across restarts: `up` after `down` "
        "brings the same data back",
    )
    up.add_argument(
        "--password", help="nodes require this password (requirepass, masterauth); the URL carries it"
    )
    up.set_defaults(func=cluster_up)

    status = actions.add_parser("status", help="show every node; exit status 1 if the cluster is not ok")
    status.set_defaults(func=cluster_status)

    down = actions.add_parser("down", help="stop the nodes this tool started in --dir")
    down.set_defaults(func=cluster_down)

    add = actions.add_parser(
        "add-node", help="start one more master on a free port and join it (it serves no slot yet)"
    )
    add.add_argument("--replicas", type=_count, default=0, help="replicas of the new master (default 0)")
    add.add_argument(
        "--rebalance", action="store_true", help="then move slots so every master holds an equal share"
    )
    add.set_defaults(func=cluster_add_node)

    remove = actions.add_parser(
        "remove-node", help="move a master's slots to the others, FORGET it (and its replicas), stop it"
    )
    remove.add_argument("port", type=int, help="the node's port")
    remove.set_defaults(func=cluster_remove_node)

    rebalance = actions.add_parser(
        "rebalance", help="move slots (keys and all) until every master holds an equal share"
    )
    rebalance.set_defaults(func=cluster_rebalance)

    for action in (up, status, down, add, remove, rebalance):
        action.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_CLUSTER_DIR,
            help=f"directory of the nodes and their state file (default {DEFAULT_CLUSTER_DIR})",
        )


def _jobs(text: str) -> int:
    """An argparse type: a whole number, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


def _count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def cluster_up(args: argparse.Namespace) -> int:
    """Start the cluster (or find it up), show it, and print the URL to connect to."""
    try:
        cluster = LocalCluster(
            masters=args.masters,
            replicas=args.replicas,
            port=args.port,
            dir=args.dir,
            durable=args.durable,
            password=args.password,
        )
    except ClusterError as e:  # the constructor checks only its arguments: --masters, --port...
        print(f"shardlb cluster up: {e}", file=sys.stderr)
        return USAGE
    print(cluster.up(timeout=args.timeout))
    print(f"SHARDLB_REDIS_URL={cluster.url}")
    return 0


def cluster_status(args: argparse.Namespace) -> int:
    """Show the cluster recorded in --dir, and each board's shards per master; non-zero unless ok."""
    cluster = LocalCluster.from_state(args.dir)
    status = cluster.status()
    print(status)
    if status.ok:
        print(asyncio.run(board_placement(cluster, status)))
    return 0 if status.ok else FAILED


async def board_placement(cluster: LocalCluster, status: ClusterStatus) -> str:
    """A table of how many shards of each board (of the registry, shardlb/store.py) each master serves."""
    from shardlb import slots
    from shardlb.connection import Scripts, connect
    from shardlb.store import BoardStore

    client = connect(cluster.url, password=cluster.password)
    try:
        boards = await BoardStore(client, Scripts.register(client)).boards()
    finally:
        await client.aclose()
    masters = {n.port: n.slots for n in status.nodes if n.role == "master"}
    placed = slots.shards_by_master({b.config.id: b.prefixes for b in boards}, slots.owner_map(masters))
    if not boards:
        return "  no boards"
    lines = ["  shards per master:", f"  {'board':<24} " + " ".join(f"{p:>6}" for p in masters)]
    for b in sorted(boards, key=lambda b: b.config.id):
        counts = " ".join(f"{placed[p][b.config.id] if p in placed else 0:>6}" for p in masters)
        lines.append(f"  {b.config.id:<24} {counts}")
    return "\n".join(lines)


def cluster_add_node(args: argparse.Namespace) -> int:
    """Add a master (and its replicas); with --rebalance, give it its share of the slots."""
    cluster = LocalCluster.from_state(args.dir)
    port = cluster.add_node(replicas=args.replicas)
    print(f"added master {port}" + (f" with {args.replicas} replica(s)" if args.replicas else ""))
    if args.rebalance:
        done = cluster.rebalance()
        print(f"rebalanced: {done.slots} slots, {done.keys} keys moved in {done.seconds:.1f} s")
    print(f"SHARDLB_REDIS_URL={cluster.url}")
    return 0


def cluster_remove_node(args: argparse.Namespace) -> int:
    """Move the node's slots away, FORGET it and its replicas everywhere, stop them."""
    cluster = LocalCluster.from_state(args.dir)
    done = cluster.remove_node(args.port)
    print(f"removed node {args.port}: {done.slots} slots, {done.keys} keys moved in {done.seconds:.1f} s")
    print(f"SHARDLB_REDIS_URL={cluster.url}")
    return 0


def cluster_rebalance(args: argparse.Namespace) -> int:
    done = LocalCluster.from_state(args.dir).rebalance()
    print(f"rebalanced: {done.slots} slots, {done.keys} keys moved in {done.seconds:.1f} s")
    return 0


def cluster_down(args: argparse.Namespace) -> int:
    """Stop the nodes recorded in --dir; nothing to stop is not an error (`make stop` may run twice)."""
    if not (args.dir / STATE_FILE).exists():
        print(f"no cluster state in {args.dir}: nothing to stop")
        return 0
    stopped = LocalCluster.from_state(args.dir).down()
    nodes = f"{stopped} node{'' if stopped == 1 else 's'} stopped"
    print(f"cluster in {args.dir}: " + (nodes if stopped else "not running"))
    return 0


def add_postgres_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb postgres up|down`: the private PostgreSQL server of the archive (shardlb/postgres.py)."""
    postgres = commands.add_parser("postgres", help="start or stop the private PostgreSQL of the archive")
    actions = postgres.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="start it (initialising it the first time); print its URL")
    up.set_defaults(func=postgres_up)
    down = actions.add_parser("down", help="stop it; its data stays")
    down.set_defaults(func=postgres_down)
    for action in (up, down):
        action.add_argument(
            "--dir",
            type=Path,
            default=DEFAULT_POSTGRES_DIR,
            help=f"its state (default {DEFAULT_POSTGRES_DIR})",
        )


def postgres_up(args: argparse.Namespace) -> int:
    print(f"SHARDLB_POSTGRES_URL={LocalPostgres(args.dir).up()}")
    return 0


def postgres_down(args: argparse.Namespace) -> int:
    stopped = LocalPostgres(args.dir).down()
    print(f"PostgreSQL of {args.dir} stopped" if stopped else f"PostgreSQL of {args.dir}: not running")
    return 0


def _period(command: argparse.ArgumentParser, default: str) -> None:
    command.add_argument(
        "--period", help=f"one API period: total, daily, daily:2026-11-30, weekly... {default}"
    )


def add_rebuild_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb rebuild BOARD | --all`: recompute boards from PostgreSQL and their journals."""
    rebuild = commands.add_parser(
        "rebuild", help="recompute a board from PostgreSQL, shard by shard, while writes go on"
    )
    rebuild.add_argument("board", nargs="?", type=board_id, help="the board (or --all)")
    rebuild.add_argument(
        "--all",
        action="store_true",
        help="every board PostgreSQL knows, put back in the registry if missing, after the ban list "
        "(after a loss of Redis)",
    )
    rebuild.add_argument(
        "--shard",
        type=int,
        help="one shard only (one lost alone: the archiver's error and the 503 board_rebuilding name it)",
    )
    rebuild.add_argument(
        "--jobs",
        type=_jobs,
        metavar="N",
        help=f"with --all: boards restored and rebuilt side by side, each on a PostgreSQL connection "
        f"of its own (default {REBUILD_JOBS}; a board's shards go one after another)",
    )
    rebuild.add_argument(
        "--force",
        action="store_true",
        help="rebuild even from an archive that holds no result of the board while Redis holds players",
    )
    connection_arguments(rebuild)
    _period(rebuild, "(default all)")
    rebuild.set_defaults(func=rebuild_boards)


def rebuild_boards(args: argparse.Namespace) -> int:
    """Rebuild and print a line per shard as it goes."""
    from shardlb import rebuild  # imported when run: the cluster commands need no PostgreSQL driver

    if bool(args.board) == bool(args.all) or not args.postgres:
        print(
            "shardlb rebuild: give a BOARD or --all, and --postgres or SHARDLB_POSTGRES_URL", file=sys.stderr
        )
        return USAGE
    if args.jobs is not None and not args.all:  # taken and ignored, it would say nothing of why
        print(
            "shardlb rebuild: --jobs goes with --all (a board's shards are rebuilt one after another)",
            file=sys.stderr,
        )
        return USAGE
    boards = None if args.all else [args.board]
    # What start-up made (the modules, some 50,000 objects) goes out of the collector's way, as a
    # router worker's does (router/heap.py): a rebuild makes several objects per result, and the
    # full collections they set off walked start-up's heap each time, a tenth of the process's CPU
    # (`rebuild --all` of 792,000 results, 2026-12-06).
    gc.freeze()
    jobs = args.jobs or REBUILD_JOBS
    done = asyncio.run(
        rebuild.run(args.redis, args.postgres, boards, args.period, args.shard, print, args.force, jobs)
    )
    print(f"rebuilt {len(done)} board(s)")
    return 0


def add_reshard_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb reshard BOARD --shards N | --resume | --cancel | --status | --rehome`
    (shardlb/reshard.py)."""
    reshard = commands.add_parser(
        "reshard", help="move a board to another shard count while it takes writes and reads"
    )
    reshard.add_argument("board", help="the board")
    what = reshard.add_mutually_exclusive_group(required=True)
    what.add_argument("--shards", type=int, help="the new shard count (of home shards, with --bands)")
    what.add_argument(
        "--resume",
        action="store_true",
        help="take the reshard under way to its end; a live mover elsewhere is waited for a lease, then "
        "its outcome said (exit 0), or, still running, said so (exit 1)",
    )
    what.add_argument("--cancel", action="store_true", help="cancel a reshard not committed yet")
    what.add_argument(
        "--status",
        action="store_true",
        help="print the state, progress, time left and whether a process moves it",
    )
    what.add_argument(
        "--rehome",
        action="store_true",
        help="move the board's archived rows to the shards of its layout now, as a reshard's end "
        "does: for a PostgreSQL restored from a backup taken before a reshard (refused while one "
        "is under way)",
    )
    reshard.add_argument(
        "--bands", help="make it a band board with these band starts, e.g. 0,1000,10000 (with --shards)"
    )
    connection_arguments(reshard)
    reshard.set_defaults(func=reshard_board)


def reshard_board(args: argparse.Namespace) -> int:
    """Run, resume, cancel or show a reshard, or re-home the board's archived rows; print progress
    lines, then the status (or what was re-homed) as JSON."""
    from shardlb import reshard

    action = "status" if args.status else "cancel" if args.cancel else "rehome" if args.rehome else "run"
    try:
        bands = None if args.bands is None else [int(b) for b in args.bands.split(",")]
    except ValueError:
        print("shardlb reshard: --bands takes integers separated by commas", file=sys.stderr)
        return USAGE
    if bands is not None and args.shards is None:
        print("shardlb reshard: --bands goes with --shards", file=sys.stderr)
        return USAGE
    if args.rehome and not args.postgres:
        print("shardlb reshard: --rehome needs --postgres or SHARDLB_POSTGRES_URL", file=sys.stderr)
        return USAGE
    try:
        status = asyncio.run(
            reshard.command(args.redis, args.board, args.shards, action, args.postgres, print, bands)
        )
    except ShardlbError as e:
        print(f"shardlb reshard: {e.message}", file=sys.stderr)
        return failed(e)
    print(json.dumps(status))
    if action == "status" and status.get("mover") == "none":
        print(
            f"shardlb reshard: no process moves {args.board}'s reshard ({status.get('state')}): the "
            "board stays in both layouts and its tracked changes grow with every write. A router "
            f"resumes it once its lease has been free for {reshard.LEASE_MS / 1000:.0f} s (a "
            "journaled board's only with SHARDLB_POSTGRES_URL); else "
            f"`shardlb reshard {args.board} --resume` or --cancel",
            file=sys.stderr,
        )
    return _unfinished("reshard", args.board, status) if action == "run" else 0


UNFINISHED = 3  # the exit code of a reshard left committed but not finished


def _unfinished(command: str, board: str, status: dict[str, Any]) -> int:
    """0 when the reshard ``status`` tells of is over (done, or cancelled: the board keeps its
    layout, and the mover said so); else say how to finish it, UNFINISHED."""
    state = status.get("state", "none")
    if state in (None, "none", "cancelled"):
        return 0
    print(
        f"shardlb {command}: {board}'s reshard is {state}, not finished (the old journals must be "
        f"archived first: an archiver running, PostgreSQL given); finish it with "
        f"`shardlb reshard {board} --resume`",
        file=sys.stderr,
    )
    return UNFINISHED


SKEW = 1.5  # `shardlb bands --apply` reshards when a band holds more than this times its share


def add_bands_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb bands BOARD --count N [--apply]`: band starts that part the board's players evenly."""
    bands = commands.add_parser(
        "bands",
        help="propose band starts that part a board's players into bands of equal size; --apply "
        "reshards a band board whose bands have drifted apart (or a hash board) to them",
    )
    bands.add_argument("board", help="the board")
    bands.add_argument("--count", type=int, required=True, help="how many bands (e.g. one per master)")
    bands.add_argument(
        "--apply",
        action="store_true",
        help="reshard the board to the proposed starts (its home shards kept) when its largest band "
        "holds more than --skew times its share of the players and the proposed starts part them more "
        "evenly, or it is a hash board, or it has another band count than --count and the proposal "
        "changes it (the proposal has fewer where many players share points); otherwise change "
        "nothing. Refused (exit 1) when the copy, which lives beside the "
        "board until the cut-over, would not fit below the masters' maxmemory with 1.25x to spare. "
        "Safe to run from cron as scores move.",
    )
    bands.add_argument(
        "--skew",
        type=float,
        default=SKEW,
        help=f"with --apply: the largest band's players over the mean band's that calls for new "
        f"starts (default {SKEW})",
    )
    bands.add_argument(
        "--redis",
        default=os.environ.get("SHARDLB_REDIS_URL", "redis://127.0.0.1:7000"),
        help="the cluster (default $SHARDLB_REDIS_URL or redis://127.0.0.1:7000)",
    )
    bands.add_argument(
        "--postgres",
        type=postgres_url,
        default=os.environ.get("SHARDLB_POSTGRES_URL", ""),
        help="with --apply on a journaled board: the archive, which the reshard moves too "
        "(default $SHARDLB_POSTGRES_URL)",
    )
    bands.set_defaults(func=propose_bands)


def propose_bands(args: argparse.Namespace) -> int:
    """Print the band starts (JSON) and the reshard that would apply them; with --apply, make it
    when the board's bands have drifted past --skew (a reshard's progress lines on stderr, the
    outcome as JSON on stdout)."""
    from shardlb.board import band_skew
    from shardlb.connection import Scripts, connect
    from shardlb.errors import BoardConflict
    from shardlb.reshard import Cancelled, Resharder, cli_cache_s, layout_bytes, masters_free, short_of_memory
    from shardlb.store import BoardStore

    if args.apply and not args.skew >= 1.0:
        print(
            "shardlb bands: --skew must be at least 1.0 (1.0: bands of exactly equal size)", file=sys.stderr
        )
        return USAGE

    home_shards = 0

    async def run() -> dict[str, Any]:
        nonlocal home_shards
        client = connect(args.redis, timeout=30.0)
        try:
            store = BoardStore(client, Scripts.register(client))
            board = await store.get(args.board)
            home_shards = board.config.sharding.shards
            say = functools.partial(print, file=sys.stderr)
            mover = Resharder(store, args.board, say, args.postgres or None, cache_s=cli_cache_s())
            if args.apply and (await mover.status())["state"] != "none":  # a run stopped half way
                say(f"{args.board}: a reshard is under way; taking it to its end, then nothing more")
                final = await mover.run()
                layout = (await store.get(args.board)).config.sharding
                return {"board": args.board, "bands": list(layout.bands), "resumed": True, **final}
            starts = await board.band_starts(args.count)
            out: dict[str, Any] = {"board": args.board, "bands": starts}
            if not args.apply:
                return out
            sizes = await board.band_sizes()
            banded = board.layout.strategy == "band"
            out["skew"] = band_skew(sizes) if banded else None
            # Ties can leave fewer starts than --count (a band holds every player of its points)
            # and bands more skewed than --skew whatever the starts: new starts that part the
            # players no more evenly would copy the whole board on every run for nothing.
            due = not banded or len(sizes) not in (args.count, len(starts))
            if not due and out["skew"] > args.skew:
                out["new_skew"] = band_skew(await board.band_sizes_at(starts))
                due = out["new_skew"] < out["skew"]
            if not due or (banded and list(board.config.sharding.bands) == starts):
                return {**out, "resharded": False}
            # Unattended (cron): a copy that would fill the masters must not start.
            short = short_of_memory(await layout_bytes(client, board), await masters_free(client))
            if short is not None:
                raise BoardConflict(short, "board")
            await mover.start(board.config.sharding.shards, starts)
            final = await mover.run()
            return {**out, "resharded": True, "state": final.get("state")}
        finally:
            await client.aclose()

    try:
        out = asyncio.run(run())
    except ShardlbError as e:
        print(f"shardlb bands: {e.message}", file=sys.stderr)
        return failed(e)
    except Cancelled:  # `shardlb reshard --cancel` elsewhere: the board keeps its layout (the mover said so)
        print(json.dumps({"board": args.board, "resharded": False, "state": "cancelled"}))
        return 0
    print(json.dumps(out))
    if not args.apply:
        starts = ",".join(map(str, out["bands"]))
        print(
            f"apply with: shardlb reshard {args.board} --shards {home_shards} --bands {starts}\n"
            f"       or: shardlb bands {args.board} --count {args.count} --apply (only if they drifted)",
            file=sys.stderr,
        )
        return 0
    return _unfinished("bands", args.board, out) if out.get("resharded") or out.get("resumed") else 0


def add_reconcile_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb reconcile BOARD`: compare Redis with PostgreSQL per shard; exit 1 on drift."""
    reconcile = commands.add_parser(
        "reconcile", help="compare a board in Redis with PostgreSQL per shard; exit status 1 on drift"
    )
    reconcile.add_argument("board", type=board_id, help="the board")
    reconcile.add_argument("--repair", action="store_true", help="rebuild the shards that drift")
    reconcile.add_argument(
        "--metrics-file", type=Path, help="write the result here as Prometheus text (textfile collector)"
    )
    connection_arguments(reconcile)
    _period(reconcile, "(default: the current one of every period the board keeps)")
    reconcile.set_defaults(func=reconcile_board)


def reconcile_board(args: argparse.Namespace) -> int:
    """Print the table; with --repair, rebuild what drifts and check again."""
    from shardlb import periods, rebuild, reconcile, times

    if not args.postgres:
        print("shardlb reconcile: give --postgres or SHARDLB_POSTGRES_URL", file=sys.stderr)
        return USAGE
    folder = None if args.metrics_file is None else args.metrics_file.parent
    if folder is not None and not folder.is_dir():  # found before the check, not after it
        print(f"shardlb reconcile: --metrics-file: no folder {str(folder)!r}", file=sys.stderr)
        return USAGE

    async def run() -> bool:
        async with rebuild.connected(args.redis, args.postgres, print) as (rebuilder, store):
            board = await store.get(args.board)
            found, config = {}, board.config
            # Without --period, the current one of every period the board keeps.
            for period in [args.period] if args.period else list(config.periods):
                # The current period ("daily") is named once: the repair and the check after it
                # are of the day checked first, even once the board's midnight has passed.
                now = times.now_ms()
                named = periods.api_name(
                    periods.parse(period, config.periods, board.tz, now, config.week_start)
                )
                checks = await reconcile.reconcile(rebuilder, board, named)
                print(f"period {named}:\n{reconcile.table(checks)}")
                if args.repair and any(c.drift for c in checks):
                    await reconcile.repair(rebuilder, board, checks, named)
                    checks = await reconcile.reconcile(rebuilder, board, named)
                    print(f"period {named}, after the repair:\n{reconcile.table(checks)}")
                found[period] = checks
            # Drift the archive cannot mend: results Redis acknowledged that a PostgreSQL restored
            # from a backup lacks (docs/design-notes.md, "PostgreSQL restored from a backup").
            for shard, archived_to, trimmed_to, at in await rebuilder.gaps(board):
                print(
                    f"archive_gaps: shard {shard}'s journal trimmed entries up to {trimmed_to}, this archive "
                    f"holds them up to {archived_to} only (found {at:%Y-%m-%d %H:%M:%S %Z}): PostgreSQL "
                    "restored from a backup? a repair would drop them from Redis, and is refused"
                )
            if args.metrics_file:
                reconcile.write_metrics(args.metrics_file, board, found)
            return any(c.drift for checks in found.values() for c in checks)

    return FAILED if asyncio.run(run()) else 0


def add_settle_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`shardlb settle BOARD PERIOD --id ID --rewards FILE|JSON`: pay a closed period once."""
    settle = commands.add_parser(
        "settle", help="freeze a closed period, order it from PostgreSQL, check it and store its awards once"
    )
    settle.add_argument("board", type=board_id, help="the board")
    settle.add_argument("period", help="a dated API period, e.g. daily:2026-11-30")
    settle.add_argument("--id", required=True, help="the settlement id: the same id never pays twice")
    settle.add_argument(
        "--rewards",
        required=True,
        help="the reward table as JSON, or a file holding it (docs/design-notes.md)",
    )
    settle.add_argument("--top-n", type=int, default=1000, help="ranks kept in the snapshot (default 1000)")
    settle.add_argument("--force", action="store_true", help="pay from PostgreSQL even if Redis differs")
    settle.add_argument("--webhook", help="POST each award to this URL (signed with $SHARDLB_WEBHOOK_SECRET)")
    settle.add_argument(
        "--wait", type=seconds, default=30.0, help="seconds to wait for the archiver to catch up (default 30)"
    )
    connection_arguments(settle)
    settle.set_defaults(func=settle_period)


def settle_period(args: argparse.Namespace) -> int:
    """Settle, deliver the webhook when the settlement has one, and print the result as JSON."""
    import orjson

    from shardlb import settlement, settlement_delivery

    if not args.postgres:
        print("shardlb settle: give --postgres or SHARDLB_POSTGRES_URL", file=sys.stderr)
        return USAGE
    secret = os.environ.get("SHARDLB_WEBHOOK_SECRET", "")
    if args.webhook and not secret:  # as the router's 409 webhook_not_configured: never sign with ""
        print("shardlb settle: --webhook needs SHARDLB_WEBHOOK_SECRET to sign its bodies", file=sys.stderr)
        return USAGE
    text = Path(args.rewards).read_text() if _is_file(args.rewards) else args.rewards
    try:
        rewards = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        print(f"shardlb settle: --rewards is neither a file nor JSON: {e}", file=sys.stderr)
        return USAGE
    body = {"settlement_id": args.id, "rewards": rewards, "top_n": args.top_n, "force": args.force}
    if args.webhook:
        body["webhook_url"] = args.webhook
    # A webhook stored by an earlier run is used when --webhook is left out, and refused (409
    # webhook_not_configured, exit status 1) without the secret as well.
    request = dataclasses.replace(settlement.Request.of(body), can_sign=bool(secret))

    async def run() -> dict[str, object]:
        result = await settlement.run(
            args.redis, args.postgres, args.board, args.period, request, _crash_hook(), args.wait
        )
        if result.get("webhook_url"):  # what is left pending after an hour is sent by the next run
            result["delivery"] = await settlement_delivery.deliver_all(
                args.postgres, secret, args.id, deadline_s=3600.0
            )
        return result

    print(orjson.dumps(asyncio.run(run()), option=orjson.OPT_INDENT_2).decode())
    return 0


def _is_file(name: str) -> bool:
    """Whether ``name`` names a file (False for text no file could be named: inline JSON past a
    file name's length makes the OS refuse the lookup)."""
    try:
        return Path(name).is_file()
    except (OSError, ValueError):
        return False


def _unreachable(e: BaseException) -> bool:
    """A failure to reach or talk to Redis or PostgreSQL: an answer for the operator, not a bug."""
    module = type(e).__module__
    return isinstance(e, OSError) or module.startswith(("redis.", "psycopg"))


def _crash_hook() -> Callable[[str], None] | None:
    """SHARDLB_SETTLE_KILL_AFTER=<step> makes the process die by SIGKILL once that step is done: how
    the crash tests stop a settlement between two steps (shardlb/settlement.py, STEPS)."""
    kill_after = os.environ.get("SHARDLB_SETTLE_KILL_AFTER")
    if not kill_after:
        return None

    def step(name: str) -> None:
        if name == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    return step


def _reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll says POLLERR)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout), or closed
        return False


def board_id(value: str) -> str:
    """A board id argument: one no board can have is a usage error, before any connection."""
    try:
        return check_id(value, "board")
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(e.message) from e


def _lines_as_said() -> None:
    """Each line written to stdout as it is printed, to a pipe or a file too: a reshard's progress,
    or `prune`'s lines per board, reach `| tee`, a cron job's log or a CI log while the command runs. Python
    holds a pipe's output in blocks of 8 KiB unless PYTHONUNBUFFERED is set (the image sets it;
    a shell does not), so until 2026-12-06 such lines came all at once at the exit."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)


def main(argv: list[str] | None = None) -> int:
    """Run the `shardlb` command line; return the exit code."""
    if argv is None:  # the program's own command line, not a caller's (the tests')
        _lines_as_said()
    argv = sys.argv[1:] if argv is None else argv
    compat.mend_wait_for()  # before any command's asyncio: a SIGTERM must not be lost (shardlb/compat.py)
    if argv and argv[0] in DELEGATED:
        delegate = importlib.import_module(DELEGATED[argv[0]][0])
        run: Callable[[], int] = functools.partial(delegate.main, argv[1:])
    else:
        args = build_parser().parse_args(argv)
        run = functools.partial(args.func, args)
    terminated = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        """Stop as Ctrl-C stops the command (asyncio.run's handler cancels its main task, so the
        command's clean-up runs), and say which signal it was."""
        nonlocal terminated
        terminated = True
        interrupt = signal.getsignal(signal.SIGINT)
        if callable(interrupt):
            interrupt(signal.SIGINT, frame)
        else:  # SIGINT ignored (a command started with `&` by a script): SIGTERM must still stop it
            raise KeyboardInterrupt

    one_shot = argv[:1] != [] and argv[0] not in LONG_RUNNING
    if one_shot and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    else:
        previous = None
    try:
        code: int = run()
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
    except BrokenPipeError as e:
        if not _reader_gone():  # a socket's, not our output's: an error like any other
            print(f"shardlb: error: {type(e).__name__}: {e}", file=sys.stderr)
            return FAILED
        # Nothing more can be written there; the interpreter's last flush must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    except ShardlbError as e:
        print(f"shardlb: error: {e}", file=sys.stderr)
        return failed(e)
    except ClusterError as e:
        print(f"shardlb: error: {e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:  # say so, or a log shows nothing to tell it from a crash
        print("shardlb: terminated" if terminated else "shardlb: interrupted", file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    except Exception as e:
        if not _unreachable(e):
            raise  # a bug: its traceback is what a report needs
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"shardlb: error: {type(e).__name__}: {first}", file=sys.stderr)
        return FAILED
    finally:
        if previous is not None:  # main() called in a process of its own (the tests) leaves it as found
            signal.signal(signal.SIGTERM, previous)
    return code
