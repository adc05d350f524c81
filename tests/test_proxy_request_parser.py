"""The request parser against the line-by-line reading it replaced, and requests end to end.

`_Handler._read_request` matches the request line once and splits the header block once. The spec it
must keep is the line-by-line strict reading the proxy had before (`_line_by_line` below): the same
requests accepted with the same fields, the same ones refused with the same status and kind, whatever
the mix of clean and unclean lines. Hypothesis draws such heads; named edge cases pin the rest. End to
end, a keep-alive conversation through a real proxy must reach a recording upstream and the client as
exactly the expected bytes, and bytes an upstream sends past an answer must never be relayed.
"""
from __future__ import annotations

import io
import re
import socket
import time
from typing import Optional, Tuple, Union

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy
import support
from proxy import AuthProxy

# A request wrk sends (benchmarks/vs_nginx.py), and one `requests` sends.
WRK_HEAD = b"POST /r/step HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n"
REQUESTS_HEAD = (b"POST /r/step HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: python-requests/2.32.3\r\n"
                 b"Accept-Encoding: gzip, deflate\r\nAccept: */*\r\nConnection: keep-alive\r\nContent-Length: 2\r\n"
                 b"Content-Type: application/json\r\n\r\n")
UVICORN_ANSWER = (b"HTTP/1.1 200 OK\r\ndate: Wed, 25 Nov 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
                  b"content-type: application/json\r\ncontent-length: 2\r\n\r\n")

NAMES = ["Host", "host", "Content-Length", "content-length", "Transfer-Encoding", "Connection", "connection",
         "Expect", "Upgrade", "TE", "Trailer", "Close", "Keep-Alive", "Proxy-Authorization", "Proxy-Connection",
         "Authorization", "Content-Type", "X-Sandbox-Token", "X-A", "Accept", "Bad Name", "X(y)", "", " X-Fold"]
VALUES = ["x", "127.0.0.1:8080", "0", "2", "32", "010", "2, 2", "2,3", "\xb2", "-1", "99999999999999999999",
          "keep-alive", "close", "Keep-Alive, close", "keep-alive,", "upgrade", "te", "x-a", "100-continue",
          "chunked", "websocket", "a b", "a\tb", "v ", " v", "\tv", "", "caf\xe9", "a\x01b", "a\x7fb", "a\rb",
          "a\r", "v \r", "\r", " \r ", "a:b", "\t"]
# Clean choices repeated, so that most drawn heads are accepted.
SEPARATORS = [": "] * 12 + [":", ":  ", ": \t", " : ", ":\t"]
LINE_ENDS = ["\r\n"] * 16 + ["\n", "\r\r\n"]
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD"] * 3 + ["CONNECT", "G@T", "get", ""]
TARGETS = ["/r/step", "/r/x?a=1&b=%20", "/"] * 4 + ["*", "http://h/x", "/a b", "/caf\xe9", ""]
VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0"] * 2 + ["HTTP/1.2", "HTTP/2.0", "http/1.1", "HTTP/1.1 ", "HTTP/11"]
TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    lines = ["%s %s %s" % (draw(st.sampled_from(METHODS)), draw(st.sampled_from(TARGETS)),
                           draw(st.sampled_from(VERSIONS)))]
    for _ in range(draw(st.integers(0, 8))):
        lines.append(draw(st.sampled_from(NAMES)) + draw(st.sampled_from(SEPARATORS)) + draw(st.sampled_from(VALUES)))
    ends = [draw(st.sampled_from(LINE_ENDS)) for _ in lines]
    return ("".join(line + end for line, end in zip(lines, ends)) + "\r\n").encode("latin-1")


Parsed = Union[Tuple[str, str, str, list, bool, bytes], Tuple[int, str]]


