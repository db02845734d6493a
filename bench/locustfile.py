"""Locust load test for a shardlb router: game servers post match results, players read the board.

    locust -f bench/locustfile.py --host http://127.0.0.1:8000 GameServer Player

Users (pick on the command line; both by default):
- ``GameServer`` posts one match per request: SHARDLB_MATCH_PLAYERS players (default 10) drawn from
  SHARDLB_PLAYERS with a Zipf-like skew (SHARDLB_SKEW), points from SHARDLB_POINTS, a unique match id;
  a share SHARDLB_RETRY_SHARE (default 0.05) of posts repeat one of the user's recent accepted posts
  verbatim.
  Paced at SHARDLB_USER_RPS requests/s per user (default 10; or, with SHARDLB_USERS set and no
  SHARDLB_USER_RPS, so that that many users offer SHARDLB_TARGET_WRITES player-scores a second:
  it paces them and starts none, so without a shape give -u the same count).
- ``Player`` reads in the mix SHARDLB_READ_MIX (default ``top:30,rank:35,around:15,friends:15,page:5``):
  top-100, my rank, around me (radius SHARDLB_AROUND_RADIUS, default 5), friends (SHARDLB_FRIENDS
  ids, default 20-200, POST players:query), a page (SHARDLB_PAGE_LIMIT entries, default 50). Paced at
  SHARDLB_READER_RPS requests/s per user (default 5).
See bench/workload.py for every distribution. Each user waits a random share of its period before
its first request and keeps that phase (``paced``), so that users started together do not send in
step (SHARDLB_USER_PHASE=together: Locust's own start, every user at once).

Writes are counted in player-scores, not only requests: every accepted post of new results also
fires a request event of type ``WRITE`` named ``player-scores`` whose response length is the number
of scores it carried. In the CSVs, that entry's Request Count x Average Content Size is the scores
written. An accepted replay fires ``WRITE replayed-scores`` instead: the router answers it from its
dedup records and writes nothing. Targets (SHARDLB_TARGET_WRITES) count fresh scores: the users post
1 / (1 - SHARDLB_RETRY_SHARE) times as many.

Shapes (SHARDLB_SHAPE; unset: Locust's own -u/-r/-t): ``ramp`` to SHARDLB_TARGET_WRITES player-score
writes/s in SHARDLB_STEPS steps, ``soak`` at the target, ``spike`` 10x for 30 s (see bench/shapes.py);
SHARDLB_DURATION seconds. A shape's users are ``GameServer`` users sized for the target, whether or not
the command line names the classes; ``Player`` users join them only with SHARDLB_TARGET_READS reads/s
(default 0: none), SHARDLB_TARGET_READS / SHARDLB_READER_RPS of them from the start to the end.
SHARDLB_WRITE_HOST (a base URL, e.g. http://shardlb-router-writes:8000; default: --host) sends the
game servers' score posts there and every other request to --host, as game servers and players use a
write pool (k8s/README.md, "Sizing"); the CSV rows are the same either way.
Keys: SHARDLB_WRITE_KEY (writes), SHARDLB_READ_KEY (reads, when required),
SHARDLB_ADMIN_KEY (when set, the board SHARDLB_BOARD is created at test start with PUT, idempotent,
as a hash board of SHARDLB_SHARDS shards, default 16; a 429 or 503 is asked again after Retry-After
for CREATE_PATIENCE_S, any other refusal stops the test before any user, exit status 1, with the
router's answer on one line).
SHARDLB_PRELOAD=1 (default 0: none) gives every player of SHARDLB_PLAYERS their initial points at
test start, after the board's creation and before any user (``preload``): without it, most rank and
around reads of a fresh board are 404 player_not_found, cheap, and counted as successes; once a
process and --host (a second Start in the web UI skips it); a region board is refused (the users
post no region).
SHARDLB_CONTENT=msgpack sends and accepts MessagePack instead of JSON.
A value the test cannot use (a word for a number, a rate of 0, an unknown SHARDLB_CONTENT) stops it
before its first request, naming the variable; a SHARDLB_* variable whose name is nearly one of these
is logged as a likely misspelling (it is ignored).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

import gevent
import gevent.pool
import locust.runners
import msgpack
import orjson
from locust import FastHttpUser, LoadTestShape, User, events, task
from locust.runners import WorkerRunner

from bench import shapes
from bench.workload import INITIAL_SPREAD_S, Workload

# Every SHARDLB_* variable the test reads, here and in bench/workload.py: a variable near one of
# these names is a misspelling (``misspelled``), and the test would run on the default instead.
SETTINGS = (
    "SHARDLB_ADMIN_KEY", "SHARDLB_AROUND_RADIUS", "SHARDLB_BOARD", "SHARDLB_CONTENT", "SHARDLB_DURATION",
    "SHARDLB_FRIENDS", "SHARDLB_MATCH_PLAYERS", "SHARDLB_PAGE_LIMIT", "SHARDLB_PLAYERS", "SHARDLB_POINTS",
    "SHARDLB_PRELOAD", "SHARDLB_READER_RPS", "SHARDLB_READ_KEY", "SHARDLB_READ_MIX", "SHARDLB_RETRY_SHARE",
    "SHARDLB_SHAPE", "SHARDLB_SHARDS", "SHARDLB_SKEW", "SHARDLB_STEPS", "SHARDLB_TARGET_READS",
    "SHARDLB_TARGET_WRITES", "SHARDLB_USERS", "SHARDLB_USER_PHASE", "SHARDLB_USER_RPS", "SHARDLB_WRITE_HOST",
    "SHARDLB_WRITE_KEY",
)  # fmt: skip
# Other programs' variables, which share the environment of `make bench` (bench/run.py) and its steps.
OTHER_PREFIXES = ("SHARDLB_BENCH_", "SHARDLB_STEPS_")


def unusable(message: str) -> NoReturn:
    """Stop the test as Locust imports the file, saying ``message`` (it names the variable) on a line
    of its own, exit status 1. Until 2026-12-06 it was a ValueError, whose message came last in a
    Python traceback through Locust's loader."""
    raise SystemExit(message)


