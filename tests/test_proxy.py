"""AuthProxy core behaviour: HTTP forwarding, routing, the token, WebSocket tunnels, lifecycle."""
from __future__ import annotations

import email.parser
import email.policy
import hashlib
import json
import logging
import socket
from typing import Iterator, Tuple, Union

import pytest
import requests
from websockets.exceptions import ConnectionClosed
from support import ws_connect as connect

import support
from support import TEST_TOKEN, Upstream, ws_url
from proxy import AuthProxy, InsecureURLError, Refusal, Route, _is_loopback_host, _route_id

TIMEOUT = 10


@pytest.fixture(params=["http", "https"])
def any_upstream(request: pytest.FixtureRequest, test_ca: support.TestCA) -> Iterator[Tuple[Upstream, object]]:
    """The test upstream over plain HTTP and over HTTPS, with the matching `verify` for mount()."""
    tls = request.param == "https"
    with Upstream(tls=test_ca if tls else None) as server:
        yield server, (test_ca.ca_path if tls else True)


@pytest.fixture
def proxy() -> Iterator[AuthProxy]:
    with AuthProxy() as p:
        yield p


def _headers(echo: dict) -> dict:
    out: dict = {}
    for name, value in echo["headers"]:
        out.setdefault(name.lower(), []).append(value)
    return out


def test_post_is_forwarded_with_token_injected_host_rewritten_and_query_kept(any_upstream, proxy):
    upstream, verify = any_upstream
    base = proxy.mount(upstream.url, TEST_TOKEN, verify=verify)
    body = json.dumps({"action": {"message": "hi"}}).encode()
    r = requests.post(base + "/step?x=1&y=%2F", data=body, headers={"Content-Type": "application/json"},
                      timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    echo = r.json()
    assert echo["method"] == "POST"
    assert echo["target"] == "/step?x=1&y=%2F"
    assert echo["body_sha256"] == hashlib.sha256(body).hexdigest()
    headers = _headers(echo)
    assert headers["authorization"] == ["Bearer " + TEST_TOKEN]
    assert headers["host"] == [upstream.url.split("://", 1)[1]]
    assert "X-Proxy-Error" not in r.headers


def test_client_authorization_is_replaced_by_the_route_token(upstream, proxy):
    base = proxy.mount(upstream.url, TEST_TOKEN)
    r = requests.get(base + "/x", headers={"Authorization": "Bearer client-own", "Connection": "Authorization"},
                     timeout=TIMEOUT)
    assert r.status_code == 200
    assert _headers(r.json())["authorization"] == ["Bearer " + TEST_TOKEN]


def test_unknown_route_answers_404_without_contacting_upstream(upstream, proxy):
    proxy.mount(upstream.url, TEST_TOKEN)
    r = requests.get(proxy.url + "/not-a-route/health", timeout=TIMEOUT)
    assert r.status_code == 404
    assert r.headers["X-Proxy-Error"] == "unknown-route"
    assert r.json()["error"] == "unknown-route"
    assert upstream.requests == [] and upstream.connections == 0


def test_environment_errors_pass_through_without_proxy_error_header(upstream, proxy):
    base = proxy.mount(upstream.url, TEST_TOKEN)
    r = requests.get(base + "/status/503", timeout=TIMEOUT)
    assert r.status_code == 503
    assert "X-Proxy-Error" not in r.headers
    assert r.json() == {"detail": "environment error", "path": "/status/503"}


def test_token_callable_is_read_at_each_request(upstream, proxy):
    tokens = iter(["first-token", "second-token"])
    upstream.token = None
    base = proxy.mount(upstream.url, lambda: next(tokens))
    seen = [_headers(requests.get(base + "/x", timeout=TIMEOUT).json())["authorization"] for _ in range(2)]
    assert seen == [["Bearer first-token"], ["Bearer second-token"]]


def test_a_token_reassigned_on_a_route_is_the_one_it_injects_next_none_included():
    route = Route("http://127.0.0.1:9", "first-token")
    assert route.current_token() == "first-token"
    route.token = "second-token"
    assert route.current_token() == "second-token"
    route.token = None  # inject nothing from now on
    assert route.current_token() is None
    route.token = "not a token"
    with pytest.raises(ValueError, match="the token set on the route is not a usable token string"):
        route.current_token()


def test_a_token_reassigned_on_a_mounted_route_is_what_its_next_request_carries(upstream, proxy):
    upstream.token = None  # (the upstream answers whatever it gets; the test reads what it got)
    base = proxy.mount(upstream.url, "first-token")
    route = proxy._routes[_route_id(base)]
    seen = [_headers(requests.get(base + "/x", timeout=TIMEOUT).json()).get("authorization")]
    route.token = "second-token"
    seen.append(_headers(requests.get(base + "/x", timeout=TIMEOUT).json()).get("authorization"))
    route.token = None  # inject nothing from now on
    seen.append(_headers(requests.get(base + "/x", timeout=TIMEOUT).json()).get("authorization"))
    assert seen == [["Bearer first-token"], ["Bearer second-token"], None]


def test_a_name_under_localhost_is_dialled_as_loopback_whatever_the_resolver_knows(upstream, proxy):
    # RFC 6761: `<name>.localhost` is loopback (the proxy's cleartext rule already says so); glibc
    # does not resolve such names, so the route dials `localhost` and keeps the name for Host.
    upstream.token = None
    base = proxy.mount(upstream.url.replace("127.0.0.1", "env-7.localhost"), TEST_TOKEN)
    answer = requests.get(base + "/x", timeout=TIMEOUT)
    assert answer.status_code == 200
    assert _headers(answer.json())["host"] == ["env-7.localhost:%d" % int(upstream.url.rsplit(":", 1)[1])]


def test_keep_alive_session_reuses_one_upstream_connection(any_upstream, proxy):
    upstream, verify = any_upstream
    base = proxy.mount(upstream.url, TEST_TOKEN, verify=verify)
    with requests.Session() as session:
        for i in range(5):
            assert session.post(base + "/step", json={"i": i}, timeout=TIMEOUT).status_code == 200
    assert upstream.connections == 1


def test_websocket_text_and_binary_echo_through_the_tunnel(any_upstream, proxy):
    upstream, verify = any_upstream
    base = proxy.mount(upstream.url, TEST_TOKEN, verify=verify)
    with connect(ws_url(base) + "/ws", max_size=None, open_timeout=TIMEOUT) as ws:
        ws.send('{"type": "reset", "data": {}}')
        assert ws.recv(TIMEOUT) == '{"type": "reset", "data": {}}'
        blob = support.pattern(1 << 20)
        ws.send(blob)
        assert ws.recv(TIMEOUT) == blob
    seen = upstream.requests[-1]
    assert seen.target == "/ws"
    assert ("Authorization", "Bearer " + TEST_TOKEN) in seen.headers


def test_mount_refuses_cleartext_upstream_off_loopback(proxy):
    with pytest.raises(InsecureURLError, match="https"):
        proxy.mount("http://example.com", TEST_TOKEN)
    assert issubclass(InsecureURLError, ValueError)


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("env-7.localhost", True), ("127.0.0.2", True),
    ("::1", True), ("[::1]", True), ("Xlocalhost", False), ("localhost.example.com", False),
    ("evillocalhost", False), ("10.0.0.1", False), ("[::2]", False), ("", False), (None, False)])
