"""The proxy's kernel-enforced socket timeouts (proxy.KERNEL_TIMEOUTS) against real peers: uvicorn in
its own process as the upstream (tests/upstreams/pressure_app.py), `requests`, `websockets` and raw
sockets as clients. Each stall is followed by ordinary requests, on the same connection where it
survives and on new ones, whose answers must be exactly the direct ones: bugs live in what a failed
request leaves behind. Bounds on time are generous and only prove "freed" or "not stuck".
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import signal
import socket
import threading
import time
from typing import Dict, Iterator, List, Tuple

import httpx
import pytest
import requests
from websockets.exceptions import InvalidStatus

import support
from diff_clients import UpstreamProcess, start_upstreams
from proxy import AuthProxy
from upstreams.common import body_of

TOKEN = "unused-by-the-pressure-app"
MIB = 1 << 20
# Generous bounds: a proxy that works answers far sooner; one that is stuck never does.
CLIENT_TIMEOUT_S = 15.0
FREED_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def pressure(test_ca: support.TestCA) -> Iterator[Dict[str, UpstreamProcess]]:
    """The pressure app under uvicorn, over plain HTTP and over TLS, each in its own process."""
    started = start_upstreams([("plain", "pressure_app.py", False, ()), ("tls", "pressure_app.py", True, ())],
                              TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started
    for up in started.values():
        up.stop()


def _mounted(proxy: AuthProxy, up: UpstreamProcess, test_ca: support.TestCA) -> str:
    return proxy.mount(up.url, TOKEN, verify=test_ca.ca_path)


def _direct(up: UpstreamProcess, test_ca: support.TestCA, target: str) -> Tuple[int, str, bytes]:
    r = requests.get(up.url + target, timeout=CLIENT_TIMEOUT_S, verify=test_ca.ca_path)
    return r.status_code, r.headers.get("Content-Type", ""), r.content


def _assert_answered_like_directly(session: requests.Session, base: str, up: UpstreamProcess,
                                   test_ca: support.TestCA, targets: List[str]) -> List[str]:
    """Each target through the proxy (on `session`) answers what it answers directly; the upstream
    connection ports the proxy used, in order."""
    ports = []
    for target in targets:
        r = session.get(base + target, timeout=CLIENT_TIMEOUT_S)
        assert (r.status_code, r.headers.get("Content-Type", ""), r.content) == _direct(up, test_ca, target), target
        assert "X-Proxy-Error" not in r.headers
        ports.append(r.headers["X-Client-Port"])
    return ports


def _wait_freed(proxy: AuthProxy) -> None:
    support.wait_until(lambda: not proxy._server.live_threads(), "every proxy worker to be free again", FREED_WITHIN_S)


def _status_line(raw: bytes) -> bytes:
    return raw.split(b"\r\n", 1)[0]


# --------------------------------------------------------------------------------------------------
# A client that stops reading, or reads slowly
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # waits out a 1 s send timeout
def test_a_client_that_stops_reading_a_large_response_is_cut_off_freed_and_others_are_served(pressure, test_ca):
    # The proxy's send to this client times out after a PARTIAL send (sendall loses the count): the
    # stream is corrupt, so the connection must close, its worker be freed, and nothing else suffer.
    up = pressure["plain"]
    size = 32 * MIB  # far more than the socket buffers on both sides hold
    with AuthProxy(idle_timeout_s=1.0, read_timeout_s=30) as proxy:
        base = _mounted(proxy, up, test_ca)
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            stalled.settimeout(CLIENT_TIMEOUT_S)
            stalled.connect(("127.0.0.1", proxy.port))
            stalled.sendall(b"GET %s/r?size=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (base[len(proxy.url):].encode(), size))
            with requests.Session() as other:  # served while that one is stuck
                _assert_answered_like_directly(other, base, up, test_ca, ["/r?size=100000", "/r?size=10"])
            _wait_freed(proxy)
            received = support.read_to_eof(stalled)  # EOF, not a hang: the proxy closed it
        head, _, body = received.partition(b"\r\n\r\n")
        assert _status_line(head) == b"HTTP/1.1 200 OK" and 0 < len(body) < size
        assert body == body_of(size)[:len(body)]  # what did arrive is the right prefix
        with requests.Session() as session:
            ports = _assert_answered_like_directly(session, base, up, test_ca,
                                                   ["/r?size=%d" % (2 * MIB), "/r?size=10", "/r?size=70000"])
        assert len(set(ports)) == 1  # one pooled upstream connection carried all three


@pytest.mark.slow  # reads for longer than a 1 s timeout on purpose
def test_a_slow_reader_gets_the_whole_body_byte_exact_and_its_next_request_answered(pressure, test_ca):
    # The kernel timeout limits each send, not the whole response: a client that keeps reading a little
    # (every 50 ms) is served for as long as it takes (here longer than the 1 s timeout), byte for byte.
    up = pressure["plain"]
    size = MIB
    with AuthProxy(idle_timeout_s=1.0) as proxy:
        base = _mounted(proxy, up, test_ca)
        path = base[len(proxy.url):].encode()
        # Small buffers on the proxy's side (accepted sockets inherit the listener's) and the client's,
        # so the proxy really waits in send while the client reads.
        proxy._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            slow.settimeout(CLIENT_TIMEOUT_S)
            slow.connect(("127.0.0.1", proxy.port))
            slow.sendall(b"GET %s/r?size=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (path, size))
            started, data = time.monotonic(), b""
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < size:
                chunk = slow.recv(32768)
                assert chunk, "the proxy closed a connection whose client was reading"
                data += chunk
                time.sleep(0.05)
            took = time.monotonic() - started
            head, _, body = data.partition(b"\r\n\r\n")
            assert _status_line(head) == b"HTTP/1.1 200 OK" and body == body_of(size)
            slow.sendall(b"GET %s/r?size=20 HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            answer = b""
            while not answer.endswith(body_of(20)):
                chunk = slow.recv(65536)
                assert chunk, "the connection did not survive the slow response"
                answer += chunk
            assert _status_line(answer) == b"HTTP/1.1 200 OK"
        assert took > 1.0, "the body arrived faster than the timeout: this run proved nothing (%.2f s)" % took


# --------------------------------------------------------------------------------------------------
# A client that stalls half way through its request
# --------------------------------------------------------------------------------------------------


STALLS = {
    "head": b"GET {path}/r?size=10 HTTP/1.1\r\nHost: x\r\nX-Half: ",
    "length-body": b"POST {path}/r?size=10 HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",
    "chunked-body": b"POST {path}/r?size=10 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n0123",
    "streamed-body": b"POST {path}/r?size=10 HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n" + b"b" * 1500000,
}


@pytest.mark.parametrize("stall", sorted(STALLS))
def test_a_request_stalled_half_way_gets_408_or_a_close_and_the_proxy_serves_on(pressure, test_ca, stall):
    # Half a head: the connection closes (no request to answer). Half a body (buffered, chunked, or one
    # over 1 MiB already streaming upstream): 408 request-timeout, not a "malformed body" 400, and close.
    up = pressure["plain"]
    with AuthProxy(idle_timeout_s=0.5, header_timeout_s=0.5) as proxy:
        base = _mounted(proxy, up, test_ca)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=CLIENT_TIMEOUT_S) as sock:
            sock.sendall(STALLS[stall].replace(b"{path}", base[len(proxy.url):].encode()))
            answer = support.read_to_eof(sock)
        if stall == "head":
            assert answer == b""
        else:
            assert _status_line(answer) == b"HTTP/1.1 408 Request Timeout"
            assert b"X-Proxy-Error: request-timeout" in answer and b"Connection: close" in answer
        _wait_freed(proxy)
        with requests.Session() as session:
            _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=10", "/r?size=100000"])


@pytest.mark.slow  # drips a body for 2 s on purpose
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_dripping_in_for_longer_than_the_timeout_is_forwarded_whole(pressure, test_ca, framing):
    # The timeout bounds each wait for the next byte, not the whole body: 40 bytes, one every 50 ms
    # (2 s in all) with idle_timeout_s=0.5 reach the upstream intact, and the connection serves on.
    up = pressure["plain"]
    body = bytes(range(65, 105))
    with AuthProxy(idle_timeout_s=0.5) as proxy:
        base = _mounted(proxy, up, test_ca)
        path = base[len(proxy.url):].encode()
        if framing == "length":
            head, pieces, tail = b"Content-Length: %d\r\n" % len(body), [body[i:i + 1] for i in range(len(body))], b""
        else:
            head = b"Transfer-Encoding: chunked\r\n"
            pieces, tail = [b"1\r\n%s\r\n" % body[i:i + 1] for i in range(len(body))], b"0\r\n\r\n"
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=CLIENT_TIMEOUT_S) as sock:
            sock.sendall(b"POST %s/r?size=7 HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path, head))
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(0.05)
            sock.sendall(tail + b"GET %s/r?size=3 HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            answers = b""
            while not answers.endswith(body_of(3)):
                chunk = sock.recv(65536)
                assert chunk, answers
                answers += chunk
        first, _, second = answers.partition(body_of(7))
        assert _status_line(first) == b"HTTP/1.1 200 OK" and _status_line(second) == b"HTTP/1.1 200 OK"
        assert b"x-body-sha: %s" % hashlib.sha256(body).hexdigest().encode() in first.lower()


# --------------------------------------------------------------------------------------------------
# An upstream that stalls
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # waits out a 1 s read timeout
def test_an_upstream_stalling_mid_body_gives_504_or_a_cut_stream_and_its_connection_is_never_reused(pressure, test_ca):
    # A small body (read whole before answering) stalling: 504 upstream-timeout. A large one, whose head
    # already went out: the client connection is cut (docs/proxy.md: "never a response that looks
    # complete"). Either way the pooled connection it stalled on must not carry another request.
    up = pressure["plain"]
    with AuthProxy(read_timeout_s=1.0) as proxy:
        base = _mounted(proxy, up, test_ca)
        with requests.Session() as session:
            _stall_then_answer(session, base, up, test_ca)
        _wait_freed(proxy)


def _stall_then_answer(session: requests.Session, base: str, up: UpstreamProcess, test_ca: support.TestCA) -> None:
    first, = _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=100"])
    r = session.get(base + "/r?size=1000&stall_after=500&stall_s=60", timeout=CLIENT_TIMEOUT_S)
    assert (r.status_code, r.headers.get("X-Proxy-Error")) == (504, "upstream-timeout")
    second, = _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=100"])
    assert second != first  # the connection that stalled (the pooled one) was dropped
    with session.get(base + "/r?size=%d&stall_after=300000&stall_s=60" % MIB, timeout=CLIENT_TIMEOUT_S,
                     stream=True) as cut:
        assert cut.status_code == 200 and cut.headers["X-Client-Port"] == second  # pooled, then stalled
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            cut.content
    ports = _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=100", "/r?size=%d" % MIB])
    assert second not in ports and first not in ports


NO_ANSWER_CASES = [("http", "plain"), ("httpx", "plain"), ("http", "tls"), ("websocket", "plain"), ("websocket", "tls")]


@pytest.mark.slow  # waits out a 1.5 s read timeout
@pytest.mark.parametrize("kind, scheme", NO_ANSWER_CASES)
def test_an_upstream_that_does_not_answer_within_read_timeout_gets_504_not_a_second_wait(pressure, test_ca, kind,
                                                                                        scheme):
    # docs/proxy.md: 504 when there is "no answer within read_timeout_s". The proxy first waits for the
    # answer while watching the client, then reads it: both waits were read_timeout_s long, so an answer
    # 1.5x read_timeout_s late was relayed as if on time. Margins of 0.75 s either side.
    up = pressure[scheme]
    with AuthProxy(read_timeout_s=1.5) as proxy:
        base = _mounted(proxy, up, test_ca)
        if kind in ("http", "httpx"):
            get = requests.get if kind == "http" else httpx.get
            r = get(base + "/r?size=10&wait_s=2.25", timeout=CLIENT_TIMEOUT_S)
            assert (r.status_code, r.headers.get("X-Proxy-Error")) == (504, "upstream-timeout")
        else:
            with pytest.raises(InvalidStatus) as info:
                with support.ws_connect(support.ws_url(base) + "/ws-wait/2.25", open_timeout=CLIENT_TIMEOUT_S):
                    pass
            assert info.value.response.status_code == 504
            assert info.value.response.headers.get("X-Proxy-Error") == "upstream-timeout"
        with requests.Session() as session:
            _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=10"])
        _wait_freed(proxy)


# --------------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------------


class _SignalRain:
    """Sends SIGUSR1 to every proxy thread every `every_s` seconds, as a kernel handing a process's
    signals (an itimer, a child's exit, a user's kill) to whichever thread does not block them would."""

    def __init__(self, every_s: float) -> None:
        self.sent = 0
        self._every_s = every_s
        self._stop = threading.Event()
        self._previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        self._thread = threading.Thread(target=self._run, name="signal-rain", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for thread in threading.enumerate():
                if thread.name.startswith("proxy") and thread.ident is not None:
                    try:
                        signal.pthread_kill(thread.ident, signal.SIGUSR1)
                        self.sent += 1
                    except (ProcessLookupError, OSError):  # it ended meanwhile
                        pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()  # (not bounded: a signal sent after the restore would end pytest)
        signal.signal(signal.SIGUSR1, self._previous)


@pytest.mark.slow  # waits out 1-1.5 s timeouts under a signal rain
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX thread-directed signals")
def test_signals_landing_on_proxy_threads_neither_cut_a_wait_short_nor_stretch_it_forever(pressure, test_ca):
    # CPython retries a system call a signal interrupted, and the kernel restarts SO_RCVTIMEO for the
    # retry: a signal every 20 ms on a worker waiting 1.5 s would restart that wait forever.
    up = pressure["plain"]
    with AuthProxy(read_timeout_s=1.5, idle_timeout_s=1.0) as proxy:
        base = _mounted(proxy, up, test_ca)
        path = base[len(proxy.url):].encode()
        rain = _SignalRain(0.02)
        try:
            def answer(target: str) -> Tuple[int, object, bytes]:
                r = requests.get(base + target, timeout=CLIENT_TIMEOUT_S)
                return r.status_code, r.headers.get("X-Proxy-Error"), r.content

            def idle_connection_closed() -> bytes:
                with socket.create_connection(("127.0.0.1", proxy.port), timeout=CLIENT_TIMEOUT_S) as sock:
                    sock.sendall(b"GET %s/r?size=5 HTTP/1.1\r\nHost: x\r\n\r\n" % path)
                    return support.read_to_eof(sock)  # the answer, then EOF after the idle timeout

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                late = pool.submit(answer, "/r?size=5000&wait_s=0.5")  # within read_timeout_s: answered
                silent = pool.submit(answer, "/r?size=10&wait_s=60")
                stalled = pool.submit(answer, "/r?size=5000&stall_after=100&stall_s=60")
                idle = pool.submit(idle_connection_closed)
                assert late.result() == (200, None, body_of(5000))
                assert silent.result()[:2] == (504, "upstream-timeout")
                assert stalled.result()[:2] == (504, "upstream-timeout")
                assert idle.result().endswith(body_of(5))
            assert rain.sent > 0
        finally:
            rain.stop()
        with requests.Session() as session:
            _assert_answered_like_directly(session, base, up, test_ca, ["/r?size=10", "/r?size=100000"])
        _wait_freed(proxy)


# --------------------------------------------------------------------------------------------------
# Requests cut off by an unmount: the proxy's doing, never blamed on the job
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_requests_in_flight_when_their_route_is_unmounted_get_404_unmounted_and_no_upstream_warning(
        pressure, test_ca, kind, caplog):
    up = pressure[kind]
    with AuthProxy() as proxy:
        base = _mounted(proxy, up, test_ca)
        with requests.Session() as pooled:
            assert pooled.get(base + "/warm", timeout=CLIENT_TIMEOUT_S).status_code == 200  # its upstream connection is pooled
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                waits = [pool.submit(pooled.get, base + "/r?wait_s=30", timeout=CLIENT_TIMEOUT_S),
                         pool.submit(requests.get, base + "/r?wait_s=30", timeout=CLIENT_TIMEOUT_S)]
                time.sleep(2.0)  # both are now waiting on the upstream
                caplog.clear()
                assert proxy.unmount(base)
                answers = [future.result() for future in waits]
    for answer in answers:  # before: 502 upstream-unreachable, "did the job restart?", and a WARNING
        assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (404, "unknown-route"), answer.text
        assert "unmounted while this request was under way" in answer.json()["message"]
    assert not [r.getMessage() for r in caplog.records if r.name == "proxy" and r.levelno >= 30]
