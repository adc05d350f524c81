"""Conversations on one client connection: every request sequence answered as it must be.

Each test plays one conversation (byte for byte, pauses included) on one client connection, once
through a plain `AuthProxy` and once through a subclass whose `route_request` hook merely calls the
default (a hook's answers are checked, and its errors caught, where the default's are trusted), each
against a fresh recording upstream; the client must receive the same bytes, the upstream see the same
requests on the same number of connections, and each test checks what those bytes must be. Both
proxies mount one route, so refusal messages name the same `route-1`.
"""
from __future__ import annotations

import contextlib
import socket
import time
from typing import Callable, Iterator, List, Optional, Tuple

import pytest

import support
from proxy import AuthProxy

# Every answer's head is fixed (no changing Date), so the two runs compare byte for byte.
ANSWER_HEAD = b"HTTP/1.1 200 OK\r\ndate: Wed, 25 Nov 2026 00:00:00 GMT\r\nserver: recorder\r\ncontent-length: %d\r\n\r\n"
BIG_BODY = b"b" * 70000  # over SMALL_RESPONSE_BYTES: streamed
HUGE_BODY = b"h" * (8 << 20)  # more than loopback socket buffers hold: its relay is still sending when the client leaves
# Seconds a pause in a conversation lasts: long enough that what comes after it is a second read.
PAUSE_S = 0.1
# How long a client waits for more bytes before calling the answer complete.
QUIET_S = 2.0


class _Recorder(support.RecordingUpstream):
    """Records each request and answers by the path's last segment: `ok` echoes the body; `close`
    answers then closes without saying so; `drop` closes a reused connection without answering; `slow`
    answers after 0.8 s; `big` and `huge` send BIG_BODY and HUGE_BODY; `chunked` answers chunked;
    `empty` answers 204."""

    def answer(self, sock: socket.socket, request: bytes, head_end: int, served: int) -> bool:
        what = request.split(b" ", 2)[1].split(b"?")[0].rsplit(b"/", 1)[-1]
        if what == b"drop" and served > 1:
            return False
        if what == b"slow":
            time.sleep(0.8)
        body = request[head_end:]
        if what in (b"big", b"huge"):
            big = BIG_BODY if what == b"big" else HUGE_BODY
            sock.sendall(ANSWER_HEAD % len(big) + big)
        elif what == b"chunked":
            sock.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n")
        elif what == b"empty":
            sock.sendall(b"HTTP/1.1 204 No Content\r\nserver: recorder\r\n\r\n")
        else:
            sock.sendall(ANSWER_HEAD % len(body) + body)
        return what != b"close"


class _HookedProxy(AuthProxy):
    """An AuthProxy whose route_request hook is its own (the default's answer)."""

    def route_request(self, target, headers):  # type: ignore[no-untyped-def]
        return AuthProxy.route_request(self, target, headers)


# A conversation step: bytes to send, a pause (float seconds), "shut" (the client ends its side), an int
# (read exactly that many bytes), or "reconnect" (close the connection, unread bytes and all, and open another).
Step = object
Conversation = Callable[[str], List[Step]]


def _request(base: str, method: str, rest: str, body: Optional[bytes] = None, headers: bytes = b"",
             version: str = "HTTP/1.1") -> bytes:
    length = b"" if body is None else b"Content-Length: %d\r\n" % len(body)
    return (b"%s %s%s %s\r\nHost: 127.0.0.1\r\n%s%sContent-Type: application/json\r\n\r\n%s"
            % (method.encode(), base.encode(), rest.encode(), version.encode(), headers, length, body or b""))


def _play(proxy_class: type, conversation: Conversation) -> Tuple[bytes, List[bytes], int]:
    """Play `conversation` through a fresh proxy of `proxy_class` and a fresh _Recorder: (what the
    client received, what the upstream received, how many upstream connections were opened; the
    upstream's port written PORT)."""
    upstream = _Recorder()
    try:
        with proxy_class(read_timeout_s=5, idle_timeout_s=10) as auth:
            base = auth.mount("http://127.0.0.1:%d/up" % upstream.port, token="tok-loop")[len(auth.url):]
            received = b""
            client = socket.create_connection(("127.0.0.1", auth.port), timeout=QUIET_S)
            with contextlib.ExitStack() as closing:
                closing.callback(lambda: client.close())
                for step in conversation(base):
                    if isinstance(step, float):
                        time.sleep(step)
                    elif isinstance(step, int):
                        want = len(received) + step
                        while len(received) < want:
                            received += client.recv(want - len(received))
                    elif step == "shut":
                        client.shutdown(socket.SHUT_WR)
                    elif step == "reconnect":
                        client.close()
                        client = socket.create_connection(("127.0.0.1", auth.port), timeout=QUIET_S)
                    else:
                        client.sendall(step)  # type: ignore[arg-type]
                with contextlib.suppress(socket.timeout, ConnectionResetError):
                    while True:
                        data = client.recv(65536)
                        if not data:
                            break
                        received += data
        port = b"%d" % upstream.port  # (in Host headers and route labels: the one thing two runs differ in)
        return received.replace(port, b"PORT"), [seen.replace(port, b"PORT") for seen in upstream.seen], \
            upstream.connections
    finally:
        upstream.close()


