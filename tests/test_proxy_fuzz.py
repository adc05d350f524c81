"""Fuzzing the proxy with mutated or malformed requests (from clients) and responses (from an
upstream), counting outcomes instead of trusting them:

- no handler thread dies of an unexpected exception (the proxy logs those at ERROR),
- every client gets a well-formed HTTP answer or a close, within a bound (no hang; every handler
  thread ends once its client is gone),
- the token never appears in anything a client receives,
- the next well-formed request on the same route is answered correctly (nothing left poisoned in the
  upstream pool), and threads and file descriptors return to their baseline.

Seeded (PROXY_FUZZ_SEED); sizes: PROXY_FUZZ_REQUESTS (default 3,000 in the slow tier; 100,000 for
the full local run) and PROXY_FUZZ_RESPONSES (default 1,000). The fast tier runs a small sample.
"""
from __future__ import annotations

import logging
import os
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import requests

import support
from diff_clients import UpstreamProcess, start_upstreams
from proxy import AuthProxy
from upstreams.scripted import Script, ScriptedUpstream, serve_by_path

TOKEN = "hf_fuzztoken_" + "Wd4Hs9Pq1Zt6"
SEED = int(os.environ.get("PROXY_FUZZ_SEED", "1123"))
SLOW_REQUESTS = int(os.environ.get("PROXY_FUZZ_REQUESTS", "3000"))
SLOW_RESPONSES = int(os.environ.get("PROXY_FUZZ_RESPONSES", "1000"))
FAST_REQUESTS, FAST_RESPONSES = 400, 100
WORKERS = 16
# A client waits this long for more bytes before it closes: a request the mutation left incomplete
# (a Content-Length longer than the body, no blank line) is legitimately waiting for its rest.
QUIET_S = 0.05
# After the run every handler thread must have ended within this bound (no hang outlives its client).
SETTLE_S = 15.0
CHECK_EVERY = 250