def _line_by_line(data: bytes) -> Parsed:
    """The spec: how the proxy read a request head line by line before its single parser.
    (command, target, version, fields, close_connection, the bytes after the head), or (status, kind)."""
    rfile = io.BytesIO(data)
    raw = rfile.readline(proxy.MAX_REQUEST_LINE + 1)
    if len(raw) > proxy.MAX_REQUEST_LINE:
        return 414, "request-line-too-long"
    parts = raw.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not re.match(r"^HTTP/[0-9]\.[0-9]$", parts[2]):
        return 400, "bad-request"
    if parts[2][5] != "1":
        return 505, "http-version-not-supported"
    fields, budget = [], proxy.MAX_HEADER_BYTES
    while True:
        line = rfile.readline(proxy.MAX_HEADER_BYTES + 1)
        budget -= len(line)
        if budget < 0:
            return 431, "headers-too-large"
        if line in (b"\r\n", b"\n"):
            break
        if not line.endswith(b"\n"):
            return 400, "bad-request"
        if len(fields) == proxy.MAX_HEADERS:
            return 431, "headers-too-large"
        name, colon, value = line.decode("latin-1").rstrip("\r\n").partition(":")
        if not colon or not TOKEN.match(name):
            return 400, "bad-header"
        fields.append((name, value.strip(" \t")))
    tokens = {t.strip().lower() for name, value in fields if name.lower() == "connection" for t in value.split(",")}
    close = "close" in tokens or (parts[2] == "HTTP/1.0" and "keep-alive" not in tokens)
    return parts[0], parts[1], parts[2], fields, close, rfile.read()


def _parsed(data: bytes) -> Parsed:
    """What the proxy's parser makes of `data`, sent whole and then ended on a real socket (no
    server: only the reading and parsing of one request head run)."""
    handler = proxy._Handler.__new__(proxy._Handler)
    client, server = socket.socketpair()
    with client, server:
        handler.connection, handler._timeout = server, None
        handler._client = proxy._Reader(handler._recv, proxy._client_cut_short)
        handler.proxy = AuthProxy()  # (only its timeouts are read)
        client.sendall(data)
        client.shutdown(socket.SHUT_WR)
        parsed = handler._read_request()
        server.shutdown(socket.SHUT_WR)
        answer = support.read_to_eof(client)
        if parsed:
            assert answer in (b"", b"HTTP/1.1 100 Continue\r\n\r\n"), answer
            return (handler.command, handler.path, handler.request_version, handler.headers.items(),
                    handler.close_connection, handler._client.buf + support.read_to_eof(server))
    kind = re.search(rb"\r\nX-Proxy-Error: ([^\r]+)\r\n", answer)
    assert handler.close_connection and kind is not None, answer
    return int(answer.split(b" ", 2)[1]), kind.group(1).decode()


def _assert_parsed_as_line_by_line(head: bytes) -> Parsed:
    expected = _line_by_line(head + b"NEXT")
    assert _parsed(head + b"NEXT") == expected, head
    return expected


def test_the_benchmark_and_requests_heads_are_accepted_with_their_fields_in_order() -> None:
    parsed = _assert_parsed_as_line_by_line(REQUESTS_HEAD)
    assert parsed[:3] == ("POST", "/r/step", "HTTP/1.1") and parsed[5] == b"NEXT"
    assert [name for name, _ in parsed[3]] == ["Host", "User-Agent", "Accept-Encoding", "Accept", "Connection",
                                               "Content-Length", "Content-Type"]
    assert _assert_parsed_as_line_by_line(WRK_HEAD)[3][1] == ("Content-Length", "2")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=request_heads())
def test_any_request_head_is_accepted_or_refused_as_the_line_by_line_reading_did(head: bytes) -> None:
    _assert_parsed_as_line_by_line(head)


@pytest.mark.parametrize("change", [
    (b"Content-Length: 2\r\n", b"Transfer-Encoding: chunked\r\n"),
    (b"Content-Length: 2\r\n", b"Content-Length: \xb2\r\n"),
    (b"Content-Type", b"Expect: 100-continue\r\nContent-Type"),
    (b"Content-Type", b"Connection: close\r\nConnection: close\r\nContent-Type"),
    (b"Content-Type: ", b"Content-Type:"),
    (b"Content-Type: ", b"Content-Type:\t "),
    (b"application/json", b"application/json \t"),
    (b"application/json", b"application/\x01json"),
    (b"application/json\r\n", b"application/json\r\n folded\r\n"),
    (b"application/json\r\n", b"application/json\n"),
    (b"application/json\r\n", b"application/json\r\r\n"),
    (b"application/json\r\n", b"application/json\r \r\n"),
    (b"Content-Type: ", b"Content-Type : "),
    (b"Content-Type: ", b"Content Type: "),
    (b"Content-Type: ", b": "),
    (b"POST /r/step", b"CONNECT /r/step"),
    (b"POST /r/step", b"POST  /r/step"),
    (b"HTTP/1.1\r\n", b"HTTP/1.2\r\n"),
    (b"HTTP/1.1\r\n", b"HTTP/2.0\r\n"),
    (b"HTTP/1.1\r\n", b"HTTP/1.1\r\r\n"),
    (b"HTTP/1.1\r\n", b"HTTP/1.1 \r\n"),
])
def test_each_unusual_request_head_is_taken_as_the_line_by_line_reading_took_it(change: Tuple[bytes, bytes]) -> None:
    head = WRK_HEAD.replace(*change, 1)
    assert head != WRK_HEAD
    _assert_parsed_as_line_by_line(head)


