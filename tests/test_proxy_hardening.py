"""AuthProxy against bad input and misuse: never an open proxy, bounded time, clear refusals, no leaks."""
from __future__ import annotations

import socket
import time
from typing import Iterator, Tuple

import pytest
import requests

from support import TEST_TOKEN, Upstream, raw_request, read_to_eof
from proxy import AuthProxy, InsecureURLError, Route

TIMEOUT = 5


@pytest.fixture
def served(upstream: Upstream) -> Iterator[Tuple[Upstream, AuthProxy, str]]:
    """(upstream, proxy, route path) with a short header timeout so stalls end quickly."""
    with AuthProxy(header_timeout_s=0.5, idle_timeout_s=2) as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        yield upstream, proxy, base[len(proxy.url):]


def _still_serving(proxy: AuthProxy, path: str) -> None:
    r = requests.get(proxy.url + path + "/ok", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["target"] == "/ok"


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def _header(raw: bytes, name: bytes) -> bytes:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return b""


@pytest.mark.parametrize("request_line, status, kind", [
    (b"GET http://example.com/ HTTP/1.1", 400, b"bad-target"),
    (b"GET example.com:80 HTTP/1.1", 400, b"bad-target"),
    (b"CONNECT example.com:443 HTTP/1.1", 405, b"method-not-allowed"),
    (b"TRACE /r HTTP/1.1", 405, b"method-not-allowed"),  # an upstream would echo the injected token back
    (b"OPTIONS * HTTP/1.1", 400, b"bad-target"),
    (b"G(E)T /x HTTP/1.1", 400, b"bad-request"),
    (b"GET /\xc3\xa9t\xc3\xa9 HTTP/1.1", 400, b"bad-target"),
])
def test_non_origin_form_targets_and_connect_are_refused(served, request_line, status, kind):
    upstream, proxy, path = served
    raw = raw_request(proxy.port, request_line + b"\r\nHost: example.com\r\nConnection: close\r\n\r\n")
    assert _status(raw) == status
    assert _header(raw, b"X-Proxy-Error") == kind
    assert upstream.connections == 0
    _still_serving(proxy, path)


@pytest.mark.parametrize("head, status", [
    (b"THIS IS NOT HTTP\r\n\r\n", 400),
    (b"GET /x HTTP/9.9\r\n\r\n", 505),
    (b"GET /x\r\n\r\n", 400),  # HTTP/0.9
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /x HTTP/1.1\r\nX-Big: " + b"b" * 70000 + b"\r\n\r\n", 431),
    (b"GET /x HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"GET /x HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(80)) + b"\r\n", 431),
    (b"GET  /x HTTP/1.1\r\n\r\n", 400),  # two spaces: not a valid request line
    (b"GET /x HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n", 400),  # obs-fold
    (b"GET /x HTTP/1.1\r\nHost : x\r\n\r\n", 400),  # whitespace before the colon
    (b"GET /x HTTP/1.1\r\nno colon here\r\nContent-Length: 5\r\n\r\n", 400),
])
def test_malformed_or_oversized_request_heads_get_a_4xx_and_the_proxy_keeps_serving(served, head, status):
    upstream, proxy, path = served
    raw = raw_request(proxy.port, head.replace(b"/x", path.encode() + b"/x", 1))
    assert _status(raw) == status
    assert _header(raw, b"Content-Type") == b"application/json"
    assert upstream.requests == []
    _still_serving(proxy, path)


@pytest.mark.parametrize("headers, status, kind", [
    (b"Bad Name: 1\r\n", 400, b"bad-header"),
    (b"X-Ctl: a\x01b\r\n", 400, b"bad-header"),
    # a bare CR: an upstream taking it for a line end would see a header the proxy never checked
    (b"X-A: foo\rAuthorization: Bearer forged\r\n", 400, b"bad-header"),
    (b"X-A: foo\r\r\n", 400, b"bad-header"),
    (b"Content-Length: abc\r\n", 400, b"bad-content-length"),
    (b"Content-Length: -5\r\n", 400, b"bad-content-length"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, b"bad-content-length"),
    # only digits (RFC 9110 8.6): a latin-1 NBSP or NEL around them is not whitespace to strip
    (b"Content-Length: 5\xa0\r\n", 400, b"bad-content-length"),
    (b"Content-Length: \x855\r\n", 400, b"bad-content-length"),
    (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, b"bad-framing"),
    (b"Transfer-Encoding: gzip, chunked\r\n", 501, b"unsupported-transfer-encoding"),
])
def test_ambiguous_or_bad_body_framing_is_refused_and_the_connection_closed(served, headers, status, kind):
    upstream, proxy, path = served
    raw = raw_request(proxy.port, b"POST %s/x HTTP/1.1\r\nHost: x\r\n%s\r\nhello" % (path.encode(), headers))
    assert _status(raw) == status
    assert _header(raw, b"X-Proxy-Error") == kind
    assert _header(raw, b"Connection") == b"close"
    assert upstream.requests == []
    _still_serving(proxy, path)


