"""benchmarks/proxy_bench.py runs end to end (tiny sample, no RESULTS.md write): it must not rot."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # the benchmark as a subprocess
def test_proxy_bench_runs_and_reports_both_targets():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "proxy_bench.py"),
                             "--http-n", "20", "--ws-n", "20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| HTTP POST /step p50 (20 each) |" in result.stdout
    assert "| WebSocket step round trip p50 (20 each) |" in result.stdout
    assert "HTTP p50 ratio <= 1.5x" in result.stdout and "WebSocket p50 added <= 60 us" in result.stdout
    assert "wrote" not in result.stdout


def test_proxy_bench_rejects_a_too_small_sample():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "proxy_bench.py"), "--http-n", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "at least 10" in result.stderr
