"""AuthProxy WebSocket tunnel: frames both ways, the one-thread TLS relay under load, failures, teardown."""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import random
import socket
import threading
from typing import Iterator, List, Tuple

import pytest
import requests
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, InvalidStatus

import support
from support import TEST_TOKEN, Upstream, pattern, raw_request, ws_connect, ws_url
from proxy import AuthProxy

TIMEOUT = 10


@pytest.fixture(params=["ws", "wss"])
def mounted(request: pytest.FixtureRequest, test_ca: support.TestCA) -> Iterator[Tuple[Upstream, AuthProxy, str]]:
    """(upstream, proxy, ws base URL) with the upstream over plain TCP and over TLS."""
    tls = request.param == "wss"
    with Upstream(tls=test_ca if tls else None) as upstream, AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path if tls else True)
        yield upstream, proxy, ws_url(base)


def test_text_binary_ping_pong_and_close_pass_both_ways(mounted):
    upstream, _, base = mounted
    with ws_connect(base + "/ws") as ws:
        assert "permessage-deflate" in ws.response.headers.get("Sec-WebSocket-Extensions", "")
        ws.send("text frame")
        assert ws.recv(TIMEOUT) == "text frame"
        blob = pattern(1 << 20)
        ws.send(blob)
        assert ws.recv(TIMEOUT) == blob
        assert ws.ping(b"cli").wait(TIMEOUT)  # client ping, upstream pong
        ws.send("ping-me")  # upstream ping, client pong, upstream reports the pong payload
        assert ws.recv(TIMEOUT) == "pong:srv"
        ws.close(1000, "done")
    assert ws.protocol.close_rcvd is not None and ws.protocol.close_rcvd.code == 1000
    assert ("Authorization", "Bearer " + TEST_TOKEN) in upstream.requests[-1].headers


def test_upstream_close_frame_reaches_the_client(mounted):
    _, _, base = mounted
    with ws_connect(base + "/ws") as ws:
        ws.send("close-me")
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(TIMEOUT)
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (4001, "bye")


def test_upstream_dying_mid_tunnel_closes_the_client_connection(mounted):
    _, _, base = mounted
    with ws_connect(base + "/ws") as ws:
        ws.send("still alive?")
        assert ws.recv(TIMEOUT) == "still alive?"
        ws.send("die")
        with pytest.raises(ConnectionClosedError) as info:
            ws.recv(TIMEOUT)
    assert info.value.rcvd is None  # no close frame: the connection was cut, as the upstream's was


def test_pipelined_bursts_flow_both_ways_at_once(mounted):
    _, _, base = mounted
    messages = [pattern(size) for size in ([3, 700, 70000, 1] * 100)]
    with ws_connect(base + "/ws", compression=None) as ws:
        sender = threading.Thread(target=lambda: [ws.send(m) for m in messages])
        sender.start()
        received = [ws.recv(TIMEOUT) for _ in messages]
        sender.join(TIMEOUT)
    assert received == messages


def _session(base: str, seed: int) -> Tuple[str, str]:
    """One stress session: a sender thread and this thread receiving, at the same time."""
    rng = random.Random(seed)
    sizes = [rng.choice([1, 17, 1000, 16385, 131072]) for _ in range(24)]
    messages = [hashlib.sha256(b"%d-%d" % (seed, i)).digest() * (size // 32 + 1) for i, size in enumerate(sizes)]
    sent, got = hashlib.sha256(), hashlib.sha256()
    with ws_connect(base + "/ws", compression=None) as ws:
        def send_all() -> None:
            for message in messages:
                sent.update(message)
                ws.send(message)

        sender = threading.Thread(target=send_all)
        sender.start()
        for _ in messages:
            got.update(ws.recv(TIMEOUT * 3))  # type: ignore[arg-type]
        sender.join(TIMEOUT)
    return sent.hexdigest(), got.hexdigest()


@pytest.mark.slow  # 64 concurrent TLS sessions
def test_64_concurrent_tls_sessions_move_large_and_small_frames_both_ways_intact(test_ca, no_leaks):
    with Upstream(tls=test_ca) as upstream, AuthProxy() as proxy:
        base = ws_url(proxy.mount(upstream.url, TEST_TOKEN, verify=test_ca.ca_path))
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda seed: _session(base, seed), range(64)))
    assert len(results) == 64
    for sent, got in results:
        assert sent == got


