"""The suite's timeout guard (tests/timeout_guard.py): a test that swallows its first timeout is failed again
until it ends, instead of running on unbounded. Two real pytest runs of one swallowing test, with and
without the guard."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

SWALLOWS_ITS_TIMEOUTS = textwrap.dedent("""
    import time

    def test_a_stop_that_swallows_the_timeout_then_a_long_wait():
        end = time.monotonic() + 2
        while time.monotonic() < end:  # the first alarm (at 1 s) lands here: stop_container() catches BaseException
            try:
                time.sleep(end - time.monotonic())
            except BaseException:
                pass
        time.sleep(28)  # then a wait that would let a failure out, as thread.join() does
""")


@pytest.mark.slow  # two pytest runs, one of 30 s
def test_a_test_that_swallows_its_timeout_is_failed_again_within_the_repeat_and_not_left_to_run_on(tmp_path):
    (tmp_path / "test_swallowing.py").write_text(SWALLOWS_ITS_TIMEOUTS)
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run(*plugin: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=1",
                                 "-c", os.devnull, "--rootdir", str(tmp_path), *plugin, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    began = time.monotonic()
    guarded, bare = run("-p", "timeout_guard"), run()
    guarded_out, _ = guarded.communicate(timeout=60)
    guarded_s = time.monotonic() - began
    bare_out, _ = bare.communicate(timeout=60)
    assert "1 failed" in guarded_out and "Timeout" in guarded_out, guarded_out[-2000:]
    assert guarded_s < 25, "the guard failed the test only after %.0f s" % guarded_s  # 1 s, then every 10 s
    # the control: without the guard the one alarm is swallowed and the test runs its 30 s and passes
    assert "1 passed" in bare_out, bare_out[-2000:]
