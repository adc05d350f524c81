"""A loopback auth proxy fronting remote OpenEnv servers (HF Jobs exposed ports) for local clients.

`AuthProxy` listens on 127.0.0.1 and forwards `http://127.0.0.1:<port>/<route-id>/<rest>` to
`<upstream>/<rest>` with the route's bearer token injected (route ids are unguessable), so
unmodified OpenEnv clients (HTTP and WebSocket) talk to a token-protected job without seeing it.
`mount_replicas` spreads WebSocket sessions over several jobs of one server (fewest open first).

The shape: an `http.server.ThreadingHTTPServer` whose connections run on a pool of worker threads
(at most MAX_WORKERS, then `503 proxy-busy`). A worker parses each request with one strict parser,
forwards it over a keep-alive connection from the upstream host's pool (TCP or `ssl.SSLSocket`) and
streams the answer back. A WebSocket upgrade gets a connection of its own; after its 101 the session
is a tunnel of two threads, one per direction, copying raw bytes. Blocking sockets only: no event
loop. Standard library only.

`AuthProxy.spawn()` serves one from a child process (module `proxy_host`, loaded on use);
`python proxy.py UPSTREAM_URL` fronts one job from the command line.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import functools
import http.server
import importlib
import ipaddress
import json
import logging
import os
import queue
import re
import secrets
import select
import signal
import socket
import socketserver
import ssl
import struct
import sys
import threading
import time
import urllib.parse
import weakref
from itertools import repeat
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping,
                    NamedTuple, Optional, Sequence, Set, Tuple, Union)

try:
    import resource  # Unix only: the open-files limit, named in refusals and raised by the CLI
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import proxy_host

__all__ = ["AuthProxy", "Route", "ReplicaRoute", "Refusal", "InsecureURLError"]

log = logging.getLogger("proxy")

# --- Constants ------------------------------------------------------------------------------------

# The stdlib's 5 resets a burst of environments connecting at once (kernel cap: somaxconn).
LISTEN_BACKLOG = 4096
# An idle keep-alive client connection is closed after this long: training loops idle between
# episodes, and clients reconnect transparently.
CLIENT_IDLE_TIMEOUT_S = 300.0
# A started request head must be complete within this: a client dripping bytes cannot hold a thread.
HEADER_TIMEOUT_S = 30.0
# Request head limits: the header section (the stdlib caps only each line), count, request line.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_REQUEST_LINE = 64 * 1024
# A chunk-size line ("1a2b;ext=...") longer than this is malformed, not a real chunk header.
MAX_CHUNK_LINE = 4096
# Request bodies up to this size are read before forwarding, so they can be replayed on a fresh
# connection when a pooled one turns out stale; bigger ones are streamed.
REPLAYABLE_BODY_BYTES = 1024 * 1024
# Response bodies up to this size are read before answering so headers and body leave in one send.
SMALL_RESPONSE_BYTES = 64 * 1024
# Upstream response heads up to this size are relayed, with no line or count limit: at least as
# permissive as the Python clients (http.client stops at 100 lines, h11 at 16 KiB), still bounded.
MAX_RESPONSE_HEAD_BYTES = 256 * 1024
# Interim (1xx) responses relayed before the final one; an upstream sending more is looping: 502.
MAX_INTERIM_RESPONSES = 32
# Socket read size for streaming bodies: a 1 MiB frame moves in a few calls.
IO_CHUNK = 64 * 1024
# Read size of each tunnel direction: OpenEnv frames are a few hundred bytes, and every held
# session's two threads wait in recv with a buffer this size.
TUNNEL_READ_BYTES = 16 * 1024
# How often a pending upgrade checks its client, so one that hung up frees its thread at once.
TUNNEL_WATCH_S = 0.5
# Idle upstream connections kept per host; more concurrent requests simply open more.
POOL_MAX_IDLE = 64
# A request waits for its answer in blocking reads this long, checking between them that the client
# is still there (one that timed out retries elsewhere): no poll() per request.
ANSWER_WATCH_S = 0.5
# Pooled connections idle longer are not reused: uvicorn (OpenEnv's server) closes them after 5 s.
POOL_IDLE_S = 4.0
# TLS contexts kept (by `verify`, least recently used dropped): one with the system store is ~1 MiB.
TLS_CONTEXTS_KEPT = 8
# Random bytes of a route id (`secrets.token_urlsafe`): 192 bits, 32 URL-safe characters, unguessable.
ROUTE_ID_BYTES = 24
# How long stop() waits for each thread it started before naming it as left behind.
STOP_JOIN_S = 5.0
# Worker threads at most: a keep-alive connection holds one, a WebSocket session two. At the cap a
# new connection (or an upgrade short of its second thread) is answered 503 `proxy-busy` with
# `Retry-After` rather than queued behind connections that may last hours.
MAX_WORKERS = 16384
# A parked worker with no work for this long ends: a trainer's next batch of sessions finds the
# threads the last one left, and a burst's thousands of threads do not outlive it by much.
WORKER_IDLE_S = 60.0
# Stack per worker thread (default: 8 MiB of address space). 1 MiB: with 256 KiB Python 3.9/3.10
# crashed at a recursion depth of 700-800 (the default limit: 1,000), and user code runs on workers
# (callables, hooks, log handlers), as may a thread started elsewhere while a worker starts (the size
# is process-wide then). Under 2 MiB, so never backed by a transparent huge page; RSS is what is used.
WORKER_STACK_BYTES = 1024 * 1024
# Seconds a client is asked to wait (Retry-After) when the proxy is at MAX_WORKERS.
BUSY_RETRY_AFTER_S = 1
# accept() failing for want of a file descriptor (the process's: EMFILE, `ulimit -n`; the system's:
# ENFILE) leaves the connection queued and the next accept() fails at once: a spin, and a client
# that hangs. The listener sheds one connection per failure with a spare descriptor it keeps (a
# 503), and without one pauses this long.
OUT_OF_FILES_PAUSE_S = 0.1
_OUT_OF_FILES_ERRNOS = (errno.EMFILE, errno.ENFILE)
# At the cap thousands of connections a second may be refused: one WARNING per this many seconds,
# with the count since the previous one.
BUSY_WARNING_EVERY_S = 10.0
# `python proxy.py` only: the GIL switch interval (the default 5 ms makes thousands of tunnel
# threads a context-switch storm; the library leaves this process-wide setting alone).
CLI_SWITCH_INTERVAL_S = 0.1
# On Linux the kernel enforces socket timeouts (SO_RCVTIMEO/SO_SNDTIMEO), saving the poll Python
# makes before every recv and send; elsewhere timeval layouts differ.
KERNEL_TIMEOUTS = sys.platform.startswith("linux")

# HTTP on a replica route: OpenEnv's /reset and /step keep state per server, so only these GET
# endpoints, stateless on every OpenEnv server, may go to any replica (unless http="any").
STATELESS_HTTP_PATHS = frozenset(["/health", "/metadata", "/schema"])
# Upgrade answers meaning "this replica is down" (the HF jobs proxy's, for a job gone or not
# listening): the upgrade never reached the environment, so it is safe to retry.
REPLICA_DOWN_STATUSES = frozenset([502, 503, 504])
# A failed upgrade is retried on one other replica: failing twice, the request is likely at fault.
REPLICA_ATTEMPTS = 2

# RFC 9110 section 7.6.1 hop-by-hop headers (plus the legacy Proxy-Connection). `Expect` is answered
# by the proxy itself, and `Authorization`/`Host` are always replaced, so they never pass through.
HOP_BY_HOP = frozenset(["connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"])
REPLACED_REQUEST_HEADERS = frozenset(["authorization", "host", "expect", "content-length"])
_NOT_FORWARDED = HOP_BY_HOP | REPLACED_REQUEST_HEADERS
# Methods whose repetition has no extra effect (RFC 9110 section 9.2.2): safe to retry once on a
# fresh connection when a pooled one died before answering.
IDEMPOTENT_METHODS = frozenset(["GET", "HEAD", "OPTIONS", "PUT", "DELETE"])
# Refused with 405: CONNECT (not a forward proxy) and TRACE (RFC 9110 section 9.3.8: an upstream that
# implements it echoes the request it got, the injected token too, back to the client).
REFUSED_METHODS = frozenset(["CONNECT", "TRACE"])
# An RFC 9110 token: a method, a header name.
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_TOKEN_RE = re.compile("^" + _TOKEN + "$")
# Request targets: visible ASCII only (anything else must be percent-encoded by the client).
_BAD_TARGET_CHAR_RE = re.compile(r"[^\x21-\x7e]")
# Header values: no control characters but tab (CR/LF only appear in obs-folds, normalised later).
_BAD_VALUE_CHAR_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# The same characters as bytes, for `bytes.translate` to delete: a head that loses none holds none.
_CONTROL_BYTES = bytes(range(0, 9)) + b"\x0b\x0c" + bytes(range(14, 32)) + b"\x7f"
# Characters a header value set by a route_request hook may not hold: those, CR, LF, and any beyond
# Latin-1 (the head goes out as Latin-1).
_BAD_EDIT_CHAR_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\u0100-\U0010ffff]")
_STATUS_LINE_RE = re.compile(rb"^HTTP/1\.[01] (\d{3})(?: |\r?$)")
_RESPONSE_LINE_RE = re.compile(r"^HTTP/1\.([01]) ([0-9]{3})(?: (.*))?$")
# One response header line: token name, colon, the value after its leading blanks (trailing ones are
# relayed: http.client keeps them) with no control character but tab, CRLF or LF.
_RESPONSE_FIELD_RE = re.compile("(" + _TOKEN + r"):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)\r?\n")
# A response head relayed byte for byte, as its parse would rebuild it: HTTP/1.1 with a reason,
# `Name: value` fields, CRLF line ends (other checks: _parse_answer).
_PLAIN_ANSWER_RE = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9]) ([^\r\n]*)\r\n(?:"
                              + _TOKEN.encode() + rb": (?:[^\r\n \t][^\r\n]*)?\r\n)*\r\n")
# In a lower-cased head: a field the proxy drops (HOP_BY_HOP) or reframes.
_REWRITTEN_FIELD_RE = re.compile(
    rb"\r\n(?:%s):" % b"|".join(name.encode() for name in sorted(HOP_BY_HOP)))
# A request line: three parts, one space apart (the target and method are checked when dispatched);
# the usual one, a token method and an origin-form target, needs no _target_refusal.
_REQUEST_LINE_RE = re.compile(r"([^ ]*) ([^ ]*) (HTTP/1\.[0-9])")
_ORIGIN_REQUEST_LINE_RE = re.compile("(" + _TOKEN + r") (/[\x21-\x7e]*) (HTTP/1\.[0-9])")
# One request header line: token name, colon, the rest up to its LF (_read_request drops CRs and the
# value's blanks); control characters in a value are refused at dispatch (_BAD_VALUE_REFUSAL).
_HEADER_LINE_RE = re.compile("(" + _TOKEN + r"):([^\n]*)\n")

# recv() flags that look at the next byte without taking it or waiting for it.
_PEEK_NOW = socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)

Token = Union[str, Callable[[], str], None]
Verify = Union[bool, str]
# Extra per-route request headers (e.g. a pooled sandbox's X-Sandbox-Token): a mapping, or a
# zero-argument callable returning one, read at each request because such credentials rotate.
ExtraHeaders = Union[Mapping[str, str], Callable[[], Mapping[str, str]], None]
# Header names a route's extra headers may not set: the proxy frames the request and names the host
# itself, and hop-by-hop headers describe the proxy's own connection, not the request.
PROXY_SET_HEADERS = HOP_BY_HOP | frozenset(["host", "content-length", "expect"])
# `mount_replicas(http=...)`: "refuse" forwards only STATELESS_HTTP_PATHS, "any" all HTTP.
HTTP_MODES = ("refuse", "any")


class InsecureURLError(ValueError):
    """Raised by `mount` for an upstream that would carry the token in clear text off this host."""


class Refusal(NamedTuple):
    """A request the proxy answers itself, as JSON with `X-Proxy-Error` (unless `proxy_error=False`:
    for a subclass answering like the server it stands in for, e.g. the HF Jobs emulator's 401)."""

    status: int  # e.g. 401, 404
    kind: str  # short machine word, e.g. "unauthorized", "unknown-route"
    message: str  # human sentence, goes in the JSON body
    headers: Tuple[Tuple[str, str], ...] = ()  # e.g. (("WWW-Authenticate", "Bearer"),)
    proxy_error: bool = True  # send `X-Proxy-Error: <kind>`
    body: Optional[Dict[str, object]] = None  # extra JSON fields, e.g. which replicas failed


# --- Public API -----------------------------------------------------------------------------------


class Route:
    """One mounted upstream: where to forward, the token to inject (None: none), TLS verify and
    extra request headers (`ExtraHeaders`).

    Keep-alive connections live in a pool per upstream host shared by the routes of one `AuthProxy`
    (many sandboxes behind one host job: one TLS handshake per connection, not per sandbox). A route
    owns its in-flight requests and tunnels: closing it (`AuthProxy.unmount`) ends them all.
    """

    def __init__(self, upstream: str, token: Token, verify: Verify = True,
                 headers: ExtraHeaders = None, host_pools: Optional["_HostPools"] = None) -> None:
        _raise_if_rejected(_upstream_rejection(upstream))
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme.lower() == "http" and not _is_loopback_host(parts.hostname or ""):
            raise InsecureURLError(
                "refusing cleartext upstream %s://%s: the token would cross the network "
                "unencrypted; use https:// (http:// is only allowed for loopback hosts)"
                % (parts.scheme, parts.netloc))
        _raise_if_rejected(_token_rejection(token) or _verify_rejection(verify)
                           or _extra_headers_rejection(headers, token is not None))
        self.upstream: str = upstream
        self.token: Token = token
        self._checked_token: Optional[str] = token if isinstance(token, str) else None  # validated
        self.verify: Verify = verify
        self.scheme: str = parts.scheme.lower()
        self.host: str = parts.hostname or ""
        default_port = 443 if self.scheme == "https" else 80
        self.port: int = parts.port or default_port
        self.base_path: str = parts.path.rstrip("/")
        # An IP literal needs no getaddrinfo per connection; names are resolved per connection (DNS
        # answers change). A name under `localhost` is loopback (RFC 6761): resolvers need not know.
        try:
            self._ip_family: Optional[int] = (
                socket.AF_INET6 if ipaddress.ip_address(self.host).version == 6 else socket.AF_INET)
        except ValueError:
            self._ip_family = None
        self._dial_host = ("localhost" if self.host.lower().rstrip(".").endswith(".localhost")
                           else self.host)
        host_header = "[%s]" % self.host if ":" in self.host else self.host
        if self.port != default_port:
            host_header += ":%d" % self.port
        self.host_header: str = host_header
        self.label: str = "%s://%s" % (self.scheme, host_header)
        self.headers: ExtraHeaders = headers  # never logged or shown: it may hold credentials
        self._fixed_headers: Tuple[Tuple[str, str], ...] = (
            () if headers is None or callable(headers) else tuple(headers.items()))
        self._lock = threading.Lock()  # tunnels and failure runs; never the pool
        # The host's idle connections (newest on the right), and this route's in flight, so close()
        # can abort a request still streaming. Lock-free: see _checkout.
        self._host_pools = host_pools or _HostPools()
        self._pool = self._host_pools.acquire((self.scheme, self.host, self.port, verify))
        self._active: Set[_UpstreamConnection] = set()
        self._connecting: Set[socket.socket] = set()  # sockets connecting or in their handshake
        self._tunnels: Set[_Tunnel] = set()  # WebSocket sessions, from their upgrade's connect on
        self._closed = False
        # The current run of upstream failures: a booting job fails every probe the same way, so
        # one WARNING per run (and one INFO on recovery).
        self._failing_kind: Optional[str] = None
        self._failures_in_run = 0

    def __repr__(self) -> str:
        verify = self.verify if isinstance(self.verify, bool) else "<ca bundle>"
        return "Route(%s, token=%s, verify=%s%s)" % (
            self.label, "set" if self.token is not None else "None", verify,
            "" if self.headers is None else ", headers=set")

    def current_token(self) -> Optional[str]:
        """The token to inject now: the string, or the callable's answer (read per request)."""
        token = self.token
        if token is self._checked_token:  # fixed and checked, or None: no work per request
            return token
        value = _called_token(token)
        if not callable(token):
            self._checked_token = value  # (a string or None assigned to `token` after mount)
        return value

    def current_headers(self) -> Tuple[Tuple[str, str], ...]:
        """The extra headers to send now: the mapping's, or the callable's answer."""
        headers = self.headers
        if not callable(headers):
            return self._fixed_headers
        answer = headers()
        if not isinstance(answer, Mapping):
            reason = "the headers callable returned %s, not a mapping" % type(answer).__name__
        else:
            reason = _extra_headers_rejection(answer, self.token is not None)
        if reason:
            raise ValueError(reason)
        return tuple(answer.items())

    def note_failure(self, kind: str) -> bool:
        """Record an upstream failure of `kind`; True when it starts a run (worth a WARNING)."""
        with self._lock:
            news = kind != self._failing_kind
            self._failing_kind = kind
            self._failures_in_run += 1
            return news

    def note_answer(self) -> None:
        """Record that the upstream answered; ends a run of failures with one INFO line."""
        if self._failing_kind is None:  # the common case, without the lock
            return
        with self._lock:
            kind, count = self._failing_kind, self._failures_in_run
            self._failing_kind, self._failures_in_run = None, 0
        if kind is not None:
            log.info("proxy: %s answering again after %d failed attempt(s) (%s)", self.label,
                     count, kind)

    def close(self) -> List[str]:
        """Abort this route's in-flight requests and tunnels, close the host's pooled connections if
        no other route uses them; return what could not be closed. Safe to call twice."""
        with self._lock:
            was_closed, self._closed = self._closed, True
            tunnels = list(self._tunnels)
        idle = [] if was_closed else self._host_pools.release(self._pool)
        problems = ["pooled connection to %s (%s)" % (self.label, problem)
                    for problem in map(_quiet_close, idle) if problem]
        for sock in [conn.sock for conn in self._active.copy()] + list(self._connecting.copy()):
            _abort_socket(sock)
        for tunnel in tunnels:
            tunnel.cut_off()
        return problems

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context for this upstream, honouring `verify` like requests (bool or CA path),
        shared by the routes with the same `verify` (a CA bundle edited since is read again)."""
        pool = self._pool
        if pool.tls_context is None:
            pool.tls_context = _shared_tls_context(pool.key[3])
        return pool.tls_context

    # -- machinery (used by the request handler) ------------------------------------------------

    def _set_label(self, name: str) -> None:
        """Name the route in logs, e.g. "route-3 (https://host)"."""
        self.label = "%s (%s)" % (name, self.label)

    def _checkout(self, proxy: AuthProxy, new: bool = False) -> Tuple["_UpstreamConnection", bool]:
        """A keep-alive connection to the upstream: a pooled one if fresh (unless `new`: a retry's,
        as the pooled ones may be stale alike), else a new one. No lock
        (every request of a route would queue on it): deque and set operations are atomic, and the
        liveness check runs on a connection this thread alone holds. A route closing is caught by
        re-reading `_closed` once registered (close() sets it before reading the set)."""
        if self._closed:
            raise ConnectionAbortedError("route was unmounted")
        cutoff = time.monotonic() - POOL_IDLE_S
        while not new:
            try:
                conn = self._pool.idle.pop()  # the most recently used: the least likely to be stale
            except IndexError:
                break
            # an idle keep-alive connection that is readable was closed (or holds stray bytes)
            if conn.since >= cutoff and not conn.reader.buf and not conn.has_input():
                return self._register(conn), True
            conn.close()
        sock = self._connect(proxy.connect_timeout_s)
        slice_s = min(ANSWER_WATCH_S, proxy.read_timeout_s)  # see _UpstreamConnection
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https":  # handshakes now, within the connect timeout
                sock = self.tls_context().wrap_socket(sock, server_hostname=self.host,
                                                      do_handshake_on_connect=False)
                self._dialing(sock, sock.do_handshake)
                sock.settimeout(slice_s)
            else:
                _set_socket_timeout(sock, slice_s, send_timeout=proxy.read_timeout_s)
            conn = _UpstreamConnection(sock, proxy.read_timeout_s)
        except BaseException:
            sock.close()
            raise
        return self._register(conn), False

    def _register(self, conn: "_UpstreamConnection") -> "_UpstreamConnection":
        self._active.add(conn)
        if self._closed:
            self._active.discard(conn)
            conn.close()
            raise ConnectionAbortedError("route was unmounted")
        return conn

    def _checkin(self, conn: "_UpstreamConnection", reusable: bool) -> None:
        """Return a connection after its response was fully read (reusable) or close it."""
        self._active.discard(conn)
        pool, idle = self._pool, self._pool.idle
        # Not a closing route's: close() may have listed it as active and be about to abort it, under
        # another route's request. (Read after the discard: a close() that misses it has not begun.)
        if not reusable or self._closed or pool.closed or len(idle) >= POOL_MAX_IDLE:
            conn.close()
            return
        conn.since = now = time.monotonic()
        idle.append(conn)
        cutoff = now - POOL_IDLE_S
        try:  # evict the oldest so they do not linger (IndexError: another thread emptied it)
            while idle[0].since < cutoff:
                old = idle.popleft()
                if old.since >= cutoff:  # another thread checked it in meanwhile: keep it
                    idle.append(old)
                    break
                old.close()
        except IndexError:
            pass
        if pool.closed:  # the pool's last route closed while we appended: it may have missed it
            for late in _drain(idle):
                late.close()

    def _connect(self, timeout: float) -> socket.socket:
        """A TCP socket connected to the upstream with `timeout` set, each address tried in turn (as
        socket.create_connection does) where close() can abort it."""
        addresses = ([(self._ip_family, (self.host, self.port))] if self._ip_family is not None else
                     [(info[0], info[4]) for info in socket.getaddrinfo(
                         self._dial_host, self.port, type=socket.SOCK_STREAM)])
        error: Optional[OSError] = None
        for family, address in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                self._dialing(sock, functools.partial(sock.connect, address))
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error or OSError("getaddrinfo returned no address for %s" % self.label)

    def _dialing(self, sock: socket.socket, step: Callable[[], object]) -> None:
        """step() (a connect, a TLS handshake) with `sock` listed for close() to abort: an upstream that
        never answers holds neither an unmount nor stop() for connect_timeout_s."""
        self._connecting.add(sock)
        try:
            if self._closed:  # (close() sets it before reading the set)
                raise ConnectionAbortedError("route was unmounted")
            step()
        finally:
            self._connecting.discard(sock)

    def _add_tunnel(self, tunnel: "_Tunnel") -> bool:
        with self._lock:
            if self._closed:
                return False
            self._tunnels.add(tunnel)
            return True

    def _remove_tunnel(self, tunnel: "_Tunnel") -> None:
        with self._lock:
            self._tunnels.discard(tunnel)


class _HostPool:
    """The idle connections and TLS context of one upstream host (scheme, host, port, verify),
    shared by the routes that use it (`users`); closed with the last of them."""

    def __init__(self, key: Tuple[str, str, int, Verify]) -> None:
        self.key = key
        self.idle: "collections.deque[_UpstreamConnection]" = collections.deque()
        self.users = 0
        self.closed = False
        self.tls_context: Optional[ssl.SSLContext] = None  # made by Route.tls_context


class _HostPools:
    """The host pools of one `AuthProxy` (or of one stand-alone route), by their key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: Dict[Tuple[str, str, int, Verify], _HostPool] = {}

    def acquire(self, key: Tuple[str, str, int, Verify]) -> _HostPool:
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _HostPool(key)
            pool.users += 1
            return pool

    def release(self, pool: _HostPool) -> List["_UpstreamConnection"]:
        """One user fewer; when it was the last, close the pool and return its idle connections."""
        with self._lock:
            pool.users -= 1
            if pool.users > 0:
                return []
            # set before draining: a late check-in sees it and closes its connection
            pool.closed = True
            if self._pools.get(pool.key) is pool:
                del self._pools[pool.key]
        return _drain(pool.idle)


def _drain(idle: "collections.deque[_UpstreamConnection]") -> List["_UpstreamConnection"]:
    """Take every connection out of an idle deque (safe against concurrent appends and pops)."""
    drained = []
    with contextlib.suppress(IndexError):
        while True:
            drained.append(idle.popleft())
    return drained


class ReplicaRoute:
    """One route id in front of K upstreams running the same server (e.g. K jobs of one image),
    made by `AuthProxy.mount_replicas`; each replica is a `Route`. Each new WebSocket session goes
    to the live replica with the fewest open sessions (ties: round robin). A replica whose upgrade
    fails (no connection, TLS, timeout, or a 502/503/504 answer) leaves rotation (logged, and in
    `status()`) and the session is retried once on another; sessions on a replica that dies end.
    HTTP gets 409 but for `GET`/`HEAD` of `STATELESS_HTTP_PATHS`, unless `http="any"`: a stateful
    request cannot pick its replica."""

    base_path = ""  # each replica's own base path is added when a request is sent to it

    def __init__(self, upstreams: Sequence[str], token: Token, verify: Verify = True,
                 http: str = "refuse") -> None:
        _raise_if_rejected(_replicas_rejection(upstreams) or _http_mode_rejection(http))
        self.token: Token = token
        self.verify: Verify = verify
        self.http: str = http
        self.label: str = "replica route"
        self._lock = threading.Lock()
        self._adding = threading.Lock()  # add(): looking a URL up and adding it are one step
        self._next = 0  # round-robin start among replicas tied on open sessions
        self._created = 0  # replicas ever added: numbers them in logs (never reused)
        self._closed = False
        self._replicas: List[_Replica] = []
        for upstream in upstreams:
            self._add_replica(upstream)

    def __repr__(self) -> str:
        with self._lock:
            live, total = sum(r.healthy for r in self._replicas), len(self._replicas)
        return "ReplicaRoute(%d/%d replicas live, token=%s, http=%r)" % (
            live, total, "set" if self.token is not None else "None", self.http)

    def current_token(self) -> Optional[str]:
        """The token every replica injects now (the string, or the callable's answer)."""
        return _called_token(self.token)

    def status(self) -> List[Dict[str, object]]:
        """One dict per replica, in mount order: `upstream` (the URL as mounted: no secret),
        `open_sessions` (open or opening), `healthy`, `reason` (why it left rotation, or None)."""
        with self._lock:
            return [{"upstream": r.route.upstream, "open_sessions": r.open_sessions,
                     "healthy": r.healthy, "reason": r.reason} for r in self._replicas]

    def add(self, upstream: str) -> bool:
        """Add a replica, or put a failed one back in rotation; False if it was already live."""
        _raise_if_rejected(_replicas_rejection([upstream]))
        with self._adding:
            with self._lock:
                for replica in self._replicas:
                    if replica.route.upstream == upstream:
                        readmitted = not replica.healthy
                        replica.healthy, replica.reason = True, None
                        if readmitted:
                            log.info("proxy: %s is back in rotation", replica.route.label)
                        return readmitted
            log.info("proxy: %s added", self._add_replica(upstream).route.label)
            return True

    def remove(self, upstream: str) -> bool:
        """Take a replica out for good and end its open sessions; False if no such replica."""
        with self._lock:
            found = [r for r in self._replicas if r.route.upstream == upstream]
            self._replicas = [r for r in self._replicas if r.route.upstream != upstream]
        for replica in found:
            problems = replica.route.close()
            log.info("proxy: %s removed%s", replica.route.label,
                     (" (could not close: %s)" % ", ".join(problems)) if problems else "")
        return bool(found)

    def close(self) -> List[str]:
        """Close every replica's connections and tunnels; return what could not be closed."""
        with self._lock:
            self._closed = True
            replicas = list(self._replicas)
        return [problem for replica in replicas for problem in replica.route.close()]

    # -- machinery (used by the request handler) ------------------------------------------------

    def _add_replica(self, upstream: str) -> "_Replica":
        """Put a new replica of `upstream` in rotation (RuntimeError once the route is closed)."""
        route = Route(upstream, self.token, self.verify)  # validates the URL, the token and verify
        with self._lock:
            if not self._closed:
                self._created += 1
                replica = _Replica(route, self._created, self.label)
                self._replicas.append(replica)
                return replica
        route.close()
        raise RuntimeError("this replica route was unmounted; mount a new one")

    def _set_label(self, label: str) -> None:
        """Name the route in logs (e.g. "route-3"); a replica is "<label> replica-<n> (<host>)"."""
        with self._lock:
            self.label = label
            for replica in self._replicas:
                replica.set_label(label)

    def _acquire(self, exclude: Sequence["_Replica"] = (),
                 reserve: bool = True) -> Optional["_Replica"]:
        """The live replica with the fewest open sessions (ties: round robin) but `exclude`, with a
        session slot reserved (freed by `_release`) unless `reserve` is False; None if none left."""
        with self._lock:
            candidates = [(r.open_sessions, (i - self._next) % len(self._replicas), i, r)
                          for i, r in enumerate(self._replicas) if r.healthy and r not in exclude]
            if not candidates:
                return None
            _, _, index, chosen = min(candidates)  # (no tie: each distance from _next differs)
            self._next = index + 1
            if reserve:
                chosen.open_sessions += 1
            return chosen

    def _release(self, replica: "_Replica") -> None:
        with self._lock:
            replica.open_sessions -= 1

    def _mark_failed(self, replica: "_Replica", reason: str) -> None:
        with self._lock:
            was_healthy, replica.healthy, replica.reason = replica.healthy, False, reason
        if was_healthy:
            log.warning("proxy: %s taken out of rotation: %s", replica.route.label, reason)

    def _failure_summary(self) -> Tuple[int, List[Dict[str, object]]]:
        with self._lock:
            return len(self._replicas), [{"replica": r.number, "reason": r.reason}
                                         for r in self._replicas if not r.healthy]


class _Replica:
    """One upstream of a `ReplicaRoute`: its `Route`, number in logs, and rotation state (under the
    route's lock): open sessions, whether in rotation, and if not why."""

    def __init__(self, route: Route, number: int, route_label: str) -> None:
        self.route, self.number, self.open_sessions, self.healthy = route, number, 0, True
        self.reason: Optional[str] = None
        self.set_label(route_label)

    def set_label(self, route_label: str) -> None:
        route = self.route  # named by scheme://host[:port]: no path, no secret
        route.label = "%s replica-%d (%s://%s)" % (route_label, self.number, route.scheme,
                                                  route.host_header)


AnyRoute = Union[Route, ReplicaRoute]


class AuthProxy:
    """A loopback HTTP + WebSocket auth proxy: one listener, many routes, threads only.

    Use as a context manager, or `start()` / `stop()`. `mount(upstream, token)` returns the base URL
    a client uses in place of the upstream's. A subclass may override `route_request` (the HF Jobs
    emulator's token gate does)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, connect_timeout_s: float = 10.0,
                 read_timeout_s: float = 300.0, idle_timeout_s: float = CLIENT_IDLE_TIMEOUT_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        timeouts = {"connect_timeout_s": connect_timeout_s, "read_timeout_s": read_timeout_s,
                    "idle_timeout_s": idle_timeout_s, "header_timeout_s": header_timeout_s}
        for name, value in timeouts.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError("%s must be a positive number of seconds, got %r" % (name, value))
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError("port must be an integer from 0 to 65535 (0 picks a free port), got "
                             "%r" % (port,))
        if not isinstance(host, str) or not host:
            raise ValueError("host must be an address to bind, e.g. '127.0.0.1', got %r" % (host,))
        self.host = host
        self.connect_timeout_s = float(connect_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.header_timeout_s = float(header_timeout_s)
        self._requested_port = port
        self._lock = threading.Lock()
        self._routes: Dict[str, AnyRoute] = {}
        self._host_pools = _HostPools()  # shared by the routes to one upstream host
        # Every route a request reached: stop() also closes those a subclass's route_request made.
        self._seen_routes: "weakref.WeakSet[AnyRoute]" = weakref.WeakSet()
        self._route_count = 0
        self._server: Optional[_Server] = None
        self._serve_thread: Optional[threading.Thread] = None
        self._stopping = False

    @classmethod
    def spawn(cls, host: str = "127.0.0.1", port: int = 0, *, processes: int = 1,
              **timeouts: float) -> "proxy_host.AuthProxyProcess":
        """Serve an AuthProxy (the constructor's arguments) from a child process that ends with
        this one, so relaying costs this GIL nothing; return its started `AuthProxyProcess` (module
        `proxy_host`; the routes API, tokens sent over a private channel). `processes=N` (Linux): N
        children sharing the port (SO_REUSEPORT), every route mounted in each."""
        try:  # (relative inside a package)
            layer = importlib.import_module(("." if __package__ else "") + "proxy_host",
                                            __package__ or None)
        except ModuleNotFoundError as exc:
            if exc.name not in ("proxy_host", "%s.proxy_host" % __package__):
                raise
            raise ImportError("this needs proxy_host.py beside proxy.py: copy it too when "
                              "vendoring") from None
        return layer.spawn(cls, host, port, processes=processes, **timeouts)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "AuthProxy":
        """Bind the listener and start serving in a background thread; returns self."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("this AuthProxy was stopped; create a new one")
            if self._server is not None:
                return self
            if not _is_loopback_host(self.host):
                log.warning("proxy binding non-loopback address %s: anyone who can reach it and "
                            "learns a route URL can use that route's token", self.host)
            try:
                self._server = self._new_server()
            except OSError as exc:
                raise OSError(exc.errno, "AuthProxy cannot listen on %s:%d (%s); pick another "
                              "port, or 0 for a free one" % (self.host, self._requested_port,
                                                             exc.strerror or exc)) from None
            self._serve_thread = threading.Thread(target=self._server.serve_until_woken,
                                                  name="proxy-listener", daemon=True)
            _start_thread(self._serve_thread)
        log.info("proxy listening on %s", self.url)
        return self

    def _new_server(self) -> "_Server":
        """The listening server (`proxy_host` binds its children's with SO_REUSEPORT)."""
        return _Server(self)

    def stop(self) -> None:
        """Close the listener, every connection and tunnel, and join every thread the proxy started.
        Never raises; logs what it could not clean up."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            server, serve_thread = self._server, self._serve_thread
            mounted = list(self._routes.values())
            routes = mounted + [r for r in list(self._seen_routes) if r not in mounted]
            self._routes.clear()
        if server is None:
            return
        server.wake()
        if serve_thread is not None:  # out of accept() before the listener closes
            serve_thread.join(STOP_JOIN_S)
        leftovers: List[str] = []
        try:
            server.server_close()
        except OSError as exc:  # pragma: no cover
            leftovers.append("listening socket (%s)" % type(exc).__name__)
        for route in routes:
            leftovers.extend(route.close())
        server.abort_connections()
        server.workers.close()
        deadline = time.monotonic() + STOP_JOIN_S
        threads = ([serve_thread] if serve_thread else []) + server.all_threads()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                leftovers.append("thread %s" % thread.name)
        if leftovers:
            log.warning("proxy stopped but could not clean up: %s", ", ".join(leftovers))
        else:
            log.info("proxy stopped")

    def __enter__(self) -> "AuthProxy":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopping else ("serving" if self._server else "not started")
        return "AuthProxy(%s, %d routes, %s)" % (self.url if self._server else self.host,
                                                 len(self._routes), state)

    @property
    def running(self) -> bool:
        """True from `start()` until `stop()` (as `AuthProxyProcess.running`)."""
        return self._server is not None and not self._stopping

    @property
    def port(self) -> int:
        """The bound port (the requested one until `start()` binds)."""
        return self._server.server_address[1] if self._server is not None else self._requested_port

    @property
    def url(self) -> str:
        """The listener's root URL, e.g. `http://127.0.0.1:41234`."""
        host = self.host.strip("[]")  # (an IPv6 host may be given as in a URL, bracketed)
        return "http://%s:%d" % ("[%s]" % host if ":" in host else host, self.port)

    # -- routes ------------------------------------------------------------------------------------

    def mount(self, upstream: str, token: Token, *, verify: Verify = True,
              headers: ExtraHeaders = None) -> str:
        """Forward `<base_url>/<rest>` to `<upstream>/<rest>` with `Authorization: Bearer <token>`;
        return the base URL (`http://127.0.0.1:<port>/<route-id>`, an id of 192 random bits).

        `token` is a string or a zero-argument callable read per request. The upstream may carry a
        path prefix (`https://host/v1/x/proxy/8000`: `<base_url>/a` goes to `/v1/x/proxy/8000/a`).
        `headers` (a mapping, or a zero-argument callable returning one, read per request) are added
        to every request and upgrade, replacing the client's; their values are never logged.
        """
        route, base_url = self._add_route(
            "mount", lambda: Route(upstream, token, verify, headers, self._host_pools))
        log.info("mounted %s", route.label)
        return base_url

    def mount_replicas(self, upstreams: Sequence[str], token: Token, *, verify: Verify = True,
                       http: str = "refuse") -> str:
        """Mount one route in front of several upstreams running the same server (same `token` and
        `verify`); return its base URL. Sessions and HTTP are spread as `ReplicaRoute` says (failed
        replicas: `replica_status`); with no live replica a client gets 502 `no-live-replica`, and
        HTTP it may not forward 409 `replicated-http-refused`. `unmount` closes it like any route.
        """
        replicas, base_url = self._add_route(
            "mount_replicas", lambda: ReplicaRoute(upstreams, token, verify, http))
        log.info("mounted %s with %d replicas (http=%s)", replicas.label, len(upstreams), http)
        return base_url

    def _add_route(self, caller: str, make: Callable[[], AnyRoute]) -> Tuple[AnyRoute, str]:
        """Make a route (if serving) and mount it under a new route id; return it and its URL."""
        if self._server is None or self._stopping:
            raise RuntimeError("AuthProxy is not serving: call start() (or use it as a context "
                               "manager) before %s()" % caller)
        route = make()
        with self._lock:
            self._route_count += 1
            route._set_label("route-%d" % self._route_count)
            route_id = secrets.token_urlsafe(ROUTE_ID_BYTES)
            self._routes[route_id] = route
        return route, "%s/%s" % (self.url, route_id)

    def add_replica(self, base_url: str, upstream: str) -> bool:
        """`ReplicaRoute.add` on the replica route at `base_url` (same token and verify)."""
        return self._replica_route(base_url).add(upstream)

    def remove_replica(self, base_url: str, upstream: str) -> bool:
        """`ReplicaRoute.remove` on the replica route at `base_url` (e.g. before its job ends)."""
        return self._replica_route(base_url).remove(upstream)

    def replica_status(self, base_url: str) -> List[Dict[str, object]]:
        """`ReplicaRoute.status()` of the replica route at `base_url`: no token, no route id."""
        return self._replica_route(base_url).status()

    def _replica_route(self, base_url: str) -> ReplicaRoute:
        route = self._routes.get(_route_id(base_url))
        if route is None:
            raise ValueError("no route is mounted at that base URL (unmounted, or not from this "
                             "proxy); pass the exact URL mount_replicas() returned")
        if not isinstance(route, ReplicaRoute):
            raise ValueError("the route at that base URL fronts a single upstream; replicas need a "
                             "route made by mount_replicas()")
        return route

    def unmount(self, base_url: str) -> bool:
        """Remove the route behind `base_url` and close its connections and tunnels; False when no
        such route is mounted (safe to call twice)."""
        with self._lock:
            route = self._routes.pop(_route_id(base_url), None)
        if route is None:
            return False
        problems = route.close()
        log.info("unmounted %s%s", route.label,
                 (" (could not close: %s)" % ", ".join(problems)) if problems else "")
        return True

    def route_request(self, target: str,
                      headers: "_RequestHeaders") -> Union[Tuple[AnyRoute, str], Refusal]:
        """Overridable hook: map an origin-form request target to (route, upstream target), or
        refuse it; `headers` (`get`, `get_all`, `items`) are the request's, a hook may change them.
        Default: `/<route-id>/<rest>?q` -> (route, `<base path>/<rest>?q`; a `ReplicaRoute`'s is "",
        each replica adds its own when sending); an unknown id -> 404."""
        path, sep, query = target.partition("?")
        route_id, _, rest = path.partition("/")[2].partition("/")  # (route ids are never "")
        route = self._routes.get(route_id)
        if route is None:
            return Refusal(404, "unknown-route",
                           "No route is mounted at this path; use the exact base URL "
                           "AuthProxy.mount() returned.")
        return route, "%s/%s%s%s" % (route.base_path, rest, sep, query)


# --- Shared with hf_sandbox_provider and hf_jobs_emulator (they import this stdlib-only module) ---


# Signals that end a process (SIGTERM, Ctrl-C, a closed terminal). The kernel may hand one to any
# thread not blocking it, but CPython runs handlers (cutting a blocking call short) only in the main
# thread: every library thread blocks these, so they reach the main thread.
MAIN_THREAD_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                                if hasattr(signal, name))
# Library threads block the other asynchronous signals too: a recv or send that one interrupts is
# retried with its whole kernel timeout (KERNEL_TIMEOUTS), so frequent signals kept a stalled peer
# from timing out. Left deliverable: fault signals and CPU profiling timers (aimed at one thread).
LIBRARY_THREAD_BLOCKED_SIGNALS = MAIN_THREAD_SIGNALS | frozenset(
    getattr(signal, name) for name in (
        "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE", "SIGQUIT", "SIGWINCH", "SIGCONT",
        "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGIO", "SIGPWR", "SIGXCPU", "SIGXFSZ")
    if hasattr(signal, name))


@contextlib.contextmanager
def _library_signal_mask() -> Iterator[None]:
    """Block LIBRARY_THREAD_BLOCKED_SIGNALS meanwhile (threads started inside inherit the mask)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no per-thread signal masks
        yield
        return
    # Blocked inside the try: a signal handler raising just after the block returned would leave the
    # main thread deaf to Ctrl-C and SIGTERM for good (the mask is read first, by a no-op change).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, LIBRARY_THREAD_BLOCKED_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _start_thread(thread: threading.Thread) -> None:
    with _library_signal_mask():
        thread.start()


def _is_loopback_host(host: Optional[str]) -> bool:
    """The one rule for "may go in clear text": `localhost`, `*.localhost` (RFC 6761) or a loopback
    IP literal, with or without the `[...]` of an IPv6 URL host."""
    host = (host or "").strip("[]").lower().rstrip(".")  # ("" fails ip_address below)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route_id(base_url: object) -> str:
    """The route id: the last path segment of a base URL `mount` returned."""
    return base_url.rstrip("/").rsplit("/", 1)[-1] if isinstance(base_url, str) else ""


# --- Validation (each returns the reason something is refused, or None) ---------------------------


def _replicas_rejection(upstreams: object) -> Optional[str]:
    if not isinstance(upstreams, (list, tuple)):
        return ("upstreams must be a list of job URLs like ['https://<job>--8000.hf.jobs', ...], "
                "got %s" % type(upstreams).__name__)
    if not upstreams:
        return "upstreams is empty; pass at least one job URL (use mount() for a single job)"
    reason = next(filter(None, map(_upstream_rejection, upstreams)), None)
    if not reason and len(set(upstreams)) != len(upstreams):  # (all strings: set() may hash them)
        return "upstreams lists the same URL twice; each replica must be a different job"
    return reason


def _http_mode_rejection(http_mode: object) -> Optional[str]:
    return None if http_mode in HTTP_MODES else (
        "http must be 'refuse' (only GET /health, /metadata, /schema pass) or 'any' (every HTTP "
        "request goes to some live replica), got %r" % (http_mode,))


def _raise_if_rejected(reason: Optional[str]) -> None:
    if reason:
        raise ValueError(reason)


def _upstream_rejection(upstream: object) -> Optional[str]:
    if not isinstance(upstream, str) or not upstream:
        return ("upstream must be a URL string like 'https://<job>--8000.hf.jobs', got "
                "%r" % (type(upstream).__name__,))
    if _BAD_TARGET_CHAR_RE.search(upstream):  # (a host name would reach Host and TLS unencoded)
        return ("upstream URL contains whitespace, control or non-ASCII characters; pass the job "
                "URL exactly (a non-ASCII host name in its xn-- form)")
    try:
        parts = urllib.parse.urlsplit(upstream)
        port = parts.port
    except ValueError as exc:
        return "upstream URL is malformed (%s); pass e.g. 'https://<job>--8000.hf.jobs'" % exc
    if parts.scheme.lower() not in ("http", "https"):
        return ("upstream URL must start with https:// (or http:// for a loopback host), got "
                "scheme %r" % parts.scheme)
    if not parts.hostname:
        return "upstream URL has no host; pass e.g. 'https://<job>--8000.hf.jobs'"
    if parts.username is not None or parts.password is not None:
        return "upstream URL must not embed credentials (user:pass@); pass the token separately"
    if parts.query or parts.fragment:
        return "upstream URL must not have a query or fragment; mount the server's base URL"
    if port == 0:
        return "upstream URL port 0 is not a real port"
    return None


def _token_rejection(token: object) -> Optional[str]:
    if token is None or callable(token):
        return None
    if not isinstance(token, str):
        return ("token must be a string, a zero-argument callable returning one, or None; got "
                "%s" % type(token).__name__)
    if not token:
        return "token is empty; pass your HF token (or None to inject no Authorization header)"
    if _BAD_TARGET_CHAR_RE.search(token):  # (a regex: a callable's answer is checked per request)
        return ("token contains whitespace, control or non-ASCII characters; pass the bare token "
                "without 'Bearer '")
    return None


def _called_token(token: Token) -> Optional[str]:
    """The token's value now (the string, or the callable's answer); ValueError if unusable."""
    value = token() if callable(token) else token
    if (value is None and callable(token)) or (value is not None and _token_rejection(value)):
        raise ValueError("the token %s is not a usable token string" % (  # (None: logged out)
            "callable returned something that" if callable(token) else "set on the route"))
    return value


def _extra_headers_rejection(headers: object, with_token: bool) -> Optional[str]:
    """Why a route's extra headers cannot be sent (names shown, never values: may be secrets)."""
    if headers is None or callable(headers):
        return None  # a callable's answer is checked at each request
    if not isinstance(headers, Mapping):
        return ("headers must be a mapping of header names to values, a zero-argument callable "
                "returning one, or None; got %s" % type(headers).__name__)
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN_RE.match(name):
            shown = name if isinstance(name, str) else type(name).__name__
            return "headers: %r is not a valid HTTP header name" % (shown,)
        low = name.lower()
        if low in PROXY_SET_HEADERS:
            return ("headers: %s is set by the proxy itself (framing, host or hop-by-hop); leave "
                    "it out" % name)
        if low == "authorization" and with_token:
            return ("headers: Authorization conflicts with the route's token; pass token=None to "
                    "send your own")
        if (not isinstance(value, str) or not value.isascii() or "\r" in value or "\n" in value
                or _BAD_VALUE_CHAR_RE.search(value)):
            return ("headers: the value of %s is not a string of printable ASCII (the value is not "
                    "shown)" % name)
    return None


