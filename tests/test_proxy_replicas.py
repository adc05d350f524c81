"""AuthProxy replica routes: one route id in front of several upstreams; plus prompt stop() and
refusals without X-Proxy-Error."""
from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from typing import Callable, Iterator, List

import pytest
import requests
from websockets.exceptions import ConnectionClosed, InvalidStatus

from support import TEST_TOKEN, Upstream, ws_connect, ws_url
from proxy import AuthProxy, InsecureURLError, Refusal, ReplicaRoute

TIMEOUT = 10


@contextlib.contextmanager
def dead_port() -> Iterator[str]:
    """A loopback URL whose port is bound but not listening: connections are refused, and nothing
    else can take the port while the test runs."""
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        yield "http://127.0.0.1:%d" % placeholder.getsockname()[1]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll a condition that another thread makes true (a tunnel ending); fail after TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for " + what)
        time.sleep(0.02)


def upgrades_seen(upstream: Upstream) -> List[str]:
    """Targets of the WebSocket upgrades this upstream received."""
    return [seen.target for seen in upstream.requests
            if any(k.lower() == "upgrade" and "websocket" in v.lower() for k, v in seen.headers)]


def sessions_per_replica(proxy: AuthProxy, base: str) -> List[int]:
    return [int(r["open_sessions"]) for r in proxy.replica_status(base)]  # type: ignore[call-overload]


def upgrade_status(base: str, path: str = "/ws") -> requests.Response:
    """Send a WebSocket upgrade with requests (which just reads the non-101 answer)."""
    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    return requests.get(base + path, headers=headers, timeout=TIMEOUT)


@pytest.fixture
def three() -> Iterator[List[Upstream]]:
    with Upstream() as a, Upstream() as b, Upstream() as c:
        yield [a, b, c]


# -- placement ----------------------------------------------------------------------------------------


def test_new_sessions_go_to_the_replica_with_fewest_open_sessions(three):
    with AuthProxy() as proxy, contextlib.ExitStack() as stack:
        base = proxy.mount_replicas([u.url for u in three], TEST_TOKEN)
        sessions = {}
        for i in range(6):  # ties everywhere: round robin spreads them 2/2/2
            ws = stack.enter_context(ws_connect(ws_url(base) + "/ws?s=%d" % i))
            ws.send("hello %d" % i)
            assert ws.recv(TIMEOUT) == "hello %d" % i
            sessions[i] = ws
        assert sessions_per_replica(proxy, base) == [2, 2, 2]
        assert [len(upgrades_seen(u)) for u in three] == [2, 2, 2]
        # End both sessions held by the first replica: it becomes the least busy one.
        on_first = [int(t.rsplit("=", 1)[1]) for t in upgrades_seen(three[0])]
        for i in on_first:
            sessions[i].close()
        wait_until(lambda: sessions_per_replica(proxy, base) == [0, 2, 2], "the closed sessions to be released")
        for i in (6, 7):
            ws = stack.enter_context(ws_connect(ws_url(base) + "/ws?s=%d" % i))
            ws.send("again")
            assert ws.recv(TIMEOUT) == "again"
        assert upgrades_seen(three[0])[-2:] == ["/ws?s=6", "/ws?s=7"]
        assert sessions_per_replica(proxy, base) == [2, 2, 2]
        assert all(seen.headers.count(("Authorization", "Bearer " + TEST_TOKEN)) == 1
                   for u in three for seen in u.requests)


def test_replicas_over_tls_use_the_route_verify_setting(test_ca):
    with Upstream(tls=test_ca) as a, Upstream(tls=test_ca) as b, AuthProxy() as proxy:
        base = proxy.mount_replicas([a.url, b.url], TEST_TOKEN, verify=test_ca.ca_path)
        for _ in range(2):
            with ws_connect(ws_url(base) + "/ws") as ws:
                ws.send("over tls")
                assert ws.recv(TIMEOUT) == "over tls"
        assert [len(upgrades_seen(u)) for u in (a, b)] == [1, 1]


