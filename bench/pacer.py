"""A light paced load of score writes: what the router's write latency is when the load generator
takes little of the machine.

    python -m bench.pacer --url http://127.0.0.1:22400 --users 158 --rps 5 --seconds 16 --settle 6

Locust's users cost about as much CPU per request as the router itself (``summary.md``, "Where the
CPU goes"): on the bench's two shared cores a Locust step at 80% of the sustained rate leaves the
router waiting for a core, and the router's own latency histogram shows it. This client offers the
same load the same way (``users`` users, one keep-alive connection each, each posting a match of
the bench's workload every 1/``rps`` s and waiting out the rest of that period after the response,
as Locust's ``constant_throughput`` does, with the same share of exact retries) from one uvloop
process that writes HTTP/1.1 by hand, a fraction of Locust's CPU per request. Its figures are the
service's latency with less of the machine taken by the client; Locust's stay in the bench beside
them. ``--matches N`` puts N matches in each request, as a game server batching its results
would. Prints one JSON object: requests, the fresh player-scores they carried (``scores``; an exact
retry's go to ``replayed_scores``, as they write nothing new) and failures after ``settle`` s,
the requests' rate, p50/p95/p99 ms, the client's own CPU seconds, and in how many of the counted
window's 100 ms slots the requests at or above the p99 started (``p99_slots``, ``SLOT_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from bench.latency import percentile
from bench.workload import Workload

RECENT_POSTS = 64  # as the locustfile: a retry replays one of the user's last posts
# ``p99_slots`` counts the slots of this length in which the requests at or above the p99 started:
# a handful of a window's hundred says that its p99 is the worst few hundred ms of it (one stall
# of the router or the machine), not a tail spread over the whole window.
SLOT_S = 0.1


@dataclass
class Tally:
    """Latencies (ms) and failures of the requests that started after the settle time."""

    latencies: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # each latency's start, s from the run's start
    scores: int = 0  # fresh player-scores in the counted requests
    replayed_scores: int = 0  # those of the counted exact retries: they write nothing new
    failures: int = 0
    failure_samples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.failure_samples) < 5:
            self.failure_samples.append(what)

    def p99_slots(self) -> dict[str, int] | None:
        """The SLOT_S slots in which the requests at or above the p99 started (``slots``), and how
        many of them the busiest slot holds (``busiest``) of how many (``requests``)."""
        if not self.latencies:
            return None
        p99 = percentile(sorted(self.latencies), 99)
        counts: dict[int, int] = {}
        for start, ms in zip(self.starts, self.latencies, strict=True):
            if ms >= p99:
                slot = int(start / SLOT_S)
                counts[slot] = counts.get(slot, 0) + 1
        return {"slots": len(counts), "busiest": max(counts.values()), "requests": sum(counts.values())}

    def summary(self, seconds: float) -> dict[str, Any]:
        done = sorted(self.latencies)
        return {
            "requests": len(done),
            "scores": self.scores,
            "replayed_scores": self.replayed_scores,
            "failures": self.failures,
            "requests_per_s": round(len(done) / seconds, 1) if seconds > 0 else 0.0,
            "p50_ms": round(percentile(done, 50), 1) if done else None,
            "p95_ms": round(percentile(done, 95), 1) if done else None,
            "p99_ms": round(percentile(done, 99), 1) if done else None,
            "p99_slots": self.p99_slots(),
            "failure_samples": self.failure_samples,
        }


class MatchBodies:
    """A user's next POST body, its score count and whether it is a replay: ``matches`` new matches
    of ``workload`` (a game server may batch its results), or, with the workload's retry share, an
    exact replay of one of the user's recent accepted posts (which writes nothing new). A post
    joins those only through ``accepted``: one the router refused wrote nothing, and sent again it
    would write its scores for the first time, counted as a replay's."""

    def __init__(self, workload: Workload, rng: random.Random, matches: int = 1) -> None:
        self.workload, self.rng, self.matches = workload, rng, matches
        self.recent: deque[tuple[bytes, int]] = deque(maxlen=RECENT_POSTS)

    def __call__(self) -> tuple[bytes, int, bool]:
        if self.recent and self.rng.random() < self.workload.retry_share:
            return (*self.rng.choice(self.recent), True)
        scores = []
        for _ in range(self.matches):
            match_id, players = self.workload.match(self.rng)
            scores += [{"player_id": p, "points": s, "match_id": match_id} for p, s in players]
        return orjson.dumps({"scores": scores}), len(scores), False

    def accepted(self, body: bytes, scores: int) -> None:
        """A new post the router answered 200: from now on it may be replayed."""
        self.recent.append((body, scores))


