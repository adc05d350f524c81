"""The out-of-process proxy host (`AuthProxy.spawn()`, `HFSandboxProvider(proxy="process")`) against
real peers: uvicorn upstreams in their own processes (plain and TLS), `requests` and `websockets`
clients, the HF Jobs emulator, real child processes and real signals. Nothing is mocked: each test
reads the child through /proc or through what its clients see.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Iterator, List, Mapping

import pytest
import requests

import hf_sandbox_provider as hsp
import proxy as proxy_module
import support
from diff_clients import UpstreamProcess, start_upstreams
from hf_jobs_emulator import echo_server_command
from proxy import AuthProxy, InsecureURLError
import proxy_host
from proxy_host import AuthProxyProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; signals as on Linux")

TOKEN = support.TEST_TOKEN
IMAGE = "registry.hf.space/openenv-echo-env:latest"
TIMEOUT = 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ups(test_ca: support.TestCA) -> Iterator[Dict[str, UpstreamProcess]]:
    """uvicorn upstreams, each in its own process: the token-checking ASGI app (plain and TLS) and the
    pressure app (stalls on demand, no token check)."""
    started = start_upstreams([("plain", "asgi_app.py", False, ()), ("tls", "asgi_app.py", True, ()),
                               ("pressure", "pressure_app.py", False, ())],
                              TOKEN, (test_ca.cert_path, test_ca.key_path))
    yield started
    for up in started.values():
        up.stop()


@pytest.fixture
def host() -> Iterator[AuthProxyProcess]:
    with AuthProxy.spawn() as spawned:
        yield spawned


def resource_hard_files() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie its new parent has not reaped yet)."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _read_proc(pid: int, name: str) -> bytes:
    with open("/proc/%d/%s" % (pid, name), "rb") as handle:
        return handle.read()


# -- relaying: HTTP, WebSocket, TLS ------------------------------------------------------------------


def test_http_through_the_child_reaches_uvicorn_with_the_token_and_answers_like_directly(host, ups):
    base = host.mount(ups["plain"].url, TOKEN)
    assert base.startswith(host.url + "/") and host.port != 0
    with requests.Session() as http:
        for target in ("/r?size=100", "/r?size=70000&mode=chunked", "/r?status=418&size=5"):
            via = http.post(base + target, data=b"x" * 1000, timeout=TIMEOUT)
            direct = requests.post(ups["plain"].url + target, data=b"x" * 1000, timeout=TIMEOUT,
                                   headers={"Authorization": "Bearer " + TOKEN})
            assert (via.status_code, via.content) == (direct.status_code, direct.content), target
            assert via.headers["X-Echo-Body-Sha"] == direct.headers["X-Echo-Body-Sha"]
            assert "X-Proxy-Error" not in via.headers


def test_websocket_session_through_the_child_echoes_text_and_binary(host, ups):
    base = host.mount(ups["plain"].url, TOKEN)
    with support.ws_connect(support.ws_url(base) + "/ws") as ws:
        ws.send("hello")
        assert ws.recv(timeout=TIMEOUT) == "hello"
        ws.send(b"\x00\x01" * 5000)
        assert ws.recv(timeout=TIMEOUT) == b"\x00\x01" * 5000


def test_tls_upstream_with_a_relative_ca_bundle_path_works_after_the_parent_changes_directory(
        host, ups, test_ca, monkeypatch):
    # The child resolves the CA path itself: a relative one must mean what it meant to the caller.
    monkeypatch.chdir(os.path.dirname(test_ca.ca_path))
    base = host.mount(ups["tls"].url, TOKEN, verify=os.path.basename(test_ca.ca_path))
    monkeypatch.chdir(ROOT)
    assert requests.get(base + "/r?size=10", timeout=TIMEOUT).status_code == 200
    with support.ws_connect(support.ws_url(base) + "/ws") as ws:
        ws.send("over tls")
        assert ws.recv(timeout=TIMEOUT) == "over tls"
    unverified = host.mount(ups["tls"].url, TOKEN)  # verify=True: the test CA is not in the system store
    failed = requests.get(unverified + "/r", timeout=TIMEOUT)
    assert (failed.status_code, failed.headers.get("X-Proxy-Error")) == (502, "upstream-tls")


def test_the_child_resolves_localhost_subdomains_to_loopback(host, ups):
    # RFC 6761 names (the TLS emulator's *.jobs.localhost): glibc does not resolve them; a route
    # dials them as localhost, in the child as in-process.
    base = host.mount(ups["plain"].url.replace("127.0.0.1", "env-7.localhost"), TOKEN)
    assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 200


def test_infrastructure_failures_come_back_as_502_and_504_with_x_proxy_error(ups):
    with AuthProxy.spawn(read_timeout_s=0.5) as host:
        refused = requests.get(host.mount("http://127.0.0.1:1", TOKEN) + "/r", timeout=TIMEOUT)
        slow = requests.get(host.mount(ups["pressure"].url, "t") + "/r?wait_s=5", timeout=TIMEOUT)
    assert (refused.status_code, refused.headers.get("X-Proxy-Error")) == (502, "upstream-unreachable")
    assert (slow.status_code, slow.headers.get("X-Proxy-Error")) == (504, "upstream-timeout")
    assert slow.json()["error"] == "upstream-timeout"


def test_replica_routes_are_served_by_the_child(host, ups):
    direct = ups["plain"]
    twins = [direct.url, direct.url.replace("127.0.0.1", "localhost")]
    base = host.mount_replicas(twins, TOKEN)
    with support.ws_connect(support.ws_url(base) + "/ws") as ws:
        ws.send("one")
        assert ws.recv(timeout=TIMEOUT) == "one"
        assert sorted(r["open_sessions"] for r in host.replica_status(base)) == [0, 1]
    assert host.remove_replica(base, twins[1]) is True
    assert [r["upstream"] for r in host.replica_status(base)] == twins[:1]
    assert host.add_replica(base, twins[1]) is True
    assert host.unmount(base) is True
    with pytest.raises(ValueError, match="no route is mounted at that base URL"):
        host.replica_status(base)


def test_threads_mounting_at_once_each_get_their_own_working_route(host, ups):
    urls: List[str] = []
    lock = threading.Lock()

    def mount_one() -> None:
        url = host.mount(ups["plain"].url, TOKEN)
        with lock:
            urls.append(url)

    threads = [threading.Thread(target=mount_one) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(set(urls)) == 16
    with requests.Session() as http:
        assert {http.get(url + "/r", timeout=TIMEOUT).status_code for url in urls} == {200}
    assert all(host.unmount(url) for url in urls)


# -- same refusals as in-process ----------------------------------------------------------------------


@pytest.mark.parametrize("upstream, token, verify, headers, kind", [
    ("http://example.com:8000", TOKEN, True, None, InsecureURLError),
    ("ftp://127.0.0.1", TOKEN, True, None, ValueError),
    ("http://127.0.0.1:9", "has space", True, None, ValueError),
    ("http://127.0.0.1:9", TOKEN, "/no/such/ca.pem", None, ValueError),
    ("http://127.0.0.1:9", TOKEN, True, {"Authorization": "x"}, ValueError),
    ("http://127.0.0.1:9", TOKEN, True, {"X-Ok": "line\nbreak"}, ValueError),
])
def test_mount_refusals_are_the_in_process_types_and_messages(host, proxy, upstream, token, verify, headers, kind):
    with pytest.raises(kind) as in_process:
        proxy.mount(upstream, token, verify=verify, headers=headers)
    with pytest.raises(kind) as hosted:
        host.mount(upstream, token, verify=verify, headers=headers)
    assert type(hosted.value) is type(in_process.value) and str(hosted.value) == str(in_process.value)


def test_spawn_refuses_bad_settings_and_a_taken_port_like_start(proxy):
    with pytest.raises(ValueError, match="read_timeout_s must be a positive number"):
        AuthProxy.spawn(read_timeout_s=0)
    with pytest.raises(OSError) as in_process:
        AuthProxy(port=proxy.port).start()
    with pytest.raises(OSError, match="AuthProxy cannot listen on 127.0.0.1:%d" % proxy.port) as spawned:
        AuthProxy.spawn(port=proxy.port)
    assert (spawned.value.errno, str(spawned.value)) == (in_process.value.errno, str(in_process.value))  # once
    # "[Errno 98] [Errno 98] ...": the child's str() was taken for the message


def test_add_replica_refusals_are_the_in_process_messages(host, proxy, ups):
    for bad in (None, 8000):
        messages = []
        for where in (proxy, host):
            base = where.mount_replicas([ups["plain"].url], TOKEN)
            with pytest.raises(ValueError) as refused:
                where.add_replica(base, bad)  # type: ignore[arg-type]
            messages.append(str(refused.value))
        assert messages[0] == messages[1] and "upstream must be a URL string" in messages[0]


@pytest.mark.skipif(not support.ipv6_loopback(), reason="::1 is not configured on this machine")
def test_a_bracketed_ipv6_host_gives_a_url_with_one_pair_of_brackets():
    with AuthProxy.spawn("[::1]") as spawned:
        assert spawned.url == "http://[::1]:%d" % spawned.port and "[[" not in repr(spawned)


def test_unmount_once_the_host_is_stopped_or_its_child_ended_returns_false(ups):
    spawned = AuthProxy.spawn()
    base = spawned.mount(ups["plain"].url, TOKEN)
    os.kill(spawned.pid, signal.SIGTERM)  # a clean end, asked for: not replaced (a SIGKILL is, see below)
    support.wait_until(lambda: not spawned.running, "the child's end to be noticed", 10)
    assert spawned.unmount(base) is False  # its routes died with it: nothing to unmount
    spawned.stop()
    assert spawned.unmount(base) is False and spawned.unmount(base) is False  # as in-process: safe twice


# -- a child that dies on its own is replaced ----------------------------------------------------------


def _killed_and_replaced(spawned: AuthProxyProcess, signum: int = signal.SIGKILL) -> int:
    """Kill the child with `signum` (the OOM killer's SIGKILL, a crash's SIGSEGV); return the new pid."""
    old = spawned.pid
    os.kill(old, signum)
    support.wait_until(lambda: spawned.pid != old and spawned._revival is None, "the child to be replaced", 30)
    assert spawned.running and _gone(old)
    return spawned.pid


def _killed_for_good(spawned: AuthProxyProcess, base: str, upstream: str, caplog, says: str) -> None:
    """Kill the child when the handle will not replace it: it gives up, and its calls raise `says`."""
    with caplog.at_level(logging.WARNING, logger="proxy"):
        os.kill(spawned.pid, signal.SIGKILL)
        support.wait_until(lambda: not spawned.running, "the host to give up", 30)
    with pytest.raises(RuntimeError, match=says):
        spawned.mount(upstream, TOKEN)
    assert spawned.unmount(base) is False


def test_a_killed_child_is_replaced_on_the_same_port_and_every_route_serves_again_under_its_url(ups, caplog):
    current = {"X-Custom": "first"}
    tokens = iter(["wrong-token"] + [TOKEN] * 1000)  # the callable's first read is refused: rotated after
    with AuthProxy.spawn() as spawned, requests.Session() as http:
        port = spawned.port
        plain = spawned.mount(ups["plain"].url, TOKEN, headers={"X-Custom": "fixed"})
        rotating = spawned.mount(ups["plain"].url, lambda: next(tokens), headers=lambda: current)
        replicas = spawned.mount_replicas([ups["plain"].url], TOKEN)
        twin = ups["plain"].url.replace("127.0.0.1", "localhost")
        assert spawned.add_replica(replicas, twin)
        gone = spawned.mount(ups["plain"].url, TOKEN)
        assert spawned.unmount(gone)
        support.wait_until(lambda: http.get(rotating + "/r", timeout=TIMEOUT).status_code == 200,
                           "the rotated token to be used", 10)
        current = {"X-Custom": "second"}
        support.wait_until(lambda: http.get(rotating + "/r", timeout=TIMEOUT).headers["X-Echo-Custom"] == "second",
                           "the rotated header to be sent", 10)
        with caplog.at_level(logging.WARNING, logger="proxy"):
            _killed_and_replaced(spawned)
        assert spawned.port == port and spawned.url in repr(spawned) and "serving" in repr(spawned)
        answer = http.get(plain + "/r", timeout=TIMEOUT)  # a new connection: the old one died with the child
        assert (answer.status_code, answer.headers["X-Echo-Custom"]) == (200, "fixed")
        answer = http.get(rotating + "/r", timeout=TIMEOUT)  # the last values pushed, not the first ones
        assert (answer.status_code, answer.headers["X-Echo-Custom"]) == (200, "second")
        assert http.get(gone + "/r", timeout=TIMEOUT).status_code == 404  # unmounted stays unmounted
        assert [row["upstream"] for row in spawned.replica_status(replicas)] == [ups["plain"].url, twin]
        with support.ws_connect(support.ws_url(replicas) + "/ws") as ws:
            ws.send("after the death")
            assert ws.recv(timeout=TIMEOUT) == "after the death"
        current = {"X-Custom": "third"}  # the pusher goes on with the new child
        support.wait_until(lambda: http.get(rotating + "/r", timeout=TIMEOUT).headers["X-Echo-Custom"] == "third",
                           "the rotated header to reach the new child", 10)
        assert spawned.unmount(plain) and http.get(plain + "/r", timeout=TIMEOUT).status_code == 404
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ended on its own (code -9)" in w and "starting another" in w for w in warnings), warnings
    assert any("3 of its 3 routes serve again" in w for w in warnings), warnings
    assert not any(TOKEN in w for w in warnings)


def test_a_child_that_keeps_dying_is_replaced_at_most_max_revivals_times_then_its_routes_are_gone(ups, caplog):
    with AuthProxy.spawn() as spawned:
        base = spawned.mount(ups["plain"].url, TOKEN)
        for _ in range(proxy_host.MAX_REVIVALS):
            _killed_and_replaced(spawned, signal.SIGSEGV)
        _killed_for_good(spawned, base, ups["plain"].url, caplog, "not serving .*code -9")
        with pytest.raises(requests.ConnectionError):
            requests.get(base + "/r", timeout=TIMEOUT)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("its routes are gone (replaced 3 times" in w for w in warnings), warnings


def _while_replacing(spawned: AuthProxyProcess, action, logged: str = "starting another") -> list:
    """Kill the child and run `action` while its revival is under way, once the record saying `logged` is
    re-emitted; returns [what action returned]."""
    when = support.WhenLogged(logged, action)
    proxy_module.log.addHandler(when)
    try:
        os.kill(spawned.pid, signal.SIGKILL)
        support.wait_until(lambda: when.thread is not None, "the revival to begin", 10)
        when.thread.join(TIMEOUT)
    finally:
        proxy_module.log.removeHandler(when)
    assert not [o for o in when.outcome if isinstance(o, BaseException)], when.outcome
    return when.outcome


def test_a_mount_made_while_the_child_is_replaced_waits_for_the_new_child(ups):
    with AuthProxy.spawn() as spawned:
        spawned.mount(ups["plain"].url, TOKEN)
        old = spawned.pid
        # before: "the proxy host process is not serving (... code -9); spawn a new one"
        (base,) = _while_replacing(spawned, lambda: spawned.mount(ups["plain"].url, TOKEN))
        assert spawned.pid != old and requests.get(base + "/r", timeout=TIMEOUT).status_code == 200


def test_stop_during_a_revival_stops_the_new_child_and_leaves_no_process(ups):
    spawned = AuthProxy.spawn()
    spawned.mount(ups["plain"].url, TOKEN)
    old = spawned.pid
    _while_replacing(spawned, spawned.stop)
    assert not spawned.running and "stopped" in repr(spawned)
    assert spawned.pid == old or _gone(spawned.pid)
    support.wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("proxy-host-")],
                       "the host's threads to end", 10)


def test_a_revival_that_cannot_bind_the_port_again_ends_the_host_and_says_why(ups, caplog):
    spawned = AuthProxy.spawn()
    base = spawned.mount(ups["plain"].url, TOKEN)
    squatter = socket.socket()
    # another process takes the port before the new child binds it
    when = support.WhenLogged("starting another", lambda: (squatter.bind(("127.0.0.1", spawned.port)),
                                                    squatter.listen(1)), inline=True)
    proxy_module.log.addHandler(when)
    try:
        _killed_for_good(spawned, base, ups["plain"].url, caplog,
                         "no new child could take its place .*Address already in use")
    finally:
        proxy_module.log.removeHandler(when)
        spawned.stop()
        squatter.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("no new child could take its place" in e and "its routes are gone" in e for e in errors), errors
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "routes are gone" in w]) == 0, warnings  # said once, by the ERROR
    assert _gone(spawned.pid)


def test_a_replica_route_emptied_by_remove_replica_is_still_mounted_after_a_revival(ups):
    with AuthProxy.spawn() as spawned:
        base = spawned.mount_replicas([ups["plain"].url], TOKEN)
        assert spawned.remove_replica(base, ups["plain"].url)  # a rolling swap: remove the old, add the new
        _killed_and_replaced(spawned)
        answer = requests.get(base + "/health", timeout=TIMEOUT)  # before: 404 unknown-route, the route gone
        assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (502, "no-live-replica")
        assert spawned.add_replica(base, ups["plain"].url) and spawned.replica_status(base)


def test_calls_in_flight_when_the_child_dies_are_answered_by_its_replacement(ups):
    with AuthProxy.spawn() as spawned:
        base = spawned.mount(ups["plain"].url, TOKEN)
        old = spawned.pid
        support.stop_process(old)  # stalled (e.g. memory pressure), then killed: the calls are in flight
        mounting, mounted = support.in_thread(lambda: spawned.mount(ups["plain"].url, TOKEN))
        unmounting, unmounted = support.in_thread(lambda: spawned.unmount(base))
        time.sleep(0.5)
        os.kill(old, signal.SIGKILL)
        mounting.join(TIMEOUT)
        unmounting.join(TIMEOUT)
        # before: both raised "the proxy host process is not serving (... code -9 (SIGKILL))"
        assert unmounted == [True] and isinstance(mounted[0], str), (mounted, unmounted)
        assert spawned.pid != old and requests.get(mounted[0] + "/r", timeout=TIMEOUT).status_code == 200
        assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 404


def test_a_call_that_reaches_the_dead_childs_channel_after_the_revival_closed_it_goes_to_the_new_child(ups):
    with AuthProxy.spawn() as spawned:
        old_pid, old_channel = spawned.pid, spawned._sock
        # the call takes the old channel, then waits its turn to send (another call is sending)
        spawned._send_lock.acquire()
        try:
            mounting, mounted = support.in_thread(lambda: spawned.mount(ups["plain"].url, TOKEN))
            time.sleep(0.2)
            os.kill(old_pid, signal.SIGKILL)
            support.wait_until(lambda: old_channel.fileno() == -1, "the revival to close the old channel", 30)
        finally:
            spawned._send_lock.release()
        mounting.join(TIMEOUT)
        # before: ValueError "file descriptor cannot be a negative integer (-1)", from poll.register
        assert isinstance(mounted[0], str), mounted
        assert spawned.pid != old_pid and requests.get(mounted[0] + "/r", timeout=TIMEOUT).status_code == 200


def test_stop_from_a_handler_of_the_revivals_record_and_from_another_thread_both_end_the_child(ups):
    spawned = AuthProxy.spawn()
    spawned.mount(ups["plain"].url, TOKEN)
    old = spawned.pid
    handler = support.WhenLogged("replaced process", spawned.stop, inline=True)  # on the revival's own thread
    proxy_module.log.addHandler(handler)
    try:
        os.kill(old, signal.SIGKILL)
        support.wait_until(lambda: handler.thread is not None or spawned._stopping, "the stop to begin", 30)
        began = time.monotonic()
        spawned.stop()  # before: returned at once, the new child still serving
        took = time.monotonic() - began
    finally:
        proxy_module.log.removeHandler(handler)
    new = spawned.pid
    assert new != old and _gone(new) and not spawned.running
    assert took < proxy_host.HOST_START_S, took  # before: the handler's stop waited 60 s for its own revival


def test_a_request_that_reaches_the_new_child_before_its_routes_are_mounted_again_waits_for_them(ups):
    # The new child listened at once and mounted the routes one by one: a request arriving meanwhile got 404
    # unknown-route, which a trainer's slot takes for its job's end (it would replace a healthy job).
    with AuthProxy.spawn() as spawned:
        bases = [spawned.mount(ups["plain"].url, TOKEN) for _ in range(200)]
        # the new child logs that it listens before the revival mounts the routes in it
        (answer,) = _while_replacing(spawned, lambda: requests.get(bases[-1] + "/r", timeout=TIMEOUT),
                                     "proxy listening on")
        assert answer.status_code == 200, (answer.status_code, answer.headers.get("X-Proxy-Error"))  # before: 404


def test_a_stop_while_the_revival_mounts_the_routes_again_logs_no_replacement(ups, caplog):
    spawned = AuthProxy.spawn()
    for _ in range(200):
        spawned.mount(ups["plain"].url, TOKEN)
    # the new child logs that it listens before the revival mounts the routes in it
    stopper = support.WhenLogged("proxy listening on", spawned.stop)
    proxy_module.log.addHandler(stopper)
    try:
        with caplog.at_level(logging.INFO, logger="proxy"):
            os.kill(spawned.pid, signal.SIGKILL)
            support.wait_until(lambda: stopper.thread is not None, "the stop to begin", 30)
            stopper.thread.join(TIMEOUT)
    finally:
        proxy_module.log.removeHandler(stopper)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if "serve again" in m or "routes are gone" in m], said  # before: "0 of its 200"
    assert not spawned.running and _gone(spawned.pid)


# -- tokens --------------------------------------------------------------------------------------------


def test_no_token_is_in_the_childs_argv_or_environment(ups, monkeypatch):
    env_token = "hf_parentenvsecret" + "Q7w3"
    monkeypatch.setenv("HF_TOKEN", env_token)
    callable_token = "hf_callablesecret" + "P5x1"
    with AuthProxy.spawn() as host:
        host.mount(ups["plain"].url, TOKEN)
        host.mount(ups["plain"].url, lambda: callable_token)
        cmdline, environ = _read_proc(host.pid, "cmdline"), _read_proc(host.pid, "environ")
        assert b"--proxy-host" in cmdline  # it is the child we think it is
        for secret in (TOKEN, env_token, callable_token):
            assert secret.encode() not in cmdline and secret.encode() not in environ
        assert b"HF_TOKEN" not in environ


def test_a_rotated_callable_token_reaches_the_child(host, ups):
    current = {"token": "hf_stale"}
    base = host.mount(ups["plain"].url, lambda: current["token"])
    with requests.Session() as http:
        assert http.get(base + "/r", timeout=TIMEOUT).status_code == 401  # the upstream refuses the stale one
        current["token"] = TOKEN
        support.wait_until(lambda: http.get(base + "/r", timeout=TIMEOUT).status_code == 200,
                           "the rotated token to be used", 10)


def test_extra_headers_fixed_and_rotating_reach_the_upstream(host, ups):
    fixed = host.mount(ups["plain"].url, TOKEN, headers={"X-Custom": "fixed"})
    current = {"X-Custom": "first"}
    rotating = host.mount(ups["plain"].url, TOKEN, headers=lambda: current)
    with requests.Session() as http:
        assert http.get(fixed + "/r", timeout=TIMEOUT).headers["X-Echo-Custom"] == "fixed"
        assert http.get(rotating + "/r", timeout=TIMEOUT).headers["X-Echo-Custom"] == "first"
        current = {"X-Custom": "second"}  # a new mapping, as a sandbox's headers property returns
        support.wait_until(lambda: http.get(rotating + "/r", timeout=TIMEOUT).headers["X-Echo-Custom"] == "second",
                           "the rotated header to be sent", 10)


def test_a_headers_callable_that_fails_gives_502_headers_unavailable(host, ups):
    answer = requests.get(host.mount(ups["plain"].url, TOKEN, headers=lambda: 42) + "/r", timeout=TIMEOUT)
    assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (502, "headers-unavailable")


def test_a_token_callable_answering_none_gives_502_token_unavailable_as_in_process(host, ups):
    answer = requests.get(host.mount(ups["plain"].url, lambda: None) + "/r", timeout=TIMEOUT)
    assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (502, "token-unavailable")


def test_a_failing_token_callable_gives_502_token_unavailable_and_its_log_line(host, ups, log_guard):
    def broken() -> str:
        raise KeyError("vault down")

    base = host.mount(ups["plain"].url, broken)
    answer = requests.get(base + "/r", timeout=TIMEOUT)
    assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (502, "token-unavailable")
    support.wait_until(lambda: "token callable failed (KeyError)" in log_guard.text(), "the child's warning", 10)


class _ExpiredHeaders(Mapping[str, str]):
    """A credentials mapping whose reading raises (e.g. a lazily refreshed one whose refresh failed)."""

    def __getitem__(self, name: str) -> str:
        raise LookupError("credential expired")

    def __iter__(self) -> Iterator[str]:
        raise LookupError("credential expired")

    def __len__(self) -> int:
        return 1


def test_a_headers_callables_mapping_that_raises_when_read_gives_502_and_other_routes_still_rotate(host, ups):
    # In-process this is a 502; through the host, mount() once raised it, and later the token pusher died of it.
    expired = host.mount(ups["plain"].url, TOKEN, headers=lambda: _ExpiredHeaders())
    answer = requests.get(expired + "/r", timeout=TIMEOUT)
    assert (answer.status_code, answer.headers.get("X-Proxy-Error")) == (502, "headers-unavailable")
    current: Dict[str, object] = {"headers": {"X-Custom": "first"}, "token": TOKEN}
    host.mount(ups["plain"].url, TOKEN, headers=lambda: current["headers"])
    rotating = host.mount(ups["plain"].url, lambda: current["token"])
    current["headers"] = _ExpiredHeaders()  # the pusher now reads a raising mapping every turn
    current["token"] = "rotated-" + TOKEN  # the upstream refuses it: proof that rotation still reaches the child
    support.wait_until(lambda: requests.get(rotating + "/r", timeout=TIMEOUT).status_code == 401,
                       "the rotated token to be pushed", 10)


def test_a_mount_too_big_for_the_control_channel_is_refused_and_the_hosts_other_routes_keep_serving(host, ups):
    base = host.mount(ups["plain"].url, TOKEN)
    with pytest.raises(ValueError, match="over its 16777216-byte control message limit .* in-process proxy"):
        host.mount(ups["plain"].url, TOKEN, headers={"X-Big": "x" * (17 * 1024 * 1024)})
    assert host.running and requests.get(base + "/r", timeout=TIMEOUT).status_code == 200


@pytest.mark.slow  # waits out a 2 s control timeout, then the stop
def test_a_wedged_child_fails_a_big_request_after_the_control_timeout_and_stop_still_returns(ups, monkeypatch):
    monkeypatch.setattr(proxy_host, "CONTROL_ANSWER_S", 2.0)
    spawned = AuthProxy.spawn()
    pid = spawned.pid
    support.stop_process(pid)  # wedged: it reads nothing more from the channel
    try:
        with pytest.raises(RuntimeError, match="did not take mount within 2 s"):  # a send that once blocked forever
            spawned.mount(ups["plain"].url, TOKEN, headers={"X-Big": "x" * (4 * 1024 * 1024)})
        stopper = threading.Thread(target=spawned.stop)
        stopper.start()
        stopper.join(TIMEOUT)
        assert not stopper.is_alive() and not spawned.running
        support.wait_until(lambda: _gone(pid), "the wedged child to be killed", 10)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_log_handler_calling_the_host_is_told_so_at_once_and_may_stop_it(ups, log_guard):
    # Such a handler runs on the thread that reads the host's answers: a call from it once waited 30 s in vain.
    spawned = AuthProxy.spawn()
    first = spawned.mount(ups["plain"].url, TOKEN)
    outcomes: List[str] = []

    class CallsTheHost(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.processName != "proxy-host" or not record.getMessage().startswith("mounted route-"):
                return
            try:
                spawned.unmount(first)
            except RuntimeError as exc:
                outcomes.append(str(exc))
            spawned.stop()  # from the same thread: stops without waiting for an answer it could never read

    handler = CallsTheHost()
    logging.getLogger("proxy").addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="not serving"):
            spawned.mount(ups["plain"].url, TOKEN)  # its answer never came: the handler stopped the host
    finally:
        logging.getLogger("proxy").removeHandler(handler)
        spawned.stop()
    assert len(outcomes) == 1 and "called from a handler of a log record" in outcomes[0], outcomes
    assert not spawned.running and spawned._process.returncode == 0  # a clean stop, not a kill
    assert "could not clean up" not in log_guard.text()


def test_stop_names_a_token_pusher_that_is_stuck_in_a_token_callable(ups, caplog):
    release, calls = threading.Event(), []

    def slow_vault() -> str:
        calls.append(1)
        if len(calls) > 1:
            release.wait(30)  # the second read hangs (a vault that stopped answering)
        return TOKEN

    spawned = AuthProxy.spawn()
    try:
        spawned.mount(ups["plain"].url, slow_vault)
        support.wait_until(lambda: len(calls) > 1, "the pusher's second read", 10)
        with caplog.at_level(logging.WARNING, logger="proxy"):
            spawned.stop()
        assert "proxy host stopped but could not clean up: thread proxy-host-tokens" in caplog.text
    finally:
        release.set()


# -- logs ------------------------------------------------------------------------------------------------


def test_the_childs_log_records_arrive_on_the_parents_proxy_logger(ups):
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[assignment]
    logging.getLogger("proxy").addHandler(handler)
    try:
        with AuthProxy.spawn() as host:
            host.mount(ups["plain"].url, TOKEN)
            pid = host.pid
    finally:
        logging.getLogger("proxy").removeHandler(handler)
    from_child = [r for r in records if r.process == pid]
    messages = [r.getMessage() for r in from_child]
    assert any(m.startswith("proxy listening on http://127.0.0.1:") for m in messages)
    assert any(m.startswith("mounted route-1 (") for m in messages)
    assert "proxy stopped" in messages
    assert {r.processName for r in from_child} == {"proxy-host"}


def test_a_log_filter_that_fails_on_the_childs_records_neither_ends_the_host_nor_its_routes(host, ups):
    class TupleArgs(logging.Filter):  # a redaction filter's usual shape: it reads args as a tuple
        def filter(self, record: logging.LogRecord) -> bool:
            record.args = tuple(record.args)  # type: ignore[arg-type]
            return True

    class Broken(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.processName == "proxy-host":
                raise RuntimeError("a filter bug")
            return True

    base = host.mount(ups["plain"].url, TOKEN)
    logger = logging.getLogger("proxy")
    for log_filter in (TupleArgs(), Broken()):
        logger.addFilter(log_filter)
        try:
            failing = host.mount(ups["plain"].url, lambda: {}["missing"])  # the child logs a WARNING
            assert requests.get(failing + "/r", timeout=TIMEOUT).status_code == 502
            assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 200
            host.unmount(host.mount(ups["plain"].url, TOKEN))  # the control channel still answers
        finally:
            logger.removeFilter(log_filter)
    assert host.running


def test_a_token_pusher_that_could_not_start_is_started_by_the_next_mount_and_stop_still_cleans_up(ups, monkeypatch):
    real_start, failed = proxy_module._start_thread, []

    def once_no_thread(thread: threading.Thread) -> None:
        if thread.name == "proxy-host-tokens" and not failed:
            failed.append(thread)
            raise RuntimeError("can't start new thread")  # a momentary thread limit
        real_start(thread)

    monkeypatch.setattr(proxy_module, "_start_thread", once_no_thread)
    host = AuthProxy.spawn()
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            host.mount(ups["plain"].url, lambda: TOKEN)
        current = [TOKEN]
        base = host.mount(ups["plain"].url, lambda: current[0])
        assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 200
        current[0] = "rotated-" + TOKEN  # the upstream refuses it: proof that the rotation reached the child
        support.wait_until(lambda: requests.get(base + "/r", timeout=TIMEOUT).status_code == 401,
                           "the rotated token to be pushed", 10)
    finally:
        host.stop()  # never raises
    assert not host.running and failed


# -- the child's lifetime ------------------------------------------------------------------------------------

_PARENT_SCRIPT = r"""
import sys, threading, time
sys.path.insert(0, sys.argv[1])
import requests
from proxy import AuthProxy
box = {}
starter = threading.Thread(target=lambda: box.update(host=AuthProxy.spawn()))  # a thread that then ends
starter.start()
starter.join()
host = box["host"]
base = host.mount(sys.argv[2], sys.argv[3])
time.sleep(1.0)  # the starting thread is gone: the child must not have taken that for the parent's death
status = requests.get(base + "/r", timeout=30).status_code
print(host.pid, status, flush=True)
time.sleep(600)
"""


# A trainer whose soft limit on open files is low (the usual 1,024 allows about 500 sessions in the
# proxy): its own limit must stay as it is, the child's goes up to the hard limit.
_LOW_FILES_PARENT = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from proxy import AuthProxy
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with AuthProxy.spawn() as host:
    print(host.pid, flush=True)
    sys.stdin.readline()
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
"""


