"""A byte-scripted upstream for proxy regression and fuzz tests: each accepted connection runs a
script (a function of the socket and a buffered reader) that writes exactly the bytes a test needs,
including ones no real server would send (interim responses, early answers, malformed heads).

The differential suite uses real servers (uvicorn, http.server) in their own processes; this one is
for the cases those servers cannot be made to produce on demand.
"""
from __future__ import annotations

import io
import socket
import ssl
import threading
from typing import Callable, List, Mapping, Optional, Tuple, Union

from .common import read_chunked

Script = Callable[[socket.socket, io.BufferedReader, int], None]
# What `serve_by_path` sends for one request: fixed bytes (the connection stays open), or a function
# of the request target returning (bytes, keep_open) for answers that vary or end the connection.
Reply = Union[bytes, Callable[[str], Tuple[bytes, bool]]]


def read_request(rfile: io.BufferedReader, body: bool = True) -> Optional[Tuple[str, str, List[Tuple[str, str]], bytes]]:
    """Read one request (method, target, headers, body); None when the peer closed first.
    With body=False the body is left unread (for early answers)."""
    line = rfile.readline(65537)
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers: List[Tuple[str, str]] = []
    while True:
        line = rfile.readline(65537)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    if not body:
        return method, target, headers, b""
    lower = {n.lower(): v for n, v in headers}
    data = b""
    if "chunked" in lower.get("transfer-encoding", "").lower():
        data = read_chunked(rfile)
    elif lower.get("content-length"):
        data = rfile.read(int(lower["content-length"]))
    return method, target, headers, data


def serve_by_path(routes: Mapping[str, Reply], otherwise: Reply) -> Script:
    """A script that reads requests (bodies included) until the client closes and answers each with
    the reply of the first suffix in `routes` its target ends with, else `otherwise`."""
    def script(sock: socket.socket, rfile: io.BufferedReader, number: int) -> None:
        while True:
            request = read_request(rfile)
            if request is None:
                return
            target = request[1]
            reply = next((r for suffix, r in routes.items() if target.endswith(suffix)), otherwise)
            data, keep_open = reply(target) if callable(reply) else (reply, True)
            sock.sendall(data)
            if not keep_open:
                return
    return script


class ScriptedUpstream:
    """A loopback server (plain or TLS) running `script(sock, rfile, connection_number)` per connection."""

    def __init__(self, script: Script, tls: Optional[ssl.SSLContext] = None, rcvbuf: int = 0) -> None:
        self.script, self.tls = script, tls
        self.connections = 0
        self.requests = 0  # scripts count what they read, for "the upstream ran it" assertions
        self.lock = threading.Lock()
        self._listener = socket.socket()
        if rcvbuf:  # a small receive window (inherited by accepted sockets): big request bodies block the sender
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = "%s://%s:%d" % ("https" if tls else "http", "localhost" if tls else "127.0.0.1", self.port)
        self._threads: List[threading.Thread] = []
        self._socks: List[socket.socket] = []
        self._stopped = False
        self._accept = threading.Thread(target=self._serve, name="scripted-upstream", daemon=True)
        self._accept.start()

    def __enter__(self) -> "ScriptedUpstream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count_request(self) -> None:
        with self.lock:
            self.requests += 1

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self.lock:
                if self._stopped:
                    sock.close()
                    return
                self.connections += 1
                number = self.connections
                self._socks.append(sock)
                thread = threading.Thread(target=self._run, args=(sock, number), daemon=True, name="scripted-conn")
                self._threads.append(thread)
            thread.start()

    def _run(self, sock: socket.socket, number: int) -> None:
        try:
            sock.settimeout(10)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
                with self.lock:
                    self._socks.append(sock)
            with sock.makefile("rb") as rfile:
                self.script(sock, rfile, number)
        except (OSError, ValueError):
            pass
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            socks, threads = list(self._socks), list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for sock in socks:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(5)
        for thread in threads:
            thread.join(5)