def test_the_first_fault_met_line_by_line_is_the_one_named() -> None:
    many = b"X-A: 1\r\n" * proxy.MAX_HEADERS
    assert _assert_parsed_as_line_by_line(WRK_HEAD.replace(b"Content-Type", many + b"Content-Type")) == (
        431, "headers-too-large")
    # A malformed line before the one past the count (or the size, or the end) is what is answered.
    bad_first = WRK_HEAD.replace(b"Content-Type", b"Bad Line\r\n" + many + b"Content-Type")
    assert _assert_parsed_as_line_by_line(bad_first) == (400, "bad-header")
    big = b"X-Big: " + b"b" * proxy.MAX_HEADER_BYTES + b"\r\n"
    assert _assert_parsed_as_line_by_line(WRK_HEAD.replace(b"Content-Type", big + b"Content-Type")) == (
        431, "headers-too-large")
    assert _assert_parsed_as_line_by_line(WRK_HEAD.replace(b"Content-Type", b"X: 1\r\nBad\r\n" + big
                                                           + b"Content-Type")) == (400, "bad-header")
    assert _line_by_line(WRK_HEAD[:-2]) == _parsed(WRK_HEAD[:-2]) == (400, "bad-request")  # no blank line
    assert _line_by_line(b"GET /" + b"x" * proxy.MAX_REQUEST_LINE + b" HTTP/1.1\r\n\r\n") == _parsed(
        b"GET /" + b"x" * proxy.MAX_REQUEST_LINE + b" HTTP/1.1\r\n\r\n") == (414, "request-line-too-long")


# --------------------------------------------------------------------------------------------------
# End to end, as an upstream and a client see it
# --------------------------------------------------------------------------------------------------


class _RecordingUpstream(support.RecordingUpstream):
    """Records each request's bytes and answers UVICORN_ANSWER + "ok"."""

    def answer(self, sock: socket.socket, request: bytes, head_end: int, served: int) -> bool:
        sock.sendall(UVICORN_ANSWER + b"ok")
        return True


def _exchange(port: int, path: str, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.replace(b"/r/step", path.encode()) + b"{}")
        answer = b""
        while not answer.endswith(b"ok"):
            data = sock.recv(65536)
            assert data, answer
            answer += data
        return answer