@pytest.mark.parametrize("body", [
    b"zz\r\nhello\r\n0\r\n\r\n",  # size is not hex
    b"5\r\nhelloXX0\r\n\r\n",  # data not followed by CRLF
    b"5\r\nhel",  # cut short, then the client goes away
])
def test_broken_chunked_bodies_are_refused_without_reaching_the_upstream(served, body):
    upstream, proxy, path = served
    head = b"POST %s/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        raw = read_to_eof(sock)
    assert _status(raw) == 400
    assert _header(raw, b"X-Proxy-Error") == b"bad-body"
    assert upstream.requests == []
    _still_serving(proxy, path)


def test_body_shorter_than_its_content_length_never_reaches_the_upstream(served):
    upstream, proxy, path = served
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST %s/step HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789" % path.encode())
        sock.shutdown(socket.SHUT_WR)  # the client gives up after 10 of its 100 bytes
        raw = sock.recv(65536)
    assert _status(raw) == 400 and _header(raw, b"X-Proxy-Error") == b"bad-body"
    _still_serving(proxy, path)
    assert [s.target for s in upstream.requests] == ["/ok"]


def test_client_stalling_mid_headers_is_disconnected_in_bounded_time(served):
    _, proxy, path = served
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GET %s/x HTTP/1.1\r\nHost: x\r\n" % path.encode())
        assert sock.recv(65536) == b""  # closed by the proxy (a socket timeout here fails the test)
    _still_serving(proxy, path)


def test_client_dripping_header_bytes_is_disconnected_in_bounded_time(served):
    _, proxy, path = served
    closed = False
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GET %s/x HTTP/1.1\r\n" % path.encode())
        for _ in range(50):  # one header byte every 0.1 s would last 5 s; the head deadline is 0.5 s
            try:
                sock.sendall(b"X")
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                closed = sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            sock.setblocking(True)
            sock.settimeout(TIMEOUT)
            if closed:
                break
    assert closed
    _still_serving(proxy, path)


@pytest.mark.slow  # waits out a 2 s idle timeout
def test_idle_keep_alive_connections_are_closed_after_the_idle_timeout(served):
    _, proxy, path = served
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"GET %s/x HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        data = b""
        while b"}" not in data:
            data += sock.recv(65536)
        assert sock.recv(65536) == b""  # idle_timeout_s=2 < the 5 s socket timeout


def test_http_1_0_clients_are_served_and_the_connection_closed(served):
    _, proxy, path = served
    raw = raw_request(proxy.port, b"GET %s/stream?n=2 HTTP/1.0\r\n\r\n" % path.encode())
    assert _status(raw) == 200
    assert _header(raw, b"Connection") == b"close"
    assert raw.split(b"\r\n\r\n", 1)[1] == b"line 0\nline 1\n"


def test_expect_100_continue_is_honoured(served):
    upstream, proxy, path = served
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST %s/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n" % path.encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 100")
        sock.sendall(b"hello")
        raw = read_to_eof(sock)
    assert _status(raw) == 200 and b'"body": "hello"' in raw
    assert "expect" not in {name.lower() for name, _ in upstream.requests[-1].headers}


_CLEARTEXT = ("refusing cleartext upstream %s: the token would cross the network unencrypted; use https:// "
              "(http:// is only allowed for loopback hosts)")
_EXAMPLE = "pass e.g. 'https://<job>--8000.hf.jobs'"
_BAD_URL_CHARACTERS = ("upstream URL contains whitespace, control or non-ASCII characters; pass the job URL "
                       "exactly (a non-ASCII host name in its xn-- form)")


@pytest.mark.parametrize("upstream_url, error, message", [
    ("http://example.com", InsecureURLError, _CLEARTEXT % "http://example.com"),
    ("http://10.0.0.1:8000", InsecureURLError, _CLEARTEXT % "http://10.0.0.1:8000"),
    ("ftp://example.com", ValueError,
     "upstream URL must start with https:// (or http:// for a loopback host), got scheme 'ftp'"),
    ("https://user:pw@example.com", ValueError,
     "upstream URL must not embed credentials (user:pass@); pass the token separately"),
    ("https://user@example.com", ValueError,
     "upstream URL must not embed credentials (user:pass@); pass the token separately"),
    ("https://", ValueError, "upstream URL has no host; " + _EXAMPLE),
    ("https://example.com/?x=1", ValueError,
     "upstream URL must not have a query or fragment; mount the server's base URL"),
    ("https://exa mple.com", ValueError, _BAD_URL_CHARACTERS),
    ("https://example.com/\x01", ValueError, _BAD_URL_CHARACTERS),
    ("https://a\x7fb.hf.jobs", ValueError, _BAD_URL_CHARACTERS),  # DEL went to Host as it was
    ("https://b\u00fccher.example", ValueError, _BAD_URL_CHARACTERS),  # Host got latin-1, TLS IDNA
    ("https://example.com:99999", ValueError,
     "upstream URL is malformed (Port out of range 0-65535); " + _EXAMPLE),
    ("https://example.com:0", ValueError, "upstream URL port 0 is not a real port"),
    (None, ValueError, "upstream must be a URL string like 'https://<job>--8000.hf.jobs', got 'NoneType'"),
    (8000, ValueError, "upstream must be a URL string like 'https://<job>--8000.hf.jobs', got 'int'"),
])
def test_mount_rejects_bad_upstreams_with_a_clear_error(upstream_url, error, message):
    with AuthProxy() as proxy:
        with pytest.raises(error) as info:
            proxy.mount(upstream_url, TEST_TOKEN)
    assert str(info.value) == message


