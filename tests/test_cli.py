"""The top-level CLI hands `serve` and `plan` to their own modules with the rest of the arguments."""

from __future__ import annotations

import pytest

from shardlb.cli import main


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
    assert main([*argv, "--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://127.0.0.1:1/x"]) == 1
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
    "command", [["archive", "--postgres", "postgresql://127.0.0.1:1/x"], ["cleanup", "b"]]
)
def test_delegated_commands_fail_with_a_message_too(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb archive` and `shardlb cleanup` run modules of their own: an unreachable cluster
    was a traceback there (an ops audit's finding), a line here."""
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
