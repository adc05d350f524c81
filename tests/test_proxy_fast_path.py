"""The proxy's fast paths agree with its strict parsers, and everything else takes the strict way.

The request head of the common shape is recognised whole (`_Handler._parse_clean_head`), and so is
the common answer head (`_parse_answer`, relayed byte for byte); anything else goes through the
strict line-by-line parsers. Hypothesis draws heads mixing clean and unclean features; whenever a
fast path takes one, every result must equal the strict parser's (parsed request, framing,
connection handling, the head sent upstream, the head relayed to the client). Each fallback trigger
is checked to take the strict path, and an end-to-end run through a real proxy checks that an
upstream and a client see the same bytes whichever path served the request.
"""
from __future__ import annotations

import re
import io
import socket
import time
from typing import Iterator, Optional, Tuple

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy
import support
from proxy import AuthProxy, Route

# A request wrk sends (benchmarks/vs_nginx.py), and one `requests` sends: the shapes the fast path is for.
WRK_HEAD = b"POST /r/step HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n"
REQUESTS_HEAD = (b"POST /r/step HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: python-requests/2.32.3\r\n"
                 b"Accept-Encoding: gzip, deflate\r\nAccept: */*\r\nConnection: keep-alive\r\nContent-Length: 2\r\n"
                 b"Content-Type: application/json\r\n\r\n")
UVICORN_ANSWER = (b"HTTP/1.1 200 OK\r\ndate: Wed, 25 Nov 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
                  b"content-type: application/json\r\ncontent-length: 2\r\n\r\n")

NAMES = ["Host", "host", "Content-Length", "content-length", "Transfer-Encoding", "Connection", "connection",
         "Expect", "Upgrade", "TE", "Trailer", "Close", "Keep-Alive", "Proxy-Authorization", "Proxy-Connection",
         "Authorization", "Content-Type", "X-Sandbox-Token", "X-A", "Accept", "Bad Name", "X(y)", ""]
VALUES = ["x", "127.0.0.1:8080", "0", "2", "32", "010", "2, 2", "2,3", "\xb2", "-1", "99999999999999999999",
          "keep-alive", "close", "Keep-Alive, close", "keep-alive,", "upgrade", "te", "x-a", "100-continue",
          "chunked", "websocket", "a b", "a\tb", "v ", " v", "\tv", "", "caf\xe9", "a\x01b", "a\x7fb", "a\rb"]
# Clean choices repeated, so that most drawn heads are ones the fast path may take.
SEPARATORS = [": "] * 12 + [":", ":  ", ": \t", " : "]
LINE_ENDS = ["\r\n"] * 16 + ["\n"]
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD"] * 3 + ["CONNECT", "G@T", "get"]
TARGETS = ["/r/step", "/r/x?a=1&b=%20", "/"] * 4 + ["*", "http://h/x", "/a b", "/caf\xe9"]
VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0"] * 2 + ["HTTP/1.2", "HTTP/2.0", "http/1.1"]


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    lines = ["%s %s %s" % (draw(st.sampled_from(METHODS)), draw(st.sampled_from(TARGETS)),
                           draw(st.sampled_from(VERSIONS)))]
    for _ in range(draw(st.integers(0, 8))):
        lines.append(draw(st.sampled_from(NAMES)) + draw(st.sampled_from(SEPARATORS)) + draw(st.sampled_from(VALUES)))
    ends = [draw(st.sampled_from(LINE_ENDS)) for _ in lines]
    return ("".join(line + end for line, end in zip(lines, ends)) + "\r\n").encode("latin-1")


def _handler_over(data: bytes) -> proxy._Handler:
    """A request handler whose parsers read `data` (no server, no socket: only parsing runs)."""
    handler = proxy._Handler.__new__(proxy._Handler)
    handler.rfile = io.BufferedReader(io.BytesIO(data), proxy.IO_CHUNK)  # type: ignore[arg-type]
    handler.wfile = io.BytesIO()  # type: ignore[assignment]
    handler.close_connection = True
    handler._clean = None
    return handler