def test_the_loopback_rule_takes_loopback_names_and_literals_and_nothing_that_resembles_them(
        host, loopback):
    # The one rule for "may go in clear text" (and for the bind warning): RFC 6761 names, loopback IP
    # literals with or without an IPv6 URL's brackets; never a name that only contains "localhost".
    assert _is_loopback_host(host) is loopback


@pytest.mark.skipif(not support.ipv6_loopback(), reason="::1 is not configured on this machine")
def test_a_bracketed_ipv6_loopback_bind_draws_no_non_loopback_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="proxy"):
        with AuthProxy(host="[::1]") as p:
            assert p.url.startswith("http://[::1]:")
    assert "non-loopback" not in caplog.text


def test_stop_closes_everything_and_joins_every_thread(upstream, no_leaks):
    p = AuthProxy().start()
    base = p.mount(upstream.url, TEST_TOKEN)
    with requests.Session() as session, connect(ws_url(base) + "/ws", open_timeout=TIMEOUT) as ws:
        ws.send("open")
        assert ws.recv(TIMEOUT) == "open"
        assert session.get(base + "/x", timeout=TIMEOUT).status_code == 200
        p.stop()
        with pytest.raises(ConnectionClosed):
            ws.recv(TIMEOUT)
    upstream.kill_connections()


class _Gate(AuthProxy):
    """A token gate like the HF Jobs emulator's: checks the client's token, forwards with none."""

    def __init__(self, upstream_url: str) -> None:
        super().__init__("127.0.0.1", 0)
        self.route = Route(upstream_url, None)

    def route_request(self, target, headers) -> Union[Tuple[Route, str], Refusal]:
        if headers.get("Authorization") != "Bearer gate-secret":
            return Refusal(401, "unauthorized", "Send the job owner's token.", (("WWW-Authenticate", "Bearer"),))
        return self.route, target


