"""Shared pytest fixtures for the whole suite.

Stable fixture names other test files may rely on:

- `test_ca` (session): a `support.TestCA` (throwaway CA + localhost server certificate, PEM paths).
- `upstream` / `tls_upstream`: a running `support.Upstream` over HTTP / HTTPS (stopped after the test).
- `no_leaks`: asserts that the threads and open file descriptors of the process return to their
  pre-test counts after the test (waits briefly for sockets/threads being torn down).
- `proxy`: a started `proxy.AuthProxy` on loopback, stopped after the test.
- `socket_dir`: a short directory for Unix sockets (removed after the test), whatever TMPDIR's length.
- `shared_proxy` (module): one `proxy.AuthProxy` (30 s read timeout) for every test of a module, for
  suites that mount a fresh route per example (the differential ones) instead of paying a start each.
- `emu`: a running `hf_jobs_emulator.JobsEmulator` whose token is watched in the logs; after it stops,
  the test fails if any job process outlived it.
- `make_emu`: `make_emu(**JobsEmulator_kwargs)` starts an emulator (e.g. with `scheduling_delay_s`)
  whose token is watched; each is stopped after the test, which fails if a job process outlived it.
- `fresh_hardware_lists` (autouse): forgets the hardware lists the core fetched (keyed by endpoint, and
  emulators reuse ports).
- `log_guard` (autouse): captures every log record (all loggers, DEBUG and up) during each test and
  fails the test if `support.TEST_TOKEN`, or any string passed to `log_guard.watch(...)`, appears in
  one. `log_guard.text()` returns the captured log output for extra assertions.

Every test's pytest-timeout alarm repeats until the test ends (`timeout_guard.py`): a swallowed one does not
leave the test unbounded.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator, List

import pytest

# CI runs on machines we do not know. The suite reads none of this one's Hugging Face set-up (a stored login, an
# endpoint, offline mode: huggingface_hub reads them once, at import, so this comes before any import of it), and
# loopback never goes through an HTTP proxy the machine sets (the pip installs some tests make still may).
for _name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_CACHE",
              "TRANSFORMERS_OFFLINE", "HUGGINGFACE_CO_STAGING", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN",
              "ALL_PROXY", "all_proxy"):  # (a SOCKS ALL_PROXY makes every httpx client fail: socksio is absent)
    os.environ.pop(_name, None)
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf-home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)
for _name in ("NO_PROXY", "no_proxy"):
    os.environ[_name] = ",".join(filter(None, [os.environ.get(_name), "127.0.0.1,localhost,::1,.localhost"]))

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import support  # noqa: E402
import timeout_guard  # noqa: E402
from hf_jobs_emulator import JobsEmulator  # noqa: E402
from proxy import AuthProxy  # noqa: E402

LEAK_WAIT_S = 5.0

pytest_runtest_setup = timeout_guard.pytest_runtest_setup  # a test's timeout alarm repeats until the test ends


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> support.TestCA:
    return support.make_test_ca(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture
def upstream() -> Iterator[support.Upstream]:
    with support.Upstream() as server:
        yield server


@pytest.fixture
def tls_upstream(test_ca: support.TestCA) -> Iterator[support.Upstream]:
    with support.Upstream(tls=test_ca) as server:
        yield server


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - non-Linux: fall back to threads only
        return -1


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves threads or file descriptors behind."""
    threads_before = threading.active_count()
    fds_before = _open_fds()
    yield
    deadline = time.monotonic() + LEAK_WAIT_S
    while True:
        threads, fds = threading.active_count(), _open_fds()
        if threads <= threads_before and fds <= fds_before:
            return
        if time.monotonic() > deadline:
            names = sorted(t.name for t in threading.enumerate())
            pytest.fail("leak: threads %d -> %d (%s), fds %d -> %d"
                        % (threads_before, threads, ", ".join(names), fds_before, fds))
        time.sleep(0.05)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception as exc:  # a broken log call is itself worth seeing
            self.lines.append("<unformattable record: %r>" % exc)


class LogGuard:
    """Captured log output plus the secrets that must never appear in it."""

    def __init__(self, capture: _Capture) -> None:
        self._capture = capture
        self.secrets: List[str] = [support.TEST_TOKEN]

    def watch(self, secret: str) -> None:
        self.secrets.append(secret)

    def text(self) -> str:
        return "\n".join(self._capture.lines)


@pytest.fixture(autouse=True)
def log_guard() -> Iterator[LogGuard]:
    root = logging.getLogger()
    capture = _Capture()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    guard = LogGuard(capture)
    try:
        yield guard
    finally:
        root.removeHandler(capture)
        root.setLevel(old_level)
    text = guard.text()
    for secret in guard.secrets:
        assert secret not in text, "a secret appeared in the captured log output"


@pytest.fixture(autouse=True)
def fresh_hardware_lists() -> None:
    """The core asks each endpoint for its hardware list once per process, but a test's emulator may get an
    earlier test's port: that emulator's flavors would then decide this test's flavor checks. Only loopback
    endpoints are forgotten: a mocked Hub (`responses`) keeps the list its first test fetched, since a fetch it
    does not answer is kept in its `calls`, traceback and all, and pins the provider that made it."""
    import hf_sandbox_provider

    for endpoint in list(hf_sandbox_provider._live_hardware):
        if urllib.parse.urlsplit(endpoint).hostname in ("127.0.0.1", "localhost", "::1"):
            hf_sandbox_provider._live_hardware.pop(endpoint, None)


@pytest.fixture
def socket_dir() -> Iterator[str]:
    """A short directory for Unix sockets: a path there fits the ~107 bytes a socket's name may take, however
    long this machine's TMPDIR (pytest's `tmp_path` adds ~60 characters to it)."""
    path = tempfile.mkdtemp(prefix="sock-", dir="/tmp" if os.path.isdir("/tmp") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def proxy() -> Iterator[AuthProxy]:
    with AuthProxy() as auth_proxy:
        yield auth_proxy


@pytest.fixture(scope="module")
def shared_proxy() -> Iterator[AuthProxy]:
    with AuthProxy(read_timeout_s=30) as auth_proxy:
        yield auth_proxy


@pytest.fixture
def emu(log_guard: LogGuard) -> Iterator[JobsEmulator]:
    with JobsEmulator() as emulator:
        log_guard.watch(emulator.token)
        yield emulator
    assert emulator.live_pids() == [], "a job process outlived the emulator"


@pytest.fixture
def make_emu(log_guard: LogGuard) -> Iterator[Callable[..., JobsEmulator]]:
    made: List[JobsEmulator] = []

    def make(**kwargs: Any) -> JobsEmulator:
        emulator = JobsEmulator(**kwargs).start()
        made.append(emulator)
        log_guard.watch(emulator.token)
        return emulator

    yield make
    for emulator in made:
        emulator.stop()
        assert emulator.live_pids() == [], "a job process outlived the emulator"