def _strict_parse(data: bytes) -> Tuple[proxy._Handler, bool]:
    handler = _handler_over(data)
    handler.raw_requestline = handler.rfile.readline(proxy.MAX_REQUEST_LINE + 1)
    return handler, handler.parse_request()


@pytest.fixture(scope="module")
def route() -> Iterator[Route]:
    route = Route("http://127.0.0.1:9/base", "tok-fast-path", headers={"X-Sandbox-Token": "sbx"})
    yield route
    route.close()


def _upstream_lines(handler: proxy._Handler, route: Route, strict: bool) -> str:
    target = route.base_path + handler.path
    token, extra = route.current_token(), route.current_headers()
    if strict:
        return proxy._request_lines(handler.command, target,
                                    proxy._upstream_request_headers(handler.headers, route, token, extra))
    assert handler._clean is not None
    return proxy._clean_request_lines(handler.command, target, handler._clean[1], route, token, extra)


def _assert_request_paths_agree(data: bytes, route: Route) -> bool:
    """Parse `data` both ways; if the fast path took it, check every result against the strict
    parser's. Returns whether the fast path took it."""
    fast = _handler_over(data + b"NEXT")
    took = fast._parse_clean_head()
    if not took:
        assert fast.rfile.read() == data + b"NEXT", "a declined head must be left for the strict parser"
        return False
    strict, ok = _strict_parse(data + b"NEXT")
    assert ok and not strict.wfile.getvalue(), "the fast path took a head the strict parser refuses"
    assert (fast.command, fast.path, fast.request_version, fast.requestline, fast.close_connection) == (
        strict.command, strict.path, strict.request_version, strict.requestline, strict.close_connection)
    assert fast.headers.items() == strict.headers.items()
    assert fast._clean is not None and fast._clean[0] == proxy._body_framing(strict.headers)
    assert proxy._target_refusal(strict.command, strict.path) is None and proxy._header_refusal(strict.headers) is None
    assert not proxy._is_websocket_upgrade(strict.command, strict.headers)
    assert _upstream_lines(fast, route, strict=False) == _upstream_lines(strict, route, strict=True)
    assert fast.rfile.read() == strict.rfile.read() == b"NEXT"
    return True


def test_the_benchmark_and_requests_heads_take_the_fast_path(route: Route) -> None:
    assert _assert_request_paths_agree(WRK_HEAD, route)
    assert _assert_request_paths_agree(REQUESTS_HEAD, route)


@pytest.mark.parametrize("lines", [
    b"Authorization: Bearer client-token\r\nX-Sandbox-Token: client\r\n",
    b"Proxy-Authorization: x\r\nProxy-Connection: keep-alive\r\nKeep-Alive: timeout=5\r\n",
    b"Connection: close\r\nx-sandbox-token: client\r\nHOST: other\r\n",
    b"Connection: keep-alive, close,\r\nX-A: caf\xe9\r\nX-Empty: \r\n",
])
def test_headers_the_proxy_drops_or_replaces_are_dropped_on_the_fast_path_too(route: Route, lines: bytes) -> None:
    head = WRK_HEAD.replace(b"Content-Type", lines + b"Content-Type")
    assert _assert_request_paths_agree(head, route)
    assert _assert_request_paths_agree(head.replace(b"HTTP/1.1", b"HTTP/1.0"), route)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=request_heads())
def test_a_request_head_the_fast_path_takes_parses_as_the_strict_parser_has_it(route: Route, head: bytes) -> None:
    _assert_request_paths_agree(head, route)