def _verify_rejection(verify: object) -> Optional[str]:
    if isinstance(verify, str) and not os.path.exists(verify):
        return ("verify=%r: no such CA bundle file or directory; pass True, False or an "
                "existing path" % verify)
    if isinstance(verify, (bool, str)):
        return None
    return ("verify must be True, False or a CA bundle path (like requests), got "
            "%s" % type(verify).__name__)


def _target_refusal(method: str, target: str) -> Optional[Refusal]:
    """Never an open proxy: only origin-form targets (`/path?query`) are forwarded."""
    if method in REFUSED_METHODS:
        return Refusal(405, "method-not-allowed", "CONNECT is not supported: this is not a forward "
                       "proxy." if method == "CONNECT" else "TRACE is not supported: it would echo "
                       "the injected token.",
                       (("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),))
    if not _TOKEN_RE.match(method):
        return Refusal(400, "bad-request", "The request method is not a valid HTTP token.")
    why = ("Asterisk-form targets (OPTIONS *) are not supported; use a route path."
           if target == "*" else
           "Only origin-form targets (/path) are accepted: this is not a forward proxy."
           if not target.startswith("/") else
           "The request target must be ASCII without spaces or control characters; "
           "percent-encode it." if _BAD_TARGET_CHAR_RE.search(target) else None)
    return Refusal(400, "bad-target", why) if why else None


# Header values must not carry control characters (names were checked while parsing).
_BAD_VALUE_REFUSAL = Refusal(400, "bad-header",
                             "A request header value contains control characters.")


def _upgrade_refusal(headers: _RequestHeaders) -> Optional[Refusal]:
    return None if headers.get("Sec-WebSocket-Key") else Refusal(
        400, "bad-upgrade", "WebSocket upgrade without Sec-WebSocket-Key.")


def _replicated_http_refusal(http_mode: str, method: str, target: str) -> Optional[Refusal]:
    """HTTP on a replica route passes only if any replica may answer it (or with http="any")."""
    if http_mode == "any" or (method in ("GET", "HEAD")
                              and target.split("?", 1)[0].rstrip("/") in STATELESS_HTTP_PATHS):
        return None
    return Refusal(409, "replicated-http-refused",
                   "This route spreads sessions over several replicas, and OpenEnv's HTTP "
                   "endpoints (/reset, /step, /state) keep state per server, so an HTTP request "
                   "cannot be pinned to one replica. Use a WebSocket session at <base_url>/ws "
                   "(OpenEnv's EnvClient does), or mount a single job for HTTP clients. Only GET "
                   "/health, /metadata and /schema are forwarded here.")


def _no_live_replica_refusal(total: int, failed: List[Dict[str, object]]) -> Refusal:
    why = "the route has no replicas (all were removed)" if not total else (
        "%d of %d replicas failed: %s" % (len(failed), total, "; ".join(
            "replica-%s %s" % (f["replica"], f["reason"]) for f in failed)))
    return Refusal(502, "no-live-replica", "No live replica is left behind this route: %s. Check "
                   "the jobs (replica_status() lists them) and add_replica() new ones." % why,
                   body={"replicas": total, "failed": failed})


def _head_end(buf: bytes, start: int) -> int:
    """Just past the first blank line in `buf` that follows an LF at or after `start` (lines end
    in CRLF or a bare LF: whichever blank line comes first), or -1."""
    crlf = buf.find(b"\n\r\n", start)
    lf = buf.find(b"\n\n", start, len(buf) if crlf < 0 else crlf + 1)
    return lf + 2 if lf >= 0 else crlf + 3 if crlf >= 0 else -1


def _head_fault(buf: bytes, final: bool) -> Optional[Refusal]:
    """The fault a line-by-line reading of the request head in `buf` meets first, or None while it
    may still end well. Unless `final` (no more bytes will come: the client closed, or the head is
    whole), a malformed header line is named only once a limit breaks: a whole head is no fault."""
    eol = buf.find(b"\n", 0, MAX_REQUEST_LINE)
    if eol < 0 and len(buf) > MAX_REQUEST_LINE:
        return Refusal(414, "request-line-too-long",
                       "The request line is longer than %d bytes." % MAX_REQUEST_LINE)
    if eol < 0 and not final:
        return None
    parts = (buf[:eol] if eol >= 0 else buf).decode("latin-1").rstrip("\r").split(" ")
    if len(parts) != 3:
        return Refusal(400, "bad-request", "The request line must be 'METHOD /target HTTP/1.1'.")
    if not re.fullmatch(r"HTTP/[0-9]\.[0-9]", parts[2]):
        return Refusal(400, "bad-request",
                       "The request line must end with an HTTP version like HTTP/1.1.")
    if parts[2][5] != "1":
        return Refusal(505, "http-version-not-supported",
                       "Only HTTP/1.0 and HTTP/1.1 are supported.")
    first = start = eol + 1 if eol >= 0 else len(buf)
    budget, count = MAX_HEADER_BYTES, 0
    while True:
        end = buf.find(b"\n", start, start + MAX_HEADER_BYTES + 1)
        line = buf[start:end + 1 if end >= 0 else start + MAX_HEADER_BYTES + 1]
        if end < 0 and len(line) <= MAX_HEADER_BYTES and not final:
            return None
        budget -= len(line)
        if budget < 0 or end < 0 or count == MAX_HEADERS or line in (b"\r\n", b"\n"):
            break
        count, start = count + 1, end + 1
    if budget >= 0 and line in (b"\r\n", b"\n") and not final:
        return None
    if any(_HEADER_LINE_RE.split(buf[first:start].decode("latin-1"))[::3]):  # (the lines before)
        return Refusal(400, "bad-header", "Malformed header line (expected 'Name: value', no line "
                                          "folding).")
    if budget < 0:
        return Refusal(431, "headers-too-large",
                       "The request headers are larger than %d bytes in total." % MAX_HEADER_BYTES)
    if end < 0:
        return Refusal(400, "bad-request", "The request head ended before its blank line.")
    return None if line in (b"\r\n", b"\n") else Refusal(
        431, "headers-too-large", "More than %d request headers." % MAX_HEADERS)


def _body_framing(headers: _RequestHeaders) -> Union[Tuple[str, int], Refusal]:
    """How the request body is delimited: ("none", 0), ("length", n) or ("chunked", -1), or a
    refusal (ambiguous framing is refused outright: it is how request smuggling works)."""
    lowered = headers._lowered
    if "transfer-encoding" in lowered:
        if "content-length" in lowered:
            return Refusal(400, "bad-framing", "Both Transfer-Encoding and Content-Length were "
                                               "sent; send one.")
        codings = [c.strip().lower() for value in headers.get_all("Transfer-Encoding") or []
                   for c in value.split(",") if c.strip()]
        return ("chunked", -1) if codings == ["chunked"] else Refusal(
            501, "unsupported-transfer-encoding",
            "Only 'Transfer-Encoding: chunked' request bodies are supported.")
    if "content-length" not in lowered:  # (the usual request: no length, or one plain number)
        return ("none", 0)
    value = headers._values[lowered.index("content-length")]
    if (lowered.count("content-length") == 1 and value.isascii() and value.isdigit()
            and len(value) <= 18):
        return ("length", int(value))
    values = {v.strip(" \t") for value in headers.get_all("Content-Length") or []
              for v in value.split(",")}
    if len(values) != 1:
        return Refusal(400, "bad-content-length", "Conflicting Content-Length values were sent.")
    value = values.pop()
    if not (value.isascii() and value.isdigit()) or len(value) > 18:  # (isdigit passes "²")
        return Refusal(400, "bad-content-length", "Content-Length must be a non-negative decimal "
                                                  "integer.")
    return ("length", int(value))


def _is_websocket_upgrade(method: str, headers: _RequestHeaders) -> bool:
    return method == "GET" and "upgrade" in headers and "websocket" in {
        token.strip().lower() for value in headers.get_all("Upgrade") or []
        for token in value.split(",")} and "upgrade" in headers.connection_tokens()


def _upstream_request_headers(headers: _RequestHeaders, route: Route, token: Optional[str],
                              extra: Tuple[Tuple[str, str], ...] = ()) -> List[Tuple[str, str]]:
    """Client headers minus hop-by-hop ones (stripped first, so a client cannot name the token
    away), minus the client's own Authorization/Host and those the route's `extra` headers replace;
    then Host, Authorization and the extra headers set for the upstream."""
    drop = _NOT_FORWARDED
    tokens = headers.connection_tokens()
    if tokens:
        drop = drop | tokens
    if extra:
        drop = drop | {name.lower() for name, _ in extra}
    out = [("Host", route.host_header)]
    for lower, name, value in headers.lowered_items():
        if lower not in drop:
            out.append((name, value))  # (no obs-fold: the parser refuses it)
    if token is not None:
        out.append(("Authorization", "Bearer " + token))
    out.extend(extra)
    return out


def _response_headers(headers: List[Tuple[str, str]], lowered: List[str],
                      length: Optional[int] = None,
                      drop_length: bool = False) -> List[Tuple[str, str]]:
    """The upstream's response headers (`lowered`: their names lower-cased) minus hop-by-hop ones
    and those its Connection header names; with `length`, one Content-Length of that value where the
    upstream's first one was (repeats merged); with `drop_length`, none (the body is re-framed)."""
    if not drop_length and HOP_BY_HOP.isdisjoint(lowered) and (length is None or (
            lowered.count("content-length") == 1
            and headers[lowered.index("content-length")][1] == str(length))):
        return list(headers)  # nothing to drop or rewrite
    drop = HOP_BY_HOP
    if "connection" in lowered:
        drop = drop | {t.strip().lower() for low, (_, v) in zip(lowered, headers)
                       if low == "connection" for t in v.split(",")}
    out: List[Tuple[str, str]] = []
    length_sent = drop_length
    for low, pair in zip(lowered, headers):
        if low in drop:
            continue
        if low == "content-length" and (length is not None or drop_length):
            if length_sent:
                continue
            length_sent, pair = True, (pair[0], str(length))
        out.append(pair)
    return out


# --- Upstream failures ----------------------------------------------------------------------------


class _UpstreamFailure(Exception):
    """An infrastructure failure talking to the upstream, already classified for the client."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _UpstreamClosed(ConnectionError):
    """The upstream closed, reset or TLS-ended the connection before any byte of an answer."""


class _BadResponse(Exception):
    """The upstream's answer broke HTTP/1.1 or a proxy limit: `kind` is the X-Proxy-Error value."""

    def __init__(self, kind: str, what: str) -> None:
        super().__init__(what)
        self.kind, self.what = kind, what


class _ClientBodyError(Exception):
    """The client's request body was malformed or cut short."""


class _ClientBodyTimeout(_ClientBodyError):
    """The client stopped sending its request body: nothing arrived for idle_timeout_s."""


def _client_body_error(exc: BaseException) -> _ClientBodyError:
    """What reading the request body from the client failing with `exc` means for the client."""
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return _ClientBodyTimeout("the client sent no more of it for idle_timeout_s")
    return _ClientBodyError("reading it from the client failed (%s)" % _failure_name(exc))


def _client_body_refusal(exc: _ClientBodyError, idle_timeout_s: float) -> Refusal:
    """408 for a body that stopped arriving (a slow client, not a wrong one), 400 for a bad one."""
    if isinstance(exc, _ClientBodyTimeout):
        return Refusal(408, "request-timeout", "The request body stopped arriving: nothing came "
                       "for %g s (idle_timeout_s); the request was dropped. Send the whole body "
                       "without pausing that long." % idle_timeout_s)
    return Refusal(400, "bad-body", "The request body was malformed: %s." % exc)


class _ClientGone(Exception):
    """The client closed its connection while the proxy waited for the upstream's answer."""


def _failure_name(exc: BaseException) -> str:
    """A short, secret-free name for a failure (the TLS reason, else the exception type)."""
    return str(getattr(exc, "reason", None) or type(exc).__name__)


def _log_upstream_failure(route: Route, refusal: Refusal, what: str) -> None:
    """WARNING for the first failure of a run on a route (see Route.note_failure), DEBUG for its
    repeats: hundreds of identical warnings would bury real problems. A 503 is the proxy's own want
    (e.g. of file descriptors): its message says what to do."""
    level = logging.WARNING if route.note_failure(refusal.kind) else logging.DEBUG
    log.log(level, "proxy: %s: %s%s", route.label, what,
            refusal.message if refusal.status == 503 else refusal.kind)


def _classify_upstream_error(exc: BaseException, route: Route) -> Refusal:
    """Map an exception from talking to the upstream to a 502/504 refusal (never with the token), or
    to 503 `proxy-busy` when the proxy itself had no file descriptor for it."""
    where, unreachable = route.label, "upstream-unreachable"
    if isinstance(exc, _BadResponse):
        return Refusal(502, exc.kind, "The upstream %s %s." % (where, exc.what))
    if isinstance(exc, _UpstreamClosed):
        return Refusal(502, unreachable, "The upstream %s closed the connection without answering "
                                         "(%s); did the job restart?" % (where, exc))
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return Refusal(504, "upstream-timeout", "The upstream %s did not answer in time; the job "
                                                "may be overloaded or stuck." % where)
    if isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
        return Refusal(502, "upstream-tls", "TLS with the upstream %s failed (%s); check its "
                       "certificate or the route's verify setting." % (where, _failure_name(exc)))
    if isinstance(exc, socket.gaierror):
        return Refusal(502, unreachable, "The upstream host of %s could not be resolved; check "
                                         "the job URL." % where)
    if isinstance(exc, OSError) and exc.errno in _OUT_OF_FILES_ERRNOS:
        return _busy_refusal(_out_of_files_reason(exc.errno))  # (the proxy's want, not the job's)
    if isinstance(exc, ConnectionRefusedError):
        return Refusal(502, unreachable, "The upstream %s refused the connection; is the job "
                                         "running with its port exposed?" % where)
    return Refusal(502, unreachable, "The connection to the upstream %s failed (%s); is the job "
                                     "still running?" % (where, type(exc).__name__))


def _may_retry(method: str, reused: bool, replayable: bool, fully_sent: bool,
               exc: BaseException) -> bool:
    """The stale-connection retry rule: once, on a fresh connection, only if the connection was
    pooled (a fresh one failing is a real failure), no response byte arrived (reset or closed, not
    slow: timeouts never retry), the body was buffered (replayable), and the method is idempotent or
    the request was not all sent (a fully sent POST that then got no answer might have run)."""
    no_answer = isinstance(exc, (_UpstreamClosed, ConnectionResetError, BrokenPipeError,
                                 ConnectionAbortedError, ssl.SSLEOFError, ssl.SSLZeroReturnError))
    return reused and no_answer and replayable and (method in IDEMPOTENT_METHODS or not fully_sent)


# --- Server and request handler -------------------------------------------------------------------


class _WorkerPool:
    """Parked threads that run jobs: `submit` hands a job to the latest parked worker (its stack is
    warm), else starts a thread while under `max_workers`; a worker idle for `idle_s` ends. A warm
    proxy serves a connection with one queue put instead of a thread start."""

    # threading.stack_size() is process-wide: the first of overlapping starts sets it, the last
    # puts the old size back, and a start wanting another size waits. Starts overlap rather than
    # queue on a lock: each waits for its new thread to get the GIL, long with thousands running.
    # Entered as _STACK_LOCK (Condition.__enter__ is Python: a signal's raise could leave it held)
    _STACK_LOCK = threading.Lock()
    _STACK = threading.Condition(_STACK_LOCK)
    _stack_starts = 0  # starts under way
    _stack_bytes = 0  # their size
    _stack_saved: Optional[int] = None  # the size before them, None if the platform keeps its own

    def __init__(self, name: str, max_workers: int, idle_s: float, stack_bytes: int) -> None:
        self.name, self.max_workers = name, max_workers
        self.idle_s, self.stack_bytes = idle_s, stack_bytes
        self._lock = threading.Lock()
        # parked workers' mailboxes (next job, or None: end) and threads; popitem() takes the latest
        self._parked: Dict[queue.SimpleQueue, threading.Thread] = {}
        self._threads: Set[threading.Thread] = set()
        self._closed = False
        # Threads listed but not yet started (start() waits for the GIL): close() waits for them, so
        # every thread `threads()` lists after it can be joined.
        self._starting = 0
        self._started = threading.Condition(self._lock)
        # Why the system last refused to start a thread (e.g. `ulimit -u`), until one starts again.
        self.start_failure: Optional[str] = None

    def submit(self, fn: Callable[..., None], *args: object) -> bool:
        """Run fn(*args) on a worker; False (nothing run) if closed, at `max_workers`, or the
        system refused a new thread (`start_failure` says why)."""
        with self._lock:
            if self._closed:
                return False
            if self._parked:
                self._parked.popitem()[0].put((fn, args))
                return True
            if len(self._threads) >= self.max_workers:
                return False
            mailbox: queue.SimpleQueue = queue.SimpleQueue()
            mailbox.put((fn, args))  # not in the thread's args: those live as long as the thread
            thread = threading.Thread(target=self._work, args=(mailbox,), name=self.name,
                                      daemon=True)
            self._threads.add(thread)
            self._starting += 1
        failure = None
        try:  # a `stack_bytes` stack for this start (and for a thread other code starts meanwhile)
            with self._stack_window():
                _start_thread(thread)
        except BaseException as exc:  # e.g. "can't start new thread" (a process or memory limit)
            failure = "%s: %s" % (type(exc).__name__, exc)
        with self._lock:
            self._starting -= 1
            if failure is not None:
                self._threads.discard(thread)
            self._started.notify_all()
        self.start_failure = failure
        return failure is None

    @contextlib.contextmanager
    def _stack_window(self) -> Iterator[None]:
        """Meanwhile, threads start with `stack_bytes` stacks (see _STACK)."""
        cls, size = _WorkerPool, self.stack_bytes
        with cls._STACK_LOCK:
            cls._STACK.wait_for(lambda: not cls._stack_starts or cls._stack_bytes == size)
            if not cls._stack_starts:
                try:
                    cls._stack_saved = threading.stack_size(size)
                except (ValueError, RuntimeError):  # a platform that cannot change it: its default
                    cls._stack_saved = None
                cls._stack_bytes = size
            cls._stack_starts += 1
        try:
            yield
        finally:
            with cls._STACK_LOCK:
                cls._stack_starts -= 1
                if not cls._stack_starts:
                    if cls._stack_saved is not None:
                        threading.stack_size(cls._stack_saved)
                    cls._STACK.notify_all()

    def close(self) -> None:
        """Refuse new jobs and end every parked worker; busy ones end after their current job.
        Returns once the threads being started have started (at most STOP_JOIN_S)."""
        with self._lock:
            self._closed = True
            while self._parked:
                self._parked.popitem()[0].put(None)
            self._started.wait_for(lambda: not self._starting, STOP_JOIN_S)

    def threads(self) -> List[threading.Thread]:
        """Every thread the pool started that has not ended yet (busy or parked)."""
        with self._lock:
            return list(self._threads)

    def busy_threads(self) -> List[threading.Thread]:
        """The threads running a job now (not parked)."""
        with self._lock:
            return list(self._threads.difference(self._parked.values()))

    def counts(self) -> Tuple[int, int]:
        """(threads alive, of which parked)."""
        with self._lock:
            return len(self._threads), len(self._parked)

    def _work(self, mailbox: queue.SimpleQueue) -> None:
        me, job = threading.current_thread(), mailbox.get()  # (submit put the first job in)
        try:
            while job is not None:
                try:
                    job[0](*job[1])
                except Exception:
                    log.error("proxy: unexpected error in a worker thread", exc_info=True)
                job = None  # drop references to the finished job's sockets before parking
                with self._lock:
                    if self._closed:
                        return
                    self._parked[mailbox] = me
                try:
                    job = mailbox.get(timeout=self.idle_s)
                except queue.Empty:  # retire, unless submit() or close() took it meanwhile: then
                    with self._lock:  # its put, made under this lock, is in the mailbox already
                        job = None if self._parked.pop(mailbox, None) else mailbox.get()
        finally:
            with self._lock:
                self._threads.discard(me)


class _Server(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer whose connections run on a `_WorkerPool`, tracked so `stop()` can end
    them all."""

    request_queue_size = LISTEN_BACKLOG
    allow_reuse_address = True

    def __init__(self, proxy: AuthProxy) -> None:
        self.proxy = proxy
        self.address_family = socket.AF_INET6 if ":" in proxy.host else socket.AF_INET
        self._conn_lock = threading.Lock()
        self._conns: Set[socket.socket] = set()
        self.workers = _WorkerPool("proxy-worker", MAX_WORKERS, WORKER_IDLE_S, WORKER_STACK_BYTES)
        self.busy_warnings = _WarningRate(BUSY_WARNING_EVERY_S)  # refusals at the thread cap
        # Client connections in a WebSocket upgrade or tunnel: stop() cuts those through their
        # routes, so a set-up still answers its client (503) before the 101.
        self.tunnelling: Set[socket.socket] = set()
        self._spare_fd: Optional[int] = None  # see OUT_OF_FILES_PAUSE_S (server_close reads it)
        super().__init__((proxy.host.strip("[]"), proxy._requested_port), _Handler)
        self._woken = False
        self._spare_fd = _open_spare_fd()

    def server_close(self) -> None:
        super().server_close()
        spare, self._spare_fd = self._spare_fd, None
        if spare is not None:
            os.close(spare)

    def serve_until_woken(self) -> None:
        """Accept connections until `wake()` in a blocking accept: unlike `serve_forever`, an idle
        proxy costs no wake-ups and `stop()` waits for no poll (the emulator runs one per job)."""
        while not self._woken:
            try:
                request, client_address = self.get_request()
            except OSError as exc:
                if exc.errno in _OUT_OF_FILES_ERRNOS and not self._woken:
                    self._shed_one(exc.errno)
                continue
            if self._woken:  # the connection wake() made
                self.shutdown_request(request)
                continue
            try:
                self.process_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
                self.shutdown_request(request)

    def _shed_one(self, error: int) -> None:
        """Out of file descriptors (see OUT_OF_FILES_PAUSE_S): with the spare one closed, accept a
        queued connection and answer it 503 `proxy-busy` naming the limit, then take a spare again;
        with none queued (accept() then fails at once too) or no spare, pause: never spin."""
        spare, self._spare_fd, request = self._spare_fd, None, None
        if spare is not None:
            os.close(spare)
            timeout = self.socket.gettimeout()
            self.socket.setblocking(False)
            try:
                request = self.get_request()[0]
            except OSError:  # none queued, or another thread took the descriptor
                pass
            finally:
                self.socket.settimeout(timeout)
        if request is not None:
            _answer_busy(request, _out_of_files_reason(error), self.busy_warnings)
            self.shutdown_request(request)
        self._spare_fd = _open_spare_fd()
        if request is None:
            time.sleep(OUT_OF_FILES_PAUSE_S)

    def wake(self) -> None:
        """Make `serve_until_woken` return now (thread-safe, idempotent): on Linux by shutting the
        listener down (no other listener sharing its port is touched), else by connecting once."""
        if self._woken:
            return
        self._woken = True
        if sys.platform.startswith("linux"):
            try:
                self.socket.shutdown(socket.SHUT_RDWR)
                return
            except OSError:  # not connected-capable here: connect instead
                pass
        host, port = self.server_address[:2]
        if host in ("", "0.0.0.0", "::"):  # a wildcard bind: reach it on loopback
            host = "::1" if self.address_family == socket.AF_INET6 else "127.0.0.1"
        with contextlib.suppress(OSError):  # (not listening any more: nothing waits in accept)
            socket.create_connection((host, port), timeout=STOP_JOIN_S).close()

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall; we need none.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.proxy.host, self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            if self.proxy._stopping:
                self.shutdown_request(request)
                return
            self._conns.add(request)
        if not self.workers.submit(self._run, request, client_address):
            with self._conn_lock:
                self._conns.discard(request)
            _answer_busy(request, _busy_reason(self.workers), self.busy_warnings)
            self.shutdown_request(request)

    def _run(self, request: socket.socket, client_address: object) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._conn_lock:
                self._conns.discard(request)

    def handle_error(self, request: object, client_address: object) -> None:
        log.error("proxy: unexpected error while serving a connection", exc_info=True)

    def abort_connections(self) -> None:
        """Shut every live client socket but the WebSocket ones (those end through their routes), so
        blocked handler threads wake up and exit."""
        with self._conn_lock:
            conns = list(self._conns - self.tunnelling)
        for sock in conns:
            _abort_socket(sock)

    def live_threads(self) -> List[threading.Thread]:
        """Worker threads serving a connection right now (parked ones excluded)."""
        return self.workers.busy_threads()

    def all_threads(self) -> List[threading.Thread]:
        return self.workers.threads()


class _RequestHeaders:
    """A request's header fields in order, by case-insensitive name: what the forwarding and a
    `route_request` hook read (`get`, `get_all`, `items`, `keys`, `values`, `in`, `[name]`,
    iteration over names and `len`, as on `HTTPMessage`) and edit (`headers[name] = value` adds a
    field, `del headers[name]` removes each of that name)."""

    __slots__ = ("_names", "_values", "_lowered", "_tokens")

    def __init__(self, names: List[str], values: List[str]) -> None:
        self._names, self._values = names, values
        self._lowered = list(map(str.lower, names))
        self._tokens = frozenset() if "connection" not in self._lowered else frozenset(
            token.strip().lower() for value in self.get_all("connection") or ()
            for token in value.split(",") if token.strip())

    def lowered_items(self) -> Iterator[Tuple[str, str, str]]:
        """(lower-cased name, name, value) of each field, in order."""
        return zip(self._lowered, self._names, self._values)

    def get(self, name: str, default: Optional[str] = None) -> Optional[str]:
        lower = name.lower()
        return self._values[self._lowered.index(lower)] if lower in self._lowered else default

    def get_all(self, name: str, default: Optional[List[str]] = None) -> Optional[List[str]]:
        lower = name.lower()
        return [value for low, value in zip(self._lowered, self._values) if low == lower] or default

    def items(self) -> List[Tuple[str, str]]:
        return list(zip(self._names, self._values))

    def keys(self) -> List[str]:
        return list(self._names)

    def values(self) -> List[str]:
        return list(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._lowered

    __getitem__ = get

    def __setitem__(self, name: str, value: str) -> None:
        # A hook's edit: held to what a client's field passed (CR/LF would add fields upstream).
        if not (isinstance(name, str) and _TOKEN_RE.match(name) and isinstance(value, str)) or (
                _BAD_EDIT_CHAR_RE.search(value)):
            raise ValueError("a header set by route_request needs a token name and a one-line "
                             "Latin-1 value without control characters (name %.60r)" % (name,))
        self.__init__(self._names + [name], self._values + [value])  # type: ignore[misc]

    def __delitem__(self, name: str) -> None:
        kept = [(n, v) for low, n, v in self.lowered_items() if low != name.lower()]
        self.__init__([n for n, _ in kept], [v for _, v in kept])  # type: ignore[misc]

    def connection_tokens(self) -> "frozenset[str]":
        """The Connection header's tokens, lower-cased (three checks read them)."""
        return self._tokens


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves one client connection: reads its requests one after another from its own buffer and
    forwards each (or tunnels a WebSocket upgrade); it parses and answers itself, not the stdlib."""

    protocol_version = "HTTP/1.1"
    server: _Server
    headers: _RequestHeaders  # type: ignore[assignment]  # (the stdlib's parser made a Message)
    _odd_target = _bad_value = False  # per request: set by _read_request, checked by _dispatch

    # -- connection plumbing ----------------------------------------------------------------------

    def setup(self) -> None:
        self.proxy: AuthProxy = self.server.proxy
        # (only a subclass's route_request is checked: the default's answers are well formed)
        self._own_routing = type(self.proxy).route_request is AuthProxy.route_request
        self._seen_route: Optional[AnyRoute] = None  # the last one known in proxy._seen_routes
        self.connection = self.request
        with contextlib.suppress(OSError):  # (not every socket family supports it)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # unread client bytes stay in `_client.buf` (not a file object's buffer): tunnels take them
        self._client = _Reader(self._recv, _client_cut_short)
        _set_socket_timeout(self.connection, self.proxy.idle_timeout_s)

    def finish(self) -> None:
        """Nothing to flush: every answer goes straight to the socket."""

    def handle(self) -> None:
        """Answer requests until either side ends the connection or the proxy stops."""
        try:
            while self._read_request():
                self._dispatch()
                if self.close_connection or self.proxy._stopping:
                    return
        except (socket.timeout, TimeoutError):
            log.debug("proxy: client connection timed out; closing it")
        except (ConnectionError, OSError, ValueError) as exc:
            log.debug("proxy: client connection ended (%s)", type(exc).__name__)

    def _read_request(self) -> bool:
        """Read and parse the next request head into `command`, `path`, `request_version`, `headers`
        and `close_connection`; False if the client closed first or a malformed head was answered.
        Strict (RFC 9112; the stdlib's parser takes HTTP/0.9, ends the headers at a malformed line):
        a whole head takes one match and one split; others wait for the rest (header_timeout_s)."""
        self.command, self.request_version, self.close_connection = "", "HTTP/1.1", True
        client = self._client
        buf = client.buf
        if not buf:
            buf = client.buf = self._recv()
            if not buf:
                return False
        eol = buf.find(b"\n", 0, MAX_REQUEST_LINE)
        end = _head_end(buf, eol)  # (-1 too if eol is)
        if end < 0 or end - eol > MAX_HEADER_BYTES + 1 or (
                buf.count(b"\n", eol + 1, end) > MAX_HEADERS + 1):  # (not whole, or too large)
            deadline, data = None, buf
            while True:
                if _head_fault(buf, final=not data):  # (final once the client closed)
                    return self._refuse_head(buf)
                end = _head_end(buf, 0)  # (no fault and a blank line: whole within the limits)
                if end >= 0:
                    break
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.proxy.header_timeout_s
                elif now >= deadline:
                    raise socket.timeout("request head not complete in time")
                _set_socket_timeout(self.connection, deadline - now)
                data = self._recv()
                buf = client.buf = buf + data
            eol = buf.find(b"\n")
            _set_socket_timeout(self.connection, self.proxy.idle_timeout_s)
        line = buf[:eol].decode("latin-1").rstrip("\r")
        match = _ORIGIN_REQUEST_LINE_RE.fullmatch(line)
        self._odd_target = match is None
        if match is None and (match := _REQUEST_LINE_RE.fullmatch(line)) is None:
            return self._refuse_head(buf)
        self.command, self.path, self.request_version = match.groups()
        block = buf[eol + 1:end]
        client.buf = buf[end:]
        text = block[:-2 if block.endswith(b"\r\n") else -1].decode("latin-1")
        # [gap, name, value, gap, name, value, ..., gap]: each gap is empty if each line is a field.
        parts = _HEADER_LINE_RE.split(text)
        if any(parts[::3]):
            return self._refuse_head(buf)
        # Each value without the CRs before its LF, then the blanks around it: one strip when every
        # CR is in a CRLF (no value holds one but at its end).
        values = parts[2::3]
        bare_cr = block.count(b"\r") != block.count(b"\r\n")
        if not bare_cr:
            values = list(map(str.strip, values, repeat(" \t\r")))
        else:
            values = [value.rstrip("\r").strip(" \t") for value in values]
        self.headers = headers = _RequestHeaders(parts[1::3], values)
        # Control characters are refused when dispatched, and so is a CR not ending its line (RFC 9112
        # section 2.2: an upstream may take it for one). Names hold none; LF and tab pass.
        self._bad_value = bare_cr or len(block.translate(None, _CONTROL_BYTES)) != len(block)
        tokens = headers._tokens
        self.close_connection = "close" in tokens or (
            self.request_version == "HTTP/1.0" and "keep-alive" not in tokens)
        if ("expect" in headers._lowered and self.request_version == "HTTP/1.1"
                and str(headers.get("Expect")).lower() == "100-continue"):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")
        return True

    def _refuse_head(self, buf: bytes) -> bool:
        """Answer the fault of the head in `buf` (and close: what follows it cannot be trusted)."""
        self._refuse(_head_fault(buf, True), close=True)  # type: ignore[arg-type]  # (it has one)
        return False

    def _recv(self, n: int = IO_CHUNK) -> bytes:
        """One read of the client socket whatever `n` (the reader keeps the rest); b"" if closed."""
        try:
            return self.connection.recv(IO_CHUNK)
        except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
            raise socket.timeout("timed out") from None

    def _send(self, data: bytes) -> None:
        try:
            self.connection.sendall(data)
        except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
            raise socket.timeout("timed out") from None

    def _refuse(self, refusal: Refusal, close: bool = False) -> None:
        """Answer a refusal (see _refusal_bytes) in one TCP segment."""
        if close:
            self.close_connection = True
        self._send(_refusal_bytes(refusal, self.close_connection, self.command != "HEAD"))

    # -- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        if self.request_version == "HTTP/1.0":  # (no chunked framing for it: one per connection)
            self.close_connection = True
        framing = _body_framing(self.headers)
        odd = self._odd_target or self.command in REFUSED_METHODS
        malformed = ((_target_refusal(self.command, self.path) if odd else None)
                     or (_BAD_VALUE_REFUSAL if self._bad_value else None)
                     or (framing if isinstance(framing, Refusal) else None))
        decision = malformed or (self.proxy.route_request(self.path, self.headers)
                                 if self._own_routing else self._route())
        if isinstance(decision, Refusal):
            # Malformed input, or an unread body that would be parsed as the next request: close.
            self._refuse(decision, close=malformed is not None or framing[0] != "none"
                         or decision.status >= 500)
            return
        route, target = decision
        if route is not self._seen_route:  # (a keep-alive connection usually asks for one route)
            if route not in self.proxy._seen_routes:  # so stop() also closes routes a subclass made
                with self.proxy._lock:
                    self.proxy._seen_routes.add(route)
            self._seen_route = route
        assert not isinstance(framing, Refusal)
        upgrade = _is_websocket_upgrade(self.command, self.headers)
        refusal = (_upgrade_refusal(self.headers) if upgrade
                   else _replicated_http_refusal(route.http, self.command, target)
                   if isinstance(route, ReplicaRoute) else None)
        if refusal is not None:
            self._refuse(refusal, close=upgrade or framing[0] != "none")
            return
        if not self._credentials(route, framing[0] != "none"):
            return
        if upgrade:
            self._tunnel(route, target, self._token)
            return
        if isinstance(route, ReplicaRoute):
            replica = route._acquire(reserve=False)
            if replica is None:
                self._refuse(_no_live_replica_refusal(*route._failure_summary()), close=True)
                return
            route = replica.route
            target = route.base_path + target
        self._forward(route, target, self._token, framing)

    def _credentials(self, route: AnyRoute, has_body: bool) -> bool:
        """Set `_token` and `_route_headers` for this request from the route; a callable that fails
        is answered 502 (closing if a body is unread) and False returned."""
        if (route.__class__ is Route and not callable(route.headers)
                and route.token is route._checked_token):
            # fixed ones: what current_token and current_headers answer, without the calls
            self._token, self._route_headers = route._checked_token, route._fixed_headers
            return True
        source = "token"
        try:
            self._token = route.current_token()
            source = "headers"
            self._route_headers = route.current_headers() if isinstance(route, Route) else ()
        except Exception as exc:
            log.warning("proxy: %s %s callable failed (%s)", route.label, source,
                        type(exc).__name__)
            message = "The route's %s callable failed (%s); check the %s source." % (
                source, type(exc).__name__, source)
            self._refuse(Refusal(502, source + "-unavailable", message), close=has_body)
            return False
        return True

    def _route(self) -> Union[Tuple[AnyRoute, str], Refusal]:
        """A subclass's `route_request` answer; a hook that raises or answers nonsense is a 500."""
        try:
            decision = self.proxy.route_request(self.path, self.headers)
        except Exception:
            log.error("proxy: route_request raised", exc_info=True)
        else:
            if isinstance(decision, Refusal) or (
                    isinstance(decision, tuple) and len(decision) == 2
                    and isinstance(decision[0], (Route, ReplicaRoute))
                    and isinstance(decision[1], str) and decision[1].startswith("/")):
                return decision
            log.error("proxy: route_request returned %s; expected (Route, '/target') or a Refusal",
                      type(decision).__name__)
        return Refusal(500, "proxy-error", "The proxy failed to route this request (see its log).")

    # -- HTTP forwarding --------------------------------------------------------------------------

    def _body_chunks(self, framing: Tuple[str, int]) -> Iterator[bytes]:
        """Yield the request body as it arrives (de-chunked); the client failing or stalling in it
        is a _ClientBodyError, never an OSError (which, while it streams, means the upstream's)."""
        kind, length = framing
        try:
            if kind == "length":
                yield from self._client.pieces(length, "before sending the whole body")
            else:
                yield from _dechunk(self._client, _client_malformed, MAX_HEADER_BYTES)
        except (OSError, ValueError) as exc:
            raise _client_body_error(exc) from None

    def _buffered_body(self, framing: Tuple[str, int]) -> Tuple[bytes, Optional[Iterator[bytes]]]:
        """The body's first bytes (all of it if at most REPLAYABLE_BODY_BYTES) and an iterator over
        the rest or None; a small Content-Length body (every OpenEnv action) comes in one piece."""
        kind, length = framing
        if kind != "chunked" and length <= REPLAYABLE_BODY_BYTES:
            try:
                return self._client.read_exact(length, "before sending the whole body"), None
            except (OSError, ValueError) as exc:
                raise _client_body_error(exc) from None
        body_iter = self._body_chunks(framing)
        buffered: List[bytes] = []
        size = 0
        for chunk in body_iter:
            buffered.append(chunk)
            size += len(chunk)
            if size > REPLAYABLE_BODY_BYTES:
                return b"".join(buffered), body_iter
        return b"".join(buffered), None

    def _forward(self, route: Route, target: str, token: Optional[str],
                 framing: Tuple[str, int]) -> None:
        """Forward one request on a pooled (or fresh) upstream connection, retrying once on a fresh
        one as _may_retry allows, and relay the answer. A body of at most REPLAYABLE_BODY_BYTES goes
        whole (a retry replays it); a larger one streams re-chunked."""
        method = self.command
        lines = _request_lines(method, target, _upstream_request_headers(
            self.headers, route, token, self._route_headers)).encode("latin-1")
        try:
            body, rest = self._buffered_body(framing)
            size = len(body)
            replayable = size <= REPLAYABLE_BODY_BYTES
            head = lines + (b"Transfer-Encoding: chunked\r\n\r\n" if not replayable
                            else b"\r\n" if framing[0] == "none"
                            else b"Content-Length: %d\r\n\r\n" % size)
            for attempt in (1, 2):
                try:
                    conn, reused = route._checkout(self.proxy, new=attempt == 2)
                except Exception as exc:
                    raise _UpstreamFailure(_classify_upstream_error(exc, route)) from None
                sent_all = False
                try:
                    try:
                        # a small request leaves in one send (send_request sends its head alone)
                        if replayable and size <= SMALL_RESPONSE_BYTES:
                            conn._sendall(head + body)
                            sent_all = True
                        else:
                            pieces = (p for part in ((body,), rest or ()) for p in part)
                            sent_all = conn.send_request(head, pieces, chunked=not replayable)
                    except (socket.timeout, TimeoutError):
                        raise
                    except OSError:
                        # Dropped while sending: a stale pooled connection (nothing to read: the
                        # retry rule decides), or an upstream that answered early (e.g. 413) and
                        # closed: relay that.
                        pass
                    if sent_all:  # the client is watched while the upstream works on the request
                        conn.watch = self.connection
                    reader = conn.reader
                    try:
                        answer = _parse_answer(reader.read_head(True), method)
                        if answer.status < 200:
                            answer = self._final_answer(reader, method, answer)
                    finally:
                        conn.watch = None
                    break
                except Exception as exc:
                    route._checkin(conn, False)
                    if isinstance(exc, (_ClientBodyError, _ClientGone)):
                        raise
                    if attempt == 1 and _may_retry(method, reused, replayable, sent_all, exc):
                        log.debug("proxy: %s pooled connection was stale; retrying once on a fresh "
                                  "one", route.label)
                        continue
                    raise _UpstreamFailure(_classify_upstream_error(exc, route)) from None
        except _ClientBodyError as exc:
            self._refuse(_client_body_refusal(exc, self.proxy.idle_timeout_s), close=True)
            return
        except _ClientGone:
            log.debug("proxy: %s: client left before the upstream answered; request abandoned",
                      route.label)
            self.close_connection = True
            return
        except _UpstreamFailure as failure:
            if route._closed:  # an unmount or stop() cut it off: not the job's failure: no WARNING
                self._refuse(_route_gone_refusal(self.proxy._stopping, "request"), close=True)
                return
            _log_upstream_failure(route, failure.refusal, "")
            self._refuse(failure.refusal, close=not replayable or failure.refusal.status == 504)
            return
        if route._failing_kind is not None:  # (note_answer's own test, without the call)
            route.note_answer()
        if not sent_all and not replayable:
            # the upstream answered early: the rest of the client's body is unread
            self.close_connection = True
        self._relay_response(route, reader, answer, conn, sent_all)

    def _final_answer(self, reader: _Reader, method: str, answer: _Answer) -> _Answer:
        """Relay interim (1xx) answers to an HTTP/1.1 client up to the final one, returned; not 100
        (the proxy answered Expect itself, sending none upstream). An unasked 101 is an error."""
        count = 0
        while answer.status < 200:
            if answer.status == 101:
                raise _BadResponse("upstream-protocol", "switched protocols without being asked to")
            if answer.status != 100 and self.request_version == "HTTP/1.1":
                try:
                    self._send(_head_bytes(answer.status, answer.reason,
                                           _response_headers(answer.headers, answer.lowered)))
                except OSError:
                    raise _ClientGone() from None
            count += 1
            if count > MAX_INTERIM_RESPONSES:
                raise _BadResponse("upstream-protocol", "sent more than %d interim (1xx) "
                                   "responses" % MAX_INTERIM_RESPONSES)
            answer = _parse_answer(reader.read_head(first=False), method)
        return answer

    def _relay_response(self, route: Route, reader: _Reader, answer: _Answer,
                        conn: Optional[_UpstreamConnection] = None, sent_all: bool = False) -> None:
        """Relay the upstream's answer (Content-Encoding untouched); `conn`, if pooled, goes back
        once read, reusable if `sent_all`. A small answer with a length (the usual one) is read
        whole, so its connection is pooled before the client can ask again, and sent in one write;
        others stream (with their length, re-chunked for HTTP/1.1 to keep its connection, or until
        the close for HTTP/1.0), and an upstream failing mid-way cuts the client (no faked end)."""
        mode, length = answer.mode, answer.length
        if mode == "none" or (mode == "length" and length <= SMALL_RESPONSE_BYTES):
            body = b""
            if length > 0:
                try:
                    body = reader.read_exact(length, "in the middle of its response body")
                except Exception as exc:
                    if conn is not None:
                        route._checkin(conn, False)
                    if route._closed:  # (as in _forward)
                        self._refuse(_route_gone_refusal(self.proxy._stopping, "request"), True)
                        return
                    refusal = _classify_upstream_error(exc, route)
                    log.warning("proxy: %s: %s while reading the response body", route.label,
                                refusal.kind)
                    self._refuse(refusal, close=True)
                    return
            if conn is not None:
                route._checkin(conn, sent_all and answer.keep_alive and not reader.buf)
            self._send(self._answer_head(answer, mode) + body)
            return
        if mode != "length" and self.request_version == "HTTP/1.0":
            mode, self.close_connection = "close", True
        elif mode != "length":
            mode = "chunked"
        complete = False
        try:
            self._send(self._answer_head(answer, mode))
            chunks = _answer_body(reader, answer)
            while True:
                try:
                    data = next(chunks, b"")
                except Exception as exc:
                    what = exc.what if isinstance(exc, _BadResponse) else _failure_name(exc)
                    log.log(logging.INFO if route._closed else logging.WARNING, "proxy: %s: %s "
                            "mid-response (%s); closing the client connection", route.label,
                            "route closed" if route._closed else "upstream failed", what)
                    self.close_connection = True
                    break
                if not data:
                    if mode == "chunked":
                        self._send(b"0\r\n\r\n")
                    complete = True
                    break
                self._send(b"%x\r\n%s\r\n" % (len(data), data) if mode == "chunked" else data)
        finally:
            if conn is not None:
                route._checkin(conn, complete and sent_all and answer.keep_alive
                               and answer.mode != "close" and not reader.buf)

    def _answer_head(self, answer: _Answer, mode: str) -> bytes:
        """The answer's head as the client gets it: as it came when nothing in it is dropped or
        rewritten, else rebuilt without hop-by-hop fields and framed for `mode`."""
        if answer.raw is not None:
            if self.close_connection:
                return answer.raw[:-2] + b"Connection: close\r\n\r\n"
            return answer.raw
        headers = _response_headers(answer.headers, answer.lowered,
                                    answer.length if mode == "length" else None,
                                    drop_length=answer.mode not in ("length", "none"))
        if mode == "chunked":
            headers.append(("Transfer-Encoding", "chunked"))
        if self.close_connection:
            headers.append(("Connection", "close"))
        return _head_bytes(answer.status, answer.reason, headers)

    # -- WebSocket tunnel -------------------------------------------------------------------------

    def _tunnel(self, route: AnyRoute, target: str, token: Optional[str]) -> None:
        """Open a WebSocket session (a replica route's on a replica: `_open_on_a_replica`): replay
        the upgrade upstream, then relay a 101 and run the tunnel, or another answer as HTTP."""
        self.close_connection = True  # whatever happens, this connection ends with the tunnel
        self.server.tunnelling.add(self.connection)  # stop() lets it answer: see abort_connections
        try:
            if isinstance(route, ReplicaRoute):
                self._open_on_a_replica(route, target, token)
                return
            try:
                tunnel, reader, head, status = self._upgrade(route, target, token)
            except _RouteGone:
                self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
                return
            except _ClientGone:
                raise
            except Exception as exc:
                refusal = _classify_upstream_error(exc, route)
                _log_upstream_failure(route, refusal, "WebSocket upgrade failed: ")
                self._refuse(refusal, close=True)
                return
            route.note_answer()
            self._finish_upgrade(route, tunnel, reader, head, status)
        except _ClientGone:
            log.debug("proxy: %s: client left before the upstream answered the upgrade",
                      route.label)
        finally:
            self.server.tunnelling.discard(self.connection)

    def _open_on_a_replica(self, replicas: ReplicaRoute, target: str, token: Optional[str]) -> None:
        """Open the session on the least busy live replica; if that replica fails before
        switching protocols, take it out of rotation and retry once on another (the environment
        never saw it). The session keeps its slot on the replica until its tunnel ends."""
        tried: List[_Replica] = []
        last: Optional[Refusal] = None
        for _ in range(REPLICA_ATTEMPTS):
            replica = replicas._acquire(exclude=tried)
            if replica is None:
                break
            tried.append(replica)
            route = replica.route
            try:
                tunnel, reader, head, status = self._upgrade(route, route.base_path + target, token)
            except _RouteGone:
                if replicas._closed:  # the whole route was unmounted, or the proxy is stopping
                    self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
                    return
                last = Refusal(502, "replica-unavailable", "The replica %s was removed while the "
                               "WebSocket upgrade was under way." % route.label)
            except _ClientGone:
                raise
            except Exception as exc:
                last = _classify_upstream_error(exc, route)
                if last.status == 503:  # the proxy lacked a descriptor: not the replica's fault
                    _log_upstream_failure(route, last, "WebSocket upgrade failed: ")
                    self._refuse(last, close=True)
                    return
                replicas._mark_failed(replica, "%s (%s)" % (last.kind, _failure_name(exc)))
            else:
                if status not in REPLICA_DOWN_STATUSES:
                    self._finish_upgrade(route, tunnel, reader, head, status)
                    return
                route._remove_tunnel(tunnel)
                tunnel.upstream.close()  # type: ignore[union-attr]
                why = "answered %d to the WebSocket upgrade" % status
                last = Refusal(502, "replica-unavailable", "The replica %s %s; its job may have "
                               "stopped." % (route.label, why))
                replicas._mark_failed(replica, why)
            finally:
                replicas._release(replica)
        total, failed = replicas._failure_summary()  # (`last` if other replicas remain for later)
        self._refuse(last if last is not None and len(failed) < total
                     else _no_live_replica_refusal(total, failed), close=True)

    def _upgrade(self, route: Route, target: str,
                 token: Optional[str]) -> Tuple["_Tunnel", _Reader, bytes, int]:
        """Open a stream to the upstream (TLS handshake within connect_timeout_s), send the client's
        upgrade request and read the answer's head within read_timeout_s, watching the client:
        (tunnel, reader holding what came past the head, head, status). The tunnel is on its route
        from before the connect, so an unmount or stop cuts it at any step (_RouteGone); a failure
        closes the stream and takes the tunnel off its route (_ClientGone if the client hung up)."""
        request = (_request_lines("GET", target, _upstream_request_headers(
            self.headers, route, token, self._route_headers)) + "Upgrade: %s\r\nConnection: "
            "Upgrade\r\n\r\n" % self.headers.get("Upgrade", "websocket")).encode("latin-1")
        tunnel = _Tunnel(self.connection, route.label)
        if not route._add_tunnel(tunnel):
            raise _RouteGone()
        client, proxy = self.connection, self.proxy
        try:
            tunnel.upstream = stream = _open_stream(route, proxy.connect_timeout_s)
            if tunnel.cut:  # (cut while connecting: it had no stream to abort)
                raise _RouteGone()
            stream.settimeout(min(TUNNEL_WATCH_S, proxy.connect_timeout_s, proxy.read_timeout_s))
            if isinstance(stream, _TlsStream):
                _watching(client, time.monotonic() + proxy.connect_timeout_s, stream.handshake,
                          "the TLS handshake with the upstream took over connect_timeout_s")
            stream.sendall(request)
            deadline = time.monotonic() + proxy.read_timeout_s
            recv = functools.partial(stream.recv, IO_CHUNK)
            reader = _Reader(lambda n: _watching(client, deadline, recv, "the upstream did not "
                                                 "answer the upgrade within read_timeout_s"),
                             _upstream_cut_short)
            head = reader.read_head(first=True)
        except BaseException as exc:
            route._remove_tunnel(tunnel)
            if tunnel.upstream is not None:
                tunnel.upstream.close()
            if tunnel.cut and isinstance(exc, Exception) and not isinstance(exc, _ClientGone):
                raise _RouteGone() from None
            raise
        match = _STATUS_LINE_RE.match(head)
        return tunnel, reader, head, int(match.group(1)) if match else 0

    def _finish_upgrade(self, route: Route, tunnel: "_Tunnel", reader: _Reader, head: bytes,
                        status: int) -> None:
        """Relay a non-101 answer as HTTP. On a 101: take the upstream->client thread from the pool
        (counted in the cap: at the cap the client gets 503 proxy-busy, not a half-made tunnel),
        relay the 101 verbatim and copy client->upstream on this thread until either side ends."""
        stream = tunnel.upstream
        assert stream is not None
        try:
            if status != 101:
                stream.settimeout(self.proxy.read_timeout_s)
                reader.recv = stream.recv
                try:
                    self._relay_response(route, reader, _parse_answer(head, "GET"))
                except _BadResponse as exc:
                    self._refuse(_classify_upstream_error(exc, route), close=True)
                return
            if tunnel.cut:
                self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
                return
            if not self.server.workers.submit(tunnel.pump_upstream):
                reason = _busy_reason(self.server.workers)
                if not self.proxy._stopping:
                    _warn_busy(self.server.busy_warnings, reason)
                self._refuse(_busy_refusal(reason), close=True)
                return
            try:
                _set_socket_timeout(self.connection, None)  # blocking: a session lasts as it likes
                stream.settimeout(None)
                tunnel.opened = True
                self.connection.sendall(head + reader.buf)
            except OSError:
                tunnel.close()
            data, self._client.buf = self._client.buf, b""  # (frames sent right behind the upgrade)
            tunnel.run(data)
        finally:
            tunnel.close()  # (a no-op after run(); else it frees the upstream->client worker)
            route._remove_tunnel(tunnel)
            stream.close()


def _head_bytes(status: int, reason: str, headers: List[Tuple[str, str]]) -> bytes:
    fields = "".join(["%s: %s\r\n" % pair for pair in headers])
    return ("HTTP/1.1 %d %s\r\n%s\r\n" % (status, reason, fields)).encode("latin-1")


def _refusal_bytes(refusal: Refusal, close: bool, with_body: bool = True) -> bytes:
    """A refusal as the client gets it: its status and headers, X-Proxy-Error, a small JSON body."""
    body = json.dumps({"error": refusal.kind, "message": refusal.message,
                       **(refusal.body or {})}).encode()
    headers = list(refusal.headers)
    if refusal.proxy_error:
        headers.append(("X-Proxy-Error", refusal.kind))
    headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if close:
        headers.append(("Connection", "close"))
    reason = http.server.BaseHTTPRequestHandler.responses.get(refusal.status, ("",))[0]
    return _head_bytes(refusal.status, reason, headers) + (body if with_body else b"")


def _watching(client: socket.socket, deadline: float, step: Callable[[], Optional[bytes]],
              what: str) -> Optional[bytes]:
    """step() on an upstream stream timing out in slices (TUNNEL_WATCH_S), retried until `deadline`
    (socket.timeout saying `what`) unless the client hung up (_ClientGone frees both sides now)."""
    while True:
        try:
            return step()
        except socket.timeout:
            if time.monotonic() >= deadline:
                raise socket.timeout(what) from None
            if _client_left(client):
                raise _ClientGone() from None


def _client_left(client: socket.socket) -> bool:
    """Whether the client hung up (a peek that never waits; bytes it sent stay for the tunnel)."""
    try:
        return not client.recv(1, _PEEK_NOW)
    except BlockingIOError:
        return False
    except OSError:
        return True


class _RouteGone(Exception):
    """An upgrade's route was closed (unmount, stop) before its 101 reached the client."""


def _route_gone_refusal(stopping: bool, what: str = "WebSocket upgrade") -> Refusal:
    """The answer to a request or upgrade that an unmount or stop() cut off."""
    if stopping:
        return Refusal(503, "proxy-stopping", "The proxy is stopping; this %s was cut off." % what)
    return Refusal(404, "unknown-route", "The route was unmounted while this %s was under way; "
                   "mount it again, or use the base URL of a mounted route." % what)


# --- Upstream connections: pool, streams, TLS engine, tunnel --------------------------------------


class _UpstreamConnection:
    """One keep-alive HTTP/1.1 connection to an upstream (an `ssl.SSLSocket` for https) and its
    reader. Reads wait in slices of ANSWER_WATCH_S, checking between them that the client in
    `watch` is still there (else _ClientGone), and give up after read_timeout_s."""

    __slots__ = ("sock", "reader", "since", "watch", "read_timeout_s", "_poller", "__weakref__")

    def __init__(self, sock: socket.socket, read_timeout_s: float) -> None:
        self.sock, self.read_timeout_s = sock, read_timeout_s
        self.watch: Optional[socket.socket] = None  # the client waiting for this answer, if any
        self.reader = _Reader(self._recv, _upstream_cut_short)
        self.since = 0.0  # when it was last checked in
        self._poller: Optional["select.poll"] = None  # has_input's, made once

    def _recv(self, n: int) -> bytes:
        """Up to IO_CHUNK bytes, whatever `n` (the reader keeps what is past it): more than a TLS
        record's plaintext, so OpenSSL never keeps decrypted bytes between two reads."""
        try:
            return self.sock.recv(IO_CHUNK)
        except (BlockingIOError, socket.timeout):  # a slice passed (BlockingIOError: the kernel's)
            pass
        deadline = time.monotonic() + self.read_timeout_s - min(ANSWER_WATCH_S, self.read_timeout_s)
        while True:
            if self.watch is not None and _client_left(self.watch):
                raise _ClientGone()
            if time.monotonic() >= deadline:
                raise socket.timeout("timed out")
            with contextlib.suppress(BlockingIOError, socket.timeout):
                return self.sock.recv(IO_CHUNK)

    def _sendall(self, data: "bytes | memoryview") -> None:
        sock = self.sock
        if KERNEL_TIMEOUTS and not isinstance(sock, ssl.SSLSocket):
            try:
                sock.sendall(data)  # the kernel's send timeout is read_timeout_s
            except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
                raise socket.timeout("timed out") from None
            return
        # Python's timeout is the read slice (settimeout costs syscalls); give up at read_timeout_s
        # without progress. OpenSSL requires a timed-out TLS write be retried with the same bytes.
        with memoryview(data) as view:
            deadline = None
            while view:
                try:
                    view = view[sock.send(view):]
                    deadline = None
                except socket.timeout:
                    deadline = deadline or time.monotonic() + self.read_timeout_s
                    if time.monotonic() >= deadline:
                        raise socket.timeout("timed out") from None

    def has_input(self) -> bool:
        """Whether the upstream sent bytes or an end of stream, without blocking. TLS records with
        no data (TLS 1.3 session tickets) are consumed, and do not count."""
        sock = self.sock  # (an SSLSocket holds no decrypted bytes between reads: see _recv)
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()  # one socket: this connection's, no wait
            poller.register(sock, select.POLLIN)
        try:
            if not poller.poll(0):
                return False
        except (OSError, ValueError):
            return True
        if not isinstance(sock, ssl.SSLSocket):
            return True
        timeout = sock.gettimeout()
        sock.settimeout(0)
        try:
            data = sock.recv(IO_CHUNK)
        except (ssl.SSLWantReadError, BlockingIOError):
            return False
        except OSError:
            return True
        finally:
            sock.settimeout(timeout)
        self.reader.buf = data + self.reader.buf
        return True

    def send_request(self, head: bytes, pieces: Iterator[bytes], chunked: bool) -> bool:
        """Send the head, then the body IO_CHUNK at a time; False, with the rest unsent, if the
        upstream answered early (e.g. 413): past SMALL_RESPONSE_BYTES each send polls first, so
        that answer is read before the upstream's close resets the connection."""
        self._sendall(head)
        sent = 0
        for piece in pieces:
            if chunked:
                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
            with memoryview(piece) as view:
                for offset in range(0, len(view), IO_CHUNK):
                    if sent > SMALL_RESPONSE_BYTES and self.has_input():
                        return False
                    self._sendall(view[offset:offset + IO_CHUNK])
                    sent += min(IO_CHUNK, len(view) - offset)
        if chunked:
            self._sendall(b"0\r\n\r\n")
        return True

    def close(self) -> None:
        self.sock.close()


class _Reader:
    """Buffered reads over a `recv(n)` callable, keeping what was read past a caller's ask in `buf`
    (`io.BufferedReader` would hide it); a peer that closes too early raises `cut_short(where)`."""

    __slots__ = ("recv", "cut_short", "buf")

    def __init__(self, recv: Callable[[int], bytes], cut_short: Callable[[str], Exception]) -> None:
        self.recv, self.cut_short, self.buf = recv, cut_short, b""

    def read1(self, n: int) -> bytes:
        """Up to n bytes: the buffered ones, else one read; b"" once the peer closed."""
        buf = self.buf or self.recv(IO_CHUNK)
        self.buf = buf[n:]
        return buf[:n]

    def read_exact(self, n: int, where: str) -> bytes:
        buf = self.buf
        while len(buf) < n:
            data = self.recv(IO_CHUNK)
            if not data:
                raise self.cut_short(where)
            buf += data
        self.buf = buf[n:]
        return buf[:n]

    def pieces(self, n: int, where: str) -> Iterator[bytes]:
        while n > 0:
            data = self.read1(min(n, IO_CHUNK))
            if not data:
                raise self.cut_short(where)
            n -= len(data)
            yield data

    def readline(self, limit: int) -> bytes:
        """What `readline(limit)` of a file answers."""
        buf = self.buf
        while len(buf) < limit and b"\n" not in buf:
            data = self.recv(IO_CHUNK)
            if not data:
                break
            buf += data
        end = buf.find(b"\n", 0, limit) + 1 or min(len(buf), limit)  # past the LF, else all it may
        self.buf = buf[end:]
        return buf[:end]

    def read_head(self, first: bool) -> bytes:
        """One answer head, through its blank line; _BadResponse if cut short or too large, but
        _UpstreamClosed for no byte at all when `first` (the retry rule's 'no answer')."""
        buf, searched = self.buf, 0
        while True:
            end = _head_end(buf, searched) if buf else -1
            if 0 <= end <= MAX_RESPONSE_HEAD_BYTES:
                self.buf = buf[end:]
                return buf[:end]
            if end > MAX_RESPONSE_HEAD_BYTES or len(buf) > MAX_RESPONSE_HEAD_BYTES:
                raise _BadResponse("upstream-head-too-large", "sent a response head larger than "
                                   "%d bytes (the proxy's limit)" % MAX_RESPONSE_HEAD_BYTES)
            searched = max(0, len(buf) - 2)
            try:
                data = self.recv(IO_CHUNK)
            except (socket.timeout, TimeoutError):
                raise
            except OSError as exc:
                if first and not buf:
                    raise _UpstreamClosed(_failure_name(exc)) from None
                raise _BadResponse("upstream-unreachable", "dropped the connection in the middle "
                                   "of its response head (%s)" % _failure_name(exc)) from None
            if not data:
                if first and not buf:
                    raise _UpstreamClosed("closed")
                raise _BadResponse("upstream-unreachable", "closed the connection in the middle of "
                                                           "its response head")
            buf += data


def _dechunk(reader: _Reader, malformed: Callable[[str], Exception],
             trailer_limit: int) -> Iterator[bytes]:
    """Yield a chunked body's data as it arrives (RFC 9112 section 7.1), dropping its trailers;
    `malformed(what)` makes the exception for a body that breaks the rules."""
    while True:
        line = reader.readline(MAX_CHUNK_LINE + 1)
        size_text = line.split(b";", 1)[0].strip()
        if (len(line) > MAX_CHUNK_LINE or not line.endswith(b"\n") or not size_text
                or len(size_text) > 16 or size_text.strip(b"0123456789abcdefABCDEF")):
            raise malformed("a malformed chunk-size line")
        size = int(size_text, 16)
        if size == 0:
            break
        yield from reader.pieces(size, "in the middle of a chunk")
        if reader.read_exact(2, "in the middle of a chunk") != b"\r\n":
            raise malformed("chunk data not followed by CRLF")
    trailer_bytes = 0
    while True:
        line = reader.readline(MAX_CHUNK_LINE + 1)
        trailer_bytes += len(line)
        if not line.endswith(b"\n") or trailer_bytes > trailer_limit:
            raise malformed("a malformed or oversized trailer section")
        if line in (b"\r\n", b"\n"):
            return


def _upstream_cut_short(where: str) -> Exception:
    return _BadResponse("upstream-unreachable", "closed the connection " + where)


def _client_cut_short(where: str) -> Exception:
    return _ClientBodyError("the client closed the connection " + where)


def _client_malformed(what: str) -> Exception:
    return _ClientBodyError("malformed chunked body: " + what)


class _Answer(NamedTuple):
    """A parsed upstream response head and how its body is delimited (RFC 9112 section 6.3)."""

    status: int
    reason: str
    headers: List[Tuple[str, str]]
    mode: str  # "none", "length", "chunked" or "close" (read until the upstream closes)
    length: int  # the Content-Length for "length", else -1
    keep_alive: bool  # the connection may carry another request once this body is read
    lowered: List[str]  # the header names lower-cased, in order
    raw: Optional[bytes] = None  # the head, if relayed as is (`headers` and `lowered` then empty)


def _parse_answer(head: bytes, method: str) -> _Answer:
    """Parse a response head, or raise _BadResponse. HEAD, 1xx, 204 and 304 have no body;
    Transfer-Encoding wins over Content-Length (the connection is then not reused)."""
    plain = _PLAIN_ANSWER_RE.fullmatch(head)
    if plain is not None and len(head.translate(None, _CONTROL_BYTES)) == len(head):
        lowered_head = head.lower()
        if _REWRITTEN_FIELD_RE.search(lowered_head) is None:
            status = int(plain.group(1))
            reason = plain.group(2).decode("latin-1")
            if method == "HEAD" or status in (204, 304):
                return _Answer(status, reason, [], "none", -1, True, [], head)
            start = lowered_head.find(b"\r\ncontent-length: ") + 18
            if start >= 18 and lowered_head.find(b"\r\ncontent-length:", start) < 0:
                value = head[start:head.find(b"\r", start)]
                if value.isdigit() and len(value) <= 18 and value == b"%d" % int(value):
                    return _Answer(status, reason, [], "length", int(value), True, [], head)
    text = head.decode("latin-1")
    start = text.find("\n") + 1
    match = _RESPONSE_LINE_RE.match(text[:start - 1].rstrip("\r"))
    if not match:
        raise _BadResponse("upstream-protocol", "sent a malformed status line")
    minor, status, reason = match.group(1), int(match.group(2)), match.group(3) or ""
    if status < 100:  # "000"-"099" are not statuses (http.client and h11 refuse them too)
        raise _BadResponse("upstream-protocol", "sent the status code %03d" % status)
    headers: List[Tuple[str, str]] = []
    for line in text[start:].split("\n")[:-2]:  # (the last two: the blank line ending the head)
        line = line[:-1] if line.endswith("\r") else line
        if line[0] in " \t":  # obs-fold: joined to the previous field's value with a space
            if not headers:
                raise _BadResponse("upstream-protocol", "sent a response head starting with a "
                                                        "folded line")
            name, value = headers.pop()
            headers.append((name, (value + " " + line.strip(" \t")).strip(" ")))
            continue
        field = _RESPONSE_FIELD_RE.fullmatch(line + "\n")
        if field is None:
            raise _BadResponse("upstream-protocol", "sent a malformed response header line")
        headers.append((field.group(1), field.group(2)))
    lowered = [name.lower() for name, _ in headers]
    listed: Dict[str, List[str]] = {"transfer-encoding": [], "content-length": [], "connection": []}
    for lower, (_, value) in zip(lowered, headers):
        if lower in listed:
            listed[lower] += [item.strip() for item in value.split(",")]
    codings = [coding.lower() for coding in listed["transfer-encoding"] if coding]
    lengths, connection = set(listed["content-length"]), {t.lower() for t in listed["connection"]}
    keep_alive = "close" not in connection and (minor == "1" or "keep-alive" in connection)
    mode, length = "close", -1
    if method == "HEAD" or status < 200 or status in (204, 304):
        mode = "none"
    elif codings:
        if codings[-1] == "chunked":
            mode, keep_alive = "chunked", keep_alive and not lengths
    elif lengths:
        value = lengths.pop()
        if lengths or not (value.isascii() and value.isdigit()) or len(value) > 18:
            raise _BadResponse("upstream-protocol", "sent an invalid or conflicting Content-Length")
        mode, length = "length", int(value)
    return _Answer(status, reason, headers, mode, length, keep_alive and mode != "close", lowered)


def _answer_body(reader: _Reader, answer: _Answer) -> Iterator[bytes]:
    """The answer's body as it arrives (de-chunked); one cut short raises _BadResponse."""
    if answer.mode == "length":
        return reader.pieces(answer.length, "in the middle of its response body")
    if answer.mode == "chunked":
        return _dechunk(reader, lambda what: _BadResponse("upstream-protocol", "sent " + what),
                        MAX_RESPONSE_HEAD_BYTES)
    return iter(functools.partial(reader.read1, IO_CHUNK), b"")  # until the upstream closes


def _request_lines(method: str, target: str, headers: List[Tuple[str, str]]) -> str:
    """The upstream request's line and header lines, each ending CRLF (no blank line yet)."""
    return "%s %s HTTP/1.1\r\n%s\r\n" % (method, target, "\r\n".join(map(": ".join, headers)))


def _set_socket_timeout(sock: socket.socket, timeout: Optional[float],
                        send_timeout: Optional[float] = None) -> None:
    """Give a plain socket `timeout` (None: block forever), in the kernel with KERNEL_TIMEOUTS (for
    sends `send_timeout` if given; calls then raise BlockingIOError: callers make it a timeout)."""
    if not KERNEL_TIMEOUTS:
        sock.settimeout(timeout)
        return
    if sock.gettimeout() is not None:  # e.g. the connect timeout, or socket.setdefaulttimeout()'s
        sock.settimeout(None)
    for option, value in ((socket.SO_RCVTIMEO, timeout),
                          (socket.SO_SNDTIMEO, timeout if send_timeout is None else send_timeout)):
        seconds = 0.0 if value is None else max(float(value), 1e-6)  # 0 is "never" to the kernel
        sock.setsockopt(socket.SOL_SOCKET, option,
                        struct.pack("@ll", int(seconds), int((seconds - int(seconds)) * 1e6)))


_TLS_CONTEXT_LOCK = threading.Lock()  # see _shared_tls_context


def _shared_tls_context(verify: Verify) -> ssl.SSLContext:
    """The TLS context for `verify` that routes (and `EnvSession`s) share; a CA bundle edited since
    is read again. One build at a time: callers racing to their first TLS use (a batch of
    environments stepped at once) would each build a ~1 MiB context, and each keep its own."""
    with _TLS_CONTEXT_LOCK:
        stamp = None
        if isinstance(verify, str):  # the bundle's mtime and size key the cache too
            with contextlib.suppress(OSError):  # (else the context creation reports it)
                stat = os.stat(verify)
                stamp = (stat.st_mtime_ns, stat.st_size)
        return _make_tls_context(verify, stamp)


@functools.lru_cache(maxsize=TLS_CONTEXTS_KEPT)
def _make_tls_context(verify: Verify, stamp: object) -> ssl.SSLContext:
    """A TLS context for `verify`, the last TLS_CONTEXTS_KEPT kept (`stamp` only keys them)."""
    if isinstance(verify, str):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    context = ssl.create_default_context()
    if verify is False:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        return context
    # like requests: also trust certifi's bundle (requests depends on it), for an empty system store
    with contextlib.suppress(ImportError, OSError, ssl.SSLError):
        import certifi

        context.load_verify_locations(cafile=certifi.where())
    return context


def _abort_socket(sock: socket.socket) -> None:
    """Wake any thread blocked on this socket (a shutdown at the fd level, even for TLS sockets)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _quiet_close(closeable: Any) -> Optional[str]:
    try:
        closeable.close()
    except Exception as exc:
        return type(exc).__name__
    return None


def _busy_reason(workers: _WorkerPool) -> str:
    """Why `workers` had no thread: the proxy's own cap, or a limit of the system's (named so that
    a user at `ulimit -u` is not told of a cap far above it)."""
    running = workers.counts()[0]
    failure = workers.start_failure
    if failure is None or running >= workers.max_workers:
        return ("no free worker thread: the proxy is at its limit of %d threads (each WebSocket "
                "session holds two)" % workers.max_workers)
    return ("no free worker thread: the system refused the proxy a new thread (%s) with %d of its "
            "threads running: raise the process's limits (ulimit -u, kernel.threads-max, "
            "vm.max_map_count, memory)" % (failure, running))


def _out_of_files_reason(error: int) -> str:
    """Why a descriptor could not be had: this process's limit (EMFILE) or the system's (ENFILE)."""
    if error == errno.ENFILE:
        return ("the system is out of file descriptors (ENFILE): raise fs.file-max, or close what "
                "holds them")
    limit = "?"
    if resource is not None:
        limit = str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return ("the proxy's process is out of file descriptors (EMFILE: its limit, `ulimit -n`, is "
            "%s; a WebSocket session holds two in the proxy, one more for a client in the same "
            "process): raise it, e.g. to the hard limit with resource.setrlimit" % limit)


def _raise_open_files_limit() -> Optional[int]:
    """For a process that only runs the proxy: its soft limit on open files raised to the hard one
    (a session holds two; the usual 1,024 stops near 500), returned. Never done in a trainer's
    process: code there using select() breaks on descriptors past 1,023."""
    if resource is None:
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):  # (e.g. an unlimited hard limit the kernel caps)
        return None


def _open_spare_fd() -> Optional[int]:
    """A descriptor held in reserve for `_Server._shed_one` (None if even that cannot be had)."""
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _busy_refusal(reason: str) -> Refusal:
    return Refusal(503, "proxy-busy", "%s%s; retry shortly, or spread sessions over more processes."
                   % (reason[0].upper(), reason[1:]),
                   headers=(("Retry-After", str(BUSY_RETRY_AFTER_S)),))


def _answer_busy(sock: socket.socket, reason: str, warnings: "_WarningRate") -> None:
    """Best effort, from the listener thread (which must never block): answer a connection the
    proxy cannot serve (no thread or descriptor: `reason`) with a 503 `proxy-busy`, unread."""
    _warn_busy(warnings, reason)
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # what already arrived (unread bytes make a reset)
            sock.recv(IO_CHUNK)
        sock.send(_refusal_bytes(_busy_refusal(reason), close=True))


def _warn_busy(warnings: "_WarningRate", reason: str) -> None:
    refused = warnings.note(time.monotonic())
    if refused:
        log.warning("proxy: answered 503 proxy-busy %d time(s) since the previous warning (at most "
                    "one per %g s): %s", refused, warnings.every_s, reason)


class _WarningRate:
    """Counts events and says when a WARNING about them is due: the first at once, then at most one
    per `every_s` seconds, each reporting how many events happened since the previous one."""

    def __init__(self, every_s: float) -> None:
        self.every_s, self._lock, self._held = every_s, threading.Lock(), 0
        self._last: Optional[float] = None

    def note(self, now: float) -> int:
        """Count one event at `now` (monotonic); if a warning is due, the events to report (this
        and those held back since the last one), else 0."""
        with self._lock:
            self._held += 1
            if self._last is not None and now - self._last < self.every_s:
                return 0
            self._last, held, self._held = now, self._held, 0
            return held


class _Stream:
    """A byte stream to the upstream for one WebSocket session, over a blocking TCP socket: one
    thread may recv while another sends (one per direction)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.settimeout = sock, sock.settimeout

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def abort(self) -> None:
        """Wake threads blocked on this stream; they see EOF or an error and end."""
        _abort_socket(self.sock)

    def close(self) -> None:
        self.abort()
        self.sock.close()


class _TlsStream(_Stream):
    """TLS through an `ssl.SSLObject` on memory buffers, for a reading and a sending thread. OpenSSL
    forbids two threads in one SSL object, so the engine is touched only under `_engine`, never held
    across a socket call. Output is taken and sent only under `_sending` (taken before `_engine`),
    in the order the engine wrote it; `_sending` is let go under `_engine` with no output left, so
    output another thread writes is sent by the holder, or finds it free. A reader never waits for
    `_sending`: stopped while the upstream's receive window is full, it could deadlock both ends."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str) -> None:
        super().__init__(sock)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self._engine, self._sending = threading.Lock(), threading.Lock()

    def handshake(self) -> None:
        """The TLS handshake on the socket's timeout (called again after one, it goes on where it
        stopped); each flight is sent before the peer's is awaited."""
        while True:
            try:
                with self._engine:
                    self._tls.do_handshake()
                self.sendall()
                return
            except ssl.SSLWantReadError:
                self.sendall()
                self._feed()

    def recv(self, n: int) -> bytes:
        """Up to `n` decrypted bytes; b"" once the peer ended the stream. With nothing buffered it
        reads the socket first: no decrypt attempt that fails on an empty buffer per frame."""
        while True:
            with self._engine:
                data: Optional[bytes] = None
                if self._incoming.pending or self._incoming.eof or self._tls.pending():
                    try:
                        data = self._tls.read(n)
                    except ssl.SSLWantReadError:
                        pass
                    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, TCP close
                        data = b""
                reply = self._outgoing.pending  # e.g. the answer to a key update
            if reply:
                self.sendall(wait=False)
            if data is not None:
                return data
            self._feed()

    def _feed(self) -> None:
        data = self.sock.recv(IO_CHUNK)
        with self._engine:
            if data:
                self._incoming.write(data)
            else:
                self._incoming.write_eof()

    def sendall(self, data: bytes = b"", wait: bool = True) -> None:
        """Encrypt `data` and send it after any output the engine wrote before it (without `wait`,
        only if no other thread holds `_sending`)."""
        if not self._sending.acquire(wait):
            return
        try:
            while True:
                with self._engine:
                    if data:
                        self._tls.write(data)
                        data = b""
                    output = self._outgoing.read()
                    if not output:
                        self._sending.release()
                        return
                self.sock.sendall(output)
        except BaseException:
            self._sending.release()
            raise


def _open_stream(route: Route, connect_timeout_s: float) -> _Stream:
    """A new stream to the route's upstream for one WebSocket session (TLS: not handshaken yet)."""
    sock = route._connect(connect_timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if route.scheme == "https":
            return _TlsStream(sock, route.tls_context(), route.host)
        return _Stream(sock)
    except BaseException:
        sock.close()
        raise


class _Tunnel:
    """A WebSocket session copied both ways: client->upstream on the handler's thread (`run`),
    upstream->client on a pool worker (`pump_upstream`, once the 101 is out); when either ends,
    both sockets close. Unmount and stop end it at any step from the connect on (`cut_off`): before
    the 101 only the upstream side, and the handler still answers the client as HTTP."""

    def __init__(self, client: socket.socket, label: str) -> None:
        self.client, self.label = client, label
        self.upstream: Optional[_Stream] = None  # set once connected
        self.opened = False  # the 101 is on its way to the client
        self.cut = False  # ended by its route (unmount, stop)
        self._closed = False
        # Plain locks, both held from the start (cheaper than Events).
        self._go = threading.Lock()  # released once the 101 is out (or the tunnel closed before)
        self._go.acquire()
        self._pumped = threading.Lock()  # released when the upstream->client direction ended
        self._pumped.acquire()

    def cut_off(self) -> None:
        self.cut = True
        if self.opened:
            self.close()
        elif self.upstream is not None:
            self.upstream.abort()

    def close(self) -> None:
        """End both directions now (from any thread; idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # released already (by run())
            self._go.release()
        _abort_socket(self.client)
        if self.upstream is not None:
            self.upstream.abort()

    def run(self, first: bytes) -> None:
        """Copy client->upstream on this thread, starting with `first` (the client's bytes already
        read), while `pump_upstream` copies the other way; return once both directions ended."""
        with contextlib.suppress(RuntimeError):  # released already (by close())
            self._go.release()
        try:
            self._pump(self.client.recv, self.upstream.sendall, first)  # type: ignore[union-attr]
        finally:
            if not self._pumped.acquire(timeout=STOP_JOIN_S):  # pragma: no cover - sockets are shut
                log.warning("proxy: %s tunnel's upstream reader did not end", self.label)

    def pump_upstream(self) -> None:
        """Copy upstream->client (a pool worker's job), once the 101 is out."""
        try:
            self._go.acquire()
            if not self._closed:
                self._pump(self.upstream.recv, self.client.sendall)  # type: ignore[union-attr]
        finally:
            self._pumped.release()

    def _pump(self, read: Callable[[int], bytes], write: Callable[[bytes], None],
              first: bytes = b"") -> None:
        try:
            with contextlib.suppress(OSError, ValueError):  # (a shut socket, or an ssl.SSLError)
                if first:
                    write(first)
                for data in iter(functools.partial(read, TUNNEL_READ_BYTES), b""):
                    write(data)
        finally:
            self.close()


# --- CLI: python proxy.py UPSTREAM_URL [--port P] -------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    """Front one upstream URL on loopback: print the base URL, stop cleanly on Ctrl-C/SIGTERM."""
    import argparse  # only the command line needs it

    parser = argparse.ArgumentParser(prog="python proxy.py",
                                     description="Front a job URL with a local auth proxy.")
    add = parser.add_argument
    add("upstream", metavar="UPSTREAM_URL", help="e.g. https://<job_id>--8000.hf.jobs")
    add("--port", type=int, default=0, help="local port (default: a free one)")
    add("--host", default="127.0.0.1", help="local address to bind (default: 127.0.0.1)")
    tls = parser.add_mutually_exclusive_group().add_argument  # (both: which one wins is unclear)
    tls("--insecure", action="store_true", help="do not verify the upstream's TLS certificate")
    tls("--ca-bundle", help="CA bundle file to verify the upstream with")
    add("-v", "--verbose", action="store_true", help="log at DEBUG level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    reason = _upstream_rejection(args.upstream)
    if reason:
        parser.error(reason)
    sys.setswitchinterval(CLI_SWITCH_INTERVAL_S)
    log.debug("proxy: GIL switch interval %.3g s, open files up to %s (this process only runs the "
              "proxy)", CLI_SWITCH_INTERVAL_S, _raise_open_files_limit())
    from huggingface_hub import get_token  # HF_TOKEN, then the `hf auth login` file (only here)
    token = get_token()
    if not token and not _is_loopback_host(urllib.parse.urlsplit(args.upstream).hostname):
        print("error: no HF token found: set HF_TOKEN or run `hf auth login`", file=sys.stderr)
        return 2
    verify: Verify = False if args.insecure else (args.ca_bundle or True)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        proxy = AuthProxy(args.host, args.port).start()
    except (OSError, ValueError) as exc:
        print("error: cannot listen on %s:%d (%s)" % (args.host, args.port, exc), file=sys.stderr)
        return 2
    try:
        print(proxy.mount(args.upstream, token or None, verify=verify), flush=True)
        while not stop.wait(0.5):  # (a short wait, so Ctrl-C gets through)
            pass
    except ValueError as exc:  # (the mount's)
        print("error: %s" % exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
