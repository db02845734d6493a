"""CPU seconds of the processes a bench phase involves, read from /proc/<pid>/stat before and after.

On a 2-core machine every process (router, Redis nodes, Locust, drivers) competes for the same two
cores, so a throughput figure only means something next to where the CPU went. Processes that come
and go during a phase (Locust's forked workers, router workers) are found by walking the process
tree from a root pid, on a background thread, so their CPU is caught before they exit.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name (which may hold spaces): state is fields[0].
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process, or None once it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICKS


def run_wait_seconds(pid: int) -> float | None:
    """Seconds the threads of one process have spent ready to run and waiting for a core (the
    second field of each thread's /proc schedstat), or None once it is gone or where the kernel
    keeps no such figures. On cores that every process shares, a request waits for its process's
    turn as long as this grows."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def machine_ticks(stat: str) -> tuple[int, int]:
    """(spent, stolen) clock ticks of all cores from the text of /proc/stat. Spent is user, nice,
    system, irq and softirq: what this machine's processes and kernel ran. Stolen is the time the
    hypervisor ran other guests when a core here wanted to run: no process here spent it, so it is
    not "other load". The guest columns are left out too: Linux already counts them in user and
    nice."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in stat.split(maxsplit=9)[1:9])
    return user + nice + system + irq + softirq, steal


def machine_times() -> tuple[float, float]:
    """CPU seconds the whole machine spent (all cores, all processes) and had stolen, so far."""
    spent, stolen = machine_ticks(Path("/proc/stat").read_text())
    return spent / TICKS, stolen / TICKS


def machine_cpu_seconds() -> float:
    """CPU seconds spent by the whole machine (all cores, all processes; idle, iowait and steal
    excluded)."""
    return machine_times()[0]


def parents() -> dict[int, int]:
    """Every process's parent, from one scan of /proc: the process tree at one moment."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                parent_of[int(entry.name)] = int(fields[1])
    return parent_of


def descendants(root: int, parent_of: Mapping[int, int] | None = None) -> list[int]:
    """``root`` and every process below it, in ``parent_of`` (``parents()``) or in a scan of its own."""
    if parent_of is None:
        parent_of = parents()
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    found = [root]
    frontier = [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


@dataclass
class CpuMeter:
    """CPU seconds per named group of processes between ``start()`` and ``stop()``.

    ``groups`` maps a name to root pids; with ``trees`` the roots' descendants count too. A pid seen
    for the first time after start counts from zero (it was born during the phase).
    """

    groups: Mapping[str, list[int]]
    trees: bool = True
    interval: float = 0.5
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)
    waited_first: dict[int, float] = field(default_factory=dict)
    waited_last: dict[int, float] = field(default_factory=dict)
    machine0: float = 0.0
    steal0: float = 0.0
    wall0: float = 0.0
    wall: float = 0.0
    machine: float = 0.0
    steal: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self, initial: bool = False) -> None:
        # One scan of /proc for every group: a process forked between two scans would otherwise
        # miss its own group's and be claimed by a later one (the harness's tree holds them all).
        tree = parents() if self.trees else {}
        for name, roots in self.groups.items():
            for root in roots:
                for pid in descendants(root, tree) if self.trees else [root]:
                    value = cpu_seconds(pid)
                    if value is None:
                        continue
                    waited = run_wait_seconds(pid)
                    if pid not in self.first:
                        self.first[pid] = value if initial else 0.0
                        self.owner[pid] = name
                        if waited is not None:
                            self.waited_first[pid] = waited if initial else 0.0
                    self.last[pid] = value
                    if waited is not None and pid in self.waited_first:
                        self.waited_last[pid] = waited

    def start(self) -> CpuMeter:
        # This process and its children not claimed by a group (driver processes, the sampler itself):
        # listed last, so every named group claims its own processes first.
        self.groups = {**self.groups, "harness": [os.getpid()]}
        self._sample(initial=True)
        (self.machine0, self.steal0), self.wall0 = machine_times(), time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> dict[str, Any]:
        """Stop sampling; CPU seconds per group, per process, the machine's total, and wall seconds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self.wall = time.monotonic() - self.wall0
        spent, stolen = machine_times()
        self.machine, self.steal = spent - self.machine0, stolen - self.steal0
        return self.report()

    def report(self) -> dict[str, Any]:
        per_group: dict[str, float] = {name: 0.0 for name in self.groups}
        busiest: dict[str, float] = {name: 0.0 for name in self.groups}
        waited: dict[str, float] = {name: 0.0 for name in self.groups}
        for pid, value in self.waited_last.items():
            waited[self.owner[pid]] += value - self.waited_first[pid]
        for pid, value in self.last.items():
            used = value - self.first[pid]
            per_group[self.owner[pid]] += used
            busiest[self.owner[pid]] = max(busiest[self.owner[pid]], used)
        return {
            "wall_s": round(self.wall, 2),
            "machine_cpu_s": round(self.machine, 2),
            # CPU that none of the metered processes spent: other work on the machine during the phase.
            "other_cpu_s": round(max(0.0, self.machine - sum(per_group.values())), 2),
            # CPU the hypervisor gave other guests while a core here wanted it: the phase had less
            # than the whole machine, though no process here used it.
            "steal_cpu_s": round(self.steal, 2),
            "cores": os.cpu_count(),
            "cpu_s": {name: round(v, 2) for name, v in per_group.items()},
            # The busiest single process of a group as a share of one core: near 1.0 it was CPU-bound.
            "busiest_process_share": {
                name: round(v / self.wall, 2) if self.wall else 0.0 for name, v in busiest.items()
            },
            "processes": {name: sum(1 for p in self.owner.values() if p == name) for name in self.groups},
            # Seconds each group's threads were ready to run and waited for a core (summed over its
            # processes' threads): a request served by a process waits for its turn as long.
            "waited_s": {name: round(v, 2) for name, v in waited.items()},
        }