@pytest.mark.parametrize("change", [
    (b"Content-Length: 2\r\n", b"Transfer-Encoding: chunked\r\n"),
    (b"Content-Length: 2\r\n", b"Content-Length: 2\r\nContent-Length: 2\r\n"),
    (b"Content-Length: 2\r\n", b"Content-Length: \xb2\r\n"),
    (b"Content-Type", b"Expect: 100-continue\r\nContent-Type"),
    (b"Content-Type", b"Upgrade: websocket\r\nConnection: Upgrade\r\nContent-Type"),
    (b"Content-Type", b"TE: trailers\r\nContent-Type"),
    (b"Content-Type", b"Trailer: x\r\nContent-Type"),
    (b"Content-Type", b"Connection: x-a\r\nContent-Type"),
    (b"Content-Type", b"Connection: close\r\nConnection: close\r\nContent-Type"),
    (b"Content-Type", b"Close: x\r\nContent-Type"),
    (b"Content-Type: ", b"Content-Type:"),
    (b"Content-Type: ", b"Content-Type:  "),
    (b"application/json", b"application/json "),
    (b"application/json", b"application/\x01json"),
    (b"application/json\r\n", b"application/json\r\n folded\r\n"),
    (b"application/json\r\n", b"application/json\n"),
    (b"POST /r/step", b"CONNECT /r/step"),
    (b"POST /r/step", b"POST  /r/step"),
    (b"HTTP/1.1\r\n", b"HTTP/1.2\r\n"),
])
def test_each_fallback_trigger_takes_the_strict_path(route: Route, change: Tuple[bytes, bytes]) -> None:
    head = WRK_HEAD.replace(*change)
    assert head != WRK_HEAD
    assert not _assert_request_paths_agree(head, route)


def test_a_head_with_too_many_headers_or_not_yet_whole_takes_the_strict_path(route: Route) -> None:
    many = WRK_HEAD.replace(b"Content-Type", b"X-A: 1\r\n" * proxy.MAX_HEADERS + b"Content-Type")
    assert not _assert_request_paths_agree(many, route)
    assert not _assert_request_paths_agree(WRK_HEAD[:-2], route)  # no blank line yet


ANSWER_STATUS_LINES = ["HTTP/1.1 200 OK", "HTTP/1.1 200 ", "HTTP/1.1 200", "HTTP/1.0 200 OK", "HTTP/1.1 204 No Content",
                       "HTTP/1.1 304 Not Modified", "HTTP/1.1 404 Not Found", "HTTP/1.1 503 x\ty", "HTTP/1.1 600 x",
                       "HTTP/1.1 101 Switching", "HTTP/1.1 103 Early"]
ANSWER_NAMES = ["content-length", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "TE", "Trailer",
                "Upgrade", "Proxy-Authenticate", "date", "server", "content-type", "X-A", "Close"]


@st.composite
def answer_heads(draw: st.DrawFn) -> bytes:
    lines = [draw(st.sampled_from(ANSWER_STATUS_LINES))]
    for _ in range(draw(st.integers(0, 6))):
        lines.append(draw(st.sampled_from(ANSWER_NAMES)) + draw(st.sampled_from(SEPARATORS))
                     + draw(st.sampled_from(VALUES)))
    ends = [draw(st.sampled_from(LINE_ENDS)) for _ in lines]
    return ("".join(line + end for line, end in zip(lines, ends)) + "\r\n").encode("latin-1")


def _assert_answer_paths_agree(head: bytes, method: str) -> bool:
    """Parse an answer head both ways; if the fast path kept it to relay as it is, check that the
    strict parse frames it the same and the strict relay would write exactly those bytes."""
    try:
        strict: Optional[proxy._Answer] = proxy._parse_answer_strictly(head.decode("latin-1"), method)
    except proxy._BadResponse:
        strict = None
    try:
        fast: Optional[proxy._Answer] = proxy._parse_answer(head, method)
    except proxy._BadResponse:
        fast = None
    if fast is None or fast.raw is None:
        assert fast == strict
        return False
    assert strict is not None
    assert (fast.status, fast.reason, fast.mode, fast.length, fast.keep_alive) == (
        strict.status, strict.reason, strict.mode, strict.length, strict.keep_alive)
    writer = _handler_over(b"")
    writer._send_head(strict.status, strict.reason, proxy._response_headers(strict.headers, strict.length))
    assert fast.raw == writer.wfile.getvalue()
    return True