def _assert_same(conversation: Conversation) -> Tuple[bytes, List[bytes], int]:
    plain = _play(AuthProxy, conversation)
    hooked = _play(_HookedProxy, conversation)
    assert plain[0] == hooked[0], "the client got different bytes through a route_request hook"
    assert plain[1] == hooked[1], "the upstream got different requests"
    assert plain[2] == hooked[2], "the upstream saw a different number of connections"
    return plain


def _answer(body: bytes) -> bytes:
    return ANSWER_HEAD % len(body) + body


def test_varied_requests_on_one_connection_are_each_answered_on_one_upstream_connection() -> None:
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/ok", b'{"a": 1}'), 0.05,
                _request(base, "POST", "/ok", b'{"b": 22}', headers=b"TE: trailers\r\n"), 0.05,
                _request(base, "GET", "/ok"), 0.05,
                _request("/no-such-route", "GET", "/ok"), 0.05,  # refused (404), the connection stays
                _request(base, "POST", "/ok", b"x" * 70000), 0.05,  # a body over 64 KiB
                b"POST %s/ok HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" % base.encode(),
                0.05, _request(base, "GET", "/empty"), 0.05,
                _request(base, "GET", "/chunked"), 0.05,
                _request(base, "POST", "/ok", b"last", headers=b"Connection: close\r\n")]
    received, seen, connections = _assert_same(conversation)
    assert received.count(b"HTTP/1.1 200 OK") == 7 and b"X-Proxy-Error: unknown-route" in received
    assert received.endswith(b"Connection: close\r\n\r\nlast") and len(seen) == 8 and connections == 1
    answers = [_answer(b'{"a": 1}'), _answer(b'{"b": 22}'), _answer(b""), _answer(b"x" * 70000), _answer(b"abc"),
               b"HTTP/1.1 204 No Content\r\nserver: recorder\r\n\r\n",
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"]
    at = 0
    for answer in answers:  # in order, each whole
        at = received.index(answer, at) + len(answer)
    assert b"TE:" not in seen[1] and seen[4].endswith(b"Content-Length: 3\r\n\r\nabc")


def test_pipelined_requests_answer_in_order() -> None:
    def conversation(base: str) -> List[Step]:
        return [b"".join([_request(base, "POST", "/ok", b"one"), _request(base, "GET", "/ok", headers=b"TE: x\r\n"),
                          _request(base, "POST", "/ok", b"three"), _request(base, "GET", "/big"),
                          _request(base, "GET", "/ok", headers=b"Connection: close\r\n")])]
    received, seen, _ = _assert_same(conversation)
    assert received.index(b"one") < received.index(b"three") < received.index(BIG_BODY) and len(seen) == 5


def test_a_body_and_a_head_split_across_reads_are_forwarded_whole() -> None:
    def conversation(base: str) -> List[Step]:
        first = _request(base, "POST", "/ok", b'{"split": "body"}')
        second = _request(base, "POST", "/ok", b'{"split": "head"}')
        last = _request(base, "GET", "/ok", headers=b"Connection: close\r\n")
        return [first[:-5], PAUSE_S, first[-5:], PAUSE_S, second[:20], PAUSE_S, second[20:], PAUSE_S, last]
    received, seen, _ = _assert_same(conversation)
    assert _answer(b'{"split": "body"}') + _answer(b'{"split": "head"}') in received and len(seen) == 3


def test_a_client_that_closes_mid_body_gets_a_bad_body_refusal() -> None:
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/ok", b"whole"), _request(base, "POST", "/ok", b"0123456789")[:-4], PAUSE_S, "shut"]
    received, seen, _ = _assert_same(conversation)
    assert received.startswith(_answer(b"whole")) and b"X-Proxy-Error: bad-body" in received and len(seen) == 1


@pytest.mark.slow  # the upstream takes 0.8 s to answer, twice (once per proxy)
def test_a_client_gone_before_the_answer_abandons_the_request() -> None:
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/ok", b"first"), PAUSE_S, _request(base, "POST", "/slow", b"gone"), PAUSE_S, "shut"]
    received, seen, _ = _assert_same(conversation)
    assert received == _answer(b"first") and len(seen) == 2


def test_a_client_gone_mid_answer_ends_its_connection() -> None:
    # Small answers leave in one send after their upstream connection went back to the pool; a streamed
    # one cut short by the client costs its upstream connection (the next request opens another).
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/ok", b"small"), len(_answer(b"small")), _request(base, "GET", "/huge"), 1000,
                "reconnect", _request(base, "GET", "/ok", b"next", headers=b"Connection: close\r\n")]
    received, seen, connections = _assert_same(conversation)
    assert received.startswith(_answer(b"small")) and received.endswith(b"next") and len(seen) == 3
    assert connections == 2


