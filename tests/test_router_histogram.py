"""router/histogram.py without a server: the bounds of a rank estimated from sampled shards."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.histogram import ShardSample, Snapshot, parse_sample


@st.composite
def shards(draw: st.DrawFn) -> list[list[tuple[float, str]]]:
    """A few shards of distinct rows (score, player), some with tied scores."""
    count = draw(st.integers(1, 4))
    out = []
    for s in range(count):
        scores = draw(st.lists(st.integers(0, 30), max_size=60))
        out.append(sorted(((float(v), f"s{s}p{i}") for i, v in enumerate(scores)), reverse=True))
    return out


def sample_reply(rows: list[tuple[float, str]], k: int) -> list[object]:
    """What sample.lua returns for a shard whose rows are ``rows`` (best first)."""
    n = len(rows)
    ranks = list(range(n)) if n <= k + 1 else sorted({i * (n - 1) // k for i in range(k + 1)})
    reply: list[object] = [n]
    for r in ranks:
        reply += [rows[r][1], repr(rows[r][0]), r]
    return reply


@given(shards(), st.integers(1, 8), st.data())
def test_estimate_is_within_its_error(
    boards: list[list[tuple[float, str]]], k: int, data: st.DataObject
) -> None:
    everyone = sorted((row for rows in boards for row in rows), reverse=True)
    if not everyone:
        return
    snapshot = Snapshot(None, [parse_sample(sample_reply(rows, k)) for rows in boards], 0)  # type: ignore[arg-type]
    target = data.draw(st.sampled_from(everyone))
    exact = everyone.index(target) + 1
    guess = snapshot.estimate(target)
    assert abs(guess.rank - exact) <= guess.error
    assert guess.players == len(everyone)
    # The bound is at most half a bucket per shard: never worse than sampling promises.
    assert guess.error <= sum(-(-len(rows) // k) for rows in boards) // 2 + len(boards)
    if all(len(rows) <= k + 1 for rows in boards):
        assert guess.error == 0 and guess.rank == exact


def test_shard_sample_bounds() -> None:
    sample = ShardSample(10, [(1.0, "z"), (5.0, "m"), (9.0, "a")], [9, 5, 0])
    assert sample.ahead((9.5, "x")) == (0, 0)
    assert sample.ahead((9.0, "a")) == (0, 0)
    assert sample.ahead((7.0, "x")) == (1, 5)
    assert sample.ahead((0.5, "x")) == (10, 10)
