"""AuthProxy's worker pool: parked threads reused across connections and tunnels, growth on demand,
idle retirement, a refusal at the cap, and stop() ending every thread."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Dict, Iterator, List, Tuple

import pytest
import requests
from websockets.exceptions import InvalidStatus

import proxy as proxy_module
import support
from support import TEST_TOKEN, Upstream, wait_until, ws_connect, ws_url
from proxy import AuthProxy, _WarningRate, _WorkerPool

TIMEOUT = 10


def _blocking_jobs(pool: _WorkerPool, n: int) -> Tuple[threading.Event, List[threading.Event]]:
    """Submit n jobs that each signal they started, then wait for one shared release."""
    release = threading.Event()
    started = [threading.Event() for _ in range(n)]
    for event in started:
        assert pool.submit(lambda e=event: (e.set(), release.wait(TIMEOUT)))
    for event in started:
        assert event.wait(TIMEOUT)
    return release, started


def _counting_thread_starts(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Record the name of every thread started from now on (stdlib Thread.start wrapped, not the proxy)."""
    names: List[str] = []
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        names.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


@contextlib.contextmanager
def _pool(max_workers: int = 8, idle_s: float = 60, stack_bytes: int = 256 * 1024) -> Iterator[_WorkerPool]:
    """A worker pool that is closed, and every thread of it joined, on leaving the block."""
    pool = _WorkerPool("t", max_workers=max_workers, idle_s=idle_s, stack_bytes=stack_bytes)
    try:
        yield pool
    finally:
        pool.close()
        for thread in pool.threads():
            thread.join(TIMEOUT)


# -- the pool on its own ------------------------------------------------------------------------


def test_the_pool_grows_to_one_thread_per_concurrent_job_and_reuses_them_afterwards():
    with _pool() as pool:
        release, _ = _blocking_jobs(pool, 5)
        assert pool.counts() == (5, 0)
        release.set()
        wait_until(lambda: pool.counts() == (5, 5), "five parked workers")
        first = set(pool.threads())
        for _round in range(3):  # sequences of smaller bursts: served by the parked threads only
            release, _ = _blocking_jobs(pool, 3)
            release.set()
            wait_until(lambda: pool.counts()[1] == 5, "the workers to park again")
        assert set(pool.threads()) == first


def test_idle_workers_retire_and_the_pool_starts_new_ones_when_work_returns():
    with _pool(idle_s=0.05) as pool:
        release, _ = _blocking_jobs(pool, 4)
        old = pool.threads()
        release.set()
        wait_until(lambda: pool.counts() == (0, 0), "idle workers to retire")
        for thread in old:
            thread.join(TIMEOUT)
            assert not thread.is_alive()
        done = threading.Event()
        assert pool.submit(done.set)
        assert done.wait(TIMEOUT)


def test_at_the_cap_submit_refuses_without_running_and_accepts_again_once_a_worker_is_free():
    ran = threading.Event()
    with _pool(max_workers=2) as pool:
        release, _ = _blocking_jobs(pool, 2)
        assert pool.submit(ran.set) is False
        assert pool.counts() == (2, 0)
        release.set()
        wait_until(lambda: pool.counts() == (2, 2), "the two workers to park")
        assert not ran.is_set()  # the refused job was dropped, not queued
        assert pool.submit(ran.set)
        assert ran.wait(TIMEOUT)
        assert pool.counts()[0] == 2


def test_close_ends_parked_workers_lets_busy_ones_finish_and_refuses_new_jobs():
    pool = _WorkerPool("t", max_workers=4, idle_s=60, stack_bytes=256 * 1024)
    release, _ = _blocking_jobs(pool, 3)
    finished = threading.Event()
    assert pool.submit(lambda: None)  # a fourth worker, parked once done
    wait_until(lambda: pool.counts() == (4, 1), "one parked worker")
    pool.close()
    assert pool.submit(finished.set) is False
    release.set()
    threads = pool.threads()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    assert pool.counts() == (0, 0)
    assert not finished.is_set()


