"""Regression tests for the answer families the differential suite and the issue found, each
proving the proxy now answers what a direct connection answers (every one failed before its fix):

- a response over 64 KiB left its pooled upstream connection unread (next request: 502, yet run),
- interim 1xx answers other than 100 (102, 103) hung the client,
- a stale pooled TLS connection dropped mid-request (SSLEOFError) was not retried,
- an early upstream answer (413/401 before reading a large body, then close) became a 502,
- response heads with 100+ lines or a 64 KiB+ line got 502 (now relayed up to a documented limit).
"""
from __future__ import annotations

import socket
import ssl
import threading
from typing import List

import pytest
import requests

import support
from proxy import _may_retry
from upstreams.scripted import Script, ScriptedUpstream, read_request, serve_by_path

TIMEOUT_S = 10.0


def _read_response(sock: socket.socket, rfile) -> tuple:  # type: ignore[no-untyped-def]
    """One response from a raw client socket: (status, headers, body); interim ones returned first
    as (status, headers, None)."""
    status_line = rfile.readline()
    assert status_line, "the proxy closed the connection without answering"
    status = int(status_line.split(b" ")[1])
    headers: List[tuple] = []
    while True:
        line = rfile.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    if status < 200:
        return status, headers, None
    lengths = [v for n, v in headers if n == "content-length"]
    if lengths:
        return status, headers, rfile.read(int(lengths[0]))
    if any(n == "transfer-encoding" for n, _ in headers):
        body = b""
        while True:
            size = int(rfile.readline().split(b";")[0], 16)
            if size == 0:
                rfile.readline()
                return status, headers, body
            body += rfile.read(size)
            rfile.readline()
    return status, headers, rfile.read()


# -- family 1: a response over 64 KiB poisons the pooled connection ---------------------------------


@pytest.mark.parametrize("size", [65535, 65536, 65537, 1 << 20])
def test_big_response_then_post_on_the_same_route_both_answered_and_run_once(proxy, upstream, size):
    base = proxy.mount(upstream.url, support.TEST_TOKEN)
    with requests.Session() as session:
        for round_ in range(3):
            big = session.get(base + "/big?n=%d" % size, timeout=TIMEOUT_S)
            assert big.status_code == 200 and big.content == support.pattern(size)
            step = session.post(base + "/step", json={"round": round_}, timeout=TIMEOUT_S)
            assert step.status_code == 200, (step.status_code, step.headers.get("X-Proxy-Error"))
            assert step.json()["method"] == "POST"
    # every request reached the upstream exactly once: a 502 that still ran would show up as a gap
    assert [r.method for r in upstream.requests] == ["GET", "POST"] * 3


# -- family 2: interim responses other than 100 -----------------------------------------------------


