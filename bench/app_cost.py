"""What the router app itself spends on a score write and a "my rank" read, without an HTTP server.

    python -m bench.app_cost                      # the working tree's router
    python -m bench.app_cost --against a81e764    # beside the router of another revision

`make bench`'s router CPU per write is the whole process under load: uvicorn's HTTP parsing and
responses, the kernel's sockets, and the app. This puts the app alone on the scale: each variant runs
in a process of its own that builds the router app (``router.app.create_app``) of its source tree,
enters its lifespan against a local cluster of 3 masters (started here, no replicas), creates a
fresh board and calls the app as uvicorn would (an ASGI scope, a body message, a send that keeps the
response), ``--concurrency`` requests at a time. It counts that process's CPU (``time.process_time``)
over ``--requests`` score posts of one match (10 scores), a tenth as many of ten matches (100 scores),
and a quarter as many ``GET /healthz`` (Starlette's whole path). The two posts give a request's part
and a score's part of the app's CPU (two equations: CPU = per request + scores x per score). Then
"my rank": a second board of 3 hash shards (one per master, as ``make bench``'s ``bench-s3``), filled
with ``RANK_PLAYERS`` players by posts of 100 scores, and a quarter as many
``GET /v1/boards/{board}/players/{player}`` of random players of it as one-match posts, sent as wrk
sends them to ``bench-s3`` (a Host header only, no key; the app's read limit off, as there), at
most ``RANK_CONCURRENCY`` at a time (the app's read permits: none waits at its gate). Last, two
more kinds of the mix on that board, as Locust sends them (Accept JSON, no key): a sixteenth as many
"around me" reads (``GET .../players/{player}/around?radius=5``, ``AROUND_RADIUS``) and as many
friends queries (``POST .../players:query`` of ``FRIENDS`` random players), the same width.

Variants take turns for ``--rounds`` rounds (the machine's load moves, so each round compares
neighbours), and the table has each variant's median; with ``--against``, the change. The other
revision runs from a git worktree of it in a temporary directory. Results: a table on stdout and
``app_cost.json`` in bench/results/app-<time>/.

CPU time on a shared 2-core VM cannot tell a 5% change from noise (the same change measured -7.1% and
+8.9% in two runs of 7 rounds). ``--instructions`` adds a count that repeats: each variant runs once
more, under ``valgrind --tool=callgrind`` with instrumentation off from the start, and turns it on
(``callgrind_control -i on``) only around ``--waves`` waves of ``--concurrency`` one-match posts, a
fifth as many waves of ten-match posts, a quarter as many of ``GET /healthz``, and as many "my
rank" reads as one-match posts (in waves of at most ``RANK_CONCURRENCY``), then a quarter as
many "around me" reads and as many friends queries (after a sixteenth of ``--warm`` of each), each
wave gathered and answered before the next (so every wave's scores go to the coalescer together,
whatever the machine's load), from a fixed seed and ``PYTHONHASHSEED``, the service's timed loops
stopped first (they tick with the wall time, not the posts). It is a proxy: an instruction of the
interpreter counts as much as one of orjson's or hiredis's C, and the kernel's work (the sockets to
the cluster) and cache misses are not in it; a change it sees is a change in the app's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # this tree (bench/services.py's ROOT, not imported:
# a worker imports nothing of bench/, so the revision it measures needs only its router/ and shardlb/)
ADMIN, WRITE = "app-cost-admin-key-0000", "app-cost-write-key-0000"
PLAYERS = 200_000
WARM = 2_000
RANK_PLAYERS = 5_000  # players of the "my rank" board, p0 to p4999
RANK_SHARDS = 3  # the "my rank" board's hash shards: one per master of the cluster, as bench-s3
# "my rank" reads in flight at most: the app's read permits (SHARDLB_READ_CONCURRENCY's default, or
# the variant's own setting when lower). wrk sends 32 at a time to bench-s3 (bench/hot.py), and the
# reads past the permits wait at the gate, each for at most SHARDLB_QUEUE_WAIT_S (0.5 s) of wall
# time, which callgrind stretches some 50 times: counted, some of them were refused 503.
RANK_CONCURRENCY = 16
AROUND_RADIUS = 5  # "around me": the mix's radius (bench/workload.py's around_radius)
FRIENDS = 20  # friends: the ids of a players:query, the mix's fewest (SHARDLB_FRIENDS' minimum)
MEASURES = ("one_match_us", "ten_matches_us", "healthz_us", "rank_us", "around_us", "friends_us")
# --instructions, in the order counted
COUNTS = ("one_match_ir", "ten_matches_ir", "healthz_ir", "rank_ir", "around_ir", "friends_ir")


def fit(one_match_us: float, ten_matches_us: float) -> tuple[float, float]:
    """(per request, per score) µs from a post of 10 scores and one of 100."""
    per_score = (ten_matches_us - one_match_us) / 90
    return one_match_us - 10 * per_score, per_score


def bodies(count: int, matches: int, rng: random.Random, first: int) -> list[bytes]:
    """``count`` POST bodies of ``matches`` new matches of 10 players each (match ids from ``first``)."""
    import orjson

    out = []
    match = first
    for _ in range(count):
        scores = []
        for _ in range(matches):
            match += 1
            scores += [
                {"player_id": f"p{rng.randrange(PLAYERS)}", "points": rng.randrange(10_000), "match_id": m}
                for m in [f"m{match}"] * 10
            ]
        out.append(orjson.dumps({"scores": scores}))
    return out


def rank_bodies(rng: random.Random) -> list[bytes]:
    """Posts of 100 scores (10 matches of 10 players) that give each of ``RANK_PLAYERS`` players one."""
    import orjson

    out = []
    for first in range(0, RANK_PLAYERS, 100):
        scores = [
            {"player_id": f"p{n}", "points": rng.randrange(10_000), "match_id": f"r{n // 10}"}
            for n in range(first, min(first + 100, RANK_PLAYERS))
        ]
        out.append(orjson.dumps({"scores": scores}))
    return out


def rank_paths(board: str, count: int, rng: random.Random) -> list[str]:
    """``count`` "my rank" paths of random players of the board ``rank_bodies`` filled."""
    return [f"/v1/boards/{board}/players/p{rng.randrange(RANK_PLAYERS)}" for _ in range(count)]


def around_paths(board: str, count: int, rng: random.Random) -> list[str]:
    """``count`` "around me" paths (with their query) of random players of the ``rank_bodies`` board."""
    return [
        f"/v1/boards/{board}/players/p{rng.randrange(RANK_PLAYERS)}/around?radius={AROUND_RADIUS}"
        for _ in range(count)
    ]


def friends_bodies(count: int, rng: random.Random) -> list[bytes]:
    """``count`` players:query bodies of ``FRIENDS`` random players of the ``rank_bodies`` board."""
    import orjson

    return [
        orjson.dumps({"player_ids": [f"p{n}" for n in rng.sample(range(RANK_PLAYERS), FRIENDS)]})
        for _ in range(count)
    ]


def _callgrind(*flags: str) -> None:
    """In a worker under callgrind (--instructions): tell valgrind, which runs this very process."""
    subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, capture_output=True)


async def _measure(
    url: str, shards: int, requests: int, concurrency: int, waves: int = 0, warm: int = WARM
) -> dict[str, float]:
    """In a worker process: the app of the source tree on ``sys.path`` first, measured. With
    ``waves`` (--instructions, the process under callgrind), the requests go in waves and only they
    are counted, each measure dumped to a file of its own; the result is then the requests of each
    dump."""
    from router.app import create_app
    from router.settings import Settings
    from shardlb.config import BoardConfig

    # read_rate 0: the "my rank" reads come from one address, as wrk's to bench-s3 (whose router
    # runs with SHARDLB_READ_RATE=0); the writes and /healthz take no read token.
    settings = Settings(redis_url=url, admin_keys=(ADMIN,), write_keys=(WRITE,), read_rate=0.0)
    app = create_app(settings)
    # Fixed width: a counted run's board name (in every key) is as long in each variant.
    board = f"app-cost-{os.getpid():07d}-{time.time_ns() % 10**9:09d}"
    ranked = f"{board}-s{RANK_SHARDS}"
    headers = [
        (b"host", b"router"),
        (b"content-type", b"application/json"),
        (b"accept", b"application/json"),
        (b"authorization", f"Bearer {WRITE}".encode()),
    ]
    reads, read_headers = f"/v1/boards/{ranked}/players/", [(b"host", b"router")]  # as wrk sends them
    # "around me" and friends as Locust's mix sends them (bench/locustfile.py): JSON asked for, no key.
    listed = [(b"host", b"router"), (b"accept", b"application/json")]
    friends = f"/v1/boards/{ranked}/players:query"

    async def call(method: str, path: str, body: bytes) -> int:
        path, _, query = path.partition("?")
        length = (b"content-length", str(len(body)).encode())
        if path == friends:
            head = [*listed, (b"content-type", b"application/json"), length]
        elif path.startswith(reads):
            head = listed if path.endswith("/around") else read_headers
        else:
            head = [*headers, length]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
            "root_path": "",
            "headers": head, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        status = 0

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    async def timed(method: str, sent: list[tuple[str, bytes]], width: int = concurrency) -> float:
        """CPU µs a request over ``sent`` (paths and bodies), ``width`` at a time."""
        queue = iter(sent)

        async def worker() -> None:
            for at, body in queue:
                status = await call(method, at, body)
                if status >= 300:
                    raise RuntimeError(f"{method} {at} answered {status}")

        start = time.process_time()
        await asyncio.gather(*(worker() for _ in range(width)))
        return (time.process_time() - start) / len(sent) * 1e6

    async def in_waves(method: str, sent: list[tuple[str, bytes]], width: int = concurrency) -> None:
        """``sent`` ``width`` at a time, each wave answered before the next."""
        for at in range(0, len(sent), width):
            wave = sent[at : at + width]
            statuses = await asyncio.gather(*(call(method, path, body) for path, body in wave))
            if max(statuses) >= 300:
                raise RuntimeError(f"{method} {wave[0][0]} answered {max(statuses)}")

    async def counted(method: str, sent: list[tuple[str, bytes]], width: int = concurrency) -> int:
        """Instructions on around ``sent`` in waves, then dumped (the dump also zeroes them):
        the number of requests of the dump."""
        _callgrind("--instr=on")
        await in_waves(method, sent, width)
        _callgrind("--instr=off")
        _callgrind("--dump")
        return len(sent)

    async with app.router.lifespan_context(app):
        store = app.state.service.boards.store
        await store.create(BoardConfig.from_dict(board, {"sharding": {"strategy": "hash", "shards": shards}}))
        # bench-s3's settings (bench/testbed.py, create_board): hash shards, one per master, no journal.
        rank_board = {"sharding": {"strategy": "hash", "shards": RANK_SHARDS}, "durability": "memory"}
        await store.create(BoardConfig.from_dict(ranked, rank_board))
        path = f"/v1/boards/{board}/scores"

        def posts(payloads: list[bytes], to: str = path) -> list[tuple[str, bytes]]:
            return [(to, body) for body in payloads]

        def gets(paths: list[str]) -> list[tuple[str, bytes]]:
            return [(at, b"") for at in paths]

        width = min(concurrency, RANK_CONCURRENCY, getattr(settings, "read_concurrency", RANK_CONCURRENCY))
        fill = posts(rank_bodies(random.Random("app-cost-rank")), f"/v1/boards/{ranked}/scores")
        try:
            if waves:
                await _stop_timed_loops(app.state.service)
                rng = random.Random("app-cost")  # the same posts in every counted run
                await in_waves("POST", posts(bodies(warm, 1, rng, 0)))
                ones = posts(bodies(waves * concurrency, 1, rng, 10**7))
                tens = posts(bodies(max(1, waves // 5) * concurrency, 10, rng, 2 * 10**7))
                one = await counted("POST", ones)
                ten = await counted("POST", tens)
                healthz = await counted("GET", gets(["/healthz"] * max(1, waves // 4) * concurrency))
                await in_waves("POST", fill)
                await in_waves("GET", gets(rank_paths(ranked, max(1, warm // 4), rng)), width)
                rank = await counted("GET", gets(rank_paths(ranked, waves * concurrency, rng)), width)
                await in_waves("GET", gets(around_paths(ranked, max(1, warm // 16), rng)), width)
                quarter = max(1, waves * concurrency // 4)
                around = await counted("GET", gets(around_paths(ranked, quarter, rng)), width)
                await in_waves("POST", posts(friends_bodies(max(1, warm // 16), rng), friends), width)
                found = posts(friends_bodies(quarter, rng), friends)
                friend = await counted("POST", found, width)
                return dict(zip(COUNTS, (one, ten, healthz, rank, around, friend), strict=True))
            rng = random.Random(board)
            if warm:  # (timed divides by the requests it sent)
                await timed("POST", posts(bodies(warm, 1, rng, 0)))
            one = await timed("POST", posts(bodies(requests, 1, rng, 10**7)))
            ten = await timed("POST", posts(bodies(max(1, requests // 10), 10, rng, 2 * 10**7)))
            healthz = await timed("GET", gets(["/healthz"] * max(1, requests // 4)))
            await timed("POST", fill)
            if warm:
                await timed("GET", gets(rank_paths(ranked, max(1, warm // 4), rng)), width)
            rank = await timed("GET", gets(rank_paths(ranked, max(1, requests // 4), rng)), width)
            if warm:
                await timed("GET", gets(around_paths(ranked, max(1, warm // 16), rng)), width)
                await timed("POST", posts(friends_bodies(max(1, warm // 16), rng), friends), width)
            around = await timed("GET", gets(around_paths(ranked, max(1, requests // 16), rng)), width)
            friend = await timed("POST", posts(friends_bodies(max(1, requests // 16), rng), friends), width)
        finally:
            await store.delete(board)
            await store.delete(ranked)
    return {
        "one_match_us": one, "ten_matches_us": ten, "healthz_us": healthz, "rank_us": rank,
        "around_us": around, "friends_us": friend,
    }  # fmt: skip


async def _stop_timed_loops(service: Any) -> None:
    """--instructions: end the service's timed loops (the bans' refresh, the registry's follow, the
    journals' and reshards' polls...) before anything is counted. They tick with the wall time,
    which callgrind stretches some 50 times and the machine's load more: counted, they moved a
    one-match post by 1-3% between runs of the same code. The service stops them alike at its end."""
    tasks = list(getattr(service, "tasks", ()))  # (a revision without them has none to stop)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def worker_main(args: argparse.Namespace) -> int:
    result = asyncio.run(
        _measure(args.url, args.shards, args.requests, args.concurrency, args.count_waves, args.warm)
    )
    print(json.dumps(result))
    return 0


def measure(
    root: Path, url: str, shards: int, requests: int, concurrency: int, warm: int = WARM
) -> dict[str, float]:
    """One round of one variant: this file run as a script in a fresh process, with the source tree
    at ``root`` first on the path (its router/ and shardlb/ are the ones measured)."""
    target = ["--url", url, "--shards", str(shards), "--concurrency", str(concurrency), "--warm", str(warm)]
    return _worker(root, [*target, "--requests", str(requests)])


def _worker(root: Path, args: list[str], under: list[str] | None = None) -> dict[str, float]:
    """Run this file as a worker with ``args`` in a fresh process, with ``root`` first on the path;
    the JSON of its last line. ``under``: a command it runs under (valgrind), with a fixed hash
    seed: str hashes, and so the order of sets and the probes of dicts, are the same in every run."""
    env = {**os.environ, "PYTHONPATH": str(root), "SHARDLB_LOG_LEVEL": "warning"}
    if under:
        env["PYTHONHASHSEED"] = "0"
    command = [*(under or []), sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=root, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the worker for {root} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _dump_total(dump: Path) -> int:
    """The instructions of one callgrind dump (its ``totals:`` line: with instrumentation off at the
    start, the ``summary:`` line of a dump says 0)."""
    for line in dump.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def count(
    root: Path, url: str, shards: int, waves: int, concurrency: int, warm: int = WARM
) -> dict[str, float]:
    """One counted run of one variant (--instructions): the worker of ``measure`` under callgrind,
    instrumentation on only around its waves of posts; instructions a request of each measure."""
    with tempfile.TemporaryDirectory(prefix="app-count-") as tmp:
        out = Path(tmp) / "callgrind.out"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        target = ["--url", url, "--shards", str(shards), "--concurrency", str(concurrency)]
        target += ["--warm", str(warm)]
        requests = _worker(root, [*target, "--count-waves", str(waves)], valgrind)
        # One dump a measure, numbered in the order counted (callgrind.out.1, .2, ...).
        dumps = sorted(Path(tmp).glob(out.name + ".*"), key=lambda p: int(p.suffix[1:]))
        if len(dumps) != len(COUNTS):
            raise RuntimeError(f"expected {len(COUNTS)} callgrind dumps, found {[p.name for p in dumps]}")
        return {key: _dump_total(dump) / requests[key] for key, dump in zip(COUNTS, dumps, strict=True)}


def counts_summary(counts: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each variant's instructions a request, with the fit of its two posts."""
    out = {}
    for label, result in counts.items():
        per_request, per_score = fit(result["one_match_ir"], result["ten_matches_ir"])
        out[label] = {**result, "per_request_ir": per_request, "per_score_ir": per_score}
    return out


