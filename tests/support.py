"""Reusable loopback test peers for the whole suite (import as `from support import ...` or `tests.support`).

Stable names other test files may rely on:

- `TEST_TOKEN`: the bearer token the upstreams require by default (never appears in logs: conftest checks).
- `TestCA` / `make_test_ca(directory)`: a throwaway CA and a server certificate for localhost, 127.0.0.1
  and ::1, made with `cryptography` at test time; `.ca_path`, `.cert_path`, `.key_path`,
  `.server_context()`, `.client_context()`.
- `Upstream(token=TEST_TOKEN, tls=None, host="127.0.0.1")`: a threaded HTTP/1.1 server (HTTPS when `tls`
  is a `TestCA`) that requires `Authorization: Bearer <token>` (token None: no check) and answers:
    any path                 -> 200 JSON echo: method, target, headers, body length and sha256, body text
    /status/<code>           -> that status with a JSON body (the environment's own error)
    /stream?n=N&delay=S      -> chunked body of N lines, one every S seconds; with &gate=1 the last
                                line waits until the test sets `upstream.gate` (proves streaming)
    /gzip                    -> gzip-compressed JSON with Content-Encoding: gzip and Content-Length
    /big?n=N                 -> N bytes (deterministic pattern) with Content-Length
    /close-delimited?n=N     -> N bytes, no length, connection closed to end the body
    /redirect                -> 302 to /elsewhere (must not be followed by a proxy)
    /slow?s=S                -> answers after S seconds (with &gate=1: once `upstream.gate` is set, at most S)
    /die-before-response     -> closes the connection without answering
    /die-mid-body?n=N        -> promises N bytes (default 1000), sends 10, closes
    WebSocket upgrade at any path -> echo server (wsproto, permessage-deflate offered/accepted):
        text/binary echoed, pings answered, close answered; the text "die" closes the TCP connection
        abruptly; "ping-me" makes the server ping (payload b"srv") and report "pong:<payload>" when the
        pong arrives; "close-me" makes the server close with code 4001 reason "bye";
        path /ws-reject answers 403 instead of switching; /ws-status/<code>[/...] answers <code>.
  `.url`, `.port`, `.gate` (threading.Event), `.requests` (list of `Seen(method, target, headers)`), `.connections` (accepted count),
  `.stop()` (closes everything, joins its threads); context manager.
- `ws_url(base_url)`: http(s)://... -> ws(s)://...
- `ws_connect(url, **kwargs)`: `websockets.sync.client.connect` (an independent, real WebSocket client)
  with test defaults: no system proxy, no size limit, 10 s open/close timeouts, no keepalive pings.
- `raw_request(port, data, timeout=5)`: send raw bytes to 127.0.0.1:port, return everything read until
  the peer closes or goes quiet.
- `pattern(n)`: n deterministic bytes.
- `proc_stat(pid)`, `alive(pid)`, `processes(where)`: a process's (state, ppid, pgid) from /proc, whether
  it runs (not a zombie), and the live pids whose stat satisfies `where` (Linux).
- `in_thread(action)`: run it in a daemon thread; returns (thread, outcome list: its result or exception).
- `wait_until(predicate, what, timeout_s=60)`: poll until truthy, failing with `what` at the deadline.
- `ipv6_loopback()`: whether ::1 can be bound on this machine (a skip condition).
- `vendored_package(parent, name, modules)`: the package `parent/name` (an empty `__init__.py`) holding copies
  of the checkout's `modules`, as a user who vendors them has it; returns its path.
- `python_of(version)`: an interpreter of that (major, minor) when this machine has one (PATH or pyenv), else None.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import gzip
import hashlib
import http.server
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import wsproto
from wsproto.connection import ConnectionState
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Message, Ping, Pong,
                            RejectConnection, Request, TextMessage)
from wsproto.extensions import PerMessageDeflate

TEST_TOKEN = "hf_testtoken_" + "Zq8XvB2kLw9Yt4"
JOIN_S = 5.0
# The checkout: where the library modules live (this file is in its tests/).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The library itself (what users import or vendor), as opposed to the emulators and benchmarks: the scans of
# its source (no reactor, no Condition entered through its Python __enter__) read these.
LIBRARY_MODULES = ["proxy.py", "proxy_host.py", "hf_sandbox_provider.py", "hf_sandbox_training.py",
                   "hf_sandbox_cli.py", "hf_sandbox_pool.py"]


# --------------------------------------------------------------------------------------------------
# TLS material
# --------------------------------------------------------------------------------------------------


class TestCA:
    """A self-signed CA and a localhost server certificate, written as PEM files in `directory`."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hf-sandbox-provider test CA")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        self.ca_path = os.path.join(directory, "ca.pem")
        self.cert_path = os.path.join(directory, "server.pem")
        self.key_path = os.path.join(directory, "server.key")
        with open(self.ca_path, "wb") as f:
            f.write(ca_cert.public_bytes(serialization.Encoding.PEM))
        with open(self.cert_path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(self.key_path, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_path, self.key_path)
        return context

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_path)