def request_bytes(host: str, path: str, key: str, body: bytes) -> bytes:
    """One HTTP/1.1 POST with a JSON body, headers and body in one write."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Accept: application/json\r\n{auth}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _response(reader: asyncio.StreamReader) -> int:
    """Read one response; its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _user(
    i: int, users: int, args: argparse.Namespace, workload: Workload, t0: float, tally: Tally
) -> None:
    """One paced user: started i/users of a second in, then a request every 1/rps s until the end."""
    split = urlsplit(args.url)
    host, port = split.hostname or "127.0.0.1", split.port or 80
    path = f"/v1/boards/{workload.board}/scores"
    bodies = MatchBodies(workload, random.Random(f"{args.seed}/{i}"), args.matches)  # seed: see run()
    period, end, settle_at = 1.0 / args.rps, t0 + args.seconds, t0 + args.settle
    await asyncio.sleep(i / users)
    streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    while (start := time.perf_counter()) < end:
        body, scores, replay = bodies()
        try:
            if streams is None:
                streams = await asyncio.open_connection(host, port)
            reader, writer = streams
            writer.write(request_bytes(f"{host}:{port}", path, args.key, body))
            status = await _response(reader)
            failed = None if status == 200 else f"HTTP {status}"
            if failed is None and not replay:
                bodies.accepted(body, scores)
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            failed = repr(e)
            await _close(streams)
            streams = None
        done = time.perf_counter()
        if start >= settle_at:
            if failed is None:
                tally.latencies.append((done - start) * 1000)
                tally.starts.append(start - t0)
                if replay:
                    tally.replayed_scores += scores
                else:
                    tally.scores += scores
            else:
                tally.fail(failed)
        await asyncio.sleep(max(0.0, period - (done - start)))
    await _close(streams)


async def _close(streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
    if streams is not None:
        streams[1].close()
        with contextlib.suppress(OSError):
            await streams[1].wait_closed()


async def run(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """Run every user until ``args.seconds``; the tally of the requests after ``args.settle``.

    Without ``args.seed`` the run draws one of its own, so its matches are new: a run that posted
    another run's matches again would write duplicates, which cost the store a check, not a write."""
    if args.seed is None:
        args = argparse.Namespace(**{**vars(args), "seed": os.urandom(8).hex()})
    tally = Tally()
    t0 = time.perf_counter()
    await asyncio.gather(*(_user(i, args.users, args, workload, t0, tally) for i in range(args.users)))
    result = tally.summary(args.seconds - args.settle)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["client_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    result["offered_requests_per_s"] = args.users * args.rps
    return result


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:22400")
    parser.add_argument("--users", type=int, required=True)
    parser.add_argument("--rps", type=float, default=5.0, help="requests a second per user")
    parser.add_argument("--seconds", type=float, default=16.0)
    parser.add_argument("--settle", type=float, default=6.0, help="requests started before are not counted")
    parser.add_argument("--key", default="", help="the write key (Bearer)")
    parser.add_argument(
        "--seed", help="repeat the matches of another run with this seed (default: new ones each run)"
    )
    parser.add_argument(
        "--matches", type=int, default=1, help="matches per request (a game server batching results)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = (p := parser()).parse_args(argv)
    if args.users < 1 or args.rps <= 0 or not 0 <= args.settle < args.seconds or args.matches < 1:
        p.error("need --users >= 1, --rps > 0, --matches >= 1 and 0 <= --settle < --seconds")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency of the router
        pass
    result = asyncio.run(run(args, Workload.from_env()))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
