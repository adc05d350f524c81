"""What pooled placement needs from the proxy, against real upstreams and real clients: an upstream
URL with a path prefix (a host's `.../proxy/<port>`), extra per-route headers read at each request
(the sandbox's bearer and X-Sandbox-Token rotate) and never shown, and one keep-alive connection pool
per upstream host shared by every route to it (one TLS handshake per connection, not per sandbox).
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Dict, Iterator

import pytest
import requests
from websockets.exceptions import ConnectionClosed

import support
from diff_clients import UpstreamProcess, start_upstreams
import proxy as proxy_module
from proxy import AuthProxy

TOKEN = "hf_routestoken_" + "Vb7Qk2Lp9Wx3"
SANDBOX_TOKEN = "sbx_secret_" + "Hn4Tr8Zc1Ym6"
PREFIX = "/v1/sandboxes/sb-1/proxy/8000"


@pytest.fixture(scope="module")
def uvicorn_tls(test_ca: support.TestCA) -> Iterator[UpstreamProcess]:
    started = start_upstreams([("uvicorn-tls", "asgi_app.py", True, ())], TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started["uvicorn-tls"]
    started["uvicorn-tls"].stop()


def _echo(proxy_base: str, path: str, **kwargs: object) -> Dict[str, object]:
    answer = requests.get(proxy_base + path, timeout=10, **kwargs)  # type: ignore[arg-type]
    assert answer.status_code == 200, answer.text
    return answer.json()


def _header(seen: Dict[str, object], name: str) -> list:
    return [v for k, v in seen["headers"] if k.lower() == name.lower()]  # type: ignore[union-attr]


def test_a_prefixed_upstream_gets_requests_under_its_prefix_with_the_query_over_uvicorn_tls(
        proxy: AuthProxy, uvicorn_tls: UpstreamProcess, test_ca: support.TestCA, log_guard) -> None:
    log_guard.watch(TOKEN)
    base = proxy.mount(uvicorn_tls.url + PREFIX, TOKEN, verify=test_ca.ca_path)
    answer = requests.get(base + "/step/x?size=3&a=b%20c", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["X-Echo-Path"] == PREFIX + "/step/x"
    assert answer.headers["X-Echo-Query"] == "size=3&a=b%20c"
    assert len(answer.content) == 3
    # The route root itself maps to the prefix.
    assert requests.get(base + "/", timeout=10).headers["X-Echo-Path"] == PREFIX + "/"


def test_a_websocket_through_a_prefixed_tls_upstream_carries_messages_both_ways_over_uvicorn(
        proxy: AuthProxy, uvicorn_tls: UpstreamProcess, test_ca: support.TestCA, log_guard) -> None:
    log_guard.watch(TOKEN)
    base = proxy.mount(uvicorn_tls.url + PREFIX, TOKEN, verify=test_ca.ca_path)
    with support.ws_connect(support.ws_url(base) + "/ws") as ws:
        ws.send("hello through the prefix")
        assert ws.recv(timeout=10) == "hello through the prefix"
        ws.send(b"\x00\x01binary")
        assert ws.recv(timeout=10) == b"\x00\x01binary"


def test_the_websocket_upgrade_goes_to_the_prefixed_path_with_the_route_headers(proxy: AuthProxy, log_guard) -> None:
    log_guard.watch(SANDBOX_TOKEN)
    with support.Upstream() as up:
        base = proxy.mount(up.url + PREFIX, support.TEST_TOKEN, headers={"X-Sandbox-Token": SANDBOX_TOKEN})
        with support.ws_connect(support.ws_url(base) + "/ws?session=7",
                                additional_headers={"X-Sandbox-Token": "client-forged"}) as ws:
            ws.send("ping")
            assert ws.recv(timeout=10) == "ping"
        upgrade = up.requests[-1]
        assert upgrade.target == PREFIX + "/ws?session=7"
        assert [v for k, v in upgrade.headers if k.lower() == "x-sandbox-token"] == [SANDBOX_TOKEN]


def test_callable_headers_are_read_at_each_request_so_a_rotated_sandbox_token_is_sent_next(
        proxy: AuthProxy, upstream: support.Upstream, log_guard) -> None:
    current = {"X-Sandbox-Token": SANDBOX_TOKEN + "-one"}
    for value in ("-one", "-two"):
        log_guard.watch(SANDBOX_TOKEN + value)
    base = proxy.mount(upstream.url + PREFIX, support.TEST_TOKEN, headers=lambda: dict(current))
    first = _echo(base, "/state")
    current["X-Sandbox-Token"] = SANDBOX_TOKEN + "-two"
    second = _echo(base, "/state")
    assert _header(first, "X-Sandbox-Token") == [SANDBOX_TOKEN + "-one"]
    assert _header(second, "X-Sandbox-Token") == [SANDBOX_TOKEN + "-two"]
    assert first["target"] == second["target"] == PREFIX + "/state"


def test_route_headers_replace_what_the_client_sent_under_the_same_name_in_any_case(
        proxy: AuthProxy, upstream: support.Upstream, log_guard) -> None:
    log_guard.watch(SANDBOX_TOKEN)
    base = proxy.mount(upstream.url, support.TEST_TOKEN, headers={"X-Sandbox-Token": SANDBOX_TOKEN})
    seen = _echo(base, "/x", headers={"x-sandbox-TOKEN": "forged-by-client", "X-Other": "kept"})
    assert _header(seen, "X-Sandbox-Token") == [SANDBOX_TOKEN]
    assert _header(seen, "X-Other") == ["kept"]


def test_with_token_none_the_route_headers_may_carry_their_own_authorization(
        proxy: AuthProxy, upstream: support.Upstream) -> None:
    base = proxy.mount(upstream.url, None, headers=lambda: {"Authorization": "Bearer " + support.TEST_TOKEN,
                                                           "X-Sandbox-Token": SANDBOX_TOKEN})
    seen = _echo(base, "/x", headers={"Authorization": "Bearer client-token"})
    assert _header(seen, "Authorization") == ["Bearer " + support.TEST_TOKEN]


def test_header_values_never_appear_in_logs_repr_or_refusals(proxy: AuthProxy, upstream: support.Upstream,
                                                             log_guard) -> None:
    log_guard.watch(SANDBOX_TOKEN)
    base = proxy.mount(upstream.url, support.TEST_TOKEN, headers={"X-Sandbox-Token": SANDBOX_TOKEN})
    _echo(base, "/x")
    route = proxy._routes[base.rsplit("/", 1)[1]]
    assert SANDBOX_TOKEN not in repr(route) and "headers=set" in repr(route)
    assert SANDBOX_TOKEN not in repr(proxy)
    # A callable that starts answering garbage: the request is refused (502) without the value.
    bad = proxy.mount(upstream.url, support.TEST_TOKEN, headers=lambda: {"X-Sandbox-Token": SANDBOX_TOKEN + "\r\nX: y"})
    answer = requests.get(bad + "/x", timeout=10)
    assert answer.status_code == 502 and answer.headers["X-Proxy-Error"] == "headers-unavailable"
    assert SANDBOX_TOKEN not in answer.text
    assert "headers callable failed" in log_guard.text()


_NOT_PRINTABLE = ("headers: the value of X-Sandbox-Token is not a string of printable ASCII (the value is "
                  "not shown)")
_SET_BY_PROXY = "headers: %s is set by the proxy itself (framing, host or hop-by-hop); leave it out"


@pytest.mark.parametrize("headers, refusal", [
    ("X-Sandbox-Token: x", "headers must be a mapping of header names to values, a zero-argument callable "
                           "returning one, or None; got str"),
    ({"Bad Name": "x"}, "headers: 'Bad Name' is not a valid HTTP header name"),
    ({7: "x"}, "headers: 'int' is not a valid HTTP header name"),
    ({"Host": "elsewhere"}, _SET_BY_PROXY % "Host"),
    ({"Transfer-Encoding": "chunked"}, _SET_BY_PROXY % "Transfer-Encoding"),
    ({"Authorization": "Bearer other"},
     "headers: Authorization conflicts with the route's token; pass token=None to send your own"),
    ({"X-Sandbox-Token": SANDBOX_TOKEN + "\n"}, _NOT_PRINTABLE),
    ({"X-Sandbox-Token": SANDBOX_TOKEN + "\r"}, _NOT_PRINTABLE),
    ({"X-Sandbox-Token": SANDBOX_TOKEN + "\x01"}, _NOT_PRINTABLE),
    ({"X-Sandbox-Token": SANDBOX_TOKEN + "\u00e9"}, _NOT_PRINTABLE),
    ({"X-Sandbox-Token": 7}, _NOT_PRINTABLE),
])
def test_bad_route_headers_are_refused_at_mount_naming_the_header_but_never_its_value(
        proxy: AuthProxy, upstream: support.Upstream, headers: object, refusal: str) -> None:
    with pytest.raises(ValueError) as caught:
        proxy.mount(upstream.url, support.TEST_TOKEN, headers=headers)  # type: ignore[arg-type]
    assert str(caught.value) == refusal


def _handshakes(up: support.Upstream) -> int:
    return up._server.tls.session_stats()["accept_good"]  # type: ignore[union-attr]


def test_many_routes_to_one_tls_host_share_its_connections_one_handshake_each(
        proxy: AuthProxy, test_ca: support.TestCA, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "POOL_IDLE_S", 300.0)  # a loaded machine's pauses must not expire them
    with support.Upstream(tls=test_ca) as up:
        bases = [proxy.mount(up.url + "/v1/sandboxes/sb-%d/proxy/8000" % i, support.TEST_TOKEN,
                             verify=test_ca.ca_path, headers={"X-Sandbox-Token": "sbx-%d" % i}) for i in range(8)]
        for _ in range(3):
            for i, base in enumerate(bases):
                seen = _echo(base, "/step")
                assert seen["target"] == "/v1/sandboxes/sb-%d/proxy/8000/step" % i
                assert _header(seen, "X-Sandbox-Token") == ["sbx-%d" % i]
        # 24 sequential requests through 8 routes: one connection, one handshake.
        assert up.connections == 1
        assert _handshakes(up) == up.connections
        # Concurrent requests open more connections, still one handshake per connection. The upstream holds
        # each until all 4 have arrived, which needs its own "/slow" path: a route of the same host without a
        # prefix (a prefixed "/slow" was echoed at once, so whether the 4 overlapped was up to the machine's load).
        plain = proxy.mount(up.url, support.TEST_TOKEN, verify=test_ca.ca_path)
        errors, arrived = [], len(up.requests)

        def burst(base: str) -> None:
            try:
                _echo(base, "/slow?s=30&gate=1")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=burst, args=(plain,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        support.wait_until(lambda: len(up.requests) - arrived >= 4, "the 4 requests held at the upstream at once", 30)
        up.gate.set()
        for thread in threads:
            thread.join(30)
        assert not errors
        assert up.connections == 4  # the pooled one and 3 new (each request waits while it is held)
        assert _handshakes(up) == up.connections


def test_unmounting_one_route_keeps_the_hosts_connections_for_the_others_and_the_last_closes_them(
        proxy: AuthProxy, test_ca: support.TestCA, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "POOL_IDLE_S", 300.0)
    with support.Upstream(tls=test_ca) as up:
        first = proxy.mount(up.url + "/a", support.TEST_TOKEN, verify=test_ca.ca_path)
        second = proxy.mount(up.url + "/b", support.TEST_TOKEN, verify=test_ca.ca_path)
        _echo(first, "/x")
        assert proxy.unmount(first)
        assert requests.get(first + "/x", timeout=10).status_code == 404
        assert _echo(second, "/x")["target"] == "/b/x"
        assert up.connections == 1  # the pooled connection outlived the first route
        assert proxy.unmount(second)
        support.wait_until(lambda: not up._server.live, "the host's pooled connection to close", 10)
        # A new route to the same host starts a new pool (and connection).
        third = proxy.mount(up.url + "/c", support.TEST_TOKEN, verify=test_ca.ca_path)
        assert _echo(third, "/x")["target"] == "/c/x"
        assert up.connections == 2


def test_sandboxes_that_come_and_go_on_one_host_reuse_its_one_connection(
        proxy: AuthProxy, test_ca: support.TestCA, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trainer restarting environments on one host: each route does its request and is unmounted at once.
    # The connection must be back in the host's pool before the client has its answer, and a closed route's
    # finished connection must stay there for the others (under load, a late check-in once closed it).
    monkeypatch.setattr(proxy_module, "POOL_IDLE_S", 300.0)
    with support.Upstream(tls=test_ca) as up:
        keep = proxy.mount(up.url + "/keep", support.TEST_TOKEN, verify=test_ca.ca_path)
        with requests.Session() as client:
            assert client.get(keep + "/x", timeout=10).status_code == 200
            for number in range(100):
                route = proxy.mount(up.url + "/r%d" % number, support.TEST_TOKEN, verify=test_ca.ca_path)
                assert client.get(route + "/x", timeout=10).status_code == 200
                assert proxy.unmount(route)
        assert up.connections == 1 and _handshakes(up) == 1


@pytest.mark.slow  # 8 s of churn: the race it guards took about that long to show
def test_routes_unmounted_mid_request_never_fail_a_neighbours_step_on_the_shared_host_pool(
        proxy: AuthProxy, upstream: support.Upstream) -> None:
    # unmount() aborts the connections its route has in flight. One that finished meanwhile went back to
    # the host's pool, a neighbour took it for its POST /step, and the abort cut that step: 502 after the
    # upstream had run it (about once per 8 s of this churn). A closing route's connections are not pooled.
    failures: list = []
    deadline = time.monotonic() + 8.0

    def neighbour() -> None:
        with requests.Session() as session:
            while time.monotonic() < deadline:
                answer = session.post(neighbour_url + "/step", data=b"x", timeout=10)
                if answer.status_code != 200:
                    failures.append((answer.status_code, answer.headers.get("X-Proxy-Error")))

    def churn() -> None:
        while time.monotonic() < deadline:
            route = proxy.mount(upstream.url, support.TEST_TOKEN)
            clients = [threading.Thread(target=_get_quietly, args=(route,)) for _ in range(4)]
            for client in clients:
                client.start()
            time.sleep(0.002)
            proxy.unmount(route)
            for client in clients:
                client.join(10)

    neighbour_url = proxy.mount(upstream.url, support.TEST_TOKEN)
    threads = [threading.Thread(target=neighbour) for _ in range(4)] + [threading.Thread(target=churn)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failures == []


def _get_quietly(base: str) -> None:
    """A few GETs on a route being unmounted: each may be answered, cut or refused."""
    with requests.Session() as session:
        for _ in range(5):
            with contextlib.suppress(requests.RequestException):
                session.get(base + "/x", timeout=10)


def test_unmount_aborts_only_that_routes_websocket_sessions(proxy: AuthProxy, upstream: support.Upstream) -> None:
    first = proxy.mount(upstream.url + "/a", support.TEST_TOKEN)
    second = proxy.mount(upstream.url + "/b", support.TEST_TOKEN)
    with support.ws_connect(support.ws_url(first) + "/ws") as ws_a, \
            support.ws_connect(support.ws_url(second) + "/ws") as ws_b:
        proxy.unmount(first)
        with pytest.raises(ConnectionClosed):
            ws_a.send("after unmount")
            ws_a.recv(timeout=10)
        ws_b.send("still here")
        assert ws_b.recv(timeout=10) == "still here"


def test_routes_with_different_verify_settings_do_not_share_a_pool(proxy: AuthProxy, test_ca: support.TestCA) -> None:
    with support.Upstream(tls=test_ca) as up:
        strict = proxy.mount(up.url + "/a", support.TEST_TOKEN, verify=test_ca.ca_path)
        lax = proxy.mount(up.url + "/b", support.TEST_TOKEN, verify=False)
        _echo(strict, "/x")
        _echo(lax, "/x")
        assert up.connections == 2
        assert json.dumps(_echo(strict, "/x")["target"]) == '"/a/x"'