REQUEST_TEMPLATES = [
    b"GET {p}/r?size=10 HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n",
    b"POST {p}/r?size=5 HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\nContent-Type: text/plain\r\n\r\nhello world",
    b"PUT {p}/r?mode=chunked&size=3 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;e=1\r\n world\r\n0\r\nT: x\r\n\r\n",
    b"GET {p}/r HTTP/1.1\r\nHost: x\r\n\r\nPOST {p}/r?size=2 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiHEAD {p}/r HTTP/1.1\r\n\r\n",
    b"GET {p}/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    b"GET {p}/r?size=100&mode=close HTTP/1.0\r\nUser-Agent: old\r\n\r\n",
    b"POST {p}/r HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\nbody",
    b"DELETE {p}/r?status=204 HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, X-Drop\r\nX-Drop: 1\r\nAuthorization: Bearer nope\r\n\r\n",
]
INSERTS = [b"\r", b"\n", b"\r\n", b"\x00", b" ", b":", b"\t", b"\xff", b"0", b"-", b",", b";", b"\r\n\r\n", b"%", b"/"]
HEADER_LINES = [
    b"Content-Length: 5", b"Content-Length: 1, 2", b"Content-Length: -1", b"Content-Length: 99999999999999999999",
    b"Content-Length: 0x10", b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: chunked, identity", b"Transfer-Encoding : chunked", b"Connection: close, te",
    b"Connection: Upgrade", b"Upgrade: websocket", b"Expect: 100-continue", b"Expect: weird", b"Host: a\r\nHost: b",
    b" folded continuation", b"X-Ctl: a\x01b", b"NoColonHere", b": empty-name", b"X-Long: " + b"L" * 70000,
    b"\r\n".join(b"X-H%d: %d" % (i, i) for i in range(120)), b"Authorization: Bearer attacker",
]
TARGETS = [b"http://evil.example/x", b"*", b"/", b"//double", b"/%00", b"/\xff", b"/" + b"a" * 70000, b""]
METHODS = [b"CONNECT", b"TRACE", b"G\x00T", b"", b"PRI", b"get", b"OPTIONS", b"X" * 300]
VERSIONS = [b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1x", b"http/1.1", b"HTTP/1.", b"HTTP/1.0"]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """Apply one to three random mutations (byte-level and HTTP-aware) to `data`."""
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(11)
        at = rng.randrange(len(data) + 1)
        if kind == 0 and data:
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        elif kind == 1:
            data = data[:at] + rng.choice(INSERTS) + data[at:]
        elif kind == 2:
            data = data[:at] + data[at + rng.randint(1, 20):]
        elif kind == 3:
            end = min(len(data), at + rng.randint(1, 40))
            data = data[:end] + data[at:end] + data[end:]
        elif kind == 4:
            data = data[:at]
        elif kind == 5:
            data = re.sub(rb"\d+", lambda m: rng.choice([b"0", b"-1", b"99999999999999999999", b"ff", b"1 1", m.group()]),
                          data, count=rng.randint(1, 3))
        elif kind in (6, 7):
            line_end = data.find(b"\r\n")
            if line_end >= 0:
                data = data[:line_end + 2] + rng.choice(HEADER_LINES) + b"\r\n" + data[line_end + 2:]
        elif kind == 8:
            first = data.split(b"\r\n", 1)
            parts = first[0].split(b" ")
            if len(parts) == 3:
                slot = rng.randrange(3)
                parts[slot] = rng.choice([METHODS, TARGETS, VERSIONS][slot])
                data = b" ".join(parts) + (b"\r\n" + first[1] if len(first) > 1 else b"")
        elif kind == 9:
            data = data.replace(b"\r\n", b"\n", rng.randint(1, 4))
        else:
            data = data.replace(b"\r\n\r\n", b"\r\n" + rng.choice(HEADER_LINES) + b"\r\n\r\n", 1)
    return data


# 600-999 are invalid statuses but relayed as sent, as http.client (so requests) hands them over
# directly (RFC 9110 section 15: the client treats them as 5xx).
_STATUS_LINE = re.compile(rb"^HTTP/1\.1 [1-9]\d\d ")


class Tally:
    """Counts outcomes across worker threads; `problems` keeps the first few failures with their input."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        self.problems: List[str] = []

    def add(self, outcome: str, problem: Optional[str] = None) -> None:
        with self.lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if problem and len(self.problems) < 10:
                self.problems.append(problem)


def send_and_read(port: int, data: bytes, quiet_s: float, limit_s: float) -> Tuple[bytes, bool]:
    """Send raw bytes to the proxy; read until it closes or stays quiet for quiet_s (then close).
    (answer bytes, whether the proxy closed by itself); a proxy talking longer than limit_s is a hang."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the proxy refused early (e.g. a too long line) and closed
        chunks: List[bytes] = []
        deadline = time.monotonic() + limit_s
        sock.settimeout(quiet_s)
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                return b"".join(chunks), False
            except OSError:
                return b"".join(chunks), True
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)
        raise AssertionError("the proxy kept talking past %.0f s" % limit_s)


class _ErrorLog(logging.Handler):
    """Counts ERROR records of the proxy logger: an unexpected exception in a handler thread."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture
def error_log() -> Iterator[_ErrorLog]:
    handler = _ErrorLog()
    logger = logging.getLogger("proxy")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def fuzz_upstream(test_ca: support.TestCA) -> Iterator[UpstreamProcess]:
    started = start_upstreams([("stdlib", "stdlib_server.py", False, ())], TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started["stdlib"]
    started["stdlib"].stop()


def _baseline(proxy: AuthProxy) -> Tuple[int, int]:
    """Threads (less the proxy's pooled workers, which stay parked by design; a WebSocket session's
    two threads are among them) and open fds."""
    pooled = len(proxy._server.all_threads()) if proxy._server else 0  # type: ignore[union-attr]
    return threading.active_count() - pooled, len(os.listdir("/proc/self/fd"))


def _fd_links() -> List[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append("%s=%s" % (fd, os.readlink("/proc/self/fd/" + fd)))
        except OSError:
            pass
    return links


def _open_sockets() -> List[str]:
    """Each open socket fd as 'local -> remote (tcp state)', to name what leaked."""
    inodes = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink("/proc/self/fd/" + fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes[link[8:-1]] = fd
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[9] in inodes:
                    local, remote = (int(c.split(":")[1], 16) for c in cols[1:3])
                    found.append("fd %s: :%d -> :%d state %s" % (inodes[cols[9]], local, remote, cols[3]))
    return found


def _settled(before: Tuple[int, int], proxy: AuthProxy) -> None:
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = _baseline(proxy)
        live = proxy._server.live_threads() if proxy._server else []  # type: ignore[union-attr]
        if now[0] <= before[0] and now[1] <= before[1] and not live:
            return
        if time.monotonic() > deadline:
            pytest.fail("threads/fds not back to baseline within %.0f s: %s -> %s, %d handler threads alive; "
                        "sockets: %s; fds: %s" % (SETTLE_S, before, now, len(live), _open_sockets(), _fd_links()))
        time.sleep(0.05)


def _good_request_answers(base: str) -> None:
    answer = requests.get(base + "/r?size=1000", timeout=10)
    assert answer.status_code == 200 and len(answer.content) == 1000, (answer.status_code, answer.headers)


def run_request_fuzz(count: int, upstream_url: str, error_log: _ErrorLog) -> Tally:
    tally = Tally()
    with AuthProxy(read_timeout_s=10, header_timeout_s=5) as proxy:
        base = proxy.mount(upstream_url, TOKEN)
        prefix = base.split(str(proxy.port), 1)[1].encode()
        _good_request_answers(base)  # the serving thread has made its selector (an fd) by now
        before = _baseline(proxy)

        def one(case: int) -> None:
            rng = random.Random(SEED * 1_000_003 + case)
            data = mutate(rng.choice(REQUEST_TEMPLATES).replace(b"{p}", prefix), rng)
            answer, closed = send_and_read(proxy.port, data, QUIET_S, 30)
            if TOKEN.encode() in answer:
                tally.add("token-leak", "case %d: the token came back for %r" % (case, data[:300]))
            elif answer and not _STATUS_LINE.match(answer):
                tally.add("malformed-answer", "case %d: %r answered %r" % (case, data[:300], answer[:200]))
            else:
                tally.add("answered" if answer else ("closed" if closed else "waiting"))

        with ThreadPoolExecutor(WORKERS) as pool:
            for start in range(0, count, CHECK_EVERY):
                list(pool.map(one, range(start, min(count, start + CHECK_EVERY))))
                _good_request_answers(base)
        proxy.unmount(base)
        _settled(before, proxy)
    tally.counts["errors-logged"] = len(error_log.records)
    return tally


def _check(tally: Tally, count: int, error_log: _ErrorLog) -> None:
    print("fuzz outcomes (seed %d): %s" % (SEED, tally.counts))
    assert not tally.problems, "\n".join(tally.problems)
    assert not error_log.records, "handler threads failed unexpectedly: %s" % error_log.records[:5]
    assert sum(v for k, v in tally.counts.items() if k != "errors-logged") == count


def test_mutated_requests_sample_are_answered_or_closed_and_leave_nothing_behind(fuzz_upstream, error_log):
    tally = run_request_fuzz(FAST_REQUESTS, fuzz_upstream.url, error_log)
    _check(tally, FAST_REQUESTS, error_log)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_mutated_requests_are_answered_or_closed_and_leave_nothing_behind(fuzz_upstream, error_log):
    tally = run_request_fuzz(SLOW_REQUESTS, fuzz_upstream.url, error_log)
    _check(tally, SLOW_REQUESTS, error_log)


# -- malformed upstream responses ------------------------------------------------------------------

RESPONSE_TEMPLATES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nX-Old: 1\r\n\r\nbody until close",
    b"HTTP/1.1 204 No Content\r\nX-E: 1\r\n\r\n",
    b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
]
GOOD = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood"


def _response_script(rng_for: Callable[[int], random.Random]) -> Script:
    def mutated(target: str) -> Tuple[bytes, bool]:
        rng = rng_for(int(target.rsplit("=", 1)[1]))
        answer = mutate(rng.choice(RESPONSE_TEMPLATES), rng)
        return answer, rng.randrange(2) == 0  # half the time the connection stays open (may be pooled)
    return serve_by_path({"/good": GOOD}, mutated)


def run_response_fuzz(count: int, error_log: _ErrorLog) -> Tally:
    tally = Tally()

    def rng_for(case: int) -> random.Random:
        return random.Random(SEED * 7_000_001 + case)

    with ScriptedUpstream(_response_script(rng_for)) as up, AuthProxy(read_timeout_s=1.0) as proxy:
        base = proxy.mount(up.url, TOKEN)
        prefix = base.split(str(proxy.port), 1)[1].encode()
        support.raw_request(proxy.port, b"GET %s/good HTTP/1.1\r\nConnection: close\r\n\r\n" % prefix)  # warm
        before = _baseline(proxy)

        def one(case: int) -> None:
            request = b"GET %s/m?case=%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (prefix, case)
            answer, closed = send_and_read(proxy.port, request, 5.0, 30)
            if answer and not _STATUS_LINE.match(answer):
                tally.add("malformed-answer", "case %d answered %r" % (case, answer[:200]))
            elif not closed:
                tally.add("hang", "case %d: no answer or close within 5 s" % case)
            else:
                tally.add(answer[9:12].decode() if answer else "closed")
            good = support.raw_request(proxy.port, b"GET %s/good HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % prefix)
            if not good.endswith(b"\r\n\r\ngood"):
                tally.add("next-request-wrong", "case %d: the next request got %r" % (case, good[:200]))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(count)))
        proxy.unmount(base)
        _settled(before, proxy)
    return tally


def test_malformed_upstream_responses_sample_get_an_answer_and_do_not_poison_the_route(error_log):
    _check_responses(run_response_fuzz(FAST_RESPONSES, error_log), FAST_RESPONSES, error_log)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_malformed_upstream_responses_get_an_answer_and_do_not_poison_the_route(error_log):
    _check_responses(run_response_fuzz(SLOW_RESPONSES, error_log), SLOW_RESPONSES, error_log)


def _check_responses(tally: Tally, count: int, error_log: _ErrorLog) -> None:
    print("response fuzz outcomes (seed %d): %s" % (SEED, tally.counts))
    assert not tally.problems, "\n".join(tally.problems)
    assert not error_log.records, "handler threads failed unexpectedly: %s" % error_log.records[:5]
    assert sum(tally.counts.values()) == count