def test_close_waits_for_a_thread_still_starting_so_every_listed_thread_can_be_joined():
    """stop() joins what close() leaves listed, and joining a thread not yet started raises: a WebSocket
    session's second thread, asked for as stop() runs, made stop() raise. A start waits for the GIL
    (long with thousands of threads), or, as here, for the stack-size window another start holds."""
    pool = _WorkerPool("t", max_workers=4, idle_s=60, stack_bytes=256 * 1024)
    ran = threading.Event()
    with _WorkerPool._STACK:  # every thread start now waits in its stack-size window
        submitter = threading.Thread(target=pool.submit, args=(ran.set,))
        submitter.start()
        wait_until(lambda: pool.counts()[0] == 1, "the new thread to be listed")
        closer = threading.Thread(target=pool.close)
        closer.start()
        closer.join(0.3)
        assert closer.is_alive()  # waiting for the start, not returning with an unstarted thread listed
    closer.join(TIMEOUT)
    submitter.join(TIMEOUT)
    threads = pool.threads()
    for thread in threads:
        thread.join(TIMEOUT)  # (raised RuntimeError for one not started)
    assert not closer.is_alive() and not any(thread.is_alive() for thread in threads)
    assert ran.is_set() and pool.counts() == (0, 0)  # the job given before close() ran, then the worker ended


def test_a_job_that_raises_is_logged_and_its_worker_serves_the_next_job(log_guard):
    with _pool(max_workers=1) as pool:
        def boom() -> None:
            raise RuntimeError("job failed")

        assert pool.submit(boom)
        wait_until(lambda: pool.counts() == (1, 1), "the worker to park after the failure")
        done = threading.Event()
        assert pool.submit(done.set)
        assert done.wait(TIMEOUT)
        assert "unexpected error in a worker thread" in log_guard.text()
        assert "RuntimeError: job failed" in log_guard.text()


def _own_stack_size() -> int:
    """The calling thread's stack size as glibc reports it (pthread_getattr_np)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong  # the default int restype would truncate the handle
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t is 56 bytes on x86-64 glibc: room to spare
    size = ctypes.c_size_t()
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    try:
        assert libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    finally:
        libc.pthread_attr_destroy(attr)
    return size.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the stack size through glibc")
def test_pool_threads_get_the_configured_stack_size_and_the_process_default_is_restored():
    # glibc hands a new thread a cached stack of an ended one when that is at least the size asked and
    # under 4x it: 1.5 MiB is served by neither the proxy workers' 1 MiB stacks nor the default 8 MiB.
    wanted = 1536 * 1024
    sizes: List[int] = []
    before = threading.stack_size()
    with _pool(max_workers=1, stack_bytes=wanted) as pool:
        done = threading.Event()
        assert pool.submit(lambda: (sizes.append(_own_stack_size()), done.set()))
        assert done.wait(TIMEOUT)
        assert threading.stack_size() == before
        assert sizes == [wanted]
        other: List[int] = []
        thread = threading.Thread(target=lambda: other.append(_own_stack_size()))
        thread.start()
        thread.join(TIMEOUT)
        assert other and other[0] != wanted  # a thread started afterwards has the process default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the stack size through glibc")
def test_overlapping_starts_get_their_pools_stack_size_and_the_process_default_is_back_after_the_last():
    # Starts overlap (the first sets the process-wide size, the last restores it); a pool wanting another
    # size waits for them. Sizes glibc's stack cache cannot serve from each other or the default 8 MiB.
    small, large = 1536 * 1024, 1792 * 1024
    before = threading.stack_size()
    seen: Dict[int, List[int]] = {small: [], large: []}
    release = threading.Event()

    def job(size: int) -> None:
        seen[size].append(_own_stack_size())
        release.wait(TIMEOUT)  # held: every submit starts a thread of its own

    with _pool(max_workers=40, stack_bytes=small) as first, _pool(max_workers=40, stack_bytes=large) as second:
        submitters = [threading.Thread(target=lambda pool=pool, size=size: [pool.submit(job, size) for _ in range(10)])
                      for pool, size in ((first, small), (second, large)) for _ in range(3)]
        for thread in submitters:
            thread.start()
        for thread in submitters:
            thread.join(TIMEOUT)
        wait_until(lambda: len(seen[small]) + len(seen[large]) == 60, "every job to run")
        release.set()
        assert threading.stack_size() == before
    assert seen == {small: [small] * 30, large: [large] * 30}


# Run by an older interpreter from the checkout: a pool worker recursing to just under the default limit
# (the frames below the job: thread bootstrap, the pool's loop) prints the depth reached.
_DEEP_JOB = """
import sys, threading
import proxy
def depth(k):
    return 0 if k == 0 else 1 + depth(k - 1)