def make_test_ca(directory: str) -> TestCA:
    """Create a throwaway CA + localhost server certificate under `directory`."""
    return TestCA(directory)


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def pattern(n: int) -> bytes:
    """n deterministic, non-repeating-looking bytes (so truncation or reordering shows up)."""
    block = hashlib.sha256(b"pattern").digest() * 64  # 2 KiB
    out = bytearray()
    i = 0
    while len(out) < n:
        out += bytes((b + i) & 0xFF for b in block[: min(len(block), n - len(out))])
        i += 1
    return bytes(out)


def ws_url(base_url: str) -> str:
    """http://host/x -> ws://host/x, https://... -> wss://..."""
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://"):]
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://"):]
    return base_url


def ws_connect(url: str, **kwargs: object):  # type: ignore[no-untyped-def]
    """A real WebSocket client connection (use as a context manager) with test-friendly defaults."""
    from websockets.sync.client import connect

    options: dict = {"proxy": None, "max_size": None, "open_timeout": 10, "close_timeout": 10, "ping_interval": None}
    options.update(kwargs)
    return connect(url, **options)


def open_files_limits(pid: int) -> Tuple[int, int]:
    """(soft, hard) limits on open files of process `pid`, from /proc/<pid>/limits (Linux)."""
    with open("/proc/%d/limits" % pid) as handle:
        line = next(line for line in handle if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    return int(soft), int(hard)


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes; a socket timeout propagates (the peer kept the
    connection open, which the caller's test means to catch)."""
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def raw_request(port: int, data: bytes, timeout: float = 5.0, host: str = "127.0.0.1") -> bytes:
    """Send raw bytes, then read until the peer closes or is quiet for `timeout` seconds."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        if data:
            sock.sendall(data)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (socket.timeout, ConnectionResetError):
            pass
        return b"".join(chunks)


class Seen(NamedTuple):
    method: str
    target: str
    headers: List[Tuple[str, str]]


# --------------------------------------------------------------------------------------------------
# The upstream server
# --------------------------------------------------------------------------------------------------


class _UpstreamHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, upstream: "Upstream", address: Tuple[str, int], tls: Optional[ssl.SSLContext]) -> None:
        self.upstream = upstream
        self.tls = tls
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.lock = threading.Lock()
        self.live: Set[socket.socket] = set()
        self.threads: Set[threading.Thread] = set()
        super().__init__(address, _UpstreamHandler)

    def server_bind(self) -> None:
        http.server.socketserver.TCPServer.server_bind(self)  # type: ignore[attr-defined]
        self.server_name, self.server_port = "localhost", self.server_address[1]

    def get_request(self):  # type: ignore[no-untyped-def]
        sock, addr = self.socket.accept()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # like uvicorn: no Nagle stalls
        thread = threading.Thread(target=self._run, args=(request, client_address), daemon=True,
                                  name="test-upstream-conn")
        with self.lock:
            self.live.add(request)
            self.threads.add(thread)
            self.upstream.connections += 1
        thread.start()

    def _run(self, request, client_address):  # type: ignore[no-untyped-def]
        try:
            self.finish_request(request, client_address)
        except Exception:
            pass
        finally:
            self.shutdown_request(request)
            with self.lock:
                self.live.discard(request)
                self.threads.discard(threading.current_thread())

    def handle_error(self, request, client_address):  # type: ignore[no-untyped-def]
        pass


class _UpstreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _UpstreamHTTPServer
    timeout = 30

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle_one_request(self) -> None:
        try:
            if isinstance(self.connection, ssl.SSLSocket) and not getattr(self, "_shaken", False):
                self.connection.do_handshake()
                self._shaken = True
        except (OSError, ssl.SSLError):
            self.close_connection = True
            return
        try:
            super().handle_one_request()
        except (OSError, ssl.SSLError):
            self.close_connection = True

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name.startswith("do_"):
            return self._serve
        raise AttributeError(name)

    # -- helpers -----------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.read(2)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, headers: Tuple[Tuple[str, str], ...] = ()) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: object, headers: Tuple[Tuple[str, str], ...] = ()) -> None:
        self._send(status, json.dumps(obj).encode(), (("Content-Type", "application/json"),) + headers)

    # -- dispatch ----------------------------------------------------------------------------------

    def _serve(self) -> None:
        up = self.server.upstream
        with self.server.lock:
            up.requests.append(Seen(self.command, self.path, list(self.headers.items())))
        if up.token is not None and self.headers.get("Authorization") != "Bearer " + up.token:
            self._read_body()
            self._json(401, {"detail": "missing or wrong bearer token"}, (("WWW-Authenticate", "Bearer"),))
            return
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if "websocket" in self.headers.get("Upgrade", "").lower():
            if url.path == "/ws-reject":
                self._json(403, {"detail": "no websocket for you"})
                self.close_connection = True
                return
            if url.path.startswith("/ws-status/"):  # e.g. a job proxy answering 503 for a stopped job
                self._json(int(url.path.split("/")[2]), {"detail": "upgrade answered with a status"})
                self.close_connection = True
                return
            self._websocket()
            return
        body = self._read_body()
        path = url.path
        if path.startswith("/status/"):
            self._json(int(path.rsplit("/", 1)[1]), {"detail": "environment error", "path": path})
        elif path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            n = int(query.get("n", 5))
            for i in range(n):
                if i == n - 1 and query.get("gate"):
                    up.gate.wait(JOIN_S * 2)
                line = ("line %d\n" % i).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                time.sleep(float(query.get("delay", 0)))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/gzip":
            payload = gzip.compress(json.dumps({"compressed": True, "pad": "x" * 2000}).encode(), mtime=0)
            self._send(200, payload, (("Content-Encoding", "gzip"), ("Content-Type", "application/json")))
        elif path == "/big":
            self._send(200, pattern(int(query.get("n", 1 << 20))), (("Content-Type", "application/octet-stream"),))
        elif path == "/close-delimited":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(pattern(int(query.get("n", 100000))))
            self.close_connection = True
        elif path == "/redirect":
            self._send(302, b"", (("Location", "/elsewhere"),))
        elif path == "/slow":
            if query.get("gate"):
                up.gate.wait(float(query.get("s", 10)))
            else:
                time.sleep(float(query.get("s", 1)))
            self._json(200, {"slow": True})
        elif path == "/die-before-response":
            self.close_connection = True
            _hard_close(self.connection)
        elif path == "/die-mid-body":
            self.send_response(200)
            self.send_header("Content-Length", query.get("n", "1000"))
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.close_connection = True
            _hard_close(self.connection)
        else:
            self._json(200, {
                "method": self.command, "target": self.path, "headers": list(self.headers.items()),
                "body_len": len(body), "body_sha256": hashlib.sha256(body).hexdigest(),
                "body": body.decode("utf-8", "replace") if len(body) < 4096 else None,
            })

    def _websocket(self) -> None:
        """Complete the handshake with wsproto from the parsed head, then echo until closed."""
        ws = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
        head = "%s\r\n%s\r\n" % (self.requestline, "".join("%s: %s\r\n" % kv for kv in self.headers.items()))
        ws.receive_data(head.encode("latin-1"))
        sock = self.connection
        self.close_connection = True
        out = b""
        for event in ws.events():
            if isinstance(event, Request):
                out += ws.send(AcceptConnection(extensions=[PerMessageDeflate()]))
            else:
                out += ws.send(RejectConnection())
        sock.sendall(out)
        while ws.state in (ConnectionState.OPEN, ConnectionState.LOCAL_CLOSING, ConnectionState.REMOTE_CLOSING):
            data = self.rfile.read1(65536)  # bytes past the head were buffered: read1 returns them first
            if not data:
                break
            ws.receive_data(data)
            out = b""
            for event in ws.events():
                if isinstance(event, TextMessage):
                    if event.data == "die" and event.message_finished:
                        _hard_close(sock)
                        return
                    if event.data == "ping-me":
                        out += ws.send(Ping(payload=b"srv"))
                        continue
                    if event.data == "close-me":
                        out += ws.send(CloseConnection(code=4001, reason="bye"))
                        continue
                    out += ws.send(Message(data=event.data, message_finished=event.message_finished))
                elif isinstance(event, Pong):
                    out += ws.send(Message(data="pong:" + bytes(event.payload).decode()))
                elif isinstance(event, BytesMessage):
                    out += ws.send(Message(data=event.data, message_finished=event.message_finished))
                elif isinstance(event, Ping):
                    out += ws.send(event.response())
                elif isinstance(event, CloseConnection):
                    if ws.state is not ConnectionState.CLOSED:
                        out += ws.send(event.response())
            if out:
                sock.sendall(out)


def _hard_close(sock: socket.socket) -> None:
    """Drop the TCP connection with an RST-free FIN, as a crashing process would."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class Upstream:
    """A loopback HTTP(S) + WebSocket test upstream (see the module docstring for its routes)."""

    def __init__(self, token: Optional[str] = TEST_TOKEN, tls: Optional[TestCA] = None,
                 host: str = "127.0.0.1") -> None:
        self.token = token
        self.requests: List[Seen] = []
        self.connections = 0
        self.gate = threading.Event()
        self._server = _UpstreamHTTPServer(self, (host, 0), tls.server_context() if tls else None)
        scheme = "https" if tls else "http"
        shown = "[%s]" % host if ":" in host else host
        if tls and host == "127.0.0.1":
            shown = "localhost"  # the certificate covers both; a name exercises SNI
        self.port = self._server.server_address[1]
        self.url = "%s://%s:%d" % (scheme, shown, self.port)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True, name="test-upstream")
        self._thread.start()

    def __enter__(self) -> "Upstream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting, cut every open connection, and join every thread."""
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:
            live = list(self._server.live)
            threads = list(self._server.threads)
        for sock in live:
            _hard_close(sock)
        self._thread.join(JOIN_S)
        for thread in threads:
            thread.join(JOIN_S)

    def kill_connections(self) -> None:
        """Cut every open connection (the server keeps listening)."""
        with self._server.lock:
            live = list(self._server.live)
        for sock in live:
            _hard_close(sock)


class RecordingUpstream:
    """A loopback HTTP/1.1 upstream, a thread per connection, that records each request's bytes
    (Content-Length bodies only) in `seen` and counts connections; `answer` (a subclass's) replies.
    Byte-level on purpose: the proxy tests compare exactly what reached the upstream."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen: List[bytes] = []
        self.connections = 0
        self._socks: List[socket.socket] = []
        self._threads: List[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def answer(self, sock: socket.socket, request: bytes, head_end: int, served: int) -> bool:
        """Reply to the connection's `served`-th request (`request[head_end:]` is its body); False ends
        the connection without a word."""
        raise NotImplementedError

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._socks.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        buf, served = b"", 0
        with sock, contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                end = buf.index(b"\r\n\r\n") + 4
                length = 0
                for line in buf[:end].split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                while len(buf) < end + length:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                request, buf = buf[:end + length], buf[end + length:]
                self.seen.append(request)
                served += 1
                if not self.answer(sock, request, end, served):
                    return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # (wakes the accept; a close alone does not)
        self.listener.close()
        for sock in self._socks:  # (the proxy keeps its pooled connections open)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._accepting.join(5)
        for thread in self._threads:
            thread.join(5)


def _stat_fields(pid: int, thread: Optional[str] = None) -> Optional[List[str]]:
    """The fields of /proc/<pid>/stat (or of one of its threads, /proc/<pid>/task/<thread>/stat) after the command
    name (Linux), or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid if thread is None else "/proc/%d/task/%s/stat" % (pid, thread)) as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def proc_stat(pid: int) -> Optional[Tuple[str, int, int]]:
    """(state, ppid, pgid) of a process from /proc (Linux), or None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[1]), int(fields[2]))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process `pid` has used (Linux); it must be alive."""
    fields = _stat_fields(pid)
    assert fields is not None, "process %d is gone" % pid
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan killed in a test may wait for an init that never reaps it)."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def open_sockets(pid: int) -> int:
    """How many sockets process `pid` holds open (Linux)."""
    count = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            count += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith("socket:")
        except OSError:  # closed since the listing
            pass
    return count