@pytest.mark.skipif(resource_hard_files() <= 256, reason="a hard limit on open files of 256 or less")
def test_the_child_raises_its_open_files_limit_to_the_hard_one_and_the_trainers_stays_as_it_was():
    parent = subprocess.Popen([sys.executable, "-c", _LOW_FILES_PARENT, ROOT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        child_limits = support.open_files_limits(int(parent.stdout.readline()))  # type: ignore[union-attr]
        parent.stdin.write("\n")  # type: ignore[union-attr]
        parent.stdin.flush()  # type: ignore[union-attr]
        assert parent.stdout.readline().strip() == "256"  # type: ignore[union-attr]
        assert parent.wait(TIMEOUT) == 0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(TIMEOUT)
        parent.stdin.close()  # type: ignore[union-attr]
        parent.stdout.close()  # type: ignore[union-attr]
    assert child_limits[0] == child_limits[1] == resource_hard_files()


@pytest.mark.slow  # a parent interpreter as a subprocess
def test_the_child_outlives_the_thread_that_spawned_it_and_dies_with_a_sigkilled_parent(ups):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT, ROOT, ups["plain"].url, TOKEN],
                              stdout=subprocess.PIPE)
    try:
        pid_text, status = parent.stdout.readline().split()  # type: ignore[union-attr]
        child = int(pid_text)
        assert status == b"200"
        assert not _gone(child)
        parent.kill()
        parent.wait(TIMEOUT)
        support.wait_until(lambda: _gone(child), "the host process to end after its parent's SIGKILL", 10)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(TIMEOUT)
        parent.stdout.close()  # type: ignore[union-attr]