_BAD_TOKEN_CHARACTERS = ("token contains whitespace, control or non-ASCII characters; pass the bare token "
                         "without 'Bearer '")


@pytest.mark.parametrize("token, message", [
    ("", "token is empty; pass your HF token (or None to inject no Authorization header)"),
    ("Bearer hf_x", _BAD_TOKEN_CHARACTERS),
    ("hf_x\r\nX-Evil: 1", _BAD_TOKEN_CHARACTERS),
    (123, "token must be a string, a zero-argument callable returning one, or None; got int"),
])
def test_mount_rejects_bad_tokens_without_echoing_them(token, message):
    with AuthProxy() as proxy:
        with pytest.raises(ValueError) as info:
            proxy.mount("https://job--8000.hf.jobs", token)
    assert str(info.value) == message


def test_mount_accepts_an_upstream_with_capitals_a_port_and_a_path_and_a_token_callable():
    # A sandbox id in the path keeps its case; a callable token is read per request, not at mount.
    with AuthProxy() as proxy:
        base = proxy.mount("https://Job-X--8000.hf.jobs:443/v1/sandboxes/sb-XYZ/proxy/8000", lambda: TEST_TOKEN)
        assert base.startswith(proxy.url + "/")


def test_mount_rejects_a_missing_ca_bundle_and_accepts_loopback_http():
    with AuthProxy() as proxy:
        with pytest.raises(ValueError, match="CA bundle"):
            proxy.mount("https://job--8000.hf.jobs", TEST_TOKEN, verify="/nonexistent/ca.pem")
        assert proxy.mount("http://localhost:1", TEST_TOKEN).startswith(proxy.url + "/")
        assert proxy.mount("http://[::1]:1", TEST_TOKEN).startswith(proxy.url + "/")


def test_mount_before_start_and_bad_settings_fail_clearly():
    with pytest.raises(RuntimeError, match="start"):
        AuthProxy().mount("https://job--8000.hf.jobs", TEST_TOKEN)
    with pytest.raises(ValueError, match="read_timeout_s"):
        AuthProxy(read_timeout_s=0)
    with pytest.raises(ValueError, match="port"):
        AuthProxy(port=70000)


def test_route_ids_are_unguessable_and_unique():
    with AuthProxy() as proxy:
        ids = {proxy.mount("https://job--8000.hf.jobs", TEST_TOKEN).rsplit("/", 1)[1] for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) >= 32 for i in ids)  # 24 random bytes, urlsafe base64: 192 bits


def test_reprs_and_info_logs_show_neither_token_nor_route_id(upstream, log_guard):
    with AuthProxy() as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        route_id = base.rsplit("/", 1)[1]
        requests.get(base + "/x", timeout=TIMEOUT)
        requests.get(base + "/die-before-response", timeout=TIMEOUT)  # a WARNING with the route's label
        for text in (repr(proxy), repr(Route(upstream.url, TEST_TOKEN))):
            assert TEST_TOKEN not in text and route_id not in text
        proxy.unmount(base)
    important = [line for line in log_guard.text().splitlines()
                 if line.startswith("proxy ") and " DEBUG " not in line]
    assert any("upstream-unreachable" in line for line in important)
    assert not any(route_id in line for line in important)


def test_ipv6_loopback_proxy_and_upstream_work():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        upstream = Upstream(host="::1")
    except OSError:
        pytest.skip("::1 is not configured")
    with upstream, AuthProxy("::1") as proxy:
        base = proxy.mount(upstream.url, TEST_TOKEN)
        assert base.startswith("http://[::1]:")
        assert requests.get(base + "/v6", timeout=TIMEOUT).json()["target"] == "/v6"


def test_a_busy_port_fails_start_with_a_clear_error():
    with AuthProxy() as first:
        second = AuthProxy(port=first.port)
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1:%d" % first.port):
            second.start()
        second.stop()  # never started: a no-op that must not raise


def test_a_client_closing_mid_head_gets_400_and_nothing_is_forwarded(served):
    upstream, proxy, path = served
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST %s/step HTTP/1.1\r\nHost: x\r\nContent-Le" % path.encode())
        sock.shutdown(socket.SHUT_WR)
        raw = sock.recv(65536)
    assert _status(raw) == 400
    assert upstream.requests == []
    _still_serving(proxy, path)