def summarise(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each variant's median of every measure over its rounds, with the fit of its two posts."""
    out = {}
    for label, results in rounds.items():
        # A measure a round lacks (an app_cost.json of a run before it was measured) is left out.
        medians = {
            k: statistics.median(r[k] for r in results) for k in MEASURES if all(k in r for r in results)
        }
        per_request, per_score = fit(medians["one_match_us"], medians["ten_matches_us"])
        out[label] = {**medians, "per_request_us": per_request, "per_score_us": per_score}
    return out


ROWS = (
    ("post of 1 match (10 scores), µs a request", "one_match_us"),
    ("post of 10 matches (100 scores), µs a request", "ten_matches_us"),
    ("GET /healthz (Starlette's path), µs a request", "healthz_us"),
    (f"GET my rank ({RANK_SHARDS} hash shards, {RANK_PLAYERS:,} players), µs a request", "rank_us"),
    (f"GET around me (radius {AROUND_RADIUS}, the same board), µs a request", "around_us"),
    (f"POST players:query ({FRIENDS} ids, the same board), µs a request", "friends_us"),
    ("fit: a request's part, µs", "per_request_us"),
    ("fit: a score's part, µs", "per_score_us"),
)


COUNT_ROWS = (
    ("post of 1 match (10 scores), instructions a request", "one_match_ir"),
    ("post of 10 matches (100 scores), instructions a request", "ten_matches_ir"),
    ("GET /healthz (Starlette's path), instructions a request", "healthz_ir"),
    (f"GET my rank ({RANK_SHARDS} hash shards, {RANK_PLAYERS:,} players), instructions a request", "rank_ir"),
    (f"GET around me (radius {AROUND_RADIUS}, the same board), instructions a request", "around_ir"),
    (f"POST players:query ({FRIENDS} ids, the same board), instructions a request", "friends_ir"),
    ("fit: a request's part, instructions", "per_request_ir"),
    ("fit: a score's part, instructions", "per_score_ir"),
)


def table(
    summary: dict[str, dict[str, float]],
    against: str | None,
    rows: tuple[tuple[str, str], ...] = ROWS,
    title: str = "router app CPU",
    form: str = ".1f",
) -> list[str]:
    """The medians as a Markdown table, with the change against ``against`` (the instruction counts:
    COUNT_ROWS, a title of their own, whole numbers). A measure a variant lacks is "-", and so is its
    change; a row no variant has is left out."""
    labels = list(summary)
    head = f"| {title} | " + " | ".join(labels) + (" | change |" if against else " |")
    rule = "|---|" + "---:|" * len(labels) + ("---:|" if against else "")
    lines = [head, rule]
    for name, key in rows:
        values = [summary[label].get(key) for label in labels]
        if all(value is None for value in values):
            continue
        cells = ["-" if value is None else format(value, form) for value in values]
        line = f"| {name} | " + " | ".join(cells) + " |"
        if against:
            base, now = summary[against].get(key), summary["this"].get(key)
            line += f" {100 * (now - base) / base:+.1f}% |" if base and now is not None else " - |"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.app_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--against", help="also measure the router of this git revision")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the variants taking turns (default 3)")
    parser.add_argument(
        "--requests", type=int, default=20_000, help="posts of one match a round (default 20000)"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    parser.add_argument("--shards", type=int, default=16, help="the board's hash shards (default 16)")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count each variant's instructions under callgrind, around its posts only (a proxy)",
    )
    parser.add_argument(
        "--waves",
        type=int,
        default=20,
        help="--instructions: waves of --concurrency one-match posts counted (default 20)",
    )
    parser.add_argument(
        "--warm",
        type=int,
        default=WARM,
        help=f"posts of one match sent before anything is measured or counted (default {WARM})",
    )
    parser.add_argument("--url", help="(worker) the cluster; without --worker a cluster is started here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count-waves", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if (
        args.rounds < (0 if args.instructions else 1)
        or args.requests < 10
        or args.concurrency < 1
        or args.waves < 1
        or args.warm < 0
        or not 1 <= args.shards <= 1024
    ):
        parser.error(
            "--rounds at least 1 (0 with --instructions), --requests at least 10, --concurrency and "
            "--waves at least 1, --warm at least 0, --shards 1-1024"
        )
    if args.instructions:
        from bench.lua_cost import missing_tools

        missing = missing_tools()
        if missing:
            print(f"app cost: instructions not counted: {missing}", file=sys.stderr)
            return 1
    from bench.harness import log, run_dir
    from bench.testbed import start_cluster

    with tempfile.TemporaryDirectory(prefix="app-cost-") as tmp:
        roots = {"this": ROOT}
        if args.against:
            tree = Path(tmp) / "against"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tree), args.against],
                cwd=ROOT, check=True, capture_output=True,
            )  # fmt: skip
            roots[args.against] = tree
        cluster = None
        try:
            url = args.url
            if url is None:
                cluster = start_cluster(3, 0, Path(tmp) / "cluster", 19300)
                url = cluster.url
            rounds: dict[str, list[dict[str, float]]] = {label: [] for label in roots}
            for n in range(args.rounds):
                order = list(roots) if n % 2 == 0 else list(reversed(roots))
                for label in order:
                    result = measure(
                        roots[label], url, args.shards, args.requests, args.concurrency, args.warm
                    )
                    rounds[label].append(result)
                    figures = ", ".join(f"{k} {v:.1f}" for k, v in result.items())
                    log(f"app cost round {n + 1}, {label}: {figures}")
            counts: dict[str, dict[str, float]] = {}
            if args.instructions:
                for label, root in roots.items():
                    counts[label] = count(root, url, args.shards, args.waves, args.concurrency, args.warm)
                    figures = ", ".join(f"{k} {v:,.0f}" for k, v in counts[label].items())
                    log(f"app cost instructions, {label}: {figures}")
        finally:
            if cluster is not None:
                cluster.down()
            if args.against:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(roots[args.against])], cwd=ROOT, check=False
                )
    summary = summarise(rounds) if args.rounds else {}
    instructions = counts_summary(counts)
    out = run_dir("app-" + time.strftime("%Y%m%d-%H%M%S"))
    names = ("against", "rounds", "requests", "concurrency", "shards", "instructions", "waves", "warm")
    settings = {k: getattr(args, k) for k in names}
    report = {"settings": settings, "rounds": rounds, "summary": summary, "instructions": instructions}
    (out / "app_cost.json").write_text(json.dumps(report, indent=2))
    where = f"{os.path.relpath(out, ROOT)}/app_cost.json"
    if summary:
        print(f"Router app CPU a request, no HTTP server ({where})")
        print("\n".join(table(summary, args.against)))
    if instructions:
        print(
            f"\nRouter app instructions a request under callgrind, {args.waves} waves of "
            f"{args.concurrency} posts of one match counted ({where}). A proxy: an instruction of the "
            "interpreter weighs as much as one of C, and the kernel's work and cache misses are not in it."
        )
        title = "router app instructions (proxy)"
        print("\n".join(table(instructions, args.against, COUNT_ROWS, title, ",.0f")))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        # Run as a script: Python put bench/ first on the path, where its modules would shadow
        # top-level names; the worker imports the tree on PYTHONPATH only.
        sys.path.remove(str(Path(__file__).resolve().parent))
    sys.exit(main())