pool = proxy._WorkerPool("deep", 1, 60.0, proxy.WORKER_STACK_BYTES)
reached, done = [], threading.Event()
pool.submit(lambda: (reached.append(depth(sys.getrecursionlimit() - 30)), done.set()))
done.wait(30)
pool.close()
print(reached[0] if reached else "no answer")
"""


@pytest.mark.parametrize("version", [(3, 9), (3, 10)], ids=["3.9", "3.10"])
def test_a_worker_holds_python_recursion_up_to_the_default_limit_on_old_interpreters(version):
    """User code runs on workers (token and headers callables, route_request, log handlers). With 256
    KiB stacks Python 3.9 and 3.10 killed the process (SIGSEGV) at a depth of 700-800, below the limit
    of 1,000 that would have raised RecursionError."""
    python = support.python_of(version)
    if python is None:
        pytest.skip("no Python %d.%d on this machine" % version)
    result = subprocess.run([python, "-I", "-c", "import sys; sys.path.insert(0, %r)\n" % os.path.dirname(proxy_module.__file__) + _DEEP_JOB],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, "exit %d: %s" % (result.returncode, result.stderr[-2000:])
    assert result.stdout.split() == ["970"], result.stdout


class _Gate:
    """A stand-in for a pool's lock (the pool takes it only with `with`): re-entrant, so the test
    thread can hold it across a submit() or close(), and it notes another thread waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.waited = threading.Event()

    def __enter__(self) -> "_Gate":
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _parked_worker_behind_the_gate(pool: _WorkerPool) -> Tuple[_Gate, threading.Thread]:
    """One parked worker whose idle wait has timed out and which now waits for the pool lock: the
    test thread holds that lock (its gate) on return."""
    assert pool.submit(lambda: None)
    wait_until(lambda: pool.counts() == (1, 1), "the worker to park")
    [worker] = pool.threads()
    gate = pool._lock = _Gate()  # type: ignore[assignment]
    gate.__enter__()
    assert gate.waited.wait(TIMEOUT)  # the worker's wait timed out: it is about to retire
    return gate, worker


def test_a_job_submitted_as_a_parked_worker_times_out_runs_on_that_worker():
    with _pool(idle_s=0.05) as pool:
        gate, worker = _parked_worker_behind_the_gate(pool)
        ran: List[threading.Thread] = []
        try:
            assert pool.submit(lambda: ran.append(threading.current_thread()))  # takes the parked one
            assert pool.counts() == (1, 0)
        finally:
            gate.__exit__()
        wait_until(lambda: ran == [worker], "the job to run on the worker that timed out")
        wait_until(lambda: pool.counts() == (0, 0), "the worker to retire after its next idle wait")


def test_close_as_a_parked_worker_times_out_ends_that_worker():
    pool = _WorkerPool("t", max_workers=4, idle_s=0.05, stack_bytes=256 * 1024)
    gate, worker = _parked_worker_behind_the_gate(pool)
    try:
        pool.close()
    finally:
        gate.__exit__()
    worker.join(TIMEOUT)
    assert not worker.is_alive() and pool.counts() == (0, 0)


def test_submits_racing_idle_timeouts_lose_no_job_and_leave_no_worker_behind():
    done = threading.Semaphore(0)
    with _pool(max_workers=4, idle_s=0.002) as pool:
        for i in range(1500):
            for _ in range(1 + i % 3):  # bursts of 1-3: parked workers, timing out, to pick from
                assert pool.submit(done.release)
            for _ in range(1 + i % 3):
                assert done.acquire(timeout=TIMEOUT)
            if i % 2:
                time.sleep(0.002 * (i % 5) / 2)  # about the idle timeout, before or after it
        wait_until(lambda: pool.counts() == (0, 0), "every worker to retire")


class _Payload:
    """A job argument: a stand-in for a connection's socket."""


