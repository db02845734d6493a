"""What the router app itself spends on a score write, without an HTTP server in front of it.

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
and a score's part of the app's CPU (two equations: CPU = per request + scores x per score).

Variants take turns for ``--rounds`` rounds (the machine's load moves, so each round compares
neighbours), and the table has each variant's median; with ``--against``, the change. The other
revision runs from a git worktree of it in a temporary directory. Results: a table on stdout and
``app_cost.json`` in bench/results/app-<time>/.

CPU time on a shared 2-core VM cannot tell a 5% change from noise (the same change measured -7.1% and
+8.9% in two runs of 7 rounds). ``--instructions`` adds a count that repeats: each variant runs once
more, under ``valgrind --tool=callgrind`` with instrumentation off from the start, and turns it on
(``callgrind_control -i on``) only around ``--waves`` waves of ``--concurrency`` one-match posts, a
fifth as many waves of ten-match posts and a quarter as many of ``GET /healthz``, each wave gathered
and answered before the next (so every wave's scores go to the coalescer together, whatever the
machine's load), from a fixed seed and ``PYTHONHASHSEED``, the service's timed loops stopped first
(they tick with the wall time, not the posts). It is a proxy: an instruction of the
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
MEASURES = ("one_match_us", "ten_matches_us", "healthz_us")
COUNTS = ("one_match_ir", "ten_matches_ir", "healthz_ir")  # --instructions, in the order counted


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


def _callgrind(*flags: str) -> None:
    """In a worker under callgrind (--instructions): tell valgrind, which runs this very process."""
    subprocess.run(["callgrind_control", *flags, str(os.getpid())], check=True, capture_output=True)


async def _measure(
    url: str, shards: int, requests: int, concurrency: int, waves: int = 0, warm: int = WARM
) -> dict[str, float]:
    """In a worker process: the app of the source tree on ``sys.path`` first, measured. With
    ``waves`` (--instructions, the process under callgrind), the posts go in waves and only they are
    counted, each measure dumped to a file of its own; the result is then the posts of each dump."""
    from router.app import create_app
    from router.settings import Settings
    from shardlb.config import BoardConfig

    settings = Settings(redis_url=url, admin_keys=(ADMIN,), write_keys=(WRITE,))
    app = create_app(settings)
    # Fixed width: a counted run's board name (in every key) is as long in each variant.
    board = f"app-cost-{os.getpid():07d}-{time.time_ns() % 10**9:09d}"
    headers = [
        (b"host", b"router"),
        (b"content-type", b"application/json"),
        (b"accept", b"application/json"),
        (b"authorization", f"Bearer {WRITE}".encode()),
    ]

    async def call(method: str, path: str, body: bytes) -> int:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
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

    async def timed(method: str, path: str, payloads: list[bytes]) -> float:
        """CPU µs a request over ``payloads``, ``concurrency`` at a time."""
        queue = iter(payloads)

        async def worker() -> None:
            for body in queue:
                status = await call(method, path, body)
                if status >= 300:
                    raise RuntimeError(f"{method} {path} answered {status}")

        start = time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return (time.process_time() - start) / len(payloads) * 1e6

    async def in_waves(method: str, path: str, payloads: list[bytes]) -> None:
        """``payloads`` ``concurrency`` at a time, each wave answered before the next."""
        for at in range(0, len(payloads), concurrency):
            statuses = await asyncio.gather(*(call(method, path, b) for b in payloads[at : at + concurrency]))
            if max(statuses) >= 300:
                raise RuntimeError(f"{method} {path} answered {max(statuses)}")

    async def counted(method: str, path: str, payloads: list[bytes]) -> int:
        """Instructions on around ``payloads`` in waves, then dumped (the dump also zeroes them):
        the number of requests of the dump."""
        _callgrind("--instr=on")
        await in_waves(method, path, payloads)
        _callgrind("--instr=off")
        _callgrind("--dump")
        return len(payloads)

    async with app.router.lifespan_context(app):
        store = app.state.service.boards.store
        await store.create(BoardConfig.from_dict(board, {"sharding": {"strategy": "hash", "shards": shards}}))
        path = f"/v1/boards/{board}/scores"
        try:
            if waves:
                await _stop_timed_loops(app.state.service)
                rng = random.Random("app-cost")  # the same posts in every counted run
                await in_waves("POST", path, bodies(warm, 1, rng, 0))
                ones = bodies(waves * concurrency, 1, rng, 10**7)
                tens = bodies(max(1, waves // 5) * concurrency, 10, rng, 2 * 10**7)
                one = await counted("POST", path, ones)
                ten = await counted("POST", path, tens)
                healthz = await counted("GET", "/healthz", [b""] * max(1, waves // 4) * concurrency)
                return dict(zip(COUNTS, (one, ten, healthz), strict=True))
            rng = random.Random(board)
            if warm:  # (timed divides by the posts it sent)
                await timed("POST", path, bodies(warm, 1, rng, 0))
            one = await timed("POST", path, bodies(requests, 1, rng, 10**7))
            ten = await timed("POST", path, bodies(max(1, requests // 10), 10, rng, 2 * 10**7))
            healthz = await timed("GET", "/healthz", [b""] * max(1, requests // 4))
        finally:
            await store.delete(board)
    return {"one_match_us": one, "ten_matches_us": ten, "healthz_us": healthz}


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
        medians = {k: statistics.median(r[k] for r in results) for k in MEASURES}
        per_request, per_score = fit(medians["one_match_us"], medians["ten_matches_us"])
        out[label] = {**medians, "per_request_us": per_request, "per_score_us": per_score}
    return out


ROWS = (
    ("post of 1 match (10 scores), µs a request", "one_match_us"),
    ("post of 10 matches (100 scores), µs a request", "ten_matches_us"),
    ("GET /healthz (Starlette's path), µs a request", "healthz_us"),
    ("fit: a request's part, µs", "per_request_us"),
    ("fit: a score's part, µs", "per_score_us"),
)


COUNT_ROWS = (
    ("post of 1 match (10 scores), instructions a request", "one_match_ir"),
    ("post of 10 matches (100 scores), instructions a request", "ten_matches_ir"),
    ("GET /healthz (Starlette's path), instructions a request", "healthz_ir"),
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
    COUNT_ROWS, a title of their own, whole numbers)."""
    labels = list(summary)
    head = f"| {title} | " + " | ".join(labels) + (" | change |" if against else " |")
    rule = "|---|" + "---:|" * len(labels) + ("---:|" if against else "")
    lines = [head, rule]
    for name, key in rows:
        cells = [format(summary[label][key], form) for label in labels]
        line = f"| {name} | " + " | ".join(cells) + " |"
        if against:
            base = summary[against][key]
            line += f" {100 * (summary['this'][key] - base) / base:+.1f}% |" if base else " - |"
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