def test_route_request_hook_serves_a_subclass_that_never_mounts():
    with Upstream(token=None) as upstream, _Gate(upstream.url) as gate:
        denied = requests.get(gate.url + "/health", timeout=TIMEOUT)
        assert denied.status_code == 401
        assert denied.headers["X-Proxy-Error"] == "unauthorized"
        assert denied.headers["WWW-Authenticate"] == "Bearer"
        assert denied.json() == {"error": "unauthorized", "message": "Send the job owner's token."}
        ok = requests.get(gate.url + "/health?q=1", headers={"Authorization": "Bearer gate-secret"}, timeout=TIMEOUT)
        assert ok.status_code == 200
        assert ok.json()["target"] == "/health?q=1"
        assert "authorization" not in _headers(ok.json())
        with connect(ws_url(gate.url) + "/ws", additional_headers={"Authorization": "Bearer gate-secret"},
                     open_timeout=TIMEOUT) as ws:
            ws.send("through the gate")
            assert ws.recv(TIMEOUT) == "through the gate"
        assert len(upstream.requests) == 2  # the refused request never reached it


class _BrokenHook(AuthProxy):
    def route_request(self, target, headers):  # type: ignore[override]
        return "not a decision"


def test_a_route_request_hook_returning_garbage_gets_500_not_a_dropped_connection(log_guard):
    with _BrokenHook() as proxy:
        r = requests.get(proxy.url + "/x", timeout=TIMEOUT)
        assert r.status_code == 500 and r.headers["X-Proxy-Error"] == "proxy-error"
    assert "expected (Route, '/target') or a Refusal" in log_guard.text()


class _EditingHook(AuthProxy):
    """A hook that edits the request headers it is given: the proxy must forward the edited set."""

    def __init__(self, upstream_url: str) -> None:
        super().__init__()
        self.route = Route(upstream_url, TEST_TOKEN)

    def route_request(self, target, headers):  # type: ignore[override]
        assert headers.get("x-remove-me") == "1" and headers.get_all("X-Twice") == ["a, b"]
        del headers["X-Remove-Me"]
        headers["X-Added"] = "by-hook"
        return self.route, target


def test_headers_edited_by_a_route_request_hook_are_what_gets_forwarded(upstream):
    with _EditingHook(upstream.url) as proxy:
        r = requests.get(proxy.url + "/edit", headers={"X-Remove-Me": "1", "X-Twice": "a, b"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        names = {name.lower(): value for name, value in r.json()["headers"]}
    assert "x-remove-me" not in names and names["x-added"] == "by-hook"


class _UnsendableEditHook(AuthProxy):
    """A hook copying a value it was given into a header: CR/LF in it would add fields upstream."""

    def __init__(self, upstream_url: str, value: str) -> None:
        super().__init__()
        self.route, self.value = Route(upstream_url, TEST_TOKEN), value

    def route_request(self, target, headers):  # type: ignore[override]
        headers["X-User"] = self.value
        return self.route, target


@pytest.mark.parametrize("value", ["a\r\nX-Injected: yes", "Jos\u00e9 \u20ac", "a\x01b"])
def test_a_header_edit_a_hook_cannot_send_is_a_500_never_injected_fields_or_a_dropped_connection(upstream, value,
                                                                                              log_guard):
    with _UnsendableEditHook(upstream.url, value) as proxy:
        r = requests.get(proxy.url + "/edit", timeout=TIMEOUT)
        assert (r.status_code, r.headers.get("X-Proxy-Error")) == (500, "proxy-error"), r.text
    assert upstream.requests == []  # before: sent with an X-Injected field, or the client got no answer at all
    assert "route_request raised" in log_guard.text()


class _ReadingHook(AuthProxy):
    """A hook that reads the request headers the ways an `HTTPMessage` is read, and records what it saw."""

    def __init__(self, upstream_url: str) -> None:
        super().__init__()
        self.route, self.seen = Route(upstream_url, TEST_TOKEN), []

    def route_request(self, target, headers):  # type: ignore[override]
        self.seen.append((list(headers), headers.keys(), headers.values(), len(headers), dict(headers),
                          headers.items()))
        return self.route, target


def test_a_route_request_hook_reads_the_headers_by_iteration_keys_values_len_and_dict_like_an_http_message(upstream):
    sent = (b"GET /read HTTP/1.1\r\nHost: h\r\nX-Twice: a\r\nx-twice: b\r\nAccept: */*\r\n"
            b"Connection: close\r\n\r\n")
    with _ReadingHook(upstream.url) as proxy, socket.create_connection(("127.0.0.1", proxy.port), TIMEOUT) as sock:
        sock.sendall(sent)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    expected = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(sent.split(b"\r\n", 1)[1])
    names = ["Host", "X-Twice", "x-twice", "Accept", "Connection"]
    assert expected.keys() == names  # (the stdlib's own reading of the same head)
    assert proxy.seen == [(names, names, expected.values(), len(expected), dict(expected), expected.items())]