def test_a_parked_worker_holds_no_reference_to_its_finished_jobs_arguments():
    with _pool(max_workers=1) as pool:
        for first in (True, False):  # a new thread's first job, then a parked worker's next one
            payload = _Payload()
            gone = weakref.ref(payload)
            assert pool.submit(lambda p: None, payload)
            del payload
            wait_until(lambda: pool.counts() == (1, 1), "the worker to park")
            wait_until(lambda: gc.collect() is not None and gone() is None,
                       "the finished job's argument to be freed (first job: %s)" % first, TIMEOUT)
            assert pool.counts() == (1, 1)  # freed while its worker is still parked


# -- the pool inside AuthProxy ------------------------------------------------------------------


@pytest.fixture
def served(no_leaks: None) -> Iterator[Tuple[Upstream, AuthProxy, str]]:
    with Upstream() as upstream, AuthProxy() as proxy:
        yield upstream, proxy, proxy.mount(upstream.url, TEST_TOKEN)


def _get_and_close(base: str, path: str) -> int:
    """One request on a fresh connection that the client closes (no keep-alive reuse)."""
    return requests.get(base + path, headers={"Connection": "close"}, timeout=TIMEOUT).status_code


@pytest.mark.slow  # 200 connections
def test_a_warm_proxy_starts_no_thread_for_200_sequential_connections(served, monkeypatch):
    _, proxy, base = served
    workers = proxy._server.workers
    for _ in range(5):  # warm up: the listener, a worker, the upstream pool
        assert _get_and_close(base, "/warm") == 200
    wait_until(lambda: not proxy._server.live_threads(), "the warm-up workers to park")
    starts = _counting_thread_starts(monkeypatch)
    idents = set()
    for i in range(200):
        assert _get_and_close(base, "/step/%d" % i) == 200
        # Sequential for the server too: the connection's worker parks before the next one arrives.
        wait_until(lambda: not proxy._server.live_threads(), "the worker to park")
        idents.update(t.ident for t in workers.threads())
    assert [name for name in starts if name.startswith("proxy")] == []
    assert idents == set(t.ident for t in workers.threads())  # the same parked threads throughout


def test_sequential_websocket_sessions_start_no_thread_and_hold_no_worker_while_open(served, monkeypatch):
    _, proxy, base = served
    for _ in range(2):
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("warm")
            assert ws.recv(TIMEOUT) == "warm"
    wait_until(lambda: not proxy._server.live_threads(), "the warm-up sessions' workers to park")
    starts = _counting_thread_starts(monkeypatch)
    for i in range(30):
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("step %d" % i)
            assert ws.recv(TIMEOUT) == "step %d" % i
            assert len(proxy._server.live_threads()) == 2  # open: one thread per direction
        wait_until(lambda: not proxy._server.live_threads(), "the session's two workers to park")
    assert [name for name in starts if name.startswith("proxy")] == []
    total, parked = proxy._server.workers.counts()
    assert total == parked >= 2


def test_concurrent_sessions_hold_two_workers_each_and_stop_ends_every_worker(no_leaks):
    with Upstream() as upstream, contextlib.ExitStack() as clients:
        proxy = AuthProxy().start()
        try:
            base = ws_url(proxy.mount(upstream.url, TEST_TOKEN))
            sessions = [clients.enter_context(ws_connect(base + "/ws")) for _ in range(6)]
            for i, ws in enumerate(sessions):
                ws.send("s%d" % i)
            assert [ws.recv(TIMEOUT) for ws in sessions] == ["s%d" % i for i in range(len(sessions))]
            assert len(proxy._server.live_threads()) == 12  # one per direction
            threads = proxy._server.all_threads()
            proxy.stop()  # tunnels still open: stop must cut them and end both threads of each
            assert not any(thread.is_alive() for thread in threads)
            assert proxy._server.workers.counts() == (0, 0)
        finally:
            proxy.stop()


def _hold_every_worker(proxy: AuthProxy, stack: contextlib.ExitStack, n: int) -> None:
    """Open n idle client connections, each holding a worker in its request read (open WebSocket
    sessions hold none), and wait until all n are busy."""
    for _ in range(n):
        stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT))
    wait_until(lambda: len(proxy._server.live_threads()) == n, "every worker to be busy")


