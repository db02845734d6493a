"""What the bench entry points (``bench.run``, ``bench.scale``, ``bench.dedup``) share: integer knobs
from SHARDLB_* variables, one results directory per run with its main files copied to
bench/results/latest/, and the progress lines they print."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"{name}: expected a positive integer, got {raw!r}")
    return int(raw)


def env_ints(name: str, default: str) -> list[int]:
    raw = os.environ.get(name, "") or default
    try:
        values = int_list(raw)
    except ValueError:
        raise SystemExit(f"{name}: expected comma-separated integers, got {raw!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{name}: expected positive integers, got {raw!r}")
    return values


def int_list(text: str) -> list[int]:
    """``"1,2,3"`` as ``[1, 2, 3]``; empty items are skipped."""
    return [int(v) for v in text.split(",") if v.strip()]


def run_dir(name: str) -> Path:
    """bench/results/<name>/, created."""
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def publish(out: Path, names: Iterable[str]) -> None:
    """Copy these files of the run in ``out`` to bench/results/latest/, the ones the repository keeps."""
    latest = RESULTS / "latest"
    latest.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(out / name, latest / name)