@pytest.mark.slow  # five pauses a run, two runs: about 1 s
def test_an_upstream_that_closed_a_pooled_connection_is_retried_or_refused_by_the_retry_rule() -> None:
    # `close` answers and hangs up without saying so (the pool's liveness check sees it); `drop` hangs up
    # on a reused connection without answering: GET is retried on a fresh one, a sent POST is not (502).
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/close", b"a"), PAUSE_S, _request(base, "POST", "/ok", b"b"), PAUSE_S,
                _request(base, "GET", "/drop"), PAUSE_S, _request(base, "GET", "/ok"), PAUSE_S,
                _request(base, "POST", "/drop", b"c"), PAUSE_S,
                _request(base, "GET", "/ok", headers=b"Connection: close\r\n")]
    received, seen, connections = _assert_same(conversation)
    assert received.count(b"HTTP/1.1 200 OK") == 5 and b"X-Proxy-Error: upstream-unreachable" in received
    assert connections == 4


def test_an_http_1_0_request_is_answered_and_ends_the_connection() -> None:
    def conversation(base: str) -> List[Step]:
        return [_request(base, "POST", "/ok", b"one"), len(_answer(b"one")),
                _request(base, "POST", "/ok", b"two", headers=b"Connection: keep-alive\r\n", version="HTTP/1.0"),
                PAUSE_S, _request(base, "POST", "/ok", b"three")]
    received, seen, _ = _assert_same(conversation)
    assert received.endswith(b"Connection: close\r\n\r\ntwo") and len(seen) == 2


def _ask(client: socket.socket, request: bytes) -> bytes:
    """Send one request on `client` and read its whole answer (a Content-Length body)."""
    client.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += client.recv(65536)
    end = data.index(b"\r\n\r\n") + 4
    length = int(data[:end].lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(data) < end + length:
        data += client.recv(65536)
    return data


@contextlib.contextmanager
def _one_connection(**mount: object) -> Iterator[Tuple[AuthProxy, _Recorder, str, socket.socket]]:
    """A proxy with one route to a fresh _Recorder (mounted with `mount`), and one client connection to it."""
    upstream = _Recorder()
    try:
        with AuthProxy(read_timeout_s=5, idle_timeout_s=10) as auth:
            base = auth.mount("http://127.0.0.1:%d/up" % upstream.port, **mount)  # type: ignore[arg-type]
            with socket.create_connection(("127.0.0.1", auth.port), timeout=5) as client:
                yield auth, upstream, base, client
    finally:
        upstream.close()


def test_a_token_rotated_between_two_requests_on_one_connection_reaches_the_upstream_on_the_next() -> None:
    current = ["tok-one"]
    with _one_connection(token=lambda: current[0]) as (auth, upstream, base, client):
        request = _request(base[len(auth.url):], "POST", "/ok", b"same")  # the same head twice
        assert _ask(client, request) == _answer(b"same")
        current[0] = "tok-two"
        assert _ask(client, request) == _answer(b"same")
    assert [b"Authorization: Bearer tok-one\r\n" in seen for seen in upstream.seen] == [True, False]
    assert b"Authorization: Bearer tok-two\r\n" in upstream.seen[1]


def test_a_headers_callable_changing_between_two_requests_on_one_connection_is_read_for_each() -> None:
    current = ["first"]
    with _one_connection(token="tok", headers=lambda: {"X-Env-Session": current[0]}) as (auth, upstream, base, client):
        request = _request(base[len(auth.url):], "GET", "/ok")
        _ask(client, request)
        current[0] = "second"
        _ask(client, request)
    assert [b"X-Env-Session: first\r\n" in upstream.seen[0], b"X-Env-Session: second\r\n" in upstream.seen[1]] == [True, True]


def test_an_unmount_between_two_requests_on_one_connection_answers_the_next_404() -> None:
    with _one_connection(token="tok") as (auth, upstream, base, client):
        request = _request(base[len(auth.url):], "POST", "/ok", b"same")
        assert _ask(client, request) == _answer(b"same")
        assert auth.unmount(base)
        answer = _ask(client, request)
    assert answer.startswith(b"HTTP/1.1 404 ") and b"X-Proxy-Error: unknown-route" in answer
    assert len(upstream.seen) == 1