def processes(where: Callable[[Tuple[str, int, int]], bool]) -> List[int]:
    """Pids of the live (non-zombie) processes whose (state, ppid, pgid) satisfy `where`."""
    found = []
    for entry in os.listdir("/proc"):
        stat = proc_stat(int(entry)) if entry.isdigit() else None
        if stat is not None and stat[0] != "Z" and where(stat):
            found.append(int(entry))
    return found


def in_thread(action: Callable[[], object], name: str = "test-action") -> Tuple[threading.Thread, List[object]]:
    """Run `action` in a daemon thread; returns the thread and a list that receives what it returned or the
    exception it raised (never lost: the test reads it)."""
    outcome: List[object] = []

    def run() -> None:
        try:
            outcome.append(action())
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, outcome


class WhenLogged(logging.Handler):
    """Runs `action` the first time a record holding `text` is logged: inline (in the logging thread, before
    the code that logged goes on), else in a thread (`in_thread`: `outcome` gets its result or exception)."""

    def __init__(self, text: str, action: Callable[[], object], inline: bool = False) -> None:
        super().__init__()
        self.text, self.action, self.inline = text, action, inline
        self.thread: Optional[threading.Thread] = None
        self.outcome: List[object] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.thread is None and self.text in record.getMessage():
            if self.inline:
                self.thread = threading.current_thread()
                self.outcome.append(self.action())
            else:
                self.thread, self.outcome = in_thread(self.action, "when-logged")


def ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (`socket.has_ipv6` says only how Python was built: a container may have
    IPv6 off all the same)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Poll `predicate` until it is truthy; fail naming `what` after `timeout_s` (generous: the 2 cores
    may be loaded by other work, and a passing test never waits that long)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.02)


def stop_process(pid: int, group: bool = False) -> None:
    """SIGSTOP process `pid` (or its process group) and wait until every thread of it is stopped. The signal
    stops a thread only once the kernel next schedules it: until then a thread blocked in accept() can still
    take a connection that has just arrived (it checks the queue before the signal), and the test's "frozen"
    process then holds it unanswered (seen under load: a 30 s upgrade timeout)."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)

    def states() -> List[str]:
        found = []
        for each in processes(lambda stat: stat[2] == pid) if group else [pid]:
            for thread in glob.glob("/proc/%d/task/*" % each):
                fields = _stat_fields(each, os.path.basename(thread))
                if fields is not None:
                    found.append(fields[0])
        return found

    wait_until(lambda: all(state in "tTZX" for state in states()), "process %d to stop" % pid, 10)


def python_of(version: Tuple[int, int]) -> Optional[str]:
    """An interpreter of Python `version` (e.g. (3, 9)) when this machine has one (the PATH or pyenv), else None."""
    name = "python%d.%d" % version
    candidates = [shutil.which(name)] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/%d.%d.*/bin/python" % version)))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            probe = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info[:2])"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == str(tuple(version)):
                return candidate
    return None


def vendored_package(parent: str, name: str, modules: Sequence[str]) -> str:
    """Make the package `parent/name` (an empty `__init__.py`) holding byte-for-byte copies of the checkout's
    `modules`, as a user who vendors them has it; return its directory."""
    package = os.path.join(parent, name)
    os.mkdir(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    for module in modules:
        shutil.copyfile(os.path.join(REPO_ROOT, module), os.path.join(package, module))
    return package


def signalled(child: "subprocess.Popen", signum: int, timeout_s: float) -> Tuple[str, str]:
    """Send `signum` to `child` and return its (stdout, stderr) once it ended. A child still running after
    `timeout_s` fails the test with every thread's stack (SIGABRT: start it with PYTHONFAULTHANDLER=1), and
    no process outlives the test."""
    try:
        child.send_signal(signum)
        try:
            return child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)  # faulthandler writes where each thread is stuck
            _, err = child.communicate(timeout=30)
            raise AssertionError("the child outlived signal %d by %ss; its threads:\n%s"
                                 % (signum, timeout_s, err[-6000:])) from None
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


@contextlib.contextmanager
def own_process_proxy() -> Iterator[None]:
    """Meanwhile the core's shared proxy="process" host is one the caller's code starts (not one an earlier
    test left); it is stopped after."""
    import hf_sandbox_provider as hsp

    with hsp._shared_proxy_lock:
        earlier = hsp._shared_proxies.pop("process", None)
    if earlier is not None:
        earlier.stop()
    try:
        yield
    finally:
        with hsp._shared_proxy_lock:
            host = hsp._shared_proxies.pop("process", None)
        if host is not None:
            host.stop()