def number(name: str, default: float, lo: float, hi: float, integer: bool = False) -> float:
    """The variable ``name`` as a number from ``lo`` to ``hi`` (``default`` when unset or empty).
    Anything else stops the test as Locust imports the file, with the variable named: a value the
    test cannot use would run a test other than the one asked for, or fail later without a name."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and lo <= value <= hi and (value.is_integer() or not integer)):
        kind = "a whole number" if integer else "a number"
        unusable(f"{name}={raw!r}: expected {kind} from {lo:g} to {hi:g}")
    return value


def choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable ``name``, one of ``choices`` (the first when unset or empty); anything else stops
    the test, as in ``number``."""
    raw = os.environ.get(name, "").strip() or choices[0]
    if raw not in choices:
        unusable(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def misspelled(environ: dict[str, str]) -> list[str]:
    """A warning for each SHARDLB_* variable that is not one of the test's but nearly the name of one
    that is not set (the router's SHARDLB_WRITE_KEYS beside the test's own SHARDLB_WRITE_KEY is not
    a misspelling)."""
    out = []
    for name in sorted(n for n in environ if n.startswith("SHARDLB_") and n not in SETTINGS):
        near = difflib.get_close_matches(name, SETTINGS, n=1, cutoff=0.85)
        if near and near[0] not in environ and not name.startswith(OTHER_PREFIXES):
            out.append(f"{name} is not a setting of the load test and is ignored: did you mean {near[0]}?")
    return out


try:
    WORKLOAD = Workload.from_env()
except ValueError as e:  # its message names the variable
    unusable(str(e))
BOARD = WORKLOAD.board
RATE_MAX = 1e6
READER_RPS = number("SHARDLB_READER_RPS", 5, 0.001, RATE_MAX)
SHAPE = os.environ.get("SHARDLB_SHAPE", "").strip()
if SHAPE and SHAPE not in shapes.SHAPES:
    unusable(
        f"SHARDLB_SHAPE={SHAPE!r}: expected one of {', '.join(shapes.SHAPES)}, or unset for Locust's -u/-r/-t"
    )
TARGET_WRITES = number("SHARDLB_TARGET_WRITES", 20000, 0, 1e9)
TARGET_READS = number("SHARDLB_TARGET_READS", 0, 0, 1e9)
# Under a shape, the Player users that offer SHARDLB_TARGET_READS reads/s, held from the start; the
# shape's own user count is game servers alone (BenchShape.tick).
SHAPE_READERS = math.ceil(TARGET_READS / READER_RPS) if SHAPE and TARGET_READS > 0 else 0
USERS = int(number("SHARDLB_USERS", 0, 1, 1e7, integer=True))
FRESH_SHARE = WORKLOAD.fresh_share
# Without a shape, SHARDLB_USERS users together offer SHARDLB_TARGET_WRITES fresh player-scores a
# second; otherwise each user posts SHARDLB_USER_RPS requests a second.
USER_RPS = number(
    "SHARDLB_USER_RPS",
    TARGET_WRITES / USERS / WORKLOAD.players_per_match / FRESH_SHARE if USERS else 10,
    0.001,
    RATE_MAX,
)
DURATION = number("SHARDLB_DURATION", 0, 1, 1e7) or None  # None: the shape's own length
STEPS = int(number("SHARDLB_STEPS", 6, 1, 1000, integer=True))
SHARDS = int(number("SHARDLB_SHARDS", 16, 1, 1024, integer=True))
MSGPACK = choice("SHARDLB_CONTENT", ("json", "msgpack")) == "msgpack"
CONTENT_TYPE = "application/msgpack" if MSGPACK else "application/json"
RECENT_POSTS = 64
# Each user starts at a random point of its first period and keeps that phase, so that the users'
# requests spread over every period. Locust starts a step's users in a clump or a few within a
# millisecond, and its constant_throughput keeps each user's pace from its start: a "constant rate"
# step was a herd of every user's request within a few milliseconds, then silence for the rest of
# the period, where independent game servers and players send whenever their matches and screens
# end. SHARDLB_USER_PHASE=together keeps Locust's own start (every user in step).
SPREAD = choice("SHARDLB_USER_PHASE", ("spread", "together")) == "spread"
# SHARDLB_PRELOAD=1: every player of SHARDLB_PLAYERS gets their initial points before the users start
# (``preload``).
PRELOAD = choice("SHARDLB_PRELOAD", ("0", "1")) == "1"
# Workers report to the master every 3 s by default; every second makes the CSV history (and so the
# per-step rates of a ramp) three times finer, for a negligible cost.
locust.runners.WORKER_REPORT_INTERVAL = 1.0


def _auth(variable: str) -> dict[str, str]:
    key = os.environ.get(variable, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _write_host() -> str:
    """SHARDLB_WRITE_HOST without its trailing slash ("" when unset: the writes go to --host). Checked
    here, as Locust imports the file: anything but a base URL would make every post fail."""
    host = os.environ.get("SHARDLB_WRITE_HOST", "").strip().rstrip("/")
    if host and not re.fullmatch(r"https?://[^/?#\s]+", host):
        unusable(
            f"SHARDLB_WRITE_HOST={host!r}: give the write routers' base URL, e.g. http://shardlb-router-writes:8000"
        )
    return host


WRITE_HEADERS = {"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE, **_auth("SHARDLB_WRITE_KEY")}
READ_HEADERS = {"Accept": CONTENT_TYPE, **_auth("SHARDLB_READ_KEY")}
QUERY_HEADERS = {**READ_HEADERS, "Content-Type": CONTENT_TYPE}
BASE = f"/v1/boards/{BOARD}"
WRITE_HOST = _write_host()
# An absolute URL is sent as it is (FastHttpSession keeps a connection pool per host); a path goes to
# --host. The request's name, not its URL, names its row in the stats.
SCORES_URL = f"{WRITE_HOST}{BASE}/scores"


def encode(body: Any) -> bytes:
    return msgpack.packb(body) if MSGPACK else orjson.dumps(body)


def paced(rps: float) -> Callable[[User], float]:
    """A wait_time like Locust's constant_throughput that keeps each user's own phase: a task starts
    one period after the previous one was due (at once when that is past, and the pace goes on from
    there), and, with ``SPREAD``, the first one a random share of a period after the user starts."""
    period = 1.0 / rps if rps > 0 else 0.0

    def wait(user: User) -> float:
        now = time.perf_counter()
        due = max(getattr(user, "_shardlb_due", now) + period, now)
        user._shardlb_due = due  # type: ignore[attr-defined]
        return due - now

    return wait


def _start_phase(user: User, rps: float) -> None:
    """Before a user's first task: wait a random share of its period (``SPREAD``), then count its
    pace from that moment (``paced``)."""
    if SPREAD and rps > 0:
        gevent.sleep(random.uniform(0.0, 1.0 / rps))
    user._shardlb_due = time.perf_counter()  # type: ignore[attr-defined]


def error_code(body: bytes | None) -> str | None:
    """The ``error.code`` of an error reply (api.md: ``{"error": {"code": ...}}``); None when the
    body is not one."""
    if not body:
        return None
    try:
        reply = msgpack.unpackb(body) if MSGPACK else orjson.loads(body)
    except ValueError:
        return None
    error = reply.get("error") if isinstance(reply, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _no_cookies(user: FastHttpUser) -> None:
    """The router sets no cookies; skipping the cookie jar saves ~6% of Locust's CPU per request."""
    user.client.client.cookiejar = None


class GameServer(FastHttpUser):
    """A game server posting match results."""

    wait_time = paced(USER_RPS)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.recent: deque[tuple[bytes, int]] = deque(maxlen=RECENT_POSTS)
        _no_cookies(self)
        _start_phase(self, USER_RPS)

    @task
    def post_match(self) -> None:
        # A replay (a game server retrying a post whose reply it lost) writes nothing new: it gets
        # its own entry, not player-scores, which counts the scores written.
        # Only accepted posts are replayed: one the router refused wrote nothing, and sending it
        # again would write its scores for the first time.
        replay = bool(self.recent) and self.rng.random() < WORKLOAD.retry_share
        if replay:
            body, count = self.rng.choice(self.recent)
        else:
            match_id, players = WORKLOAD.match(self.rng)
            count = len(players)
            body = encode(
                {"scores": [{"player_id": p, "points": s, "match_id": match_id} for p, s in players]}
            )
        t0 = time.perf_counter()
        with self.client.post(
            SCORES_URL,
            data=body,
            headers=WRITE_HEADERS,
            catch_response=True,
            name="/v1/boards/[board]/scores",
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
                return
            response.success()
        if not replay:
            self.recent.append((body, count))
        self.environment.events.request.fire(
            request_type="WRITE",
            name="replayed-scores" if replay else "player-scores",
            response_time=(time.perf_counter() - t0) * 1000,
            response_length=count,
            exception=None,
            context={},
        )


class Player(FastHttpUser):
    """A player looking at the board: top, own rank, neighbours, friends, pages."""

    wait_time = paced(READER_RPS)
    # Locust spawns a fixed count before the weighted classes and keeps it whatever the total.
    fixed_count = SHAPE_READERS

    def on_start(self) -> None:
        self.rng = random.Random()
        _no_cookies(self)
        _start_phase(self, READER_RPS)

    def _get(self, path: str, name: str, missing_ok: bool = False) -> None:
        with self.client.get(path, headers=READ_HEADERS, name=name, catch_response=True) as response:
            # A player without a score is a correct 404; a missing board (board_not_found) is not.
            missing = response.status_code == 404 and error_code(response.content) == "player_not_found"
            if response.status_code == 200 or (missing_ok and missing):
                response.success()
            else:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")

    @task
    def read(self) -> None:
        kind = WORKLOAD.read_kind(self.rng)
        if kind == "top":
            self._get(f"{BASE}/top?limit=100", "/v1/boards/[board]/top")
        elif kind == "rank":
            # A player without a score (a small test population) is a correct 404 player_not_found.
            self._get(
                f"{BASE}/players/{WORKLOAD.player(self.rng)}",
                "/v1/boards/[board]/players/[id]",
                missing_ok=True,
            )
        elif kind == "around":
            self._get(
                f"{BASE}/players/{WORKLOAD.player(self.rng)}/around?radius={WORKLOAD.around_radius}",
                "/v1/boards/[board]/players/[id]/around",
                missing_ok=True,
            )
        elif kind == "friends":
            body = encode({"player_ids": WORKLOAD.friends(self.rng)})
            with self.client.post(
                f"{BASE}/players:query",
                data=body,
                headers=QUERY_HEADERS,
                name="/v1/boards/[board]/players:query",
                catch_response=True,
            ) as response:
                if response.status_code == 200:
                    response.success()
                else:
                    response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
        else:
            offset = WORKLOAD.page_offset(self.rng)
            self._get(
                f"{BASE}/entries?offset={offset}&limit={WORKLOAD.page_limit}", "/v1/boards/[board]/entries"
            )


class BenchShape(LoadTestShape):
    """The shape SHARDLB_SHAPE names (bench/shapes.py); absent when the variable is unset. Its stages
    count game servers; SHARDLB_TARGET_READS adds Player users, as many in every stage."""

    abstract = not SHAPE

    def __init__(self) -> None:
        super().__init__()
        self.stages = shapes.schedule(
            SHAPE or "ramp",
            TARGET_WRITES,
            DURATION,
            USER_RPS,
            WORKLOAD.players_per_match,
            STEPS,
            FRESH_SHARE,
        )

    def tick(self) -> tuple[int, float, list[type[User]]] | None:
        stage = shapes.at(self.stages, self.get_run_time())
        if stage is None:
            return None
        # Naming the classes matters: given a count alone, Locust shares it out among every class by
        # weight, half of it Player users, and the writes offered fall to half the target.
        chosen = self.runner.user_classes if self.runner else [GameServer, Player]
        classes: list[type[User]] = [GameServer]
        readers = SHAPE_READERS if Player in chosen else 0
        if readers:
            classes.append(Player)
        users = stage.users + readers
        return users, max(stage.spawn_rate, float(users)), classes


@events.init.add_listener
def clock_now(**_: Any) -> None:
    """The event loop's clock read afresh, once the locustfile is imported: Locust sets its -t timer
    just after this, on that clock, which had stood still since the loop last ran (before the
    import), and stopped the test that much early: 0.6 s of a -t of 3 s on a quiet machine, 2.2 s
    on a busy one (until 2026-12-06)."""
    gevent.get_hub().loop.update_now()


@events.init.add_listener
def warn_of_misspellings(environment: Any, **_: Any) -> None:
    """Once (on the master, or the only process), the variables that look like misspelled settings."""
    if not isinstance(environment.runner, WorkerRunner):
        for warning in misspelled(dict(os.environ)):
            logging.warning(warning)


@events.test_start.add_listener
def strip_host_slash(environment: Any, **_: Any) -> None:
    """``--host http://127.0.0.1:8000/`` (or the web UI's host with its slash) as the same router:
    every request's path starts with a slash. Here, before the board's PUT and before the runner
    hands the host to the users (and to the workers). Until 2026-12-06 the paths were joined after
    the slash: the PUT went to //v1/boards/... (404 no such route) and every user's request failed
    as a protocol-relative URI."""
    if environment.host:
        environment.host = environment.host.rstrip("/")


# How long a request of the test's own (the board's PUT, the preload's) is tried again while the
# router answers 429 or 503 (starting up, busy).
CREATE_PATIENCE_S = 60.0


class Refused(Exception):
    """The router refused a request of the test's own (or did not answer); the message says how."""


def _ask(request: urllib.request.Request, what: str) -> bytes:
    """Send ``request`` outside Locust's stats and return the body of its answer. A 429 or 503 is
    asked again after its Retry-After, for CREATE_PATIENCE_S at most; any other refusal, or no
    router answering, raises Refused with the router's answer."""
    deadline = time.monotonic() + CREATE_PATIENCE_S
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as e:
            answer = e.read()[:500].decode(errors="replace")
            wait = _retry_after(e.headers.get("retry-after"))
            if e.code in (429, 503) and time.monotonic() + wait < deadline:
                logging.warning("%s answered %d, asking again in %.1f s: %s", what, e.code, wait, answer)
                gevent.sleep(wait)
                continue
            raise Refused(f"{what} answered {e.code}: {answer}") from None
        except OSError as e:  # no router there: refused, reset, timed out
            raise Refused(f"{what} failed: {e}") from None


@events.test_start.add_listener
def create_board(environment: Any, **_: Any) -> None:
    """With SHARDLB_ADMIN_KEY set, create the board once (on the master) before any user starts.
    A 429 or 503 is tried again (after its Retry-After, for CREATE_PATIENCE_S at most); any other
    refusal stops the test with the router's answer. Until 2026-12-05 urlopen's error on a refusal
    (a 409: a board of that id with other settings) was logged by Locust as an uncaught error in an
    event handler, and the whole test ran against a board that was not the one asked for, or none."""
    if WRITE_HOST and not isinstance(environment.runner, WorkerRunner):
        logging.info("score posts go to %s, every other request to %s", WRITE_HOST, environment.host)
    admin = os.environ.get("SHARDLB_ADMIN_KEY")
    if not admin or not environment.host or isinstance(environment.runner, WorkerRunner):
        return
    body = orjson.dumps({"sharding": {"strategy": "hash", "shards": SHARDS}})
    request = urllib.request.Request(
        f"{environment.host}{BASE}",
        data=body,
        method="PUT",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {admin}"},
    )
    try:
        _ask(request, f"PUT {BASE}")
    except Refused as e:
        _stop_test(environment, str(e))


# The preload's scores a request (the API's most) and requests in flight.
PRELOAD_BATCH = 1000
PRELOAD_IN_FLIGHT = 8
DAY_MS = 86_400_000
# The hosts whose board this process has preloaded: a second Start in the web UI (a new test_start)
# goes on from there, without the minute a million players' replay would take before its first user.
PRELOADED: set[str] = set()


def preload_times(epoch_ms: int, now_ms: int) -> tuple[int, float]:
    """(anchor, scale): player ``i`` reached their points at ``anchor - initial_age_s(i) * 1000 *
    scale``. The anchor is the day's start (UTC), so that a preload run again the same day sends the
    same scores, a replay; the ages (up to 30 days, so that ties stay as rare as in a live board)
    shrink to fit after a newer epoch, before which the board refuses a time."""
    anchor = now_ms // DAY_MS * DAY_MS
    if anchor <= epoch_ms:  # a season that started today
        anchor = now_ms
    spread_ms = INITIAL_SPREAD_S * 1000
    return anchor, min(max(anchor - epoch_ms - 1, 0), spread_ms) / spread_ms


def preload_body(first: int, stop: int, anchor: int, scale: float, points_max: int) -> bytes:
    """The scores of players ``first`` .. ``stop - 1``, each under its own match id (a replay of
    the preload changes nothing)."""
    return orjson.dumps(
        {
            "scores": [
                {
                    "player_id": f"p{i}",
                    "points": min(WORKLOAD.initial_points(i), points_max),
                    "match_id": f"preload-{i}",
                    "achieved_at": anchor - int(WORKLOAD.initial_age_s(i) * 1000 * scale),
                }
                for i in range(first, stop)
            ]
        }
    )


@events.test_start.add_listener
def preload(environment: Any, **_: Any) -> None:
    """With SHARDLB_PRELOAD=1, give every player of SHARDLB_PLAYERS their initial points (the
    workload's, as `make bench` preloads them) once, on the master, after the board's creation (a
    listener registered after ``create_board``) and before any user starts: otherwise most rank and
    around reads of a fresh board are cheap 404s that Locust counts as successes. Over HTTP with the
    write key, outside Locust's stats; a 429 or 503 is asked again, any other refusal stops the test
    with the router's answer."""
    if not PRELOAD or not environment.host or isinstance(environment.runner, WorkerRunner):
        return
    if environment.host in PRELOADED:
        said = "preload: %s on %s already preloaded by this Locust process, skipped"
        logging.info(said, BOARD, environment.host)
        return
    try:
        _preload(environment.host)
    except Refused as e:
        _stop_test(environment, f"preload: {e}")
    PRELOADED.add(environment.host)
    # A shape's clock (the local runner starts it before this event) counts from the users' start.
    if environment.shape_class is not None:
        environment.shape_class.reset_time()


def _preload(host: str) -> None:
    read = {"Accept": "application/json", **_auth("SHARDLB_READ_KEY")}
    settings = orjson.loads(_ask(urllib.request.Request(f"{host}{BASE}", headers=read), f"GET {BASE}"))
    sharding = settings.get("sharding") or {}
    if sharding.get("strategy") == "region":
        # Its every score names the player's region (api.md); the test's users post none, and a
        # preload that picked regions would home players where no user of the test plays them.
        raise Refused(
            f"{BOARD} is a region board ({', '.join(sharding.get('regions', []))}): the test's users post "
            "no region, which such a board refuses, so it preloads none; load-test a hash or band board"
        )
    epoch_ms = int(datetime.fromisoformat(settings["epoch"]).timestamp() * 1000)
    anchor, scale = preload_times(epoch_ms, int(time.time() * 1000))
    headers = {"Content-Type": "application/json", "Accept": "application/json", **_auth("SHARDLB_WRITE_KEY")}
    total = WORKLOAD.players
    statuses: Counter[str] = Counter()

    def post(first: int) -> int | Refused:
        """The players posted, or the refusal, which the loop below raises: raised in the pool's
        greenlet, gevent's hub would print its traceback above the test's one line (``_stop_test``)."""
        stop = min(first + PRELOAD_BATCH, total)
        body = preload_body(first, stop, anchor, scale, int(settings["points_max"]))
        request = urllib.request.Request(f"{host}{BASE}/scores", data=body, headers=headers)
        try:
            answer = orjson.loads(_ask(request, f"POST {BASE}/scores (players p{first}..p{stop - 1})"))
        except Refused as e:
            return e
        statuses.update(r["status"] for r in answer["results"])
        return stop - first

    logging.info("preload: %d players into %s, %d a request", total, BOARD, PRELOAD_BATCH)
    t0 = time.perf_counter()
    done, tenth = 0, 1
    pool = gevent.pool.Pool(PRELOAD_IN_FLIGHT)
    try:
        for count in pool.imap_unordered(post, range(0, total, PRELOAD_BATCH)):
            if isinstance(count, Refused):
                raise count
            done += count
            if done * 10 >= tenth * total and done < total:
                tenth = done * 10 // total + 1
                rate = done / (time.perf_counter() - t0)
                logging.info("preload: %d%% (%d players), %.0f players/s", done * 100 // total, done, rate)
    finally:
        pool.kill()
    took = time.perf_counter() - t0
    logging.info(
        "preload: %d players in %.1f s (%.0f players/s): %s",
        total,
        took,
        total / took,
        ", ".join(f"{n} {status}" for status, n in sorted(statuses.items())),
    )


def _retry_after(header: str | None) -> float:
    """A Retry-After in seconds (1 when absent or not a number of seconds), at most 10."""
    try:
        return min(max(float(header or 1), 0.0), 10.0)
    except ValueError:
        return 1.0


def _stop_test(environment: Any, reason: str) -> NoReturn:
    """Stop the test before any user's request, exit code 1, saying ``reason`` on a line of its own.

    What Locust does with a StopTest raised in the start's greenlet, done here, because Locust does
    it for only some of the greenlets that fire test_start: there gevent's hub printed the
    StopTest's traceback above the line, and under --processes with -u (the master's start in a
    greenlet of locust.main) Locust logged the traceback alone as an unhandled exception and ran
    on to -t (until 2026-12-06). Leaving the start's greenlet as one killed (GreenletExit) spawns
    no user and is no error to gevent or Locust; the runner stops in a greenlet of its own, as the
    start's greenlet would be killed by it."""
    environment.process_exit_code = 1
    logging.error(reason)
    runner = environment.runner
    headless = environment.parsed_options is None or environment.parsed_options.headless
    gevent.spawn(runner.quit if headless else runner.stop)  # the web UI's runner waits for a new Start
    raise gevent.GreenletExit