def test_sigterm_ends_a_child_spawned_from_a_thread_that_blocks_it(ups):
    box: Dict[str, AuthProxyProcess] = {}

    def spawn_with_signals_blocked() -> None:  # what every library thread does (proxy._start_thread)
        signal.pthread_sigmask(signal.SIG_BLOCK, proxy_module.LIBRARY_THREAD_BLOCKED_SIGNALS)
        box["host"] = AuthProxy.spawn()

    starter = threading.Thread(target=spawn_with_signals_blocked)
    starter.start()
    starter.join(TIMEOUT)
    host = box["host"]
    try:
        base = host.mount(ups["plain"].url, TOKEN)
        status = _read_proc(host.pid, "status").decode()
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        assert blocked & (1 << (signal.SIGTERM - 1)) == 0
        os.kill(host.pid, signal.SIGTERM)
        support.wait_until(lambda: not host.running, "the host to end on SIGTERM", 10)
        assert host._process.returncode == 0  # a clean exit, not death by the signal
        with pytest.raises(RuntimeError, match="not serving .*exited with code 0"):
            host.mount(ups["plain"].url, TOKEN)
        with pytest.raises(requests.ConnectionError):
            requests.get(base + "/r", timeout=TIMEOUT)
    finally:
        host.stop()


def test_a_child_spawned_under_nohup_keeps_serving_through_a_hangup(ups):
    # nohup makes the trainer ignore SIGHUP; the child once installed its own handler over that and stopped.
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        spawned = AuthProxy.spawn()
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        base = spawned.mount(ups["plain"].url, TOKEN)
        os.kill(spawned.pid, signal.SIGHUP)
        time.sleep(1.0)  # a child that acted on it would have stopped by now
        assert spawned.running and requests.get(base + "/r", timeout=TIMEOUT).status_code == 200
    finally:
        spawned.stop()