def test_the_uvicorn_answer_takes_the_fast_path() -> None:
    assert _assert_answer_paths_agree(UVICORN_ANSWER, "POST")
    assert not _assert_answer_paths_agree(UVICORN_ANSWER, "HEAD")  # no body: the strict framing


@settings(max_examples=200, deadline=None)
@given(head=answer_heads(), method=st.sampled_from(["GET", "POST", "HEAD"]))
def test_an_answer_head_the_fast_path_relays_is_what_the_strict_path_writes(head: bytes, method: str) -> None:
    _assert_answer_paths_agree(head, method)


@pytest.mark.parametrize("change", [
    (b"content-length: 2\r\n", b"transfer-encoding: chunked\r\n"),
    (b"content-length: 2\r\n", b"content-length: 2\r\ncontent-length: 2\r\n"),
    (b"content-length: 2\r\n", b"content-length: 002\r\n"),
    (b"content-length: 2\r\n", b""),
    (b"server: uvicorn\r\n", b"Connection: keep-alive\r\n"),
    (b"server: uvicorn\r\n", b"Keep-Alive: timeout=5\r\n"),
    (b"server: uvicorn\r\n", b"server:uvicorn\r\n"),
    (b"server: uvicorn\r\n", b"server: uvicorn\n"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 200"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 204 OK"),
])
def test_each_answer_fallback_trigger_takes_the_strict_path(change: Tuple[bytes, bytes]) -> None:
    head = UVICORN_ANSWER.replace(*change)
    assert head != UVICORN_ANSWER
    assert not _assert_answer_paths_agree(head, "POST")


# --------------------------------------------------------------------------------------------------
# End to end: the same request through each path, as an upstream and a client see it
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


@pytest.mark.parametrize("head", [WRK_HEAD, REQUESTS_HEAD], ids=["wrk", "requests"])
def test_an_upstream_and_a_client_see_the_same_bytes_through_either_path(proxy: AuthProxy, head: bytes) -> None:
    # A TE header sends a request the strict way, and is hop-by-hop: the strict path drops it, so the
    # same request with it must reach the upstream, and answer the client, exactly as without it.
    assert _handler_over(head)._parse_clean_head()
    strict_head = head.replace(b"Content-Type", b"TE: trailers\r\nContent-Type")
    assert not _handler_over(strict_head)._parse_clean_head()
    upstream = _RecordingUpstream()
    try:
        base = proxy.mount("http://127.0.0.1:%d/base" % upstream.port, token="tok-e2e",
                           headers={"X-Sandbox-Token": "sbx-e2e"})
        path = base[len(proxy.url):] + "/step"
        fast_answer = _exchange(proxy.port, path, head)
        strict_answer = _exchange(proxy.port, path, strict_head)
    finally:
        upstream.close()
    assert fast_answer == strict_answer == UVICORN_ANSWER + b"ok"
    fast_seen, strict_seen = upstream.seen
    assert fast_seen == strict_seen
    assert b"Authorization: Bearer tok-e2e\r\nX-Sandbox-Token: sbx-e2e\r\nContent-Length: 2\r\n\r\n{}" in fast_seen


def test_a_content_length_of_a_non_ascii_digit_is_refused_not_dropped(proxy: AuthProxy, upstream) -> None:
    # "²" is a digit to str.isdigit() but not to int(): the strict path let a ValueError end the
    # connection without an answer (and called an upstream's such answer a connection failure).
    base = proxy.mount(upstream.url, token="tok-digit")
    head = WRK_HEAD.replace(b"/r/step", base[len(proxy.url):].encode() + b"/step").replace(b": 2\r\n", b": \xb2\r\n")
    answer = support.raw_request(proxy.port, head + b"{}")
    assert answer.startswith(b"HTTP/1.1 400 ") and b"X-Proxy-Error: bad-content-length" in answer