class _TLSUpgradeEcho:
    """A one-connection TLS upstream (stdlib ssl) that answers a WebSocket upgrade with 101, sends
    `greeting` right behind it in separate TLS records, then echoes raw bytes until the client ends:
    drives the proxy's TLS tunnel without a WebSocket library hiding what moves."""

    def __init__(self, test_ca: support.TestCA, greeting: List[bytes]) -> None:
        self._context = test_ca.server_context()
        self.greeting = greeting
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(TIMEOUT)
        self.url = "https://localhost:%d" % self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with self._context.wrap_socket(conn, server_side=True) as tls:
            tls.settimeout(TIMEOUT)
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            tls.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            for record in self.greeting:
                tls.sendall(record)  # one TLS record each
            while True:
                data = tls.recv(65536)
                if not data:
                    break
                tls.sendall(data)

    def close(self) -> None:
        self.thread.join(TIMEOUT)
        self.listener.close()


def _open_raw_tunnel(proxy: AuthProxy, base: str) -> Tuple[socket.socket, bytes]:
    """A raw client socket whose upgrade the proxy switched: (socket, bytes that arrived past the 101)."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT)
    sock.sendall(b"GET %s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                 % base[len(proxy.url):].encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        assert chunk, answer
        answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101 "), head
    return sock, rest


def _recv_exactly(sock: socket.socket, n: int, already: bytes = b"") -> bytes:
    received = bytearray(already)
    while len(received) < n:
        chunk = sock.recv(65536)
        assert chunk, "stream ended early"
        received += chunk
    return bytes(received)


def test_tls_tunnel_relays_4_mib_each_way_at_once_and_bytes_the_upstream_sent_behind_its_101(test_ca, no_leaks):
    """Two threads share one TLS engine, one per direction: a client writing 4 MiB while it reads the
    echo must not stall (back-pressure both ways), and records that arrived with the 101, which the
    engine holds decrypted before anyone asks, reach the client before the echo."""
    greeting = [b"hello-1;", b"hello-2;", b"x" * 20000]
    server = _TLSUpgradeEcho(test_ca, greeting)
    payload = pattern(4 * 1024 * 1024)
    try:
        with AuthProxy() as proxy:
            base = proxy.mount(server.url, TEST_TOKEN, verify=test_ca.ca_path)
            sock, early = _open_raw_tunnel(proxy, base)
            with sock:
                writer = threading.Thread(target=sock.sendall, args=(payload,))
                writer.start()
                got = _recv_exactly(sock, len(b"".join(greeting)) + len(payload), early)
                writer.join(TIMEOUT)
                assert got == b"".join(greeting) + payload
                # two threads carry it, one per direction
                assert len(proxy._server.live_threads()) == 2
    finally:
        server.close()


def test_tls_tunnel_ends_and_frees_its_worker_when_the_upstream_closes(test_ca, no_leaks):
    server = _TLSUpgradeEcho(test_ca, [b"bye"])
    try:
        with AuthProxy() as proxy:
            base = proxy.mount(server.url, TEST_TOKEN, verify=test_ca.ca_path)
            sock, early = _open_raw_tunnel(proxy, base)
            with sock:
                assert _recv_exactly(sock, 3, early) == b"bye"
                sock.shutdown(socket.SHUT_WR)  # the upstream echo sees EOF and closes its side
                assert support.read_to_eof(sock) == b""
            support.wait_until(lambda: not proxy._server.live_threads(), "both tunnel threads to end")
    finally:
        server.close()


def test_non_101_answer_reaches_the_client_as_http(upstream):
    with AuthProxy() as proxy:
        base = ws_url(proxy.mount(upstream.url, TEST_TOKEN))
        with pytest.raises(InvalidStatus) as info:
            with ws_connect(base + "/ws-reject"):
                pass  # pragma: no cover
        assert info.value.response.status_code == 403
        assert "X-Proxy-Error" not in info.value.response.headers
        wrong = ws_url(proxy.mount(upstream.url, "not-the-token"))
        with pytest.raises(InvalidStatus) as info:
            with ws_connect(wrong + "/ws"):
                pass  # pragma: no cover
        assert info.value.response.status_code == 401
        assert requests.get(proxy.url.replace("ws", "http") + "/nope", timeout=TIMEOUT).status_code == 404


def test_websocket_to_unreachable_upstream_gets_502():
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        with AuthProxy() as proxy:
            base = ws_url(proxy.mount("http://127.0.0.1:%d" % placeholder.getsockname()[1], TEST_TOKEN))
            with pytest.raises(InvalidStatus) as info:
                with ws_connect(base + "/ws"):
                    pass  # pragma: no cover
    assert info.value.response.status_code == 502
    assert info.value.response.headers["X-Proxy-Error"] == "upstream-unreachable"


def test_websocket_to_untrusted_tls_upstream_gets_502_upstream_tls(tls_upstream):
    with AuthProxy() as proxy:
        base = ws_url(proxy.mount(tls_upstream.url, TEST_TOKEN, verify=True))
        with pytest.raises(InvalidStatus) as info:
            with ws_connect(base + "/ws"):
                pass  # pragma: no cover
    assert info.value.response.status_code == 502
    assert info.value.response.headers["X-Proxy-Error"] == "upstream-tls"


def test_unmount_closes_that_routes_open_tunnels_only(mounted, test_ca):
    upstream, proxy, base = mounted
    with Upstream() as other:
        other_base = ws_url(proxy.mount(other.url, TEST_TOKEN))
        with ws_connect(base + "/ws") as doomed, ws_connect(other_base + "/ws") as survivor:
            doomed.send("a")
            survivor.send("b")
            assert doomed.recv(TIMEOUT) == "a" and survivor.recv(TIMEOUT) == "b"
            assert proxy.unmount(base.replace("ws://", "http://"))
            with pytest.raises(ConnectionClosed):
                doomed.recv(TIMEOUT)
            survivor.send("still here")
            assert survivor.recv(TIMEOUT) == "still here"


def test_open_tls_sessions_hold_two_threads_each_and_free_them_when_they_end(test_ca, no_leaks):
    """An open TLS session holds two threads, one per direction (the design card): with 16 sessions
    open 32 workers are busy, each session still echoes in any order, and every tunnel's threads go
    back to the pool when its client leaves."""
    with Upstream(tls=test_ca) as secure, AuthProxy() as proxy:
        base = ws_url(proxy.mount(secure.url, TEST_TOKEN, verify=test_ca.ca_path))
        with contextlib.ExitStack() as clients:
            sessions = [clients.enter_context(ws_connect(base + "/ws")) for _ in range(16)]
            for i, ws in enumerate(sessions):
                ws.send("hi %d" % i)
                assert ws.recv(TIMEOUT) == "hi %d" % i
            assert len(proxy._server.live_threads()) == 32
            for i, ws in reversed(list(enumerate(sessions))):
                ws.send("again %d" % i)
                assert ws.recv(TIMEOUT) == "again %d" % i
        support.wait_until(lambda: not proxy._server.live_threads(), "every tunnel's threads to end")


def test_stop_with_open_tls_and_plain_tunnels_leaves_no_threads_or_sockets(test_ca, no_leaks):
    with Upstream(tls=test_ca) as secure, Upstream() as plain, contextlib.ExitStack() as clients:
        proxy = AuthProxy().start()
        try:
            bases = [ws_url(proxy.mount(secure.url, TEST_TOKEN, verify=test_ca.ca_path)),
                     ws_url(proxy.mount(plain.url, TEST_TOKEN))]
            sessions = []
            for i in range(8):
                ws = clients.enter_context(ws_connect(bases[i % 2] + "/ws"))
                sessions.append(ws)
                ws.send("hi %d" % i)
                assert ws.recv(TIMEOUT) == "hi %d" % i
        finally:
            proxy.stop()
        for ws in sessions:
            with pytest.raises(ConnectionClosed):
                ws.recv(TIMEOUT)


def test_upgrade_without_a_key_is_refused_with_400(upstream):
    with AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        path = base[len(proxy.url):]
        raw = raw_request(proxy.port, b"GET %s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                      b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\r\n" % path.encode())
    assert raw.startswith(b"HTTP/1.1 400")
    assert b"X-Proxy-Error: bad-upgrade" in raw
    assert upstream.requests == []


def test_bytes_sent_right_after_the_101_reach_the_client(no_leaks):
    """An upstream that greets in the same write as its 101: those frame bytes must not be lost."""
    import base64

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)

    def greet_then_wait() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(4096)
            key = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key:")][0]
            accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
            frame = b"\x81\x05hello"  # unmasked text frame from the server
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n" + frame)
            try:
                conn.recv(4096)  # until the client closes
            except OSError:
                pass

    server = threading.Thread(target=greet_then_wait)
    server.start()
    try:
        with AuthProxy() as proxy:
            base = ws_url(proxy.mount("http://127.0.0.1:%d" % listener.getsockname()[1], TEST_TOKEN))
            with ws_connect(base + "/ws", compression=None, close_timeout=1) as ws:
                assert ws.recv(TIMEOUT) == "hello"
    finally:
        server.join(TIMEOUT)
        listener.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_tunnel_reaches_upstreams_named_by_ipv4_ipv6_literal_or_host_name(host, no_leaks):
    # IP literals are connected to without a name lookup; a host name is still resolved per session.
    bind = "::1" if host == "::1" else "127.0.0.1"
    try:
        upstream = Upstream(host=bind)
    except OSError:
        pytest.skip("%s is not configured" % bind)
    shown = "[::1]" if host == "::1" else host
    with upstream, AuthProxy() as proxy:
        base = proxy.mount("http://%s:%d" % (shown, upstream.port), TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("over %s" % host)
            assert ws.recv(TIMEOUT) == "over %s" % host
    assert ("Authorization", "Bearer " + TEST_TOKEN) in upstream.requests[-1].headers


def test_frames_sent_in_the_same_packet_as_the_upgrade_request_reach_the_upstream(mounted):
    """Bytes the proxy read past the upgrade request (buffered with it) are replayed into the tunnel
    before it reads the client socket itself, in order, on plain and TLS upstreams."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request, TextMessage

    _, _, base = mounted
    host_port, _, path = base[len("ws://"):].partition("/")
    conn = WSConnection(ConnectionType.CLIENT)
    request = conn.send(Request(host="x", target="/%s/ws" % path))
    mask = b"\x01\x02\x03\x04"
    frames = b""
    for text in (b"early one", b"early two"):  # masked client text frames, sent before any 101
        frames += b"\x81" + bytes([0x80 | len(text)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(text))
    with socket.create_connection(("127.0.0.1", int(host_port.split(":")[1])), timeout=TIMEOUT) as sock:
        sock.sendall(request + frames)
        seen: list = []
        while len([e for e in seen if isinstance(e, TextMessage)]) < 2:
            data = sock.recv(65536)
            assert data, "the proxy closed the tunnel before echoing both frames"
            conn.receive_data(data)
            seen.extend(conn.events())
    assert isinstance(seen[0], AcceptConnection)
    assert [e.data for e in seen if isinstance(e, TextMessage)] == ["early one", "early two"]