def test_stop_leaves_no_process_thread_or_socket(no_leaks, ups):
    host = AuthProxy.spawn()
    base = host.mount(ups["plain"].url, TOKEN)
    with support.ws_connect(support.ws_url(base) + "/ws") as ws:  # a tunnel open while stopping
        ws.send("x")
        assert ws.recv(timeout=TIMEOUT) == "x"
        pid = host.pid
        host.stop()
        host.stop()  # idempotent
    assert _gone(pid) and host._process.returncode == 0
    assert not os.path.exists("/proc/%d" % pid)  # reaped by us, not left a zombie
    assert host._sock.fileno() == -1  # the channel is closed now, not when the handle is collected
    assert not [t for t in threading.enumerate() if t.name.startswith("proxy-host")]
    assert "stopped" in repr(host) and TOKEN not in repr(host)
    with pytest.raises(RuntimeError, match="stopped"):
        host.mount(ups["plain"].url, TOKEN)


def test_a_copy_vendored_inside_a_package_spawns_its_own_file(tmp_path, ups):
    package = support.vendored_package(str(tmp_path), "vendored_pkg", ["proxy.py", "proxy_host.py"])
    script = ("import sys, requests\nfrom vendored_pkg.proxy import AuthProxy\n"
              "with AuthProxy.spawn() as host:\n"
              "    print(requests.get(host.mount(sys.argv[1], sys.argv[2]) + '/r', timeout=30).status_code,\n"
              "          open('/proc/%d/cmdline' % host.pid).read().split(chr(0))[2])\n")
    out = subprocess.run([sys.executable, "-c", script, ups["plain"].url, TOKEN], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["200", os.path.join(package, "proxy_host.py")]


def test_a_forked_copy_of_the_trainer_closes_its_copy_of_the_channel_and_refuses_to_use_it(host, ups):
    base = host.mount(ups["plain"].url, TOKEN)
    channel_fd = host._sock.fileno()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked copy (e.g. a DataLoader worker): report, then leave without cleanup
        try:
            os.close(read_end)
            try:
                os.fstat(channel_fd)
                closed = False
            except OSError:
                closed = True
            try:
                host.mount(ups["plain"].url, TOKEN)
                refused = ""
            except RuntimeError as exc:
                refused = str(exc)
            os.write(write_end, json.dumps([closed, host.running, refused]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as report:
        closed, running, refused = json.loads(report.read())
    os.waitpid(pid, 0)
    assert closed and not running and "belongs to the process that spawned it" in refused
    assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 200  # the parent's host is untouched


def test_spawn_is_refused_on_a_subclass():
    class Gate(AuthProxy):
        pass

    with pytest.raises(TypeError, match="plain AuthProxy"):
        Gate.spawn()


# -- several children on one port (SO_REUSEPORT) -------------------------------------------------------------


def test_two_children_share_one_port_and_each_serves_every_route(ups):
    with AuthProxy.spawn(processes=2) as group:
        pids = group.pids
        assert len(set(pids)) == 2 and group.running
        base = group.mount(ups["plain"].url, TOKEN, headers={"X-Custom": "both"})
        before = {pid: support.open_sockets(pid) for pid in pids}
        sessions = [requests.Session() for _ in range(16)]  # 16 connections held open: the kernel spreads them
        try:
            answers = {(r.status_code, r.headers["X-Echo-Custom"])
                       for r in (s.get(base + "/r", timeout=TIMEOUT) for s in sessions)}
            held = {pid: support.open_sockets(pid) for pid in pids}
        finally:
            for session in sessions:
                session.close()
        assert answers == {(200, "both")}  # every child had the route, under the same id
        assert all(held[pid] > before[pid] for pid in pids), (before, held)  # both children took connections
        with pytest.raises(RuntimeError, match="replica routes need one proxy process"):
            group.mount_replicas([ups["plain"].url], TOKEN)
        assert group.unmount(base) is True
        assert requests.get(base + "/r", timeout=TIMEOUT).status_code == 404
    assert not group.running
    support.wait_until(lambda: all(_gone(pid) for pid in pids), "both children to exit", 10)


def test_a_killed_child_of_two_is_replaced_on_the_shared_port_with_every_route(ups):
    with AuthProxy.spawn(processes=2) as group:
        base = group.mount(ups["plain"].url, TOKEN, headers={"X-Custom": "both"})
        first, second = group.members
        survivor = second.pid
        _killed_and_replaced(first)
        assert group.running and second.pid == survivor and first.port == second.port
        sessions = [requests.Session() for _ in range(16)]  # the kernel spreads them over both children again
        try:
            answers = {(r.status_code, r.headers["X-Echo-Custom"])
                       for r in (s.get(base + "/r", timeout=TIMEOUT) for s in sessions)}
            held = support.open_sockets(first.pid)
        finally:
            for session in sessions:
                session.close()
        assert answers == {(200, "both")}  # the new child serves the route under the group's id
        assert held > 2, held  # (its channel and listener, plus connections the kernel gave it)


def test_spawn_refuses_a_bad_process_count():
    with pytest.raises(ValueError, match="processes must be a whole number"):
        AuthProxy.spawn(processes=0)


# -- the provider ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_process_proxy() -> Iterator[None]:
    """The core's shared process host, started fresh by the test and stopped after it."""
    host = hsp._shared_proxies.get("process")
    assert host is None or not host.running
    yield
    with hsp._shared_proxy_lock:
        host = hsp._shared_proxies.pop("process", None)
    if host is not None:
        host.stop()


def test_provider_with_proxy_process_serves_http_and_websocket_from_the_shared_child(emu, fresh_process_proxy):
    providers = [hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy="process",
                                       command=echo_server_command(), poll_interval_s=0.05) for _ in range(2)]
    try:
        urls = [p.start_container() for p in providers]
        for provider in providers:
            provider.wait_for_ready()
        host = hsp._shared_proxies.get("process")
        assert isinstance(host, AuthProxyProcess) and host.running
        assert all(url.startswith(host.url + "/") for url in urls)  # one child for both
        with requests.Session() as http:
            assert http.post(urls[0] + "/reset", json={}, timeout=TIMEOUT).status_code == 200
            step = http.post(urls[0] + "/step", json={"action": {"message": "hosted"}}, timeout=TIMEOUT).json()
            assert step["observation"]["echoed_message"] == "hosted"
        with support.ws_connect(support.ws_url(urls[1]) + "/ws") as ws:
            ws.send(json.dumps({"type": "step", "data": {"message": "over ws"}}))
            assert json.loads(ws.recv(timeout=TIMEOUT))["data"]["observation"]["echoed_message"] == "over ws"
    finally:
        for provider in providers:
            provider.stop_container()
    assert requests.get(urls[0] + "/health", timeout=TIMEOUT).status_code == 404  # unmounted in the child
    support.wait_until(lambda: all(job.stage == "CANCELED" for job in emu.jobs), "both jobs cancelled")


def test_a_provider_given_a_two_process_host_steps_through_both_children_and_unmounts_in_each(emu):
    # README's advice for HTTP-heavy loads: proxy=AuthProxy.spawn(processes=2)
    with AuthProxy.spawn(processes=2) as group:
        provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=group,
                                         command=echo_server_command(), poll_interval_s=0.05)
        sessions = [requests.Session() for _ in range(16)]  # held open: the kernel spreads them
        try:
            url = provider.start_container()
            provider.wait_for_ready()
            assert url.startswith(group.url + "/")
            before = {pid: support.open_sockets(pid) for pid in group.pids}
            for index, session in enumerate(sessions):
                step = session.post(url + "/step", json={"action": {"message": "s%d" % index}}, timeout=TIMEOUT)
                assert step.json()["observation"]["echoed_message"] == "s%d" % index
            held = {pid: support.open_sockets(pid) for pid in group.pids}
            assert all(held[pid] > before[pid] for pid in group.pids), (before, held)  # both served
        finally:
            for session in sessions:
                session.close()
            provider.stop_container()
        fresh = [requests.Session() for _ in range(16)]
        try:  # new connections land on either child: neither has the route any more
            assert {s.get(url + "/health", timeout=TIMEOUT).status_code for s in fresh} == {404}
        finally:
            for session in fresh:
                session.close()
        assert group.running  # the user's host: the provider unmounts, never stops it
    support.wait_until(lambda: emu.jobs and all(job.stage == "CANCELED" for job in emu.jobs), "the job cancelled")


def test_provider_replaces_a_shared_process_host_that_ended(emu, fresh_process_proxy):
    first = hsp._shared_proxy("process")
    os.kill(first.pid, signal.SIGTERM)  # ended for good (a killed child is replaced by its handle itself)
    support.wait_until(lambda: not first.running, "the host's end to be noticed", 10)
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy="process",
                                     command=echo_server_command(), poll_interval_s=0.05)
    try:
        provider.wait_for_ready(provider.start_container())
        host = hsp._shared_proxies["process"]
        assert host is not first and host.running
    finally:
        provider.stop_container()