def test_empty_and_multi_record_tls_answers_are_relayed_on_one_pooled_connection(test_ca, tls_upstream) -> None:
    # A pooled TLS connection decrypts from memory buffers: an empty body must not wait for bytes
    # (it hung until read_timeout_s), and a body sent in several records must be read record by record.
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
    # not be reused with them waiting. Over plain HTTP they stay in the kernel (the liveness check
    # sees them). Over TLS they were read with the body's last record: decrypted with it (the reader
    # keeps them; they were relayed as the next answer, a streamed body's with the body), or still
    # encrypted in the engine's buffer (the liveness check sees them; they were the next answer too).
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
    # The pool's liveness check reads the kernel's TCP state and byte count (no poll: a poll hands
    # the GIL to another thread): stray bytes and a FIN must both be seen, and reading them counts.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        conn = proxy._UpstreamConnection(client, 5.0)
        try:
            assert conn.looks_idle()
            server.sendall(b"stray")
            support.wait_until(lambda: not conn.looks_idle(), "stray bytes seen", 5)
            assert conn.reader.read1(10) == b"stray" and conn.looks_idle()
            server.shutdown(socket.SHUT_RDWR)
            support.wait_until(lambda: not conn.looks_idle(), "the FIN seen", 5)
        finally:
            conn.close()
            server.close()


@settings(max_examples=100, deadline=None)
@given(first=answer_heads(), second=answer_heads(), method=st.sampled_from(["GET", "POST"]),
       date=st.sampled_from(["Thu, 26 Nov 2026 00:00:01 GMT", "x", " x", "x ", "", "a\tb", "caf\xe9", "a\x01b"]),
       length=st.sampled_from(["0", "7", "70000", "007", "", "x", "1" * 19]))
def test_an_answer_the_memo_recognises_is_what_the_strict_path_writes(first: bytes, second: bytes, method: str,
                                                                     date: str, length: str) -> None:
    # A connection's reader remembers the last head it relayed as it came; a later head equal to it but
    # in its Date and Content-Length values is recognised without the regular expressions: it must be
    # exactly a head the fast path would relay (the strict path writes the same bytes).
    for head in (first, UVICORN_ANSWER):
        reader = proxy._UpstreamReader(lambda n: b"")
        try:
            proxy._parse_answer(head, method, reader)
        except proxy._BadResponse:
            pass
        text = head.decode("latin-1")
        varied = re.sub(r"(?im)^(date|content-length): [^\r\n]*", lambda m: "%s: %s" % (
            m.group(1), date if m.group(1).lower() == "date" else length), text, count=2).encode("latin-1")
        memo = reader.memo  # (each later head is also compared with the first's memo)
        # (and as HTTP/1.0, with a line more after them, and another letter starting the line after the Date line)
        for later in (varied, varied.replace(b"HTTP/1.1 ", b"HTTP/1.0 ", 1), varied[:-2] + b"x-tail: 1\r\n\r\n", re.sub(
                rb"(?i)(\ndate: [^\r\n]*\r\n)([a-z])", lambda m: m.group(1) + (b"z" if m.group(2) == b"y" else b"y"),
                varied, count=1), second):
            if memo is not None:  # recognised by the memo exactly when its _answer_key is the remembered head's
                key, later_length = proxy._answer_key(later)
                probe = proxy._UpstreamReader(lambda n: b"")
                probe.memo = memo
                try:
                    answer = proxy._parse_answer(later, method, probe)
                except proxy._BadResponse:
                    answer = None
                recognised = answer is not None and answer.raw is not None and probe.memo is memo  # (else replaced)
                assert recognised == (later_length >= 0 and key == memo[2])
                assert not recognised or answer.length == later_length  # type: ignore[union-attr]
            try:
                remembered = proxy._parse_answer(later, method, reader)
            except proxy._BadResponse:
                continue
            if remembered.raw is not None:
                assert _assert_answer_paths_agree(later, method)
                assert (remembered.status, remembered.reason, remembered.length) == (
                    proxy._parse_answer(later, method).status, proxy._parse_answer(later, method).reason,
                    proxy._parse_answer(later, method).length)


