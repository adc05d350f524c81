"""WebSocket set-ups, to TLS and (where the test is not about the handshake) plain upstreams:
the TLS handshake with the upstream and the upgrade exchange run on the connection's own worker
thread, and every way a set-up can end gives a 101 and a working tunnel, the upstream's own non-101
answer, a typed refusal (upstream-timeout, upstream-tls, upstream-unreachable, unknown-route,
proxy-stopping), or a quiet end when the client leaves. The
upstream here is a stdlib server on raw sockets (TLS or plain) that can be told to stall before its
handshake (plain: before reading the request), to stall before answering, or to hang up mid-handshake
(plain: before answering).
"""
from __future__ import annotations

import base64
import hashlib
import socket
import ssl
import threading
from typing import Callable, Iterator, List, Optional

import pytest
from websockets.exceptions import InvalidStatus

import support
from support import TEST_TOKEN, Upstream, ws_connect, ws_url
from proxy import AuthProxy

TIMEOUT = 10.0
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class _ScriptedTLSUpstream:
    """A TLS (or, `tls=False`, plain) upstream serving each connection on its own thread: `hold_handshake`
    (an Event) delays the handshake (plain: reading the request) until set, `mode` says what follows it
    ("101" then echo, "silent": never answer, "403", "hangup": close the TCP connection before the
    handshake (plain: before answering); "403": a keep-alive refusal)."""

    def __init__(self, test_ca: support.TestCA, mode: str = "101", hold_handshake: Optional[threading.Event] = None,
                 tls: bool = True):
        self._context = test_ca.server_context() if tls else None
        self.mode, self.hold = mode, hold_handshake
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = "%s://localhost:%d" % ("https" if tls else "http", self.listener.getsockname()[1])
        self.accepted = 0
        self.ended = threading.Semaphore(0)  # released as each connection's server side ends
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept)
        self._acceptor.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(conn,))
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(TIMEOUT)
                if self.mode == "hangup":
                    conn.recv(1)  # the ClientHello's first byte: the proxy is handshaking
                    return
                if self.hold is not None:
                    self.hold.wait(TIMEOUT)
                with (self._context.wrap_socket(conn, server_side=True) if self._context else conn) as tls:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = tls.recv(65536)
                        if not chunk:
                            return
                        head += chunk
                    if self.mode == "silent":
                        tls.recv(1)  # until the proxy gives up (EOF) or TIMEOUT
                        return
                    if self.mode == "403":
                        # keep-alive: the proxy, not this upstream, must end the exchange after the body
                        tls.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 7\r\n\r\nno, no.")
                        tls.settimeout(3 * TIMEOUT)  # longer than the client waits for its EOF
                        tls.recv(1)
                        return
                    key = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                           if line.lower().startswith(b"sec-websocket-key:")][0]
                    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
                    tls.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                b"Sec-WebSocket-Accept: %s\r\n\r\n" % accept)
                    while True:
                        data = tls.recv(65536)
                        if not data:
                            return
                        tls.sendall(data)
        except (OSError, ssl.SSLError):
            pass
        finally:
            self.ended.release()

    def close(self) -> None:
        self._stop.set()
        if self.hold is not None:
            self.hold.set()
        self._acceptor.join(TIMEOUT)
        for thread in self._threads:
            thread.join(TIMEOUT)
        self.listener.close()


@pytest.fixture
def scripted(test_ca: support.TestCA) -> Iterator[Callable[..., "_ScriptedTLSUpstream"]]:
    made: List[_ScriptedTLSUpstream] = []

    def make(mode: str = "101", hold: Optional[threading.Event] = None, tls: bool = True) -> _ScriptedTLSUpstream:
        made.append(_ScriptedTLSUpstream(test_ca, mode, hold, tls))
        return made[-1]

    yield make
    for upstream in made:
        upstream.close()


