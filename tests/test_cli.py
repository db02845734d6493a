"""The top-level CLI hands `serve` and `plan` to their own modules with the rest of the arguments."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardlb.cli import main
from shardlb.cluster import ClusterError, LocalCluster


@pytest.mark.parametrize(("command", "usage"), [("serve", "shardlb serve"), ("plan", "shardlb plan")])
def test_delegated_commands_parse_their_own_arguments(
    command: str, usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert usage in capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("cluster", "serve", "plan"))


def test_archive_help_states_the_default_of_each_loop(capsys: pytest.CaptureFixture[str]) -> None:
    """README and router/README give the repair loop and the webhook sweep 5 s each; `shardlb archive
    --help` stated only the cleanup's default (until 2026-12-06), so an operator could not tell
    from the command whether an unset flag meant "never"."""
    from shardlb import settlement_delivery
    from shardlb.archive import REPAIR_EVERY_S

    with pytest.raises(SystemExit):
        main(["archive", "--help"])
    out = " ".join(capsys.readouterr().out.split())

    def said(flag: str) -> str:  # the flag's help, after the usage line that names it too
        return out.rsplit(f"{flag} {flag[2:].replace('-', '_').upper()}", 1)[1]

    assert f"(0: none; default {REPAIR_EVERY_S:g})" in said("--repair-every")
    assert f"(0: none; default {settlement_delivery.SWEEP_EVERY_S:g})" in said("--deliver-every")
    assert "(0: none; default 60)" in said("--cleanup-every")


def test_cleanup_help_states_its_default_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """router/README gives `shardlb cleanup --limit` a default of 1000 players per shard; its help
    named none (until 2026-12-06)."""
    from shardlb.moderation import CLEANUP_LIMIT

    with pytest.raises(SystemExit):
        main(["cleanup", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"players removed per shard at most (default {CLEANUP_LIMIT:,})" in out


def test_every_positional_argument_has_help() -> None:
    """`shardlb reconcile --help` and `shardlb settle --help` listed `board` without a word (until
    2026-12-06), where rebuild, reshard and bands say "the board"."""
    import argparse

    from shardlb.cli import build_parser

    bare = []
    pending = [("shardlb", build_parser())]
    while pending:
        name, parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend((f"{name} {command}", sub) for command, sub in action.choices.items())
            elif not action.option_strings and not action.help:
                bare.append(f"{name} {action.dest}")
    assert bare == []


def test_settle_refuses_a_webhook_without_a_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router answers 409 webhook_not_configured; the command did settle and sign with an empty
    key (signatures anyone could forge). Refused before anything runs."""
    monkeypatch.delenv("SHARDLB_WEBHOOK_SECRET", raising=False)
    argv = [
        "settle",
        "b",
        "daily:2026-11-30",
        "--id",
        "s1",
        "--rewards",
        "[]",
        "--webhook",
        "https://x.test/h",
    ]
    assert main([*argv, "--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]) == 2
    assert "SHARDLB_WEBHOOK_SECRET" in capsys.readouterr().err


def test_settle_refuses_a_malformed_webhook_with_a_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that is not valid IDNA made `url.host` raise outside the URL check: a traceback."""
    monkeypatch.setenv("SHARDLB_WEBHOOK_SECRET", "s")
    argv = ["settle", "b", "daily:2026-11-30", "--id", "s1", "--rewards", "[]", "--webhook", "http://xn--/"]
    assert main([*argv, "--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardlb: error: webhook_url must be") and "Traceback" not in err, err


def test_inline_rewards_longer_than_a_file_name_are_read_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`--rewards` is a file or JSON; JSON longer than a file name may be (255 bytes) made
    Path.is_file raise OSError (a traceback) instead of being read."""
    table = "[" + ",".join(['{"ranks": [1, 1], "reward": "gold"}'] * 12) + "]"
    argv = ["settle", "b", "daily:2026-11-30", "--id", "s1", "--rewards", table[:-1]]  # not valid JSON
    assert main([*argv, "--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]) == 2
    assert "neither a file nor JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["rebuild", "b"],
        ["reconcile", "b"],
        ["settle", "b", "daily:2026-11-30", "--id", "s1", "--rewards", '[{"ranks": [1, 1], "reward": "g"}]'],
    ],
)
def test_unreachable_servers_are_a_message_not_a_traceback(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on port 1: each command fails with exit status 1 and one line naming the
    failure, not a Python traceback."""
    argv = [*command, "--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardlb: error:") and "Traceback" not in err, err


@pytest.mark.parametrize(
    "command",
    [
        ["cleanup", "b"],
        ["prune", "--postgres", "postgresql://127.0.0.1:1/x"],
        ["erase", "p1", "--postgres", "postgresql://127.0.0.1:1/x"],
    ],
)
def test_delegated_commands_fail_with_a_message_too(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb cleanup` and the others run modules of their own: an unreachable cluster was a
    traceback there (an ops audit's finding), a line here. (`shardlb archive` waits for the cluster
    since 2026-12-06, logging the outage, as it waits for PostgreSQL, its webhook sweep running
    meanwhile: tests/test_settlement_recovery.py.)"""
    assert main([*command, "--redis", "redis://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardlb: error:") and "Traceback" not in err, err


def test_a_reshard_left_half_done_is_not_a_success(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reshard that ends committed but not finished (the old journals not archived in time, no
    PostgreSQL) exited 0, so a CronJob reported it done (an ops audit's finding): it exits 3 and
    says how to finish it."""
    from shardlb import reshard

    async def left(*_: object) -> dict[str, object]:
        return {"board": "b", "shards": 4, "state": "committed"}

    monkeypatch.setattr(reshard, "command", left)
    assert main(["reshard", "b", "--shards", "4", "--redis", "redis://127.0.0.1:1"]) == 3
    assert "--resume" in capsys.readouterr().err

    async def done(*_: object) -> dict[str, object]:
        return {"board": "b", "shards": 4, "state": "none"}

    monkeypatch.setattr(reshard, "command", done)
    assert main(["reshard", "b", "--shards", "4", "--redis", "redis://127.0.0.1:1"]) == 0
    assert main(["reshard", "b", "--status", "--redis", "redis://127.0.0.1:1"]) == 0


def test_a_reshard_no_process_moves_says_so_in_its_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reshard whose mover died (a router restarted under it, a killed CLI) holds the board in both
    layouts, its change sets growing with every write: the status says nobody moves it, and how to
    resume or cancel it; one a mover holds says nothing more."""
    from shardlb import reshard

    status: dict[str, object] = {"board": "b", "shards": 4, "state": "copying", "mover": "none"}

    async def found(*_: object) -> dict[str, object]:
        return status

    monkeypatch.setattr(reshard, "command", found)
    assert main(["reshard", "b", "--status", "--redis", "redis://127.0.0.1:1"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["mover"] == "none"
    assert "no process moves" in err and "--resume" in err and "--cancel" in err, err
    status["mover"] = "running"
    assert main(["reshard", "b", "--status", "--redis", "redis://127.0.0.1:1"]) == 0
    assert capsys.readouterr().err == ""


UNREACHABLE = ["--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]
TIER = '[{"ranks": [1, 1], "reward": "g"}]'
DAY = ["b", "daily:2026-11-30"]


@pytest.mark.parametrize(
    "argv",
    [
        ["settle", *DAY, "--id", "s1", "--rewards", TIER, "--top-n", "100001", *UNREACHABLE],
        ["settle", *DAY, "--id", "s1", "--rewards", "[]", *UNREACHABLE],
        ["settle", *DAY, "--id", "s 1", "--rewards", TIER, *UNREACHABLE],
        ["rebuild", "b", "--redis", "http://x", "--postgres", "postgresql://127.0.0.1:1/x"],
        ["reshard", "b", "--shards", "2", "--redis", "http://x"],
        ["bands", "b", "--count", "2", "--redis", "http://x"],
        ["cleanup", "b", "--redis", "http://x"],
        ["prune", "--redis", "http://x", "--postgres", "postgresql://127.0.0.1:1/x"],
        ["erase", "p1", "--redis", "http://x", "--postgres", "postgresql://127.0.0.1:1/x"],
        ["cluster", "up", "--masters", "0", "--dir", "/nonexistent/shardlb"],
    ],
    ids=[
        "top-n",
        "rewards",
        "id",
        "rebuild-url",
        "reshard-url",
        "bands-url",
        "cleanup-url",
        "prune-url",
        "erase-url",
        "masters",
    ],
)
def test_a_bad_argument_exits_2_as_a_usage_error_does(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """README: 2 is a usage error, 1 a command that could not be done. A value the library refused
    (settle's top_n, reward table or id, a --redis that is no Redis URL, a cluster of no masters)
    exited 1, as if Redis had been down, while argparse's own refusals exit 2: a script that
    retries on 1 retried a command that can never work."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("shardlb") and "Traceback" not in err, err


@pytest.mark.cluster
async def test_a_value_the_board_refuses_exits_2(store: Any, cluster_url: str) -> None:
    """The library's range errors against a real board (a band count past its limit): exit 1 before."""
    from shardlb.config import MAX_BANDS, BoardConfig

    config = BoardConfig.from_dict("cli-bad-count", {"durability": "memory"})
    await store.create(config)
    try:
        argv = [sys.executable, "-m", "shardlb", "bands", config.id, "--count", "0", "--redis", cluster_url]
        done = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done
        refused = f"shardlb bands: count must be 1 to {MAX_BANDS}"
        assert done.stderr.strip().splitlines() == [refused], done.stderr
    finally:
        await store.delete(config.id)


def test_sigterm_stops_a_one_shot_command_with_one_line() -> None:
    """SIGTERM (a CronJob's deadline, `kill`, a container stopping) killed a one-shot command
    without a word and with the signal's status; Ctrl-C already said "shardlb: interrupted".
    It now says "shardlb: terminated" and exits 143, after the command's own clean-up, as Ctrl-C's."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        command = ["bands", "b", "--count", "2", "--redis", f"redis://127.0.0.1:{port}"]
        process = subprocess.Popen(
            [sys.executable, "-m", "shardlb", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            listener.settimeout(30)
            held, _ = listener.accept()  # connected, waiting for an answer that never comes
            with held:
                process.send_signal(signal.SIGTERM)
                _, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert process.returncode == 143, (process.returncode, err)
    assert err.decode().strip().splitlines() == ["shardlb: terminated"], err


@pytest.mark.parametrize("wait", ["nan", "-1", "inf", "soon"])
def test_settle_refuses_a_wait_that_is_no_number_of_seconds(
    wait: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--wait nan` made the archiver's deadline NaN, which no clock reaches: with the archiver
    behind, `shardlb settle` waited for good (a CronJob hung until its own deadline killed it). A
    negative or endless wait is no number of seconds either. Refused before anything runs."""
    argv = ["settle", *DAY, "--id", "s1", "--rewards", TIER, "--wait", wait, *UNREACHABLE]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert "argument --wait: seconds must be 0 or more" in capsys.readouterr().err


def test_add_node_refuses_a_negative_replica_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cluster add-node --replicas -1` recorded a node it never started in the cluster's state
    file, failed on a refused connection to it (exit 1), and left `cluster status` reporting the
    cluster NOT ok for good (and `cluster up` would form it afresh, its data lost). A count below
    0 is a usage error, refused before the state is read."""
    with pytest.raises(SystemExit) as done:
        main(["cluster", "add-node", "--replicas", "-1", "--dir", str(tmp_path)])
    assert done.value.code == 2
    assert "argument --replicas: must be 0 or more" in capsys.readouterr().err
    with pytest.raises(ClusterError, match="replicas"):
        LocalCluster(masters=1, replicas=0, port=40000, dir=tmp_path).add_node(replicas=-1)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "command",
    [
        ["rebuild", "b"],
        ["reconcile", "b"],
        ["settle", *DAY, "--id", "s1", "--rewards", TIER],
        ["reshard", "b", "--shards", "2"],
    ],
    ids=["rebuild", "reconcile", "settle", "reshard"],
)
def test_a_postgres_that_is_no_postgresql_url_exits_2(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--postgres notaurl` (or a SHARDLB_POSTGRES_URL set to one) failed with exit 1 and psycopg's
    ProgrammingError, as if the server were down, where a --redis that is no Redis URL exits 2:
    a script retrying on 1 retried a command that can never work."""
    with pytest.raises(SystemExit) as done:
        main([*command, "--redis", "redis://127.0.0.1:1", "--postgres", "notaurl"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --postgres: not a PostgreSQL URL" in err and "Traceback" not in err, err


def test_a_metrics_file_in_a_missing_folder_is_refused_before_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`reconcile --metrics-file` whose folder does not exist was found out only after the whole
    check had run (exit 1, naming prometheus-client's temporary file, not the operator's path)."""
    target = tmp_path / "missing" / "reconcile.prom"
    command = ["reconcile", "b", "--metrics-file", str(target), "--redis", "redis://127.0.0.1:1"]
    assert main([*command, "--postgres", "postgresql://127.0.0.1:1/x"]) == 2
    err = capsys.readouterr().err
    assert str(target.parent) in err and "reconcile.prom." not in err, err


def test_output_piped_into_a_reader_that_stops_early_ends_quietly() -> None:
    """`shardlb ... | head` closes the pipe before the command has written all: the command stops
    as a program killed by SIGPIPE does (141), without an error line, where it printed
    'shardlb: error: BrokenPipeError' and exited 1 as if it had failed."""
    plan = ["plan", "--players", "1000000", "--writes", "100", "--reads", "100"]
    command = [sys.executable, "-m", "shardlb", *plan]
    done = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert done.stdout is not None and done.stderr is not None
    done.stdout.close()  # the reader went away before the first line
    with done.stderr:
        errors = done.stderr.read().decode()
    assert done.wait(timeout=60) == 141, errors
    assert errors == ""


@pytest.mark.parametrize("command", [["reconcile"], ["rebuild"], ["settle"]])
@pytest.mark.parametrize("board", ["bad id", "x" * 65])
def test_a_board_id_no_board_can_have_is_a_usage_error_before_any_connection(
    command: list[str], board: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused as `reshard` and `bands` refuse it (exit 2), where it was found only after reaching
    PostgreSQL (exit 1, or the server's error when it is down)."""
    where = ["--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/none"]
    if command == ["settle"]:
        where += ["daily:2026-12-01", "--id", "s1", "--rewards", '[{"rank": 1, "reward": "gold"}]']
    with pytest.raises(SystemExit) as stopped:
        main([*command, board, *where])
    assert stopped.value.code == 2
    assert "ids are 1-64 characters" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["0", "-2", "two"])
def test_rebuild_jobs_must_be_a_whole_number_of_1_or_more(
    jobs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rebuild --all --jobs N` takes N boards side by side: 0 would take none (and say done)."""
    argv = [
        "rebuild",
        "--all",
        "--jobs",
        jobs,
        "--redis",
        "redis://127.0.0.1:1",
        "--postgres",
        "postgresql://x/y",
    ]
    with pytest.raises(SystemExit) as usage:
        main(argv)
    assert usage.value.code == 2
    assert "--jobs: must be 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["1", "4"])
def test_rebuild_jobs_without_all_is_a_usage_error(jobs: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`rebuild BOARD --jobs N` was taken and did nothing (a board's shards go one after another,
    --jobs is how many boards of --all go side by side): an operator who meant to speed one board
    up was told nothing."""
    argv = ["rebuild", "b", "--jobs", jobs, "--redis", "redis://127.0.0.1:1"]
    assert main([*argv, "--postgres", "postgresql://127.0.0.1:1/x"]) == 2
    err = capsys.readouterr().err
    assert err == "shardlb rebuild: --jobs goes with --all (a board's shards are rebuilt one after another)\n"