def test_a_providers_environment_answers_again_at_its_url_after_its_proxy_host_child_was_killed(emu, host):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=host,
                                     command=echo_server_command(), poll_interval_s=0.05)
    try:
        base_url = provider.start_container()
        provider.wait_for_ready(base_url)
        _killed_and_replaced(host)  # as the OOM killer would
        answer = requests.post(base_url + "/step", json={"action": {"message": "after"}}, timeout=TIMEOUT)
        assert answer.status_code == 200 and answer.json()["observation"]["echoed_message"] == "after"
        assert provider.base_url == base_url and emu.job(provider.job_id).stage == "RUNNING"
    finally:
        provider.stop_container()
    assert emu.wait_for_stage(provider.job_id, ["CANCELED"]).stage == "CANCELED"
    assert requests.get(base_url + "/health", timeout=TIMEOUT).status_code == 404  # unmounted in the new child


def test_a_stop_after_its_proxy_host_ended_still_cancels_the_job_and_warns_only_of_the_end(emu, host, caplog):
    provider = hsp.HFSandboxProvider(IMAGE, endpoint=emu.endpoint, token=emu.token, proxy=host,
                                     command=echo_server_command(), poll_interval_s=0.05)
    provider.start_container()
    job_id = provider.job_id
    os.kill(host.pid, signal.SIGTERM)  # ended for good: a SIGTERM is asked for, so it is not replaced
    support.wait_until(lambda: not host.running, "the host's end to be noticed", 10)
    provider.stop_container()
    assert emu.wait_for_stage(job_id, ["CANCELED"]).stage == "CANCELED"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("proxy host process %d ended on its own" % host.pid) for w in warnings), warnings
    assert not [w for w in warnings if "unmount" in w or job_id in w], warnings  # its routes died with it


def test_a_sandbox_with_proxy_process_opens_its_session_through_the_shared_child(emu, fresh_process_proxy):
    from hf_sandbox_provider import Sandbox, stop_sandboxes

    box = Sandbox(IMAGE, proxy="process", endpoint=emu.endpoint, token=emu.token, command=echo_server_command(),
                  poll_interval_s=0.05)
    try:
        with box.session() as env:
            env.reset()
            assert env.step({"message": "slot"})["observation"]["echoed_message"] == "slot"
        host = hsp._shared_proxies.get("process")
        assert host is not None and host.running and box.provider.base_url.startswith(host.url + "/")
    finally:
        stop_sandboxes()


def test_provider_proxy_setting_is_checked_and_survives_pickling():
    with pytest.raises(hsp.SandboxConfigError, match="proxy must be None"):
        hsp.HFSandboxProvider(IMAGE, proxy="processes")
    import pickle
    copy = pickle.loads(pickle.dumps(hsp.HFSandboxProvider(IMAGE, proxy="process", token="hf_x")))
    assert copy._proxy == "process"