# -- failures -----------------------------------------------------------------------------------------


def test_a_dead_replica_is_taken_out_and_the_session_retried_on_a_live_one(upstream, log_guard):
    with dead_port() as dead, AuthProxy() as proxy:
        base = proxy.mount_replicas([dead, upstream.url], TEST_TOKEN)  # round robin starts at the dead one
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("retried")
            assert ws.recv(TIMEOUT) == "retried"
            status = proxy.replica_status(base)
        assert status[0]["upstream"] == dead and status[0]["healthy"] is False
        assert "upstream-unreachable" in str(status[0]["reason"])
        assert status[1] == {"upstream": upstream.url, "open_sessions": 1, "healthy": True, "reason": None}
        for _ in range(3):  # out of rotation: never tried again
            with ws_connect(ws_url(base) + "/ws") as ws:
                ws.send("x")
                assert ws.recv(TIMEOUT) == "x"
        assert len(upgrades_seen(upstream)) == 4
        warnings = [line for line in log_guard.text().splitlines() if " WARNING " in line]
        assert sum("taken out of rotation" in line for line in warnings) == 1
        route_id = base.rsplit("/", 1)[1]
        assert not any(route_id in line for line in warnings)


def test_a_replica_answering_503_to_the_upgrade_is_taken_out_and_the_session_retried(upstream):
    with AuthProxy() as proxy:
        stopped = upstream.url + "/ws-status/503"  # a job proxy that says the job is gone
        base = proxy.mount_replicas([stopped, upstream.url], TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("fine")
            assert ws.recv(TIMEOUT) == "fine"
        status = proxy.replica_status(base)
    assert (status[0]["healthy"], status[0]["reason"]) == (False, "answered 503 to the WebSocket upgrade")
    assert status[1]["healthy"] is True


def test_an_environment_refusing_the_upgrade_is_relayed_not_treated_as_a_dead_replica(upstream):
    with AuthProxy() as proxy:
        base = proxy.mount_replicas([upstream.url, upstream.url + "/"], TEST_TOKEN)
        with pytest.raises(InvalidStatus) as info:
            with ws_connect(ws_url(base) + "/ws-reject"):
                pass  # pragma: no cover
        assert info.value.response.status_code == 403
        assert "X-Proxy-Error" not in info.value.response.headers
        assert all(r["healthy"] for r in proxy.replica_status(base))


def test_all_replicas_dead_answers_502_no_live_replica_naming_each_failure(test_ca):
    with dead_port() as dead, Upstream(tls=test_ca) as untrusted, AuthProxy() as proxy:
        base = proxy.mount_replicas([dead, untrusted.url], TEST_TOKEN, verify=True)  # test CA not trusted
        first = upgrade_status(base)
        again = upgrade_status(base)  # nothing left to try: answered without contacting anyone
    for answer in (first, again):
        assert answer.status_code == 502
        assert answer.headers["X-Proxy-Error"] == "no-live-replica"
        body = answer.json()
        assert body["error"] == "no-live-replica" and body["replicas"] == 2
        assert [f["replica"] for f in body["failed"]] == [1, 2]
        assert "2 of 2 replicas failed" in body["message"]
    reasons = [f["reason"] for f in first.json()["failed"]]
    assert reasons[0].startswith("upstream-unreachable") and reasons[1].startswith("upstream-tls")
    assert TEST_TOKEN not in first.text


def test_two_failures_in_a_row_with_replicas_left_answer_the_last_failure(upstream):
    with dead_port() as dead_a, dead_port() as dead_b, AuthProxy() as proxy:
        base = proxy.mount_replicas([dead_a, dead_b, upstream.url], TEST_TOKEN)
        answer = upgrade_status(base)  # tries dead_a, retries once on dead_b, stops there
        assert answer.status_code == 502 and answer.headers["X-Proxy-Error"] == "upstream-unreachable"
        with ws_connect(ws_url(base) + "/ws") as ws:  # the next session finds the live one
            ws.send("ok")
            assert ws.recv(TIMEOUT) == "ok"
        assert [r["healthy"] for r in proxy.replica_status(base)] == [False, False, True]


def test_a_replica_dying_mid_session_ends_only_its_own_sessions():
    with Upstream() as doomed, Upstream() as survivor, AuthProxy() as proxy:
        base = proxy.mount_replicas([doomed.url, survivor.url], TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as on_doomed, ws_connect(ws_url(base) + "/ws") as on_survivor:
            assert [len(upgrades_seen(u)) for u in (doomed, survivor)] == [1, 1]
            doomed.stop()
            with pytest.raises(ConnectionClosed):
                on_doomed.recv(TIMEOUT)
            on_survivor.send("still here")
            assert on_survivor.recv(TIMEOUT) == "still here"
            wait_until(lambda: sessions_per_replica(proxy, base) == [0, 1], "the dead session to be released")
        # The next session that lands on the dead replica takes it out and is retried on the survivor.
        with ws_connect(ws_url(base) + "/ws") as ws:
            ws.send("after")
            assert ws.recv(TIMEOUT) == "after"
        assert [r["healthy"] for r in proxy.replica_status(base)] == [False, True]


def test_add_replica_readmits_a_failed_one_and_remove_replica_ends_its_sessions():
    with Upstream() as a, Upstream() as b, AuthProxy() as proxy:
        base = proxy.mount_replicas([a.url + "/ws-status/502"], TEST_TOKEN)
        assert upgrade_status(base).headers["X-Proxy-Error"] == "no-live-replica"
        assert proxy.add_replica(base, a.url + "/ws-status/502") is True  # back in rotation
        assert proxy.replica_status(base)[0]["healthy"] is True
        assert proxy.remove_replica(base, a.url + "/ws-status/502") is True
        assert proxy.remove_replica(base, a.url + "/ws-status/502") is False
        assert upgrade_status(base).json()["replicas"] == 0
        assert proxy.add_replica(base, a.url) is True
        assert proxy.add_replica(base, a.url) is False  # already live
        assert proxy.add_replica(base, b.url) is True
        with ws_connect(ws_url(base) + "/ws?s=0") as zero, ws_connect(ws_url(base) + "/ws?s=1") as one:
            on_a = [t for t in upgrades_seen(a) if t.startswith("/ws?s=")]
            on_b = [t for t in upgrades_seen(b) if t.startswith("/ws?s=")]
            assert sorted(on_a + on_b) == ["/ws?s=0", "/ws?s=1"] and len(on_a) == 1
            doomed, kept = (zero, one) if on_a == ["/ws?s=0"] else (one, zero)
            assert proxy.remove_replica(base, a.url) is True
            with pytest.raises(ConnectionClosed):
                doomed.recv(TIMEOUT)
            kept.send("b stays")
            assert kept.recv(TIMEOUT) == "b stays"
        assert [r["upstream"] for r in proxy.replica_status(base)] == [b.url]


# -- HTTP on a replica route ---------------------------------------------------------------------------


def test_concurrent_adds_of_one_new_upstream_add_it_once():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch at almost every bytecode: the race shows if it is there
    try:
        _add_one_new_upstream_from_eight_threads_at_once()
    finally:
        sys.setswitchinterval(previous)


def _add_one_new_upstream_from_eight_threads_at_once() -> None:
    with AuthProxy() as proxy:
        base_url = proxy.mount_replicas(["http://127.0.0.1:1"], TEST_TOKEN)
        for port in range(2, 22):  # a fresh URL each round: the race is in adding a new one
            url, results = "http://127.0.0.1:%d" % port, []
            start = threading.Barrier(8)

            def add() -> None:
                start.wait()
                results.append(proxy.add_replica(base_url, url))

            threads = [threading.Thread(target=add) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            assert sorted(results) == [False] * 7 + [True]
            assert [r["upstream"] for r in proxy.replica_status(base_url)].count(url) == 1


def test_stateful_http_is_refused_with_409_and_stateless_gets_are_forwarded(three):
    with AuthProxy() as proxy:
        base = proxy.mount_replicas([u.url for u in three], TEST_TOKEN)
        for method, path in (("POST", "/reset"), ("POST", "/step"), ("GET", "/state"), ("POST", "/health")):
            answer = requests.request(method, base + path, json={"action": {}}, timeout=TIMEOUT)
            assert answer.status_code == 409, (method, path)
            assert answer.headers["X-Proxy-Error"] == "replicated-http-refused"
            assert "/ws" in answer.json()["message"] and "single job" in answer.json()["message"]
        assert not any(u.requests for u in three)  # refused without contacting any replica
        for path in ("/health", "/metadata", "/schema?x=1"):
            answer = requests.get(base + path, timeout=TIMEOUT)
            assert answer.status_code == 200 and answer.json()["target"] == path
            assert "X-Proxy-Error" not in answer.headers
        assert sum(len(u.requests) for u in three) == 3


def test_http_any_forwards_every_request_to_a_live_replica(upstream):
    with dead_port() as dead, AuthProxy() as proxy:
        base = proxy.mount_replicas([upstream.url], TEST_TOKEN, http="any")
        answer = requests.post(base + "/reset", json={"seed": 1}, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.json()["target"] == "/reset"
        assert ("Authorization", "Bearer " + TEST_TOKEN) in upstream.requests[-1].headers
        proxy.remove_replica(base, upstream.url)
        proxy.add_replica(base, dead)
        assert upgrade_status(base).status_code == 502  # the dead one is now out of rotation
        answer = requests.get(base + "/health", timeout=TIMEOUT)
        assert answer.status_code == 502 and answer.headers["X-Proxy-Error"] == "no-live-replica"


# -- lifecycle and inputs ------------------------------------------------------------------------------


def test_unmount_closes_every_replica_session_and_forgets_the_route(three, no_leaks):
    with AuthProxy() as proxy:
        base = proxy.mount_replicas([u.url for u in three], TEST_TOKEN)
        with contextlib.ExitStack() as stack:
            sessions = [stack.enter_context(ws_connect(ws_url(base) + "/ws")) for _ in range(3)]
            assert proxy.unmount(base) is True
            for ws in sessions:
                with pytest.raises(ConnectionClosed):
                    ws.recv(TIMEOUT)
        assert proxy.unmount(base) is False
        assert requests.get(base + "/health", timeout=TIMEOUT).status_code == 404
        with pytest.raises(ValueError, match="no route is mounted"):
            proxy.replica_status(base)


def test_stop_with_open_replica_sessions_leaves_no_thread_or_fd(no_leaks):
    with Upstream() as a, Upstream() as b:
        proxy = AuthProxy().start()
        base = proxy.mount_replicas([a.url, b.url], TEST_TOKEN)
        with ws_connect(ws_url(base) + "/ws") as one, ws_connect(ws_url(base) + "/ws") as two:
            one.send("x")
            assert one.recv(TIMEOUT) == "x"
            proxy.stop()
            for ws in (one, two):
                with pytest.raises(ConnectionClosed):
                    ws.recv(TIMEOUT)


def test_bad_replica_inputs_are_refused_with_what_to_do(upstream):
    with AuthProxy() as proxy:
        with pytest.raises(ValueError, match="list of job URLs"):
            proxy.mount_replicas(upstream.url, TEST_TOKEN)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="empty"):
            proxy.mount_replicas([], TEST_TOKEN)
        with pytest.raises(ValueError, match="same URL twice"):
            proxy.mount_replicas([upstream.url, upstream.url], TEST_TOKEN)
        with pytest.raises(ValueError, match="http must be 'refuse'"):
            proxy.mount_replicas([upstream.url], TEST_TOKEN, http="stateless")
        with pytest.raises(InsecureURLError):
            proxy.mount_replicas([upstream.url, "http://example.com"], TEST_TOKEN)
        with pytest.raises(ValueError, match="token"):
            proxy.mount_replicas([upstream.url], "")
        single = proxy.mount(upstream.url, TEST_TOKEN)
        with pytest.raises(ValueError, match="single upstream"):
            proxy.add_replica(single, upstream.url)
        base = proxy.mount_replicas([upstream.url], TEST_TOKEN)
        with pytest.raises(ValueError, match="https://"):
            proxy.add_replica(base, "ftp://example.com")
        assert TEST_TOKEN not in repr(proxy._routes[base.rsplit("/", 1)[1]])
    with pytest.raises(RuntimeError, match="start"):
        proxy.mount_replicas([upstream.url], TEST_TOKEN)


def test_a_route_request_hook_may_return_a_replica_route(upstream):
    replicas = ReplicaRoute([upstream.url], TEST_TOKEN)

    class Fixed(AuthProxy):
        def route_request(self, target, headers):  # type: ignore[no-untyped-def]
            return replicas, target

    with Fixed() as proxy:
        with ws_connect(ws_url(proxy.url) + "/ws") as ws:
            ws.send("via hook")
            assert ws.recv(TIMEOUT) == "via hook"
            assert replicas.status()[0]["open_sessions"] == 1
        assert requests.post(proxy.url + "/step", timeout=TIMEOUT).status_code == 409


# -- small fixes: client hang-up during the upgrade, prompt stop, refusals without X-Proxy-Error --------


@pytest.mark.parametrize("replicated", [False, True], ids=["single", "replicas"])
def test_client_hanging_up_during_the_upgrade_ends_the_upstream_attempt(replicated):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        silent.settimeout(TIMEOUT)
        with AuthProxy() as proxy:
            url = "http://127.0.0.1:%d" % silent.getsockname()[1]
            base = proxy.mount_replicas([url], TEST_TOKEN) if replicated else proxy.mount(url, TEST_TOKEN)
            route_path = base.split("/", 3)[3]
            client = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT)
            client.sendall(("GET /%s/ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
                            % route_path).encode())
            conn, _ = silent.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(4096)
                assert head.startswith(b"GET /ws HTTP/1.1")
                client.close()  # the trainer gave up
                assert conn.recv(4096) == b""  # so the proxy ended its upstream attempt
            if replicated:
                assert proxy.replica_status(base)[0]["healthy"] is True  # a client leaving says nothing about the job
                wait_until(lambda: sessions_per_replica(proxy, base) == [0], "the abandoned slot to be released")


def test_stop_returns_with_the_listener_ended_and_the_port_closed(no_leaks):
    proxies = [AuthProxy().start() for _ in range(5)]
    ports = [p.port for p in proxies]
    for proxy in proxies:
        listener = proxy._serve_thread
        proxy.stop()
        assert listener is not None and not listener.is_alive()
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()


def test_stop_from_another_thread_while_serving_requests(upstream, no_leaks):
    proxy = AuthProxy().start()
    base = proxy.mount(upstream.url, TEST_TOKEN)
    assert requests.get(base + "/x", timeout=TIMEOUT).status_code == 200
    stopper = threading.Thread(target=proxy.stop)
    stopper.start()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    with pytest.raises(requests.ConnectionError):
        requests.get(base + "/x", timeout=TIMEOUT)


def test_a_refusal_may_leave_out_x_proxy_error(upstream):
    class Gate(AuthProxy):
        def route_request(self, target, headers):  # type: ignore[no-untyped-def]
            if target == "/open":
                return Refusal(401, "unauthorized", "no token", (("WWW-Authenticate", "Bearer"),))
            return Refusal(401, "unauthorized", "no token", (("WWW-Authenticate", "Bearer"),), proxy_error=False)

    with Gate() as proxy:
        plain = requests.get(proxy.url + "/anything", timeout=TIMEOUT)
        marked = requests.get(proxy.url + "/open", timeout=TIMEOUT)
    assert plain.status_code == 401 and "X-Proxy-Error" not in plain.headers
    assert plain.headers["WWW-Authenticate"] == "Bearer" and plain.json()["message"] == "no token"
    assert marked.headers["X-Proxy-Error"] == "unauthorized"
