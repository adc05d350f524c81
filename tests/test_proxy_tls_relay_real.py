"""The WebSocket tunnel (two threads, one per direction; over TLS both share one TLS engine) with
real peers, over TLS and plain upstreams: the `websockets` sync client and uvicorn in its own
process (tests/upstreams/pressure_app.py), plus raw sockets and a stdlib TLS server for the peers
that misbehave. Seeded sequences of large frames both ways at once, bursts of small frames and deaf
periods (PROXY_RELAY_SEED and PROXY_RELAY_EXAMPLES set the slow run); a peer that stops reading
(the tunnel must wait, not spin); abrupt closes mid-frame from either side;
TLS close_notify, a bare TCP close and a reset from the upstream, each compared with the plain
tunnel. After each: no thread or fd left behind.
"""
from __future__ import annotations

import hashlib
import os
import queue
import socket
import ssl
import struct
import threading
import time
from typing import Iterator, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

import support
from diff_clients import UpstreamProcess
from proxy import AuthProxy, _TlsStream
from test_proxy_ws import _open_raw_tunnel
from upstreams.common import body_of

TOKEN = "unused-by-the-pressure-app"
MIB = 1 << 20
TIMEOUT = 30.0  # generous: a tunnel that works moves these sizes in well under a second
SEED = int(os.environ.get("PROXY_RELAY_SEED", "20261123"))
FAST_EXAMPLES, SLOW_EXAMPLES = 6, int(os.environ.get("PROXY_RELAY_EXAMPLES", "60"))
SETTINGS = dict(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Over this many seconds of a stalled peer the tunnel's two threads may use at most half a CPU:
# threads that wait in recv or send use ~0; one that spins uses ~100%.
STALL_S = 3.0
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@pytest.fixture(scope="module", params=["tls", "plain"])
def tls_app(request: pytest.FixtureRequest, test_ca: support.TestCA) -> Iterator[UpstreamProcess]:
    """The pressure app over TLS, then over plain TCP (the name stays: most of these tests began TLS-only)."""
    tls = request.param == "tls"
    up = UpstreamProcess("pressure-" + request.param, "pressure_app.py", TOKEN,
                         (test_ca.cert_path, test_ca.key_path) if tls else None)
    yield up
    up.stop()


def _mount(proxy: AuthProxy, url: str, test_ca: support.TestCA) -> str:
    return support.ws_url(proxy.mount(url, TOKEN, verify=test_ca.ca_path))


def _tunnel_threads(proxy: AuthProxy) -> List[threading.Thread]:
    """The session's two threads, one per direction, once it is open (no other worker is busy)."""
    support.wait_until(lambda: len(proxy._server.live_threads()) == 2, "the tunnel's two threads",
                       TIMEOUT)
    return proxy._server.live_threads()


def _tunnel_idle(proxy: AuthProxy) -> bool:
    return not proxy._server.live_threads()


def _cpu_seconds(thread: threading.Thread) -> float:
    """User + system CPU time of one thread of this process, from the kernel (/proc)."""
    with open("/proc/self/task/%d/stat" % thread.native_id) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _cpu_share_over(threads: List[threading.Thread], seconds: float) -> float:
    cpu, wall = sum(map(_cpu_seconds, threads)), time.monotonic()
    time.sleep(seconds)
    return (sum(map(_cpu_seconds, threads)) - cpu) / (time.monotonic() - wall)


def _digest(message: object) -> Tuple[str, int, str]:
    raw = message.encode() if isinstance(message, str) else message
    return ("text" if isinstance(message, str) else "binary", len(raw), hashlib.sha256(raw).hexdigest()[:16])  # type: ignore[arg-type]


class _Reader:
    """Everything a websockets client receives, drained by a thread of its own (so the client never
    stops reading while the test thread sends: the peers themselves cannot deadlock)."""

    def __init__(self, ws) -> None:  # type: ignore[no-untyped-def]
        self.messages: "queue.Queue[object]" = queue.Queue()
        self.closed: Optional[ConnectionClosed] = None
        self._ws = ws
        self._thread = threading.Thread(target=self._run, name="test-ws-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self.messages.put(self._ws.recv())
        except ConnectionClosed as exc:
            self.closed = exc
            self.messages.put(exc)

    def take(self, n: int) -> List[object]:
        return [self.messages.get(timeout=TIMEOUT) for _ in range(n)]

    def join(self) -> None:
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "the session did not end"


# --------------------------------------------------------------------------------------------------
# Seeded sequences
# --------------------------------------------------------------------------------------------------

SIZES = [0, 1, 125, 126, 65535, 65536, 16385, MIB, 4 * MIB]
small = st.sampled_from([1, 7, 125, 126, 1000, 16384])
ops = st.one_of(
    st.tuples(st.just("send"), st.sampled_from(SIZES)),
    st.tuples(st.just("both-ways"), st.integers(1, 6), st.sampled_from([65536, MIB]), st.sampled_from([MIB, 4 * MIB])),
    st.tuples(st.just("burst"), st.integers(2, 300), small),
    st.tuples(st.just("flood"), st.integers(1, 300), small),
    st.tuples(st.just("deaf"), st.integers(1, 50), small),
    st.tuples(st.just("text"), st.text(max_size=300)),
)
endings = st.sampled_from([("client-close", 1000), ("client-close", 4000), ("server-close", 1000),
                           ("server-close", 4001)])
sequences = st.tuples(st.lists(ops, min_size=1, max_size=8), endings)


def _binary(size: int, salt: int) -> bytes:
    return (hashlib.sha256(b"relay%d" % salt).digest() * (size // 32 + 1))[:size]


def play(url: str, steps: List[tuple], ending: Tuple[str, int]) -> None:
    """Run one session; every message must come back as the app answers it, in order."""
    sent_binary, sent_count = hashlib.sha256(), 0  # every binary byte the client sent, as the app counts them
    with support.ws_connect(url, max_queue=None, compression=None) as ws:
        reader = _Reader(ws)
        for i, op in enumerate(steps):
            expected: List[object] = []
            sent: List[bytes] = []
            if op[0] == "send":
                sent = [_binary(op[1], i)]
                ws.send(sent[0])
                expected = list(sent)
            elif op[0] == "both-ways":  # the app floods while the client sends one large frame
                _, n, flood_size, size = op
                sent = [_binary(size, i)]
                ws.send("flood:%d:%d" % (n, flood_size))
                ws.send(sent[0])
                expected = [body_of(flood_size) + b"%d" % j for j in range(n)] + sent  # type: ignore[operator]
            elif op[0] in ("burst", "deaf"):
                if op[0] == "deaf":
                    ws.send("deaf:0.3")  # the app stops reading; uvicorn stops reading the socket
                sent = [_binary(op[2], i * 1000 + j) for j in range(op[1])]
                for data in sent:
                    ws.send(data)
                expected = (["awake"] if op[0] == "deaf" else []) + sent  # type: ignore[operator]
            elif op[0] == "flood":
                ws.send("flood:%d:%d" % (op[1], op[2]))
                expected = [body_of(op[2]) + b"%d" % j for j in range(op[1])]
            elif op[0] == "text":
                ws.send("t:" + op[1])  # (never one of the app's commands)
                expected = ["t:" + op[1]]
            for data in sent:
                sent_binary.update(data)
                sent_count += len(data)
            got = reader.take(len(expected))
            assert [_digest(m) if not isinstance(m, Exception) else repr(m) for m in got] == \
                [_digest(m) for m in expected], "step %d %r" % (i, op[:3])
        ws.send("sha")
        assert reader.take(1) == ["%s %d" % (sent_binary.hexdigest(), sent_count)]
        if ending[0] == "client-close":
            ws.close(ending[1], "bye")
        else:
            ws.send("close:%d" % ending[1])
        reader.join()
    assert isinstance(reader.closed, ConnectionClosed)
    assert reader.closed.rcvd is not None and reader.closed.rcvd.code == ending[1]


def _check_sequence(sequence, tls_app, test_ca) -> None:  # type: ignore[no-untyped-def]
    note("seed=%d (PROXY_RELAY_SEED)" % SEED)
    steps, ending = sequence
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = _mount(proxy, tls_app.url, test_ca)
        play(base + "/ws", steps, ending)
        support.wait_until(lambda: _tunnel_idle(proxy), "the tunnel's threads to end", TIMEOUT)


@seed(SEED)
@settings(max_examples=FAST_EXAMPLES, **SETTINGS)
@given(sequence=sequences)
def test_seeded_sessions_through_the_tls_tunnel_arrive_complete_and_in_order_sample(sequence, tls_app,
                                                                                     test_ca):
    _check_sequence(sequence, tls_app, test_ca)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@seed(SEED + 1)
@settings(max_examples=SLOW_EXAMPLES, **SETTINGS)
@given(sequence=sequences)
def test_seeded_sessions_through_the_tls_tunnel_arrive_complete_and_in_order(sequence, tls_app,
                                                                              test_ca):
    _check_sequence(sequence, tls_app, test_ca)


# --------------------------------------------------------------------------------------------------
# A peer that stops reading
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # measures the tunnel's CPU over a STALL_S stall
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads a thread's CPU time from Linux /proc")
def test_a_client_that_stops_reading_makes_the_tunnel_wait_not_spin_and_loses_nothing(tls_app, test_ca,
                                                                                     no_leaks):
    count, size = 200, 65536  # 12.5 MiB: far more than the socket buffers between app and client hold
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = _mount(proxy, tls_app.url, test_ca)
        # max_queue=2: the client's own reader stops reading the socket once 2 messages wait unread
        with support.ws_connect(base + "/ws", max_queue=2, compression=None) as ws:
            ws.send("flood:%d:%d" % (count, size))
            threads = _tunnel_threads(proxy)
            time.sleep(1.0)  # the buffers fill
            share = _cpu_share_over(threads, STALL_S)
            assert share < 0.5, "the tunnel used %.0f%% of a CPU while the client read nothing" % (
                share * 100)
            for i in range(count):
                assert ws.recv(TIMEOUT) == body_of(size) + b"%d" % i
            ws.send("after")
            assert ws.recv(TIMEOUT) == "after"


@pytest.mark.slow  # measures the tunnel's CPU over a STALL_S stall
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads a thread's CPU time from Linux /proc")
def test_an_upstream_that_stops_reading_makes_the_tunnel_wait_not_spin_and_loses_nothing(tls_app,
                                                                                        test_ca,
                                                                                        no_leaks):
    count = 300
    datas = [_binary(65536, i) for i in range(count)]
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = _mount(proxy, tls_app.url, test_ca)
        with support.ws_connect(base + "/ws", max_queue=None, compression=None) as ws:
            ws.send("deaf:%g" % (STALL_S + 2))
            sender = threading.Thread(target=lambda: [ws.send(data) for data in datas], daemon=True)
            sender.start()
            threads = _tunnel_threads(proxy)
            time.sleep(1.0)
            share = _cpu_share_over(threads, STALL_S)
            assert share < 0.5, "the tunnel used %.0f%% of a CPU while the upstream read nothing" % (
                share * 100)
            assert ws.recv(TIMEOUT) == "awake"
            for data in datas:
                assert ws.recv(TIMEOUT) == data
            sender.join(TIMEOUT)
            ws.send("sha")
            expected = hashlib.sha256(b"".join(datas)).hexdigest()
            assert ws.recv(TIMEOUT) == "%s %d" % (expected, 65536 * count)


# --------------------------------------------------------------------------------------------------
# Abrupt ends
# --------------------------------------------------------------------------------------------------


def _route_path(proxy: AuthProxy, ws_base: str) -> str:
    return ws_base[len(support.ws_url(proxy.url)):]


def _masked_frame_head(length: int, opcode: int = 2) -> bytes:
    """A client frame head (FIN, `opcode`, masked with a zero key) announcing `length` payload bytes."""
    if length < 126:
        return struct.pack("!BB", 0x80 | opcode, 0x80 | length) + b"\0\0\0\0"
    if length < 65536:
        return struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, length) + b"\0\0\0\0"
    return struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, length) + b"\0\0\0\0"


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_a_client_vanishing_mid_frame_ends_the_session_upstream_and_frees_everything(tls_app, test_ca, no_leaks, how):
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = _mount(proxy, tls_app.url, test_ca)
        sock, _ = _open_raw_tunnel(proxy, proxy.url + _route_path(proxy, base))
        _tunnel_threads(proxy)
        sock.sendall(_masked_frame_head(MIB) + b"\0" * 300000)  # 300 KB of a 1 MiB frame
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        support.wait_until(lambda: _tunnel_idle(proxy), "the tunnel's threads to end", TIMEOUT)
        with support.ws_connect(base + "/ws", compression=None) as ws:  # the route works on
            ws.send(b"next")
            assert ws.recv(TIMEOUT) == b"next"


@pytest.mark.slow  # an upstream in its own process
def test_an_upstream_dying_mid_frame_gives_the_client_an_abnormal_close_and_frees_everything(test_ca, no_leaks):
    # The app starts an 8 MiB message and ends its process: the frame is cut and the TCP connection
    # closed with no WebSocket close and no TLS close_notify.
    up = UpstreamProcess("pressure-dies", "pressure_app.py", TOKEN, (test_ca.cert_path, test_ca.key_path))
    try:
        with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
            base = _mount(proxy, up.url, test_ca)
            with support.ws_connect(base + "/ws", compression=None) as ws:
                ws.send("die:%d" % (8 * MIB))
                with pytest.raises(ConnectionClosedError) as info:
                    ws.recv(TIMEOUT)
            assert info.value.rcvd is None  # cut, as the upstream's connection was
            support.wait_until(lambda: _tunnel_idle(proxy), "the tunnel's threads to end", TIMEOUT)
    finally:
        up.stop()


class _EndingTLSUpstream:
    """A one-connection upstream (stdlib ssl over TLS, or plain TCP) that answers the upgrade with 101,
    sends `payload` and then ends the way asked: "close_notify" (TLS shutdown, TCP left open),
    "tcp-close" (a bare FIN: no close_notify) or "reset" (RST), `settle_s` after the payload left (so
    the payload has reached the proxy's socket by then)."""

    def __init__(self, test_ca: support.TestCA, tls: bool, payload: bytes, ending: str, settle_s: float = 0.5) -> None:
        self._context = test_ca.server_context() if tls else None
        self.payload, self.ending, self.settle_s = payload, ending, settle_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(TIMEOUT)
        self.url = "%s://localhost:%d" % ("https" if tls else "http", self.listener.getsockname()[1])
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        raw, _ = self.listener.accept()
        conn: socket.socket = self._context.wrap_socket(raw, server_side=True) if self._context else raw
        try:
            conn.settimeout(TIMEOUT)
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
                         + self.payload)
            time.sleep(self.settle_s)
            if self.ending == "close_notify":
                conn = conn.unwrap()  # type: ignore[attr-defined]  # TLS shutdown; TCP stays open
                self.done.wait(TIMEOUT)
            elif self.ending == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()
            raw.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(TIMEOUT)
        self.listener.close()


# Each case sleeps about a second on purpose (the upstream ends before the client reads), so the fast tier
# keeps one of them: TLS ended by a reset.
_SLOW = pytest.mark.slow
ENDINGS = [pytest.param("tls", "close_notify", marks=_SLOW), pytest.param("tls", "tcp-close", marks=_SLOW),
           ("tls", "reset"),
           pytest.param("plain", "tcp-close", marks=_SLOW), pytest.param("plain", "reset", marks=_SLOW)]


@pytest.mark.parametrize("scheme, ending", ENDINGS)
def test_bytes_the_upstream_sent_before_it_ended_reach_a_slow_client_then_the_connection_closes(
        test_ca, no_leaks, scheme, ending):
    # The client reads nothing until the upstream has ended, so the tunnel still holds bytes for it
    # when the end arrives: close_notify, a bare TCP close and a reset must all let those bytes
    # through first, over TLS (the TLS engine may hold decrypted bytes) as over plain TCP.
    # A reset discards what the upstream's kernel has not sent yet, directly as through the proxy:
    # 80 KB fits in the proxy's receive window, so all of it has left the upstream before the reset.
    payload = support.pattern(80000 if ending == "reset" else 400000)
    server = _EndingTLSUpstream(test_ca, scheme == "tls", payload, ending)
    try:
        with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
            # Small buffers toward the client (accepted sockets inherit the listener's), so most of
            # the payload waits inside the proxy when the upstream ends.
            proxy._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            base = _mount(proxy, server.url, test_ca)
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
                sock.settimeout(TIMEOUT)
                sock.connect(("127.0.0.1", proxy.port))
                sock.sendall(b"GET %s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                             % _route_path(proxy, base).encode())
                time.sleep(server.settle_s + 0.5)  # the upstream has ended by now
                received = support.read_to_eof(sock)
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101 ")
            assert len(rest) == len(payload) and rest == payload
            support.wait_until(lambda: _tunnel_idle(proxy), "the tunnel's threads to end", TIMEOUT)
    finally:
        server.close()


def test_a_tls_stream_read_in_small_pieces_returns_what_is_decrypted_before_reading_the_socket_again(
        test_ca) -> None:
    """The engine's decrypted bytes and its memory buffer are drained before the socket is read: a
    record read one byte at a time must not wait for more bytes from a peer that sent it all."""
    sent, finish = threading.Event(), threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            conn, _ = listener.accept()
            with test_ca.server_context().wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"hello")
                tls.sendall(b"world")  # a second record: it waits in the engine's buffer
                sent.set()
                finish.wait(TIMEOUT)
                try:
                    tls.unwrap()  # close_notify (the client closes without answering it)
                except (ssl.SSLError, OSError):
                    pass

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        sock = socket.create_connection(listener.getsockname(), timeout=TIMEOUT)
        stream = _TlsStream(sock, test_ca.client_context(), "localhost")
        try:
            stream.handshake()
            sent.wait(TIMEOUT)
            time.sleep(0.05)  # both records on the wire before the first read
            sock.settimeout(2)  # a read that waits on the socket now is the bug: it times out
            assert b"".join(stream.recv(1) for _ in range(10)) == b"helloworld"
            finish.set()
            sock.settimeout(TIMEOUT)
            assert stream.recv(1) == b""
        finally:
            finish.set()
            stream.close()
            server.join(TIMEOUT)
