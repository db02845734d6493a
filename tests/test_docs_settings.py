"""The docs name the settings the code reads: router/README.md's table is the router's Settings, name
for name and default for default, and every SHARDLB_* variable read anywhere (shardlb/, router/,
bench/, scripts/, k8s/, the Makefile) is named in a doc, as every one a doc names is read."""

from __future__ import annotations

import ast
import re
from dataclasses import MISSING, fields
from pathlib import Path

from bench.run import Settings as BenchSettings
from router.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *(ROOT / d / "README.md" for d in ("router", "bench", "k8s"))]
DOCS += ROOT.glob("docs/*.md")
NAME = re.compile(r"\bSHARDLB_[A-Z0-9_]*[A-Z0-9]\b")
# A name (its family, the word after SHARDLB_, kept) or a shorthand of the family's last name
NAME_OR_SHORTHAND = re.compile(r"\bSHARDLB_([A-Z0-9]+)_?[A-Z0-9_]*[A-Z0-9]?\b|`(_[A-Z0-9_]*[A-Z0-9])`")
# Named in a doc on purpose though nothing reads it: the misspelling the Locust test warns of
# (bench/README.md, "Locust on its own").
NOT_SETTINGS = {"SHARDLB_TARGET_WRITE"}
# Defaults the table says in words, as it says them: a change of either default must change these.
IN_WORDS = {"SHARDLB_READ_BURST": "five seconds of the rate", "SHARDLB_PROBE_HOST": "`SHARDLB_HOST`"}


def _table() -> dict[str, str]:
    """router/README.md's settings table: each variable with the text of its default."""
    readme = (ROOT / "router" / "README.md").read_text()
    rows = readme.split("| variable | default | meaning |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    out: dict[str, str] = {}
    for row in rows.splitlines():
        names_cell, default_cell = [c.strip() for c in row.strip("|").split(" | ")][:2]
        names = NAME.findall(names_cell)
        # one default for several names ("empty"), or one each, comma-separated
        defaults = [d.strip() for d in default_cell.split(", ")] if len(names) > 1 else [default_cell]
        if len(defaults) == 1:
            defaults *= len(names)
        assert len(defaults) == len(names), row
        out.update(zip(names, defaults, strict=True))
    return out


def _same(said: str, default: object) -> bool:
    """Whether the table's default (its first word: "`0` (none)") says the code's."""
    value = said.split(" (", 1)[0]
    if isinstance(default, bool):
        return value == f"`{str(default).lower()}`"
    if default in ("", None):
        return value == "unset"
    if default == ():
        return value == "empty"
    if not (value.startswith("`") and value.endswith("`")):
        return False
    if isinstance(default, int | float):
        try:
            return float(value.strip("`")) == default
        except ValueError:
            return False
    return value.strip("`") == default


def test_the_router_readme_tables_every_setting_with_its_default() -> None:
    table = _table()
    settings = {"SHARDLB_" + f.name.upper(): f for f in fields(Settings)}
    assert sorted(set(settings) - set(table)) == [], "settings the table leaves out"
    assert sorted(set(table) - set(settings)) == [], "rows of the table no setting reads"
    wrong = []
    for name, f in settings.items():
        default = f.default
        assert default is not MISSING, name  # every setting has a plain default
        if name in IN_WORDS:
            assert default in (0, ""), name  # the words say what an unset (0, empty) value does
            if table[name] != IN_WORDS[name]:
                wrong.append((name, table[name], IN_WORDS[name]))
        elif not _same(table[name], default):
            wrong.append((name, table[name], repr(default)))
    assert wrong == [], "(variable, the table's default, the code's)"


def _python_reads() -> set[str]:
    """The SHARDLB_* names Python code reads by name: a call's first argument (os.environ.get,
    env_int, number, ...) or a subscript (os.environ[...]); and the dataclasses' fields that are
    read by a prefix (the router's Settings, bench/run.py's SHARDLB_BENCH_*)."""
    found = {"SHARDLB_" + f.name.upper() for f in fields(Settings)}
    found |= {"SHARDLB_BENCH_" + f.name.upper() for f in fields(BenchSettings)}
    for source in [*ROOT.glob("shardlb/**/*.py"), *ROOT.glob("router/*.py"), *ROOT.glob("bench/*.py")]:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and node.args:
                first: ast.expr = node.args[0]
            elif isinstance(node, ast.Subscript):
                first = node.slice
            else:
                continue
            if isinstance(first, ast.Constant) and NAME.fullmatch(str(first.value)):
                found.add(first.value)
    return found


def _shell_reads() -> set[str]:
    """The SHARDLB_* names the shell code expands: scripts/, the Makefile, k8s/'s pod scripts and
    manifests (a CronJob's command), and those they set for a program to read (a recipe's
    ``SHARDLB_SCREENSHOTS=docs/img pytest``, a ConfigMap's literal, a container's env)."""
    sources = [*ROOT.glob("scripts/*.sh"), ROOT / "Makefile", *ROOT.glob("k8s/**/*.sh")]
    sources += ROOT.glob("k8s/**/*.yaml")
    found: set[str] = set()
    for source in sources:
        text = source.read_text()
        found |= set(re.findall(r"\$\{?(SHARDLB_[A-Z0-9_]*[A-Z0-9])\b", text))
        found |= set(re.findall(r"(?<![\w$])(SHARDLB_[A-Z0-9_]*[A-Z0-9])=", text))  # a command's, a literal
        found |= set(re.findall(r"^\s*- name: (SHARDLB_[A-Z0-9_]*[A-Z0-9])$", text, re.M))  # env
        found |= set(re.findall(r"\bremember (SHARDLB_[A-Z0-9_]*[A-Z0-9])\b", text))  # kept in dev.env
    return found


def _documented() -> set[str]:
    """Every SHARDLB_* name the docs give, a family's shorthand spelled out (bench/README.md's
    "`SHARDLB_SCALEOUT_MASTERS` (`1,2,3`), `_PLAYERS` (200000)" names SHARDLB_SCALEOUT_PLAYERS)."""
    found: set[str] = set()
    for doc in DOCS:
        for block in re.split(r"\n\s*\n", doc.read_text()):
            family = None
            for token in NAME_OR_SHORTHAND.finditer(block):
                if token[1]:
                    family = token[1]
                    if NAME.fullmatch(token[0]):
                        found.add(token[0])
                elif family is not None:
                    found.add(f"SHARDLB_{family}{token[2]}")
    return found


def test_every_variable_the_code_reads_is_documented_and_every_documented_one_read() -> None:
    python, shell, documented = _python_reads(), _shell_reads(), _documented()
    # the scans work: a variable of each kind of source
    assert {"SHARDLB_RESHARD_LEASE_MS", "SHARDLB_SCALEOUT_PLAYERS", "SHARDLB_WRITE_HOST"} <= python
    assert {"SHARDLB_PRUNE_BUDGET_S", "SHARDLB_API_URL", "SHARDLB_PROBE_PORT"} <= shell
    assert {"SHARDLB_BENCH_RAMP_STEPS", "SHARDLB_SCALEOUT_REPLICA_MASTERS"} <= documented
    read = python | shell
    assert sorted(read - documented) == [], "read by the code, named in no doc"
    assert sorted(documented - read - NOT_SETTINGS) == [], "named in a doc, read by nothing"
