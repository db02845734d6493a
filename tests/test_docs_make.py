"""The docs and the Makefile agree: every `make TARGET` the docs write is a target of the Makefile
with a help text (`make help` lists it), and bench/README.md's list of the bench targets gives each
the time the target's help gives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *(ROOT / d / "README.md" for d in ("router", "bench", "k8s"))]
DOCS += ROOT.glob("docs/*.md")
# make, its options and variables (`make -o .venv/.installed lint`, `make test PYTEST_WORKERS=0`), the target
COMMAND = re.compile(r"make(?: -[a-zA-Z] \S+)*(?: [A-Z_]+=\S+)* ([a-z][\w-]*)")


def _help() -> dict[str, str]:
    """Each target with the help text `make help` prints for it (its `## text`)."""
    return dict(re.findall(r"^([a-zA-Z0-9_-]+):.*?## (.*)$", (ROOT / "Makefile").read_text(), re.M))


def _commands(text: str) -> list[str]:
    """The make commands a doc writes: a backquoted `make ...`, or a line of a code block."""
    commands = re.findall(r"`(make [^`]*)`", text)
    for block in re.findall(r"^```.*?^```", text, re.M | re.S):
        commands += [line.strip() for line in block.splitlines() if line.strip().startswith("make ")]
    return commands


def test_every_target_the_docs_write_is_one_make_help_lists() -> None:
    targets = _help()
    assert {"run", "test", "bench", "k8s-check"} <= set(targets)  # the Makefile was read
    wrong = []
    for doc in DOCS:
        for command in _commands(doc.read_text()):
            found = COMMAND.match(command)
            if found and found[1] not in targets:
                wrong.append(f"{doc.relative_to(ROOT)}: {command}")
    assert wrong == []


def test_the_bench_targets_times_are_the_makefiles() -> None:
    targets = _help()
    readme = (ROOT / "bench" / "README.md").read_text()
    listed = readme.split("## Running\n\n```\n", 1)[1].split("```", 1)[0]
    said = re.findall(r"^make ([\w-]+)[^#\n]*# (~[\d.]+ min|long)", listed, re.M)
    assert len(said) >= 10, listed
    wrong = [(target, time, targets[target]) for target, time in said if not targets[target].startswith(time)]
    assert wrong == [], "(target, bench/README.md's time, the Makefile's help)"