def test_at_the_thread_cap_a_new_connection_gets_503_proxy_busy_and_service_resumes_after(monkeypatch, no_leaks):
    monkeypatch.setattr(proxy_module, "MAX_WORKERS", 2)
    with Upstream() as upstream, AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as ws, contextlib.ExitStack() as idle:
            ws.send("hold")
            assert ws.recv(TIMEOUT) == "hold"
            _hold_every_worker(proxy, idle, 2)
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
                sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = support.read_to_eof(sock)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ")
            assert b"X-Proxy-Error: proxy-busy" in head and b"Retry-After: 1" in head
            assert json.loads(body)["error"] == "proxy-busy"
            ws.send("still open")  # the session open at the cap is untouched
            assert ws.recv(TIMEOUT) == "still open"
        wait_until(lambda: proxy._server.workers.counts() == (2, 2), "the idle connections' workers to park")
        assert requests.get(base + "/after", timeout=TIMEOUT).status_code == 200


def test_warning_rate_reports_the_first_event_then_one_count_per_interval():
    rate = _WarningRate(every_s=10.0)
    times = [100.0, 100.5, 101.0, 109.9, 110.0, 110.1, 125.0, 125.0]
    assert [rate.note(t) for t in times] == [1, 0, 0, 0, 4, 0, 2, 0]
    # every event is reported exactly once, whatever the spacing (the last is held until the next is due)
    rate = _WarningRate(every_s=3.0)
    reported = sum(rate.note(float(t)) for t in range(0, 30, 1))
    assert reported + rate.note(1000.0) == 31


@pytest.mark.parametrize("every_s, expected", [
    (None, ["1 time(s)"]),  # the default interval: the first refusal warns, the 4 after it are held
    (0.0, ["1 time(s)"] * 5),  # no interval: each refusal is its own warning
], ids=["default-interval", "no-interval"])
def test_refusals_at_the_thread_cap_warn_at_most_once_per_interval_with_a_count(monkeypatch, caplog, no_leaks,
                                                                               every_s, expected):
    monkeypatch.setattr(proxy_module, "MAX_WORKERS", 2)
    if every_s is not None:
        monkeypatch.setattr(proxy_module, "BUSY_WARNING_EVERY_S", every_s)
    caplog.set_level(logging.WARNING, logger="proxy")
    with AuthProxy() as proxy:
        with contextlib.ExitStack() as idle:
            _hold_every_worker(proxy, idle, 2)
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
                    sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert support.read_to_eof(sock).startswith(b"HTTP/1.1 503 ")
    busy = [r.getMessage() for r in caplog.records if r.name == "proxy" and "proxy-busy" in r.getMessage()]
    assert len(busy) == len(expected), busy
    assert all(count + " since the previous warning" in m for count, m in zip(expected, busy)), busy


def test_an_upgrade_at_the_worker_cap_gets_a_clean_503_and_open_sessions_keep_working(monkeypatch,
                                                                                     no_leaks):
    # A session holds two workers, one per direction. At MAX_WORKERS = 3 one session is open; a
    # second upgrade is parsed by the third worker, which finds no thread for the other direction:
    # the client gets 503 proxy-busy before any 101 (never a half-made tunnel), and the open session
    # is untouched.
    monkeypatch.setattr(proxy_module, "MAX_WORKERS", 3)
    with Upstream() as upstream, AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as first:
            first.send("one")
            assert first.recv(TIMEOUT) == "one"
            with pytest.raises(InvalidStatus) as info:
                with ws_connect(ws_url(base) + "/ws"):
                    pass  # pragma: no cover
            response = info.value.response
            assert (response.status_code, response.headers["X-Proxy-Error"]) == (503, "proxy-busy")
            assert response.headers["Retry-After"] == "1"
            first.send("still open")
            assert first.recv(TIMEOUT) == "still open"
        wait_until(lambda: not proxy._server.live_threads(), "the session's workers to park")
        with ws_connect(ws_url(base) + "/ws") as again:  # the freed threads carry the next session
            again.send("two")
            assert again.recv(TIMEOUT) == "two"
        assert requests.get(base + "/between", timeout=TIMEOUT).status_code == 200