def _interim_script(interims: bytes):  # type: ignore[no-untyped-def]
    def script(sock, rfile, number):  # type: ignore[no-untyped-def]
        while read_request(rfile) is not None:
            sock.sendall(interims + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal")
    return script


@pytest.mark.parametrize("interims, expected", [
    (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n", [103]),
    (b"HTTP/1.1 102 Processing\r\n\r\n", [102]),
    (b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", [102, 103]),
])
def test_interim_responses_are_relayed_and_the_final_answer_follows(proxy, interims, expected):
    with ScriptedUpstream(_interim_script(interims)) as up:
        base = proxy.mount(up.url, None)
        port, prefix = proxy.port, base.split(str(proxy.port), 1)[1]
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock, sock.makefile("rb") as rfile:
            for _ in range(2):  # and the connection is still good afterwards
                sock.sendall(b"GET %s/x HTTP/1.1\r\nHost: a\r\n\r\n" % prefix.encode())
                seen = []
                while True:
                    status, headers, body = _read_response(sock, rfile)
                    seen.append(status)
                    if body is not None:
                        break
                    if status == 103:
                        assert ("link", "</style.css>; rel=preload") in headers or ("link", "</a>") in headers
                assert seen == expected + [200]
                assert body == b"final" and ("x-final", "yes") in headers


def test_interim_responses_are_not_sent_to_http10_clients(proxy):
    with ScriptedUpstream(_interim_script(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")) as up:
        base = proxy.mount(up.url, None)
        prefix = base.split(str(proxy.port), 1)[1]
        answer = support.raw_request(proxy.port, b"GET %s/x HTTP/1.0\r\n\r\n" % prefix.encode())
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"final") and b" 103 " not in answer


# -- family 3: a stale pooled TLS connection is retried ---------------------------------------------


@pytest.mark.parametrize("exc", [ssl.SSLEOFError(8, "EOF occurred in violation of protocol"),
                                 ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed (EOF)")],
                         ids=["SSLEOFError", "SSLZeroReturnError"])
def test_retry_rule_treats_a_tls_eof_like_a_plain_connection_reset(exc):
    """A pooled TLS connection the upstream dropped surfaces as SSLEOFError (a write after the peer's
    FIN or reset) or SSLZeroReturnError, where plain TCP gives ConnectionResetError/BrokenPipeError:
    the same 'no answer', so the same retry decisions."""
    reset = ConnectionResetError()
    for method, reused, replayable, fully_sent in [("GET", True, True, True), ("POST", True, True, False),
                                                   ("POST", True, True, True), ("GET", False, True, True),
                                                   ("PUT", True, False, False)]:
        assert _may_retry(method, reused, replayable, fully_sent, exc) == \
            _may_retry(method, reused, replayable, fully_sent, reset), (method, reused, replayable, fully_sent)
    assert _may_retry("POST", reused=True, replayable=True, fully_sent=False, exc=exc)


@pytest.mark.parametrize("tls", [True, False], ids=["https", "http"])
@pytest.mark.parametrize("method, size", [("PUT", 1 << 20), ("GET", 0), ("POST", 100)])
def test_pooled_connection_dropped_mid_request_is_retried_once(proxy, test_ca, tls, method, size):
    """The upstream drops a pooled connection (no TLS close_notify) after reading only the head of
    the next request, as a server closing an idle keep-alive connection just as a request crossed
    it. A request the upstream cannot have run (idempotent, or not all sent) is retried on a fresh
    connection; a fully sent POST is not (it might have run), and gets a 502 that says so."""
    def script(sock, rfile, number):  # type: ignore[no-untyped-def]
        served = 0
        while True:
            request = read_request(rfile, body=not (number == 1 and served == 1))
            if request is None:
                return
            if number == 1 and served == 1:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
                return
            up.count_request()
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            served += 1

    up = ScriptedUpstream(script, tls=test_ca.server_context() if tls else None)
    with up:
        base = proxy.mount(up.url, "tok", verify=test_ca.ca_path)
        with requests.Session() as session:
            statuses = []
            for _ in range(3):
                answer = session.request(method, base + "/x", data=support.pattern(size), timeout=TIMEOUT_S)
                statuses.append(answer.status_code)
                assert answer.status_code != 502 or answer.headers["X-Proxy-Error"] == "upstream-unreachable"
        if method == "POST":
            assert statuses == [200, 502, 200] and (up.connections, up.requests) == (2, 2)
        else:
            assert statuses == [200, 200, 200] and (up.connections, up.requests) == (2, 3)


# -- family 4: an early upstream answer before the whole body was read ------------------------------


def _early_answer_script(status: int):  # type: ignore[no-untyped-def]
    def script(sock, rfile, number):  # type: ignore[no-untyped-def]
        request = read_request(rfile, body=False)
        if request is None:
            return
        reason = {401: b"Unauthorized", 413: b"Content Too Large"}[status]
        sock.sendall(b"HTTP/1.1 %d %s\r\nContent-Length: 7\r\nConnection: close\r\n\r\nrefused" % (status, reason))
        # close without reading the body (the kernel answers the unread bytes with a reset)
    return script


@pytest.mark.parametrize("status", [413, 401])
@pytest.mark.parametrize("body_size", [900 * 1024, 4 << 20])
def test_early_upstream_answer_reaches_the_client(proxy, status, body_size):
    with ScriptedUpstream(_early_answer_script(status)) as up:
        base = proxy.mount(up.url, None)
        prefix = base.split(str(proxy.port), 1)[1]
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S) as sock, \
                sock.makefile("rb") as rfile:
            sock.sendall(b"POST %s/upload HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (prefix.encode(), body_size))
            sender = threading.Thread(target=_send_quietly, args=(sock, support.pattern(body_size)))
            sender.start()
            try:
                got, headers, body = _read_response(sock, rfile)
            finally:
                sender.join(TIMEOUT_S)
        assert (got, body) == (status, b"refused")
        assert not any(n == "x-proxy-error" for n, _ in headers)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the proxy may close once it relayed the early answer, as the upstream did
        pass


# -- family 5: big response heads ------------------------------------------------------------------


def _head_script(extra_headers: bytes) -> Script:
    return serve_by_path({"/big-head": b"HTTP/1.1 200 OK\r\n" + extra_headers + b"Content-Length: 4\r\n\r\nbody"},
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsmall")


@pytest.mark.parametrize("extra_headers", [
    b"".join(b"X-Many-%d: %d\r\n" % (i, i) for i in range(150)),  # 150 header lines
    b"X-Long: " + b"v" * (70 * 1024) + b"\r\n",  # one 70 KiB line
], ids=["150-lines", "70KiB-line"])
def test_response_heads_over_the_stdlib_limits_are_relayed(proxy, extra_headers):
    with ScriptedUpstream(_head_script(extra_headers)) as up:
        base = proxy.mount(up.url, None)
        prefix = base.split(str(proxy.port), 1)[1].encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S) as sock, \
                sock.makefile("rb") as rfile:
            sock.sendall(b"GET %s/big-head HTTP/1.1\r\nHost: a\r\n\r\n" % prefix)
            status, headers, body = _read_response(sock, rfile)
            assert (status, body) == (200, b"body")
            sent = [line.split(b":", 1)[0].decode().lower() for line in extra_headers.split(b"\r\n") if line]
            assert [n for n, _ in headers if n.startswith("x-")] == sent


def test_response_head_over_the_proxy_limit_is_a_clear_502_and_the_route_keeps_working(proxy):
    import proxy as proxy_module

    huge = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(proxy_module.MAX_RESPONSE_HEAD_BYTES // 1000 + 8))
    with ScriptedUpstream(_head_script(huge)) as up:
        base = proxy.mount(up.url, None)
        with requests.Session() as session:
            answer = session.get(base + "/big-head", timeout=TIMEOUT_S)
            assert answer.status_code == 502 and answer.headers["X-Proxy-Error"] == "upstream-head-too-large"
            after = session.get(base + "/small", timeout=TIMEOUT_S)
            assert (after.status_code, after.content) == (200, b"small")


# -- family 6 (found by the differential suite): header value whitespace ----------------------------


def test_response_header_values_keep_their_trailing_whitespace_like_a_direct_connection(proxy):
    """http.server sends `Server: name ` (its empty sys_version leaves a trailing space); http.client
    (so requests) keeps trailing whitespace of a value, and the proxy stripped it: the direct and
    proxied answers differed. The proxy now relays values as sent (leading whitespace aside)."""
    def script(sock, rfile, number):  # type: ignore[no-untyped-def]
        while read_request(rfile) is not None:
            sock.sendall(b"HTTP/1.1 200 OK\r\nServer: stdlib-upstream \r\nX-Tabs:\tv\t \r\nContent-Length: 2\r\n\r\nok")

    with ScriptedUpstream(script) as up:
        base = proxy.mount(up.url, None)
        direct = requests.get(up.url + "/x", timeout=TIMEOUT_S)
        proxied = requests.get(base + "/x", timeout=TIMEOUT_S)
    for name in ("Server", "X-Tabs"):
        assert proxied.headers[name] == direct.headers[name], name
    assert proxied.headers["Server"] == "stdlib-upstream "


# -- family 7 (found by review of the new send path): a client dying mid-body ----------------------


def test_client_resetting_mid_body_ends_its_handler_without_waiting_for_the_upstream(test_ca):
    """A client that resets its connection while its (streamed, over 1 MiB) body is being forwarded:
    the read from the client fails with an OSError, which the send path took for the upstream
    dropping the connection, so it waited for an upstream answer that could not come (the upstream
    waits for the rest of the body) until read_timeout_s. It must end at once."""
    def script(sock, rfile, number):  # type: ignore[no-untyped-def]
        read_request(rfile, body=False)
        sock.settimeout(60)
        while rfile.read1(65536):  # wait for the rest of the body, which never comes
            pass

    from proxy import AuthProxy

    with ScriptedUpstream(script) as up, AuthProxy(read_timeout_s=60) as proxy:
        base = proxy.mount(up.url, None)
        prefix = base.split(str(proxy.port), 1)[1].encode()
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S)
        sock.sendall(b"POST %s/upload HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (prefix, 8 << 20))
        sock.sendall(support.pattern(2 << 20))
        support.wait_until(lambda: up.connections == 1, "the upstream sees the request", TIMEOUT_S)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()  # a reset, mid-body
        support.wait_until(lambda: not proxy._server.live_threads(), "the handler thread to end", 20)


# -- family 8 (found by the response fuzzer): status codes below 100 --------------------------------


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 003 Odd", b"HTTP/1.1 099 Odd", b"HTTP/1.1 000"])
def test_a_status_code_below_100_is_an_upstream_protocol_error_not_an_interim_answer(proxy, status_line):
    """The fuzzer's upstream sent 'HTTP/1.1 003 ...': the proxy took it for an interim (1xx) answer
    and relayed 'HTTP/1.1 3 ...', a status line no client can parse. http.client and h11 refuse such
    a status; the proxy now answers 502 upstream-protocol, and the route keeps working."""
    odd = status_line + b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    script = serve_by_path({"/odd": lambda target: (odd, False)}, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ngood")

    with ScriptedUpstream(script) as up:
        base = proxy.mount(up.url, None)
        prefix = base.split(str(proxy.port), 1)[1].encode()
        answer = support.raw_request(proxy.port, b"GET %s/odd HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" % prefix)
        assert answer.startswith(b"HTTP/1.1 502 ") and b"X-Proxy-Error: upstream-protocol" in answer, answer[:200]
        assert requests.get(base + "/next", timeout=TIMEOUT_S).content == b"good"
