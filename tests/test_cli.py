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
