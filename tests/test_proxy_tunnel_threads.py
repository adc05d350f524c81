"""The design card's shape of a WebSocket session (DESIGN.md "No event loop"): two threads, one
per direction, against uvicorn in its own process over plain TCP and TLS; both directions streaming
at once with full buffers over one shared TLS engine; and no readiness reactor in any library
module.
"""
from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import socket
import struct
import threading
from typing import Iterator, List, Tuple

import pytest

import support
from diff_clients import UpstreamProcess
from proxy import AuthProxy
from test_proxy_ws import _open_raw_tunnel
from upstreams.common import body_of

TOKEN = "unused-by-the-pressure-app"
TIMEOUT = 30.0
HELD = 12
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the project vendors and a trainer imports (the emulator is a test and benchmark stand-in).


@pytest.fixture(scope="module", params=["plain", "tls"])
def app(request: pytest.FixtureRequest, test_ca: support.TestCA) -> Iterator[UpstreamProcess]:
    tls = request.param == "tls"
    up = UpstreamProcess("threads-" + request.param, "pressure_app.py", TOKEN,
                         (test_ca.cert_path, test_ca.key_path) if tls else None)
    yield up
    up.stop()


def _tasks() -> int:
    """This process's threads, as the kernel counts them."""
    return len(os.listdir("/proc/self/task"))


def _tasks_but_others(server) -> int:
    """The kernel's count less the Python threads that are not the proxy's workers: an earlier test's library
    thread (a job watcher, the reaper of a collected provider) may end meanwhile."""
    workers = set(server.all_threads())
    return _tasks() - sum(1 for thread in threading.enumerate() if thread not in workers)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux /proc")
def test_n_held_sessions_hold_exactly_2n_tunnel_threads_freed_when_they_close(app, test_ca,
                                                                                no_leaks):
    """Raw client sockets (no client library thread), so the kernel's count of this process's
    threads grows by the proxy's alone: two per held session, and each a busy worker."""
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = proxy.mount(app.url, TOKEN, verify=test_ca.ca_path)
        server, idle_tasks = proxy._server, _tasks()
        idle = _tasks_but_others(server)
        with contextlib.ExitStack() as clients:
            sessions = []
            for i in range(HELD):
                sock, early = _open_raw_tunnel(proxy, base)
                clients.enter_context(sock)
                sock.sendall(_client_frame(b"held %d" % i, opcode=1))
                assert _Frames(sock, early).next() == (1, b"held %d" % i)
                sessions.append(sock)
            support.wait_until(lambda: _tasks_but_others(server) - idle == 2 * HELD, "2 threads per session")
            assert len(server.live_threads()) == 2 * HELD  # every busy worker is a tunnel direction
            sessions[0].close()
            support.wait_until(lambda: len(server.live_threads()) == 2 * (HELD - 1),
                               "one session's two threads to be free")
        support.wait_until(lambda: not server.live_threads(), "every tunnel thread to be free")
        assert server.workers.counts() == (2 * HELD, 2 * HELD)  # parked, ready for more sessions
        threads = server.all_threads()
    assert not any(thread.is_alive() for thread in threads)  # stop() ended them
    # (a thread Python saw end leaves the kernel's list a moment later; the listener ended too)
    support.wait_until(lambda: _tasks() < idle_tasks, "the proxy's threads to leave the kernel's list")


def _client_frame(payload: bytes, opcode: int = 2) -> bytes:
    """A final client frame masked with a zero key (so the payload goes as it is)."""
    n = len(payload)
    length = (struct.pack("!B", 0x80 | n) if n < 126 else struct.pack("!BH", 0x80 | 126, n)
              if n < 65536 else struct.pack("!BQ", 0x80 | 127, n))
    return struct.pack("!B", 0x80 | opcode) + length + b"\0\0\0\0" + payload


class _Frames:
    """Server frames read off a raw client socket, one message at a time."""

    def __init__(self, sock: socket.socket, already: bytes) -> None:
        self.sock, self.buffer = sock, bytearray(already)

    def _need(self, n: int) -> None:
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the tunnel ended early"
            self.buffer += chunk

    def next(self) -> Tuple[int, bytes]:
        self._need(2)
        opcode, n, at = self.buffer[0] & 0x0F, self.buffer[1] & 0x7F, 2
        if n == 126:
            self._need(4)
            n, at = struct.unpack_from("!H", self.buffer, 2)[0], 4
        elif n == 127:
            self._need(10)
            n, at = struct.unpack_from("!Q", self.buffer, 2)[0], 10
        self._need(at + n)
        payload = bytes(self.buffer[at:at + n])
        del self.buffer[:at + n]
        return opcode, payload