def test_a_keep_alive_conversation_of_varied_requests_reaches_the_upstream_and_the_client_as_expected(
        proxy: AuthProxy) -> None:
    # One client connection, requests of the shapes wrk and requests send, one with hop-by-hop
    # headers to drop, one whose Connection header names a header: each reaches the upstream as
    # exactly these bytes (Host first, the client's fields minus hop-by-hop and replaced ones, then
    # the token, the route's extra header and the framing) and the client gets the upstream's answer.
    upstream = _RecordingUpstream()
    try:
        base = proxy.mount("http://127.0.0.1:%d/base" % upstream.port, token="tok-e2e",
                           headers={"X-Sandbox-Token": "sbx-e2e"})
        path = (base[len(proxy.url):] + "/step").encode()
        hop = b"TE: trailers\r\nKeep-Alive: timeout=5\r\nAuthorization: Bearer client\r\nContent-Type"
        named = b"Connection: keep-alive, X-Drop\r\nX-Drop: 1\r\nX-Keep: 2\r\nContent-Type"
        heads = [WRK_HEAD, REQUESTS_HEAD, WRK_HEAD.replace(b"Content-Type", hop),
                 WRK_HEAD.replace(b"Content-Type", named)]
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            for head in heads:
                sock.sendall(head.replace(b"/r/step", path) + b"{}")
                answer = b""
                while not answer.endswith(b"ok"):
                    data = sock.recv(65536)
                    assert data, answer
                    answer += data
                assert answer == UVICORN_ANSWER + b"ok"
    finally:
        upstream.close()
    host = b"POST /base/step HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % upstream.port
    tail = b"Authorization: Bearer tok-e2e\r\nX-Sandbox-Token: sbx-e2e\r\nContent-Length: 2\r\n\r\n{}"
    assert upstream.seen == [
        host + b"Content-Type: application/json\r\n" + tail,
        host + b"User-Agent: python-requests/2.32.3\r\nAccept-Encoding: gzip, deflate\r\nAccept: */*\r\n"
               b"Content-Type: application/json\r\n" + tail,
        host + b"Content-Type: application/json\r\n" + tail,
        host + b"X-Keep: 2\r\nContent-Type: application/json\r\n" + tail,
    ]
    assert upstream.connections == 1


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 400), max_size=8))
def test_pipelined_requests_arriving_in_any_pieces_reach_the_upstream_and_the_client_unchanged(
        proxy: AuthProxy, cuts) -> None:
    # The client's bytes are read into the connection's own buffer: however they arrive (a byte at
    # a time, a request line or CRLF split, a body after its head, several requests in one read),
    # every request reaches the upstream as the same bytes and every answer comes back whole.
    upstream = _RecordingUpstream()
    try:
        base = proxy.mount("http://127.0.0.1:%d" % upstream.port, token="tok-pieces")
        path = (base[len(proxy.url):] + "/step").encode()
        data = b"".join(head.replace(b"/r/step", path) + b"{}"
                        for head in (WRK_HEAD, REQUESTS_HEAD, WRK_HEAD))
        points = sorted(set(cut % len(data) for cut in cuts) | {0, len(data)})
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for start, end in zip(points, points[1:]):
                sock.sendall(data[start:end])
                time.sleep(0.002)  # (only to vary how the pieces arrive; nothing waits on it)
            answers = b""
            while answers.count(b"ok") < 3:
                chunk = sock.recv(65536)
                assert chunk, answers
                answers += chunk
        assert answers == (UVICORN_ANSWER + b"ok") * 3
    finally:
        upstream.close()
    host = b"POST /step HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % upstream.port
    tail = b"Authorization: Bearer tok-pieces\r\nContent-Length: 2\r\n\r\n{}"
    wrk = host + b"Content-Type: application/json\r\n" + tail
    assert upstream.seen == [wrk, host + b"User-Agent: python-requests/2.32.3\r\nAccept-Encoding: gzip, "
                             b"deflate\r\nAccept: */*\r\nContent-Type: application/json\r\n" + tail, wrk]
    assert upstream.connections == 1


def test_a_content_length_of_a_non_ascii_digit_is_refused_not_dropped(proxy: AuthProxy, upstream) -> None:
    # "²" is a digit to str.isdigit() but not to int(): a ValueError once ended the connection
    # without an answer (and called an upstream's such answer a connection failure).
    base = proxy.mount(upstream.url, token="tok-digit")
    head = WRK_HEAD.replace(b"/r/step", base[len(proxy.url):].encode() + b"/step").replace(b": 2\r\n", b": \xb2\r\n")
    answer = support.raw_request(proxy.port, head + b"{}")
    assert answer.startswith(b"HTTP/1.1 400 ") and b"X-Proxy-Error: bad-content-length" in answer


def test_empty_and_multi_record_tls_answers_are_relayed_on_one_pooled_connection(test_ca, tls_upstream) -> None:
    # An empty body must not wait for bytes (it once hung until read_timeout_s), and a body sent in
    # several TLS records must be read record by record, all on one pooled connection.
    with AuthProxy(read_timeout_s=5) as p, requests.Session() as session:
        base = p.mount(tls_upstream.url, support.TEST_TOKEN, verify=test_ca.ca_path)
        for path in ("/big?n=0", "/big?n=0", "/stream?n=5&delay=0.01", "/big?n=70000", "/big?n=0"):
            answer = session.get(base + path, timeout=4)
            assert answer.status_code == 200 and "X-Proxy-Error" not in answer.headers, (path, answer.text[:200])
        assert tls_upstream.connections == 1  # (one pooled connection served them all)