def _send_upgrade(proxy: AuthProxy, base: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT)
    sock.sendall(b"GET %s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                 % base[len(proxy.url):].encode())
    return sock


def _answer_to_upgrade(proxy: AuthProxy, upstream: _ScriptedTLSUpstream, test_ca: support.TestCA) -> bytes:
    """Everything the proxy sends a raw client's upgrade request through `upstream`, to EOF."""
    with proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        with _send_upgrade(proxy, base) as sock:
            return support.read_to_eof(sock)


def _setting_up(proxy: AuthProxy, n: int) -> bool:
    """n set-ups in flight, each on its own worker thread (and no other worker busy)."""
    return len(proxy._server.live_threads()) == n


def test_a_handshake_that_stalls_gets_504_upstream_timeout_and_frees_its_thread(no_leaks, scripted, test_ca):
    hold = threading.Event()
    upstream = scripted(hold=hold)
    with AuthProxy(connect_timeout_s=0.5) as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        with _send_upgrade(proxy, base) as sock:
            answer = support.read_to_eof(sock)
        assert answer.startswith(b"HTTP/1.1 504 "), answer
        assert b"X-Proxy-Error: upstream-timeout" in answer
        support.wait_until(lambda: _setting_up(proxy, 0), "the set-up to end")
    hold.set()


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_an_upgrade_never_answered_gets_504_upstream_timeout(no_leaks, scripted, test_ca, tls):
    upstream = scripted("silent", tls=tls)
    answer = _answer_to_upgrade(AuthProxy(read_timeout_s=0.5), upstream, test_ca)
    assert answer.startswith(b"HTTP/1.1 504 "), answer
    assert b"X-Proxy-Error: upstream-timeout" in answer
    assert upstream.ended.acquire(timeout=TIMEOUT)  # the proxy closed its upstream connection


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_an_upstream_hanging_up_mid_set_up_gets_a_typed_502(no_leaks, scripted, test_ca, tls):
    upstream = scripted("hangup", tls=tls)
    answer = _answer_to_upgrade(AuthProxy(), upstream, test_ca)
    assert answer.startswith(b"HTTP/1.1 502 "), answer
    assert b"X-Proxy-Error: upstream-" in answer  # upstream-tls or upstream-unreachable, as OpenSSL words the EOF


def test_an_untrusted_upstream_certificate_names_the_verification_failure(tls_upstream, no_leaks):
    with AuthProxy() as proxy:
        base = ws_url(proxy.mount(tls_upstream.url, TEST_TOKEN, verify=True))
        with pytest.raises(InvalidStatus) as info:
            with ws_connect(base + "/ws"):
                pass  # pragma: no cover
    response = info.value.response
    assert (response.status_code, response.headers["X-Proxy-Error"]) == (502, "upstream-tls")
    assert b"CERTIFICATE_VERIFY_FAILED" in response.body


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_a_non_101_answer_reaches_the_client_as_http(no_leaks, scripted, test_ca, tls):
    upstream = scripted("403", tls=tls)
    answer = _answer_to_upgrade(AuthProxy(), upstream, test_ca)
    assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert answer.endswith(b"\r\n\r\nno, no.") and b"X-Proxy-Error" not in answer
    assert upstream.ended.acquire(timeout=TIMEOUT)  # relayed as HTTP, then its connection closed


def _switched(sock: socket.socket) -> bytes:
    """Read the proxy's answer head on a raw upgrade socket (asserting a 101); bytes past it."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101 "), head
    return head.partition(b"\r\n\r\n")[2]


def _echoes(sock: socket.socket, data: bytes) -> bool:
    sock.sendall(data)  # the scripted upstream echoes raw bytes back through the relay
    got = b""
    while len(got) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got == data


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_two_set_ups_in_flight_hold_a_thread_each_while_a_third_session_relays(no_leaks, scripted, test_ca, tls):
    hold = threading.Event()
    stalled, live = scripted(hold=hold, tls=tls), scripted(tls=tls)
    with AuthProxy() as proxy:
        slow_base = proxy.mount(stalled.url, TEST_TOKEN, verify=test_ca.ca_path)
        live_base = proxy.mount(live.url, TEST_TOKEN, verify=test_ca.ca_path)
        with _send_upgrade(proxy, live_base) as open_session:
            assert _switched(open_session) == b""
            pending = [_send_upgrade(proxy, slow_base) for _ in range(2)]
            try:
                # the open session's two threads, and one per set-up
                support.wait_until(lambda: _setting_up(proxy, 4) and stalled.accepted == 2,
                                   "two set-ups on their workers", TIMEOUT)
                for i in range(20):  # the open session keeps relaying while the two wait
                    assert _echoes(open_session, b"frame %d;" % i)
                hold.set()
                for sock in pending:
                    assert _switched(sock) == b""
                    assert _echoes(sock, b"raw bytes")
                assert _echoes(open_session, b"still here")
            finally:
                for sock in pending:
                    sock.close()
            support.wait_until(lambda: _setting_up(proxy, 2), "the two sessions to end with their clients", TIMEOUT)


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_a_client_leaving_during_set_up_ends_it_and_closes_the_upstream_connection(no_leaks, scripted, test_ca, tls):
    hold = threading.Event()
    upstream = scripted(hold=hold, tls=tls)
    with AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        sock = _send_upgrade(proxy, base)
        support.wait_until(lambda: _setting_up(proxy, 1) and upstream.accepted == 1, "the set-up to start", TIMEOUT)
        sock.close()
        support.wait_until(lambda: _setting_up(proxy, 0), "the set-up to end with its client", TIMEOUT)
        hold.set()  # the upstream now handshakes on a connection the proxy closed: it ends at once
        assert upstream.ended.acquire(timeout=TIMEOUT / 2)


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_stop_during_set_ups_answers_their_clients_503_and_leaves_nothing(no_leaks, scripted, test_ca, tls):
    """An upgrade that races a stop gets an HTTP answer, never a bare close before the 101 (DESIGN.md)."""
    hold = threading.Event()
    upstream = scripted(hold=hold, tls=tls)
    proxy = AuthProxy().start()
    try:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        pending = [_send_upgrade(proxy, base) for _ in range(2)]
        support.wait_until(lambda: _setting_up(proxy, 2) and upstream.accepted == 2, "two set-ups", TIMEOUT)
    finally:
        proxy.stop()
    for sock in pending:
        with sock:
            answer = support.read_to_eof(sock)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"X-Proxy-Error: proxy-stopping" in answer
    hold.set()


def test_a_tls_session_still_echoes_frames(test_ca, no_leaks):
    with Upstream(tls=test_ca) as secure, AuthProxy() as proxy:
        base = ws_url(proxy.mount(secure.url, TEST_TOKEN, verify=test_ca.ca_path))
        with ws_connect(base + "/ws") as ws:
            ws.send("hello")
            assert ws.recv(TIMEOUT) == "hello"


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
@pytest.mark.parametrize("stall", ["before-handshake", "before-answer"])
@pytest.mark.parametrize("kind", ["route", "replicas"])
def test_an_unmount_racing_a_set_up_answers_its_client_404_unknown_route(no_leaks, scripted, test_ca,
                                                                         tls, stall, kind):
    """An upgrade whose route is unmounted while the upstream stalls (in the TLS handshake, or
    before answering) still gets an HTTP answer, never a bare close before the 101 (DESIGN.md)."""
    hold = threading.Event()
    upstream = scripted("101" if stall == "before-handshake" else "silent",
                        hold=hold if stall == "before-handshake" else None, tls=tls)
    with AuthProxy() as proxy:
        if kind == "route":
            base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path)
        else:
            base = proxy.mount_replicas([upstream.url], TEST_TOKEN, verify=test_ca.ca_path)
        with _send_upgrade(proxy, base) as sock:
            support.wait_until(lambda: _setting_up(proxy, 1) and upstream.accepted == 1,
                               "the set-up to start", TIMEOUT)
            assert proxy.unmount(base)
            answer = support.read_to_eof(sock)
        assert answer.startswith(b"HTTP/1.1 404 "), answer
        assert b"X-Proxy-Error: unknown-route" in answer
        hold.set()
        assert upstream.ended.acquire(timeout=TIMEOUT)  # the proxy closed its upstream connection
        support.wait_until(lambda: _setting_up(proxy, 0), "the set-up's worker to be free", TIMEOUT)