def test_both_directions_streaming_at_once_with_full_buffers_complete_intact(app, test_ca,
                                                                              no_leaks):
    """A raw client sends 16 MiB (the app echoes it) while the app floods 16 MiB: the app reads
    nothing while it floods, so every buffer on the way fills both ways at once. Over TLS both
    tunnel threads share one engine: a lock held across a blocked send, or output sent out of
    order, would hang or corrupt this."""
    count, size = 256, 65536
    chunks = [support.pattern(size)[i:] + support.pattern(size)[:i] for i in range(count)]
    with AuthProxy(read_timeout_s=TIMEOUT) as proxy:
        base = proxy.mount(app.url, TOKEN, verify=test_ca.ca_path)
        sock, early = _open_raw_tunnel(proxy, base)
        with sock:
            sock.sendall(_client_frame(b"flood:%d:%d" % (count, size), opcode=1))
            failures: List[BaseException] = []

            def send_all() -> None:
                try:
                    for chunk in chunks:
                        sock.sendall(_client_frame(chunk))
                except BaseException as exc:  # pragma: no cover - reported below
                    failures.append(exc)

            sender = threading.Thread(target=send_all, daemon=True)
            sender.start()
            frames = _Frames(sock, early)
            for i in range(count):
                assert frames.next() == (2, body_of(size) + b"%d" % i)
            for chunk in chunks:  # the app echoes each binary message once the flood is out
                assert frames.next() == (2, chunk)
            sender.join(TIMEOUT)
            assert not sender.is_alive() and not failures
            sock.sendall(_client_frame(b"sha", opcode=1))
            digest = hashlib.sha256(b"".join(chunks)).hexdigest()
            assert frames.next() == (1, b"%s %d" % (digest.encode(), count * size))


def _reactor_uses(path: str) -> List[str]:
    """Where a module imports asyncio or selectors, or names select.epoll/poll/kqueue/devpoll, or
    calls select.select with more than one socket: a readiness set over many sockets. A blocking
    wait on one socket (a recv or send with a timeout, or select.select on a one-socket list
    literal) is allowed, and so is a poll object made on a line that says `# one socket:` why."""
    with open(path) as fh:
        source = fh.read()
    tree = ast.parse(source, path)
    lines = source.splitlines()
    one_socket_waits = {id(node.func) for node in ast.walk(tree)
                        if isinstance(node, ast.Call) and node.args and all(
                            isinstance(a, ast.List) and len(a.elts) <= 1 for a in node.args[:3])}
    found = []
    for node in ast.walk(tree):
        names: List[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + ["%s.%s" % (node.module, a.name) for a in node.names]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "select" and id(node) not in one_socket_waits
              and "# one socket:" not in lines[node.lineno - 1]
              and node.attr in ("epoll", "poll", "kqueue", "devpoll", "select")):
            names = ["select." + node.attr]
        found += ["%s:%d %s" % (os.path.basename(path), node.lineno, name) for name in names
                  if name.split(".")[0] in ("asyncio", "selectors") or name.startswith("select.")]
    return found


def test_the_reactor_scan_finds_each_kind_of_reactor(tmp_path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\nimport selectors\nfrom asyncio import run\nimport select\n"
                      "p = select.epoll()\nq = select.poll()\nselect.select([a, b], [], [])\n"
                      "select.select([a], [], [], 1.0)\nr = select.poll()  # one socket: a check\n")
    assert [f.split(" ", 1)[1] for f in _reactor_uses(str(sample))] == [
        "asyncio", "selectors", "asyncio", "asyncio.run",
        "select.epoll", "select.poll", "select.select"]


def test_no_library_module_contains_a_reactor() -> None:
    found = [use for module in support.LIBRARY_MODULES if os.path.exists(os.path.join(ROOT, module))
             for use in _reactor_uses(os.path.join(ROOT, module))]
    assert found == []


def test_the_websocket_tunnel_code_contains_no_reactor() -> None:
    """The WebSocket half of proxy.py (from the handler's tunnel section to the tunnel class) has
    none, and the relay it replaced is gone."""
    import proxy
    with open(proxy.__file__) as fh:
        source = fh.read()
    section = ""
    for start in (source.index("    # -- WebSocket tunnel"), source.index("class _Stream:")):
        section += source[start:source.index("\n# ---", start)]
    for word in ("select.", "selectors", "asyncio", "epoll", "_sslobj"):
        assert word not in section, word
    assert not hasattr(proxy, "_TunnelRelay") and not hasattr(proxy, "_UpgradeSetup")