class _OverrunningUpstream(support.RecordingUpstream):
    """Answers the first request with a body of `size` bytes that comes after the head, followed at once
    by a whole made-up answer (in the same write, or `apart`: in a write of its own, for TLS a record
    of its own, leaving in the same TCP segment); every later request "RIGHT"."""

    def __init__(self, tls: Optional[support.TestCA], size: int, apart: bool) -> None:
        self.context = tls.server_context() if tls is not None else None
        self.size, self.apart = size, apart
        super().__init__()

    def _serve(self, sock: socket.socket) -> None:
        if self.context is not None:
            try:
                sock = self.context.wrap_socket(sock, server_side=True)
            except OSError:
                return
        super()._serve(sock)

    def answer(self, sock: socket.socket, request: bytes, head_end: int, served: int) -> bool:
        if len(self.seen) > 1:
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nRIGHT")
            return True
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.size)
        time.sleep(0.5)  # (the proxy reads the head on its own first)
        body, overrun = b"x" * self.size, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nWRONG"
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)  # (held until uncorked: one segment)
        sock.sendall(body) if self.apart else None
        sock.sendall(overrun if self.apart else body + overrun)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        return True


@pytest.mark.skipif(not hasattr(socket, "TCP_CORK"), reason="the upstream corks its writes (Linux)")
@pytest.mark.parametrize("apart", [False, True], ids=["same-write", "own-write"])
@pytest.mark.parametrize("size", [2, 70000], ids=["small", "streamed"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_bytes_an_upstream_sends_past_its_answer_are_never_relayed(test_ca, tls: bool, size: int, apart: bool) -> None:
    # Neither as the rest of the body nor as the next request's answer: the pooled connection must
    # not be reused with them waiting, whether they were read with the body (the reader keeps them),
    # are still in the kernel, or (TLS) still undecrypted (the liveness check sees both).
    upstream = _OverrunningUpstream(test_ca if tls else None, size, apart)
    try:
        with AuthProxy(read_timeout_s=5) as p, requests.Session() as session:
            base = p.mount(("https" if tls else "http") + "://127.0.0.1:%d" % upstream.port, "tok-overrun",
                           verify=test_ca.ca_path)
            first = session.post(base + "/step", data=b"{}", timeout=10)
            second = session.post(base + "/step", data=b"{}", timeout=10)
        assert (first.status_code, first.content) == (200, b"x" * size)
        assert (second.status_code, second.content) == (200, b"RIGHT")
        assert upstream.connections == 2  # (the overrun one was dropped, not pooled)
    finally:
        upstream.close()


def test_a_pooled_connection_looks_idle_only_until_the_upstream_sends_or_closes() -> None:
    # The pool's liveness check: stray bytes and a FIN must both be seen, and reading them counts.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        conn = proxy._UpstreamConnection(client, 5.0)

        def looks_idle() -> bool:  # what Route._checkout asks of a pooled connection
            return not conn.reader.buf and not conn.has_input()

        try:
            assert looks_idle()
            server.sendall(b"stray")
            support.wait_until(lambda: not looks_idle(), "stray bytes seen", 5)
            assert conn.reader.read1(10) == b"stray" and looks_idle()
            server.shutdown(socket.SHUT_RDWR)
            support.wait_until(lambda: not looks_idle(), "the FIN seen", 5)
        finally:
            conn.close()
            server.close()


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
@pytest.mark.parametrize("slack", [-1, 0, 1])
def test_a_request_line_at_its_size_limit_counts_its_line_ending_like_the_line_by_line_reading(
        ending: bytes, slack: int) -> None:
    # the line with its ending is MAX_REQUEST_LINE + slack bytes: at most the limit passes, one more is 414
    filler = proxy.MAX_REQUEST_LINE + slack - len(b"GET / HTTP/1.1") - len(ending)
    head = b"GET /" + b"x" * filler + b" HTTP/1.1" + ending + b"Host: x\r\n\r\n"
    expected = _assert_parsed_as_line_by_line(head)
    assert (expected == (414, "request-line-too-long")) == (slack > 0)
