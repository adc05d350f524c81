"""Clients and upstream processes for the proxy's differential tests (tests/test_proxy_differential.py).

A *sequence* is a list of client connections, each a list of HTTP *steps*; `run_sequence` plays it
with one client library against a base URL and returns a transcript (per step: status, reason,
end-to-end headers, body, interim responses). The test plays each sequence straight to the upstream
(adding the token itself) and through a freshly mounted proxy route, and compares the transcripts.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Dict, List, NamedTuple, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT_TIMEOUT_S = 10.0
# A test upstream asked to stop is killed after this long: a clean exit is not what any test checks.
UPSTREAM_STOP_GRACE_S = 2.0

# Headers left out of the comparison: hop-by-hop ones (RFC 9110 section 7.6.1, which a proxy must
# not forward and re-frames: chunked vs close-delimited), and Date (a clock, not content).
UNCOMPARED_HEADERS = frozenset(["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "te",
                                "trailer", "transfer-encoding", "upgrade", "date"])
# Statuses the proxy makes itself: a proxy-made 502/504 that the direct run did not get is a failure.
PROXY_MADE = frozenset([502, 504])


class Step(NamedTuple):
    method: str
    size: int  # response body size asked for
    mode: str  # "length", "chunked" or "close" (response framing; "close" only on the stdlib upstream)
    status: int
    gzip: bool
    slow: bool
    interim: bool  # ask for a 103 first (stdlib upstream only)
    close: bool  # the upstream answers Connection: close
    body: str  # request body framing: "none", "length" or "chunked"
    body_size: int
    expect: bool  # Expect: 100-continue (raw client)
    abandon: bool  # the client reads the head and 1 body byte, then drops the connection (raw client)
    idle: float  # seconds to wait before the request (stale pooled connections)

    def target(self) -> str:
        query = [("size", str(self.size)), ("mode", self.mode), ("status", str(self.status))]
        for name in ("gzip", "slow", "interim", "close"):
            if getattr(self, name):
                query.append((name, "1"))
        return "/r?" + urllib.parse.urlencode(query)

    def request_body(self) -> bytes:
        return hashlib.sha256(b"req%d" % self.body_size).digest() * (self.body_size // 32) + b"x" * (self.body_size % 32)


class Sequence(NamedTuple):
    upstream: str
    client: str  # "raw", "requests", "httpx", "http.client"
    connections: List[List[Step]]
    pipelined: bool  # raw client: each connection's requests are sent at once, answers read after
    http10: bool  # raw client: HTTP/1.0 requests, one per connection


class Target(NamedTuple):
    """Where a run sends its requests: base URL, extra headers (the token, direct only), TLS context."""

    base: str
    headers: Dict[str, str]
    tls: object  # a support.TestCA for https targets (CA path and client context), else None


Outcome = Tuple  # (status, reason, headers, body sha, body length, interims) or ("error",) / ("abandoned", status)


def normalized(headers: List[Tuple[str, str]]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((n.lower(), v) for n, v in headers if n.lower() not in UNCOMPARED_HEADERS))


def outcome(status: int, reason: str, headers: List[Tuple[str, str]], body: bytes,
            interims: Tuple = ()) -> Outcome:
    return (status, reason, normalized(headers), hashlib.sha256(body).hexdigest()[:16], len(body), interims)


# --------------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------------


def run_sequence(seq: Sequence, target: Target) -> List[List[Outcome]]:
    runner = {"raw": _run_raw, "requests": _run_requests, "httpx": _run_httpx, "http.client": _run_http_client}[seq.client]
    return [runner(steps, target, seq) for steps in seq.connections]


def _body_iter(data: bytes):  # type: ignore[no-untyped-def]
    """A body in a few pieces (so clients send it chunked)."""
    step = max(1, len(data) // 3)
    for i in range(0, len(data), step):
        yield data[i:i + step]


def _run_requests(steps: List[Step], target: Target, seq: Sequence) -> List[Outcome]:
    import requests

    out = []
    with requests.Session() as session:
        session.trust_env = False
        for step in steps:
            time.sleep(step.idle)
            data = step.request_body()
            body = None if step.body == "none" else (data if step.body == "length" else _body_iter(data))
            try:
                r = session.request(step.method, target.base + step.target(), data=body, allow_redirects=False,
                                    headers=dict(target.headers, **{"X-Custom": "c%d" % step.size}),
                                    timeout=CLIENT_TIMEOUT_S, verify=target.tls.ca_path if target.tls else True)  # type: ignore[union-attr]
                out.append(outcome(r.status_code, r.reason, list(r.headers.items()), r.content))
            except requests.RequestException as exc:
                out.append(("error", type(exc).__name__))
    return out


def _run_httpx(steps: List[Step], target: Target, seq: Sequence) -> List[Outcome]:
    import httpx

    out = []
    verify = target.tls.ca_path if target.tls else True  # type: ignore[union-attr]
    with httpx.Client(verify=verify, timeout=CLIENT_TIMEOUT_S, trust_env=False) as client:
        for step in steps:
            time.sleep(step.idle)
            data = step.request_body()
            content = None if step.body == "none" else (data if step.body == "length" else _body_iter(data))
            try:
                r = client.request(step.method, target.base + step.target(), content=content,
                                   headers=dict(target.headers, **{"X-Custom": "c%d" % step.size}))
                out.append(outcome(r.status_code, r.reason_phrase, list(r.headers.multi_items()), r.content))
            except httpx.HTTPError as exc:
                out.append(("error", type(exc).__name__))
    return out


def _run_http_client(steps: List[Step], target: Target, seq: Sequence) -> List[Outcome]:
    parts = urllib.parse.urlsplit(target.base)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=CLIENT_TIMEOUT_S, context=target.tls.client_context())  # type: ignore[union-attr]
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=CLIENT_TIMEOUT_S)
    out = []
    try:
        for step in steps:
            time.sleep(step.idle)
            data = step.request_body()
            headers = dict(target.headers, **{"X-Custom": "c%d" % step.size})
            try:
                if step.body == "chunked":
                    conn.request(step.method, parts.path + step.target(), body=_body_iter(data), headers=headers,
                                 encode_chunked=True)
                else:
                    conn.request(step.method, parts.path + step.target(), body=data if step.body == "length" else None,
                                 headers=headers)
                r = conn.getresponse()
                body = r.read()
                out.append(outcome(r.status, r.reason, r.getheaders(), body))
            except (OSError, http.client.HTTPException) as exc:
                out.append(("error", type(exc).__name__))
                conn.close()
    finally:
        conn.close()
    return out


class _RawConnection:
    """A raw socket client: writes exact request bytes and parses answers itself (interim ones too)."""

    def __init__(self, target: Target) -> None:
        parts = urllib.parse.urlsplit(target.base)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=CLIENT_TIMEOUT_S)
        if target.tls is not None:
            sock = target.tls.client_context().wrap_socket(sock, server_hostname=parts.hostname)  # type: ignore[union-attr]
        self.sock, self.path, self.host = sock, parts.path, parts.netloc
        self.rfile = sock.makefile("rb")
        self.target = target

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()

    def request_bytes(self, step: Step, version: str = "HTTP/1.1") -> Tuple[bytes, bytes]:
        """(head, body bytes on the wire) for a step."""
        lines = ["%s %s%s %s" % (step.method, self.path, step.target(), version), "Host: " + self.host,
                 "X-Custom: c%d" % step.size]
        lines += ["%s: %s" % kv for kv in self.target.headers.items()]
        data = step.request_body()
        wire = b""
        if step.body == "length":
            lines.append("Content-Length: %d" % len(data))
            wire = data
        elif step.body == "chunked":
            lines.append("Transfer-Encoding: chunked")
            wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in _body_iter(data) if p) + b"0\r\n\r\n"
        if step.expect and step.body != "none":
            lines.append("Expect: 100-continue")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), wire

    def read_answer(self, method: str, abandon: bool = False) -> Tuple[Outcome, bool]:
        """(outcome, whether the connection stays usable)."""
        interims = []
        while True:
            status, reason, version, headers = self._read_head()
            if status >= 200:
                break
            interims.append((status, normalized(headers)))
        lower = [(n.lower(), v) for n, v in headers]
        tokens = {t.strip().lower() for n, v in lower if n == "connection" for t in v.split(",")}
        keep = "close" not in tokens and version == "HTTP/1.1"
        if abandon:  # one byte of the body if there is one, then drop the connection
            lengths = [v for n, v in lower if n == "content-length"]
            if method != "HEAD" and status not in (204, 304) and lengths != ["0"]:
                self.rfile.read(1)
            return ("abandoned", status), False
        if method == "HEAD" or status in (204, 304):
            body = b""
        elif any(n == "transfer-encoding" for n, _ in lower):
            pieces = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    break
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
            body = b"".join(pieces)
        elif any(n == "content-length" for n, _ in lower):
            body = self.rfile.read(int([v for n, v in lower if n == "content-length"][0]))
        else:
            body, keep = self.rfile.read(), False
        return outcome(status, reason, headers, body, tuple(interims)), keep

    def _read_head(self) -> Tuple[int, str, str, List[Tuple[str, str]]]:
        line = self.rfile.readline(70000)
        if not line:
            raise ConnectionError("closed before an answer")
        version, status, reason = (line.decode("latin-1").rstrip("\r\n").split(" ", 2) + [""])[:3]
        headers = []
        while True:
            line = self.rfile.readline(300000)
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        return int(status), reason, version, headers


def _run_raw(steps: List[Step], target: Target, seq: Sequence) -> List[Outcome]:
    out: List[Outcome] = []
    conn: Optional[_RawConnection] = None
    try:
        if seq.pipelined:
            conn = _RawConnection(target)
            conn.sock.sendall(b"".join(b"".join(conn.request_bytes(step)) for step in steps))
            for step in steps:
                try:
                    result, _ = conn.read_answer(step.method)
                except (OSError, ValueError) as exc:
                    result = ("error", type(exc).__name__)
                out.append(result)
            return out
        for step in steps:
            time.sleep(step.idle)
            if conn is None:
                conn = _RawConnection(target)
            try:
                head, wire = conn.request_bytes(step, "HTTP/1.0" if seq.http10 else "HTTP/1.1")
                if step.expect and step.body != "none":
                    conn.sock.sendall(head)
                    status, reason, _, headers = conn._read_head()
                    if status != 100:
                        raise ValueError("expected 100 Continue, got %d" % status)
                    conn.sock.sendall(wire)
                else:
                    conn.sock.sendall(head + wire)
                result, keep = conn.read_answer(step.method, step.abandon)
            except (OSError, ValueError) as exc:
                result, keep = ("error", type(exc).__name__), False
            out.append(result)
            if not keep or seq.http10:
                conn.close()
                conn = None
    finally:
        if conn is not None:
            conn.close()
    return out


# --------------------------------------------------------------------------------------------------
# Upstream processes
# --------------------------------------------------------------------------------------------------


class UpstreamProcess:
    """One upstream server in its own process (uvicorn or stdlib), its URL and how to stop it."""

    def __init__(self, name: str, script: str, token: str, tls_files: Optional[Tuple[str, str]] = None,
                 extra: Tuple[str, ...] = ()) -> None:
        args = [sys.executable, os.path.join(HERE, "upstreams", script)] + list(extra)
        if tls_files:
            args += ["--tls", tls_files[0], tls_files[1]]
        env = dict(os.environ, DIFF_TOKEN=token)
        self.name = name
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line.strip():
            self.stop()
            raise RuntimeError("upstream %s did not start" % name)
        self.port = int(line)
        self.url = "%s://%s:%d" % ("https" if tls_files else "http", "localhost" if tls_files else "127.0.0.1", self.port)
        self.tls = tls_files is not None
        self._wait_listening()

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("upstream %s is not listening" % self.name)

    def stop(self) -> None:
        self.process.terminate()
        try:  # (uvicorn waits for handlers still in flight, e.g. a test's 30 s wait the proxy gave up on)
            self.process.wait(UPSTREAM_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_upstreams(specs: List[Tuple[str, str, bool, Tuple[str, ...]]], token: str,
                    tls_files: Tuple[str, str]) -> Dict[str, UpstreamProcess]:
    """Start the upstreams in parallel (uvicorn's import takes a second each)."""
    started: Dict[str, UpstreamProcess] = {}
    errors: List[BaseException] = []

    def start(name: str, script: str, tls: bool, extra: Tuple[str, ...]) -> None:
        try:
            started[name] = UpstreamProcess(name, script, token, tls_files if tls else None, extra)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=spec) for spec in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for up in started.values():
            up.stop()
        raise errors[0]
    return started
