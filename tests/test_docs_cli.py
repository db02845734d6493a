"""The docs and the `shardlb` command line agree: every subcommand (and every action of `cluster` and
`postgres`) is in README.md, and every option the docs write after `shardlb COMMAND` is one of its
own, as its --help lists them."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from shardlb.cli import DELEGATED, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *(ROOT / d / "README.md" for d in ("router", "bench", "k8s"))]
DOCS += [*ROOT.glob("docs/*.md"), *ROOT.glob("k8s/**/*.yaml"), ROOT / "Makefile", ROOT / "Dockerfile"]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def _options(words: list[str]) -> set[str]:
    """The options `shardlb WORDS --help` lists (a delegated command's from its own module)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*words, "--help"])
    return set(OPTION.findall(out.getvalue()))


def _commands() -> dict[str, set[str]]:
    """Each command ("rebuild", "cluster up") with its options."""
    out: dict[str, set[str]] = {}
    for name, parser in _subparsers(build_parser()).items():
        actions = _subparsers(parser)
        out[name] = _options([name]) if not actions else set()
        for action in actions:
            out[f"{name} {action}"] = _options([name, action])
            out[name] |= out[f"{name} {action}"]  # `shardlb cluster ... --dir` in a sentence
    return out


def test_every_command_is_in_the_readme() -> None:
    commands = _commands()
    assert set(DELEGATED) <= set(commands) and "cluster add-node" in commands  # the walk found them
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert sorted(c for c in commands if f"shardlb {c}" not in readme) == []


def test_every_option_the_docs_give_a_command_is_its_own() -> None:
    commands = _commands()
    assert "--rehome" in commands["reshard"] and "--durable" in commands["cluster up"]
    mention = re.compile(rf"\bshardlb ({'|'.join(sorted(commands, key=len, reverse=True))})\b")
    wrong = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for found in mention.finditer(line):
                command = found[1]
                # the options up to the end of the command: its backquoted span, or the line
                rest = line[found.end() :].split("`", 1)[0]
                rest = re.split(r"\bshardlb ", rest, maxsplit=1)[0]
                wrong += [
                    f"{doc.relative_to(ROOT)}:{number}: shardlb {command} {option}"
                    for option in OPTION.findall(rest)
                    if option not in commands[command] | {"--help"}
                ]
    assert wrong == []


def _plan_fields(words: list[str]) -> set[str]:
    """The names of the fields `shardlb plan WORDS` prints at the top of its plan, as its lines
    give them ("  Redis masters        3  (CPU-bound; ...)" names `Redis masters`)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *words]) == 0
    plan = out.getvalue().split("\n\n", 2)[1]  # the lines between the heading and the steps
    return {found[1] for found in re.finditer(r"^  (\S+(?: \S+)*)  ", plan, re.MULTILINE)}


def test_every_line_of_the_plan_the_k8s_sizing_table_reads_is_one_the_plan_prints() -> None:
    # k8s/README.md, "Sizing": each row of its table takes a field of `shardlb plan`'s output to a
    # setting of the overlay, named as the plan prints it (`Redis masters M`), or an option of the
    # plan's; and every field has its row. Its rows "routers for the peak" (printed: `router
    # processes`) and "layout: band board" named no printed field, and `shards per board` and
    # `journal bound` had no row (until 2026-12-07).
    options = _commands()["plan"]
    fields = _plan_fields(["--players", "100000000", "--writes", "50000", "--reads", "200000"])
    assert {"Redis masters", "router processes", "PostgreSQL disk"} <= fields  # the scan reads them
    sizing = (ROOT / "k8s" / "README.md").read_text().split("\n## Sizing\n", 1)[1]
    rows = sizing.split("| `shardlb plan` says | set in the overlay |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    wrong, taken = [], set()
    for row in rows.splitlines():
        said = row.strip("|").split(" | ", 1)[0]
        spans = re.findall(r"`([^`]+)`", said)
        named = {f for f in fields for s in spans if s.startswith(f)}
        if not named and not any(s.split()[0] in options for s in spans):
            wrong.append(said)
        taken |= named
    assert wrong == [], f"rows that name no field the plan prints ({sorted(fields)}) nor an option"
    assert sorted(fields - taken) == [], "fields the plan prints that no row of the table takes"


def test_the_readmes_memory_per_1000_writes_is_the_plans() -> None:
    # README.md's dedup records and pins per 1,000 writes a second are what `shardlb plan` counts
    # for them on the committed costs (bench/results/latest/dedup.json), 1.2 for fragmentation
    # included. Its pins said 11.4 GiB, the bytes alone, where the plan prints 13.6 (until
    # 2026-12-07).
    load = ["--players", "1000", "--writes", "1000", "--reads", "10"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *load, "--incr", "1", "--timeless", "1"])
    model = out.getvalue()
    dedup, pins = (re.search(rf"^  {name} = .* = ([\d.]+) GiB$", model, re.M) for name in ("dedup", "pins"))
    assert dedup and pins, model
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"window that is {dedup[1]} GiB per 1,000 incr writes/s" in readme
    assert f"1,000 such results per second keep up to 101M pins, {pins[1]} GiB" in readme
