"""A pytest plugin that keeps a test's timeout from being swallowed.

pytest-timeout's signal method raises in the main thread once. Code that must not raise, such as a teardown
that catches BaseException (`stop_container()` does, by design), can swallow that one failure, and the test
then runs on with no bound at all: a stuck loop of bounded waits can hold a CI run past its own limit with no
word of which test it is. Here the alarm repeats every TIMEOUT_REPEAT_S after the first, so such a test is
failed again until the failure gets out; pytest-timeout's own cancel clears the repeat with its timer.
tests/conftest.py loads this module's hook; tests/test_timeout_guard.py proves it.
"""
from __future__ import annotations

import signal

import pytest

# Long enough that a teardown cut short by the first alarm can finish, short enough that a stuck test costs
# minutes, not the CI run. pytest-timeout dumps every thread's stack at each alarm: the log says where it hangs.
TIMEOUT_REPEAT_S = 10.0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not hasattr(signal, "setitimer"):  # Windows: pytest-timeout uses its thread method there
        return
    remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    if remaining > 0:  # the timer pytest-timeout armed for this test, before its setup
        signal.setitimer(signal.ITIMER_REAL, remaining, TIMEOUT_REPEAT_S)