def test_content_length_values_are_read_as_their_numbers_through_the_length_cache() -> None:
    # Both memos look a value up (proxy._LENGTH_VALUES) before converting it: values that are prefixes
    # of one another, seen in any order, must each read as their own number, and the cache stays bounded.
    values = [b"70000", b"7000", b"700", b"70", b"7", b"0", b"7000", b"70000", b"10", b"100", b"10"]
    request = b"POST /r/step HTTP/1.1\r\nHost: h\r\nContent-Length: %s\r\nContent-Type: a/b\r\n\r\n"
    memo = proxy._head_memo(request % b"2", len(request % b"2"))
    reader = proxy._UpstreamReader(lambda n: b"")
    proxy._parse_answer(UVICORN_ANSWER, "POST", reader)
    assert reader.memo is not None
    for value in values:
        head = request % value
        assert proxy._head_memo_length(head, len(head), memo) == int(value)
        answer = UVICORN_ANSWER.replace(b"content-length: 2", b"content-length: " + value)
        assert proxy._parse_answer(answer, "POST", reader).length == int(value)
    for number in range(proxy.MAX_CACHED_LENGTHS + 10):
        head = request % b"%d" % number
        assert proxy._head_memo_length(head, len(head), memo) == number
    assert len(proxy._LENGTH_VALUES) <= proxy.MAX_CACHED_LENGTHS


def _head_key(data: bytes, end: int) -> Tuple[bytes, int]:
    """What the clean loop's head memo must agree with: the request head `data[:end]` without the value
    of its first `Content-Length` line, and that value (-1 without such a line, -2 if it is not 1-18
    ASCII digits)."""
    before, after = proxy._head_memo(data, end)
    if after is None:
        return before, -1
    value = data[len(before):end - len(after)]
    return before + after, int(value) if value.isdigit() and len(value) <= 18 else -2


@settings(max_examples=100, deadline=None)
@given(head=request_heads(), length=st.sampled_from(["0", "7", "70000", "007", "", "x", "\xb2", "1" * 19, "2 ", "-1"]))
def test_a_head_the_clean_loop_reuses_a_parse_for_parses_to_that_with_its_own_length(head: bytes, length: str) -> None:
    # The clean loop parses a connection's head once and reuses the parse for a later head with the same
    # _head_key (equal but in its Content-Length value): the later head must be clean too, and parse to
    # the same request with its own length.
    for head in (head, WRK_HEAD, REQUESTS_HEAD, REQUESTS_HEAD.replace(b"Content-Length", b"content-length")):
        first = proxy._clean_request_head(head, len(head))
        key, _ = _head_key(head, len(head))
        later = re.sub(rb"(?i)(\r\ncontent-length: )[^\r\n]*", lambda m: m.group(1) + length.encode("latin-1"),
                       head, count=1)
        later_key, later_length = _head_key(later, len(later))
        for other in (later, later[:-2] + b"X-Tail: 1\r\n\r\n"):  # the loop's test: the same as comparing keys
            other_key, other_length = _head_key(other, len(other))
            assert proxy._head_memo_length(other + b"body", len(other), proxy._head_memo(head, len(head))) == (
                other_length if other_key == key else -3)
        if first is None or later_key != key or later_length < -1:
            continue  # (the loop parses such a head afresh)
        again = proxy._clean_request_head(later, len(later))
        assert again is not None, "a head the loop would reuse a parse for is not clean"
        assert again[5] == later_length
        assert again[:3] + again[6:] == first[:3] + first[6:]
