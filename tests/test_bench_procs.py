"""CPU metering from /proc: a busy child shows up with about the CPU it burnt."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.procs import CpuMeter, cpu_seconds, descendants

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")


def test_a_busy_child_is_metered_through_its_parent() -> None:
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        meter = CpuMeter({"me": [os.getpid()]}, interval=0.05).start()
        assert child.pid in descendants(os.getpid())
        child.wait(20)
        report = meter.stop()
    finally:
        child.kill()
        child.wait()
    assert 0.3 <= report["cpu_s"]["me"] <= report["machine_cpu_s"] + 0.1
    assert report["processes"]["me"] >= 2
    assert cpu_seconds(os.getpid()) is not None and cpu_seconds(2**22 + 7) is None
