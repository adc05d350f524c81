"""AuthProxy at the system's limits rather than its own: a process that may start no more threads, or
open no more files, long before MAX_WORKERS. Each proxy runs in a child process under a real limit
(setrlimit), so what the test sees is what a trainer under `ulimit` sees: clients get a 503 that names
the limit (never a hang, never the proxy's own cap), the proxy says so once in its log, does not
spin, and serves again once the limit is no longer hit."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Iterator, List, Tuple

import pytest

import proxy as proxy_module
import support
from support import TEST_TOKEN, Upstream

TIMEOUT = 10

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="setrlimit and /proc/<pid>: Linux")

# The child: an AuthProxy with a route and a replica route to one upstream, then a limit lowered once it listens. RLIMIT_AS: only
# `amount` MiB more address space, so 1 MiB worker stacks run out long before MAX_WORKERS (the way
# `ulimit -u` or a full vm.max_map_count would refuse threads), with one malloc arena (the parent sets
# MALLOC_ARENA_MAX) so the room goes to stacks. RLIMIT_NOFILE: a soft limit of `amount` descriptors.
_LIMITED_PROXY = """
import logging, resource, sys
sys.path.insert(0, sys.argv[1])
import proxy
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
server = proxy.AuthProxy().start()
base_url = server.mount(sys.argv[4], sys.argv[5])
replicas_url = server.mount_replicas([sys.argv[4]], sys.argv[5])
limit, amount = sys.argv[2], int(sys.argv[3])
if limit == "RLIMIT_AS":
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, ((size + amount * 1024) * 1024,) * 2)
else:
    resource.setrlimit(resource.RLIMIT_NOFILE, (amount, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(base_url, replicas_url, flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def _limited_proxy(limit: str, amount: int, upstream_url: str) -> Iterator[Tuple[subprocess.Popen, str, str]]:
    """The child proxy under `limit` and its routes' base URLs (single, replicas); killed on exit."""
    child = subprocess.Popen([sys.executable, "-c", _LIMITED_PROXY, support.REPO_ROOT, limit, str(amount),
                              upstream_url, TEST_TOKEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, MALLOC_ARENA_MAX="1"))
    try:
        base_url, replicas_url = child.stdout.readline().split()
        yield child, base_url, replicas_url
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()


def _stop(child: subprocess.Popen) -> List[str]:
    """Stop the child proxy cleanly; its log lines."""
    child.stdin.close()
    assert child.wait(TIMEOUT) == 0
    return child.stderr.read().splitlines()


def _exchange(sock: socket.socket, path: str) -> bytes:
    """One keep-alive GET of `path`: the whole answer (head, and a body up to its Content-Length)."""
    sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
    answer = b""
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        if sep:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(body) >= length:
                return answer
        data = sock.recv(65536)
        if not data:
            return answer
        answer += data


def _message(answer: bytes) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"X-Proxy-Error: proxy-busy" in head, answer[:300]
    assert b"Retry-After: 1" in head
    return json.loads(body)["message"]


# RLIMIT_AS bounds the heap as well as the stacks: the last thread that starts may leave too little for its own
# first read (a 64 KiB buffer), which then fails with MemoryError (logged; the client gets no answer) before any
# thread is refused. Which comes first is up to where the limit falls (1 run in ~15 on a loaded machine, none
# idle): such a run is started over, up to this many times.
LIMIT_ATTEMPTS = 4


def test_when_the_system_refuses_a_worker_thread_the_503_and_the_warning_name_that_limit_not_the_cap():
    for _ in range(LIMIT_ATTEMPTS):
        with Upstream() as upstream, _limited_proxy("RLIMIT_AS", 24, upstream.url) as (child, base_url, _):
            port, path = int(base_url.split(":")[2].split("/")[0]), "/" + base_url.split("/", 3)[3]
            held: List[socket.socket] = []
            try:
                for _ in range(200):  # each served connection keeps its worker, waiting for its next request
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT))
                    answer = _exchange(held[-1], path + "/x")
                    if not answer.startswith(b"HTTP/1.1 200 "):
                        break
            finally:
                for sock in held[:-1]:
                    sock.close()
            with held[-1]:
                if answer == b"":  # a worker ran out of heap first (see LIMIT_ATTEMPTS), and said so
                    assert any(line == "MemoryError" for line in _stop(child)), answer
                    continue
            served = len(held) - 1
            message = _message(answer)
            assert 0 < served < proxy_module.MAX_WORKERS
            assert message.startswith("No free worker thread: the system refused the proxy a new thread "
                                      "(RuntimeError: can't start new thread) with %d of its threads running: "
                                      "raise the process's limits (ulimit -u, " % served), message
            assert "at its limit" not in message and str(proxy_module.MAX_WORKERS) not in message
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:  # a parked worker serves
                assert _exchange(sock, path + "/again").startswith(b"HTTP/1.1 200 ")
            warnings = [line for line in _stop(child) if "proxy-busy" in line]
            break
    else:
        pytest.fail("in each of %d runs a worker ran out of heap before the system refused a thread" % LIMIT_ATTEMPTS)
    assert len(warnings) == 1 and warnings[0].startswith("WARNING proxy: answered 503 proxy-busy 1 time(s)")
    assert ("no free worker thread: the system refused the proxy a new thread (RuntimeError: can't start new "
            "thread) with %d of its threads running" % served) in warnings[0], warnings


def test_out_of_file_descriptors_queued_connections_get_a_503_naming_the_limit_and_the_listener_does_not_spin():
    # Without the spare descriptor the listener's accept() failed with EMFILE at once, again and again:
    # a core burnt, no log line, and every connection past the limit hung until its client gave up.
    with Upstream() as upstream, _limited_proxy("RLIMIT_NOFILE", 40, upstream.url) as (child, base_url, replicas_url):
        port, path = int(base_url.split(":")[2].split("/")[0]), "/" + base_url.split("/", 3)[3]
        clients = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) for _ in range(60)]
        try:
            # Served connections hold a worker and hear nothing; each one past the limit is answered and
            # closed. Settled once every client is one or the other.
            support.wait_until(lambda: _accepted(child.pid) + sum(map(_answered, clients)) == 60,
                               "every connection to be served or answered")
            held = [sock for sock in clients if not _answered(sock)]
            answers = [support.read_to_eof(sock) for sock in clients if _answered(sock)]
            assert held and answers
            limit = "out of file descriptors (EMFILE: its limit, `ulimit -n`, is 40; "
            assert all(_message(answer).startswith("The proxy's process is " + limit) for answer in answers)
            cpu = support.cpu_seconds(child.pid)
            time.sleep(2.0)
            assert support.cpu_seconds(child.pid) - cpu < 1.0  # (the spinning listener: over 2.5 s in 3 s)
            # a served connection's request: its worker finds no descriptor for the upstream socket
            assert _message(_exchange(held[0], path + "/x")).startswith("The proxy's process is " + limit)
            # likewise an upgrade on the replica route: a 503 too, and its one replica stays in rotation
            held[1].sendall(b"GET /%s/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                            % replicas_url.rsplit("/", 1)[1].encode())
            assert _message(support.read_to_eof(held[1])).startswith("The proxy's process is " + limit)
        finally:
            for sock in clients:
                sock.close()
        support.wait_until(lambda: len(os.listdir("/proc/%d/fd" % child.pid)) < 10, "the proxy's descriptors to free")
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            assert _exchange(sock, path + "/after").startswith(b"HTTP/1.1 200 ")
        with support.ws_connect(support.ws_url(replicas_url) + "/ws") as session:
            session.send("after")
            assert session.recv(TIMEOUT) == "after"
        lines = _stop(child)
    listener = [line for line in lines if line.startswith("WARNING proxy: answered 503 proxy-busy")]
    assert len(listener) == 1 and "the proxy's process is " + limit in listener[0], lines
    assert not [line for line in lines if "out of rotation" in line], lines
    route = [line for line in lines if line.startswith("WARNING proxy: route-")]
    assert len(route) == 2, lines  # the request's route, and the replica the upgrade was for
    assert all(line.endswith(": The proxy's process is " + limit + "a WebSocket session holds two in the proxy, "
                             "one more for a client in the same process): raise it, e.g. to the hard limit with "
                             "resource.setrlimit; retry shortly, or spread sessions over more processes.")
               for line in route), route
    assert "WebSocket upgrade failed: " in route[1] and " replica-1 (" in route[1], route


def _answered(sock: socket.socket) -> bool:
    """Whether the proxy answered this connection and closed it (a peek that never waits)."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(TIMEOUT)
    return data == b"" or data.endswith(b"}")


def _accepted(pid: int) -> int:
    """The client connections the proxy process holds: its sockets but the listener."""
    fds = os.listdir("/proc/%d/fd" % pid)
    return sum(os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:") for fd in fds) - 1
