"""A loopback auth proxy that fronts remote OpenEnv servers (HF Jobs exposed ports) for local clients.

`AuthProxy` listens on 127.0.0.1 and mounts upstreams under unguessable path prefixes. Each request to
`http://127.0.0.1:<port>/<route-id>/<rest>` is forwarded to `<upstream>/<rest>` with the route's bearer
token injected, so unmodified OpenEnv clients (HTTP and WebSocket) can talk to a token-protected job
without ever seeing the token. Threads only, standard library only: no event loop; WebSocket frames are
never parsed, the tunnel copies raw bytes. `mount_replicas` puts one route in front of several jobs of
the same server and spreads WebSocket sessions over them (fewest open sessions first).

Public names: `AuthProxy`, `Route`, `ReplicaRoute`, `Refusal`, `InsecureURLError`. Run `python proxy.py UPSTREAM_URL`
to front one job from the command line.
"""
from __future__ import annotations

import argparse
import collections
import functools
import http.client
import http.server
import io
import ipaddress
import json
import logging
import os
import re
import secrets
import select
import selectors
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

__all__ = ["AuthProxy", "AuthProxyProcess", "Route", "ReplicaRoute", "Refusal", "InsecureURLError"]

log = logging.getLogger("proxy")

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------

# The stdlib listen backlog is 5: a burst of a few hundred environments connecting at once would see
# connection resets. At 8,192 simultaneous sessions a 1,024 backlog overflowed (185 resets) while the
# listener thread waited for the GIL; 4096 absorbs such bursts. The kernel silently caps it at
# net.core.somaxconn (4096 by default since Linux 5.4), so asking for more would buy nothing.
LISTEN_BACKLOG = 4096
# A keep-alive client connection with no request in flight is closed after this long. Generous because
# training loops may sit idle between episodes; clients (requests/urllib3) reconnect transparently.
CLIENT_IDLE_TIMEOUT_S = 300.0
# Once the first byte of a request has arrived, its request line and headers must be complete within
# this bound, so a client that stalls (or drips bytes) mid-headers cannot hold a thread forever.
HEADER_TIMEOUT_S = 30.0
# Limits on the request head: the whole header section (the stdlib only caps each line, so 100 x 64 KiB
# would pass), the header count (the stdlib's 100) and the request line.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_REQUEST_LINE = 64 * 1024
# A chunk-size line ("1a2b;ext=...") longer than this is malformed, not a real chunk header.
MAX_CHUNK_LINE = 4096
# Request bodies up to this size are read fully before forwarding, which makes them replayable on a
# fresh upstream connection when a pooled one turns out stale; bigger bodies are streamed.
REPLAYABLE_BODY_BYTES = 1024 * 1024
# Response bodies up to this size are read before answering so headers and body leave in one send.
SMALL_RESPONSE_BYTES = 64 * 1024
# Upstream response heads (status line + headers) up to this size are relayed; a bigger one gets 502
# upstream-head-too-large. No separate line or count limit: clients differ (http.client stops at 100
# header lines, h11 at 16 KiB by default, curl at 300 KiB), so the proxy is at least as permissive as
# the Python clients and stays bounded per connection.
MAX_RESPONSE_HEAD_BYTES = 256 * 1024
# Interim (1xx) responses relayed before the final one; an upstream sending more is looping: 502.
MAX_INTERIM_RESPONSES = 32
# Socket read size for streaming bodies and tunnels: large enough to move a 1 MiB frame in a few calls.
IO_CHUNK = 64 * 1024
# Content-Length values read (digits to int) and lines made (int to a request's framing line), kept: a
# client's requests and an upstream's answers repeat a few lengths, then looked up instead of converted
# (int() or formatting, ~500 instructions each). At most this many of each are kept, each ~100 bytes.
MAX_CACHED_LENGTHS = 4096
# What a pooled TLS connection asks its engine for per read: a TLS record's largest plaintext (RFC 8446
# section 5.1, RFC 5246 section 6.2.1), so each read takes a whole record and none is left half-read.
TLS_RECORD_BYTES = 16 * 1024
# Read size of each direction of a WebSocket tunnel. OpenEnv frames are a few hundred bytes; a 1 MiB
# frame takes 64 reads. A held session's two threads each wait in recv with a buffer of this size.
TUNNEL_READ_BYTES = 16 * 1024
# While an upgrade waits for the upstream's answer, the client is checked every this many seconds: one
# that hung up frees the thread and the upstream connection at once rather than after read_timeout_s.
TUNNEL_WATCH_S = 0.5
# Idle upstream connections kept per route; more concurrent requests simply open more connections.
POOL_MAX_IDLE = 64
# While a request waits for its upstream's answer, the client may hang up (a trainer whose request
# timed out retries on a new connection): the wait is a blocking read in slices of this many seconds,
# checking the client between slices, instead of a poll() of both sockets per request (a system call
# and a GIL hand-off the CPython floor does not pay; an answer within the first slice costs nothing).
ANSWER_WATCH_S = 0.5
# Pooled upstream connections idle longer than this are not reused: uvicorn (OpenEnv's server) closes
# idle keep-alive connections after 5 s, and racing that close would turn a request into an error.
POOL_IDLE_S = 4.0
# TLS contexts shared by routes with the same `verify`: one with the system store and certifi's bundle
# costs ~920 KiB of RSS (measured), and a trainer mounts a route per environment and per replacement,
# so per-route contexts cost 64 environments ~58 MiB and churned the heap at every restart. A handful
# of distinct `verify` values is the norm; the least recently used beyond this many is dropped.
TLS_CONTEXTS_KEPT = 8
# glibc gives each busy thread an arena of its own and returns freed memory to the system only from
# the top of an arena's heap: in a 5-minute chaos run (64 environments, restarts) the live heap stayed
# ~20 MiB while the free memory glibc held grew ~2 MiB a minute, and RSS with it. The proxy asks glibc
# to release free pages (malloc_trim) after an unmount or a worker's retirement, at most this often
# (a trim walks every arena: a few milliseconds); no-op where malloc_trim does not exist (not glibc).
MALLOC_TRIM_EVERY_S = 30.0
# How long stop() waits for each thread it started before naming it as left behind.
STOP_JOIN_S = 5.0
# Worker threads at most: a keep-alive HTTP connection holds one, an open WebSocket session two (one
# per direction), so this caps connections served at once and open sessions at half of it. At the
# cap a new connection (or an upgrade short of its second thread) is answered 503 `X-Proxy-Error:
# proxy-busy` with `Retry-After` instead of queueing behind connections that may last hours.
MAX_WORKERS = 16384
# A parked worker that got no work for this long ends. Long enough that a trainer's next batch of
# sessions (seconds to a minute apart) finds the threads the previous one left; short enough that a
# burst's thousands of threads do not outlive it by much.
WORKER_IDLE_S = 60.0
# Stack reserved per worker thread (the default is 8 MiB of address space). The proxy's call depth
# is shallow (handler -> forwarding -> ssl/http.client), far below 256 KiB; it is virtual memory, so
# resident memory is what is touched either way (benchmarks/RESULTS.md measures RSS per session).
WORKER_STACK_BYTES = 256 * 1024
# Seconds a client is asked to wait (Retry-After) when the proxy is at MAX_WORKERS.
BUSY_RETRY_AFTER_S = 1
# At the thread cap every new connection is refused, possibly thousands a second: at most one WARNING
# per this many seconds, carrying the count of refusals since the previous one, says it all.
BUSY_WARNING_EVERY_S = 10.0
# `python proxy.py` only (its own process, nothing else to be fair to): how long a thread may hold the
# GIL before another runnable one gets it. The default 5 ms makes thousands of tunnel threads hand the
# GIL round in a futex-and-context-switch storm when sessions step together; 0.1 s cut a lockstep
# 4,096-session p99 from 67.8 s to 11.6 s. The library never changes it: the setting is process-wide
# and a trainer's own threads need the default.
CLI_SWITCH_INTERVAL_S = 0.1
# A Python socket with a timeout polls before every recv and send: two system calls (and two GIL
# hand-offs) where one would do. On Linux the client connections and pooled plain upstream connections
# are blocking sockets whose timeouts the kernel enforces (SO_RCVTIMEO/SO_SNDTIMEO): one call each,
# about four fewer per forwarded request (benchmarks/RESULTS.md). Elsewhere (timeval layouts differ)
# Python's own timeouts are used.
KERNEL_TIMEOUTS = sys.platform.startswith("linux")

# HTTP on a replica route: OpenEnv's /reset, /step and /state keep one environment per server, so a
# request sent to "any replica" would act on some other episode's state. These GET endpoints are
# stateless on every OpenEnv server (health check, environment metadata, action/observation schema),
# so they may go to any live replica; everything else is refused unless the route was mounted with
# http="any".
STATELESS_HTTP_PATHS = frozenset(["/health", "/metadata", "/schema"])
# Answers to a WebSocket upgrade that mean "this replica is down" (the HF jobs proxy answers these when
# the job is gone or not listening): the upgrade never reached the environment, so it is safe to retry.
REPLICA_DOWN_STATUSES = frozenset([502, 503, 504])
# A session whose upgrade fails on one replica is retried on one other replica, no more: a failure on
# two replicas in a row usually means the request (or the image) is at fault, not one job.
REPLICA_ATTEMPTS = 2

# RFC 9110 section 7.6.1 hop-by-hop headers (plus the legacy Proxy-Connection). `Expect` is answered
# by the proxy itself, and `Authorization`/`Host` are always replaced, so they never pass through.
HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
     "trailer", "transfer-encoding", "upgrade"]
)
REPLACED_REQUEST_HEADERS = frozenset(["authorization", "host", "expect", "content-length"])
# Methods whose repetition has no extra effect (RFC 9110 section 9.2.2): safe to retry once on a fresh
# connection when a pooled connection died before answering.
IDEMPOTENT_METHODS = frozenset(["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"])
# RFC 9110 token characters: a method is exactly one token.
_TOKEN_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_OBS_FOLD_RE = re.compile(r"\r?\n[ \t]+")
# Request targets: visible ASCII only (anything else must be percent-encoded by the client).
_BAD_TARGET_CHAR_RE = re.compile(r"[^\x21-\x7e]")
# Header values: no control characters except tab (CR/LF only appear in obs-folds, normalised later).
_BAD_VALUE_CHAR_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_VERSION_RE = re.compile(r"^HTTP/[0-9]\.[0-9]$")
_STATUS_LINE_RE = re.compile(rb"^HTTP/1\.[01] (\d{3})(?: |\r?$)")
_RESPONSE_LINE_RE = re.compile(r"^HTTP/1\.([01]) ([0-9]{3})(?: (.*))?$")
# One response header line (its CR removed) in one match: a token name, a colon, the value after its
# leading blanks, with no control character but tab (what _TOKEN_RE, _BAD_VALUE_CHAR_RE and a CR check
# did in three calls per line).
_RESPONSE_HEADER_RE = re.compile(r"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)\Z")
# The fast path for the common heads (anything else goes to the strict parsers, which name what is
# wrong). A clean request head is "METHOD /target HTTP/1.x", then "Name: value" lines with one space
# after the colon, a value without surrounding blanks or control characters, CRLF line ends: it
# parses to exactly what the strict parser makes of it, and each line is already the line the strict
# path would write upstream. Found with two regex calls (each costs about as much as 30 bytecodes):
# the request line, then a split on the header lines, which leaves only empty gaps if all are clean.
_CLEAN_VALUE = r"[^\x00-\x20\x7f](?:[^\x00-\x08\x0a-\x1f\x7f]*[^\x00-\x20\x7f])?"
_CLEAN_REQUEST_LINE_RE = re.compile(r"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (/[\x21-\x7e]*) (HTTP/1\.[01])\r\n")
_CLEAN_HEADER_LINE_RE = re.compile(r"(([!#$%%&'*+\-.^_`|~0-9A-Za-z]+): ((?:%s)?)\r\n)" % _CLEAN_VALUE)
# Request headers the fast path looks at (framing, connection, expectations) or drops (hop-by-hop ones,
# and those the proxy replaces). `close` is here because a `Connection: close` makes a header called
# Close hop-by-hop: such a request takes the strict path.
_SPECIAL_REQUEST_HEADERS = HOP_BY_HOP | REPLACED_REQUEST_HEADERS | {"close"}
# Of those, the ones the fast path simply drops; any other special one sends the request the strict way.
_DROPPED_PLAINLY = frozenset(["host", "authorization", "keep-alive", "proxy-connection", "proxy-authorization",
                              "proxy-authenticate"])
# Connection tokens the fast path understands ("" from a stray comma, which the strict parse skips).
_PLAIN_CONNECTION_TOKENS = frozenset(["keep-alive", "close", ""])
# A clean answer head: an HTTP/1.1 status line with a reason, header lines as a clean request's (an
# empty value allowed). Relayed byte for byte when it names no hop-by-hop header and has one
# Content-Length in canonical decimal: what the strict path writes for it, without re-formatting.
_CLEAN_ANSWER_RE = re.compile(r"HTTP/1\.1 ([2-5][0-9][0-9]) ([^\x00-\x08\x0a-\x1f\x7f]*)\r\n"
                              r"(?:[!#$%%&'*+\-.^_`|~0-9A-Za-z]+: (?:%s)?\r\n)*\r\n" % _CLEAN_VALUE)
# Its special lines, searched in the lower-cased head (a literal prefix: the search skips ahead).
_SPECIAL_ANSWER_RE = re.compile(r"\r\n(%s): ([^\r]*)" % "|".join(sorted(HOP_BY_HOP | {"content-length"})))
# A Date value the answer memo accepts unseen (see _answer_key): printable ASCII, deleted to nothing.
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))

Token = Union[str, Callable[[], str], None]
Verify = Union[bool, str]
# Extra per-route request headers (e.g. a pooled sandbox's X-Sandbox-Token): a mapping, or a
# zero-argument callable returning one, read at each request because such credentials rotate.
ExtraHeaders = Union[Mapping[str, str], Callable[[], Mapping[str, str]], None]
# Header names a route's extra headers may not set: the proxy frames the request and names the host
# itself, and hop-by-hop headers describe the proxy's own connection, not the request.
PROXY_SET_HEADERS = HOP_BY_HOP | frozenset(["host", "content-length", "expect"])
# `mount_replicas(http=...)`: "refuse" forwards only STATELESS_HTTP_PATHS (safe for every OpenEnv
# server); "any" forwards all HTTP to some live replica (only for servers stateless over HTTP).
HTTP_MODES = ("refuse", "any")


class InsecureURLError(ValueError):
    """Raised by `mount` for an upstream that would carry the token in clear text off this machine."""


class Refusal(NamedTuple):
    """A request the proxy answers itself instead of forwarding (sent as JSON with `X-Proxy-Error`).

    `proxy_error=False` leaves out the `X-Proxy-Error` header, for a subclass that must answer like the
    server it stands in for (the HF Jobs emulator's 401 looks like the real `*.hf.jobs` one)."""

    status: int  # e.g. 401, 404
    kind: str  # short machine word, e.g. "unauthorized", "unknown-route"
    message: str  # human sentence, goes in the JSON body
    headers: Tuple[Tuple[str, str], ...] = ()  # e.g. (("WWW-Authenticate", "Bearer"),)
    proxy_error: bool = True  # send `X-Proxy-Error: <kind>` (False: look like the upstream's own answer)
    body: Optional[Dict[str, object]] = None  # extra JSON fields for the body, e.g. which replicas failed


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


class Route:
    """One mounted upstream: where to forward, which token to inject (None = inject nothing), TLS verify,
    and extra request headers (`headers`: a mapping or a zero-argument callable, read per request).

    Keep-alive upstream connections live in a pool per upstream host (scheme, host, port, verify) that
    every route of one `AuthProxy` to that host shares (many sandboxes behind one host job: one TLS
    handshake per connection, not per sandbox). A route owns its in-flight requests and its open
    WebSocket tunnels, so closing it (`AuthProxy.unmount`) ends everything that talks through it; the
    host's idle connections close with the last route that uses them.
    """

    def __init__(self, upstream: str, token: Token, verify: Verify = True, headers: ExtraHeaders = None,
                 host_pools: Optional["_HostPools"] = None) -> None:
        _raise_if_rejected(_upstream_rejection(upstream))
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme.lower() == "http" and not _is_loopback_host(parts.hostname or ""):
            raise InsecureURLError(
                "refusing cleartext upstream %s://%s: the token would cross the network unencrypted; use "
                "https:// (http:// is only allowed for loopback hosts)" % (parts.scheme, parts.netloc))
        _raise_if_rejected(_token_rejection(token) or _verify_rejection(verify)
                           or _extra_headers_rejection(headers, token is not None))
        self.upstream: str = upstream
        self.token: Token = token
        self._checked_token: Optional[str] = token if isinstance(token, str) else None  # validated above
        self.verify: Verify = verify
        self.scheme: str = parts.scheme.lower()
        self.host: str = parts.hostname or ""
        self.port: int = parts.port or (443 if self.scheme == "https" else 80)
        self.base_path: str = parts.path.rstrip("/")
        # An IP-literal upstream (the emulator, a local server) needs no name lookup per connection:
        # getaddrinfo releases the GIL, and with thousands of sessions opening every release is a
        # context switch. Host names are still resolved per connection (DNS answers change).
        self._ip_family: Optional[int] = _ip_literal_family(self.host)
        default_port = 443 if self.scheme == "https" else 80
        host_for_header = "[%s]" % self.host if ":" in self.host else self.host
        self.host_header: str = host_for_header if self.port == default_port else "%s:%d" % (host_for_header, self.port)
        self.label: str = "%s://%s" % (self.scheme, self.host_header)
        self.headers: ExtraHeaders = headers  # never logged or shown: it may hold credentials
        self._fixed_headers: Tuple[Tuple[str, str], ...] = (
            () if headers is None or callable(headers) else tuple(headers.items()))
        # The last extra headers as clean-head lines (see _clean_request_lines): (headers, the pattern of
        # the client lines they replace, their lines).
        self._extra_lines: Optional[Tuple[Tuple[Tuple[str, str], ...], "re.Pattern[str]", str]] = None
        self._lock = threading.Lock()  # tunnels and failure runs; never the pool
        # The host's pool (shared with the proxy's other routes to this host, or this route's own),
        # whose idle keep-alive connections (newest on the right) this route uses, and this route's
        # connections in flight, so close() can abort a request that is still streaming. Lock-free:
        # see _checkout.
        self._pool: _HostPool = (host_pools or _HostPools()).acquire((self.scheme, self.host, self.port, verify))
        self._idle: "collections.deque[_UpstreamConnection]" = self._pool.idle
        self._active: Set[_UpstreamConnection] = set()
        self._tunnels: Set[_Tunnel] = set()  # WebSocket sessions, from their upgrade's connect on
        self._closed = False
        # The current run of upstream failures: while a job boots, every readiness probe fails the
        # same way, and one WARNING per run (plus one INFO on recovery) says all there is to say.
        self._failing_kind: Optional[str] = None
        self._failures_in_run = 0

    def __repr__(self) -> str:
        verify = self.verify if isinstance(self.verify, bool) else "<ca bundle>"
        return "Route(%s, token=%s, verify=%s%s)" % (self.label, "set" if self.token is not None else "None", verify,
                                                    "" if self.headers is None else ", headers=set")

    def current_token(self) -> Optional[str]:
        """The token to inject now: the string, or the callable's answer (read per request for rotation)."""
        token = self.token
        if token is None or token is self._checked_token:  # a fixed token, checked once: no work per request
            return token
        fixed = not callable(token)
        if not fixed:
            token = token()  # type: ignore[operator]
        if token is not None and _token_rejection(token):
            raise ValueError("the token %s is not a usable token string" % ("set on the route" if fixed else
                                                                            "callable returned something that"))
        if fixed:
            self._checked_token = token  # type: ignore[assignment]  # (assigned after mount)
        return token  # type: ignore[return-value]

    def current_headers(self) -> Tuple[Tuple[str, str], ...]:
        """The extra headers to send now: the mapping's, or the callable's answer (read per request)."""
        headers = self.headers
        if not callable(headers):
            return self._fixed_headers
        answer = headers()
        reason = ("the headers callable returned %s, not a mapping" % type(answer).__name__
                  if not isinstance(answer, Mapping) else _extra_headers_rejection(answer, self.token is not None))
        if reason:
            raise ValueError(reason)
        return tuple(answer.items())

    def note_failure(self, kind: str) -> bool:
        """Record an upstream failure of `kind`; True when it starts a run (worth a WARNING), False for
        a repeat of the failure already reported."""
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
            log.info("proxy: %s answering again after %d failed attempt(s) (%s)", self.label, count, kind)

    def close(self) -> List[str]:
        """Abort this route's in-flight requests and tunnels, close the host's pooled connections if no
        other route uses them; return what could not be closed. Safe to call twice."""
        with self._lock:
            was_closed, self._closed = self._closed, True
            tunnels = list(self._tunnels)
        idle = [] if was_closed else self._pool.release()
        active = self._active.copy()
        problems: List[str] = []
        for conn in idle:
            problem = _quiet_close(conn)
            if problem:
                problems.append("pooled connection to %s (%s)" % (self.label, problem))
        for conn in active:
            _abort_socket(conn.sock)
        for tunnel in tunnels:
            tunnel.cut_off()
        return problems

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context for this upstream, honouring `verify` like requests (bool or CA bundle path)."""
        return self._pool.tls_context(self.verify)


    # -- machinery (used by the request handler) ------------------------------------------------

    def _checkout(self, proxy: AuthProxy) -> Tuple["_UpstreamConnection", bool]:
        """A keep-alive connection to the route's upstream: a pooled one if fresh, else a new one.

        No lock: every request of a route would queue on it. `deque.pop`/`append` and `set.add`/
        `discard` are atomic, and the liveness check (a poll syscall) runs on a connection this
        thread alone now holds. A route closing meanwhile is caught by re-reading `_closed` after
        registering the connection (close() sets the flag before it reads the set)."""
        if self._closed:
            raise ConnectionAbortedError("route was unmounted")
        cutoff = time.monotonic() - POOL_IDLE_S
        while True:
            try:
                conn = self._idle.pop()  # the most recently used: the least likely to be stale
            except IndexError:
                break
            # Reusable: no stray bytes read or readable (an idle keep-alive connection that is readable was closed).
            if conn.since >= cutoff and not conn.reader._buf and conn.looks_idle():
                self._register(conn)
                return conn, True
            conn.close()
        sock = self._connect(proxy.connect_timeout_s)
        slice_s = min(ANSWER_WATCH_S, proxy.read_timeout_s)  # reads wait in slices (see _UpstreamConnection)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https":  # handshakes now, within the connect timeout
                conn = _UpstreamConnection.over_tls(sock, self.tls_context(), self.host, proxy.read_timeout_s)
            else:
                conn = _UpstreamConnection(sock, proxy.read_timeout_s)
            _set_socket_timeout(sock, slice_s, send_timeout=proxy.read_timeout_s)
        except BaseException:
            sock.close()
            raise
        self._register(conn)
        return conn, False

    def _register(self, conn: "_UpstreamConnection") -> None:
        self._active.add(conn)
        if self._closed:
            self._active.discard(conn)
            conn.close()
            raise ConnectionAbortedError("route was unmounted")

    def _checkin(self, conn: "_UpstreamConnection", reusable: bool) -> None:
        """Return a connection after its response was fully read (reusable) or close it."""
        self._active.discard(conn)
        pool, idle = self._pool, self._idle
        # A closed route's finished connection still serves the host's other routes: only the pool's end closes it.
        if not reusable or pool.closed or len(idle) >= POOL_MAX_IDLE:
            conn.close()
            return
        conn.since = now = time.monotonic()
        idle.append(conn)
        cutoff = now - POOL_IDLE_S
        while idle and idle[0].since < cutoff:  # evict the oldest so they do not linger
            try:
                old = idle.popleft()
            except IndexError:
                break
            if old.since >= cutoff:  # another thread checked it in meanwhile: keep it
                idle.append(old)
                break
            old.close()
        if pool.closed:  # the pool's last route closed while we appended: it may have missed this one
            for late in self._drain_idle():
                late.close()

    def _drain_idle(self) -> List["_UpstreamConnection"]:
        return _drain(self._idle)

    def _connect(self, timeout: float) -> socket.socket:
        """A connected TCP socket to the upstream (with `timeout` set), like socket.create_connection."""
        if self._ip_family is None:
            return socket.create_connection((self.host, self.port), timeout=timeout)
        sock = socket.socket(self._ip_family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

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
    """The idle keep-alive connections to one upstream host and its TLS context, shared by the routes
    that use it (`users`); closed, with its idle connections, when the last of them closes."""

    def __init__(self, key: Tuple[str, str, int, Verify]) -> None:
        self.key = key
        self.idle: "collections.deque[_UpstreamConnection]" = collections.deque()
        self.users = 0
        self.closed = False
        self._registry: Optional[_HostPools] = None
        self._tls_context: Optional[ssl.SSLContext] = None
        self._tls_lock = threading.Lock()

    def tls_context(self, verify: Verify) -> ssl.SSLContext:
        context = self._tls_context
        if context is None:
            with self._tls_lock:
                if self._tls_context is None:
                    self._tls_context = _shared_tls_context(verify)  # one per verify for the whole process
                context = self._tls_context
        return context

    def release(self) -> List["_UpstreamConnection"]:
        """One user fewer; when it was the last, close the pool and return its idle connections."""
        assert self._registry is not None
        return self._registry.release(self)


class _HostPools:
    """The host pools of one `AuthProxy` (or of one stand-alone route), by (scheme, host, port, verify)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: Dict[Tuple[str, str, int, Verify], _HostPool] = {}

    def acquire(self, key: Tuple[str, str, int, Verify]) -> _HostPool:
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _HostPool(key)
                pool._registry = self
            pool.users += 1
            return pool

    def release(self, pool: _HostPool) -> List["_UpstreamConnection"]:
        with self._lock:
            pool.users -= 1
            if pool.users > 0:
                return []
            pool.closed = True  # set before draining: a late check-in sees it and closes its connection
            if self._pools.get(pool.key) is pool:
                del self._pools[pool.key]
        return _drain(pool.idle)


def _drain(idle: "collections.deque[_UpstreamConnection]") -> List["_UpstreamConnection"]:
    """Take every connection out of an idle deque (safe against concurrent appends and pops)."""
    drained = []
    while True:
        try:
            drained.append(idle.popleft())
        except IndexError:
            return drained


class ReplicaRoute:
    """One route id in front of K upstreams running the same server (e.g. K jobs of one image, each
    hosting many WebSocket sessions): each new WebSocket session goes to the live replica with the
    fewest open sessions (ties: round robin).

    A replica whose upgrade fails (connection refused/reset, TLS failure, timeout, or a 502/503/504
    answer) is taken out of rotation, logged and reported by `status()`, and the session is retried
    once on another live replica. Sessions already open on a replica that dies simply end. HTTP is
    refused with 409 except `GET`/`HEAD` of `STATELESS_HTTP_PATHS`, unless `http="any"` (for servers
    whose HTTP endpoints are stateless), because a stateful request cannot be pinned to a replica.
    Made by `AuthProxy.mount_replicas`; each replica is a `Route` (its own pool and tunnels).
    """

    base_path = ""  # each replica's own base path is added when a request is sent to it

    def __init__(self, upstreams: Sequence[str], token: Token, verify: Verify = True, http: str = "refuse") -> None:
        _raise_if_rejected(_replicas_rejection(upstreams) or _http_mode_rejection(http))
        self.token: Token = token
        self.verify: Verify = verify
        self.http: str = http
        self.label: str = "replica route"
        self._lock = threading.Lock()
        self._replicas: List[_Replica] = []
        self._next = 0  # round-robin start among replicas tied on open sessions
        self._created = 0  # replicas ever added: numbers them in logs (never reused)
        self._closed = False
        for upstream in upstreams:
            self._replicas.append(self._new_replica(upstream))

    def __repr__(self) -> str:
        with self._lock:
            live = sum(1 for r in self._replicas if r.healthy)
            total = len(self._replicas)
        return "ReplicaRoute(%d/%d replicas live, token=%s, http=%r)" % (
            live, total, "set" if self.token is not None else "None", self.http)

    def current_token(self) -> Optional[str]:
        """The token to inject now (the string, or the callable's answer), shared by every replica."""
        token = self.token() if callable(self.token) else self.token
        if token is not None and _token_rejection(token):
            raise ValueError("the token callable returned something that is not a usable token string")
        return token

    def status(self) -> List[Dict[str, object]]:
        """One dict per replica, in mount order: `upstream` (the URL as mounted; it holds no secret),
        `open_sessions` (WebSocket sessions open or being opened), `healthy`, `reason` (why it was
        taken out of rotation, else None)."""
        with self._lock:
            return [{"upstream": r.upstream, "open_sessions": r.open_sessions, "healthy": r.healthy,
                     "reason": r.reason} for r in self._replicas]

    def add(self, upstream: str) -> bool:
        """Add a replica, or put a failed one back in rotation; False if it was already live."""
        _raise_if_rejected(_replicas_rejection([upstream]))
        with self._lock:
            for replica in self._replicas:
                if replica.upstream == upstream:
                    if replica.healthy:
                        return False
                    replica.healthy, replica.reason = True, None
                    log.info("proxy: %s is back in rotation", replica.label)
                    return True
        replica = self._new_replica(upstream)
        with self._lock:
            closed = self._closed
            if not closed:
                self._replicas.append(replica)
        if closed:
            replica.route.close()
            raise RuntimeError("this replica route was unmounted; mount a new one")
        log.info("proxy: %s added", replica.label)
        return True

    def remove(self, upstream: str) -> bool:
        """Take a replica out for good and end its open sessions; False if no such replica."""
        with self._lock:
            found = [r for r in self._replicas if r.upstream == upstream]
            self._replicas = [r for r in self._replicas if r.upstream != upstream]
        for replica in found:
            problems = replica.route.close()
            log.info("proxy: %s removed%s", replica.label,
                     (" (could not close: %s)" % ", ".join(problems)) if problems else "")
        return bool(found)

    def close(self) -> List[str]:
        """Close every replica's connections and tunnels; return what could not be closed."""
        with self._lock:
            self._closed = True
            replicas = list(self._replicas)
        problems: List[str] = []
        for replica in replicas:
            problems.extend(replica.route.close())
        return problems

    # -- machinery (used by the request handler) ------------------------------------------------

    def _new_replica(self, upstream: str) -> "_Replica":
        route = Route(upstream, self.token, self.verify)  # validates the URL, the token and verify
        with self._lock:
            self._created += 1
            replica = _Replica(upstream, route, self._created, route.label)
            replica.set_label(self.label)
        return replica

    def _set_label(self, label: str) -> None:
        """Name the route in logs (e.g. "route-3"); replicas are logged as "<label> replica-<n> (<host>)"."""
        with self._lock:
            self.label = label
            for replica in self._replicas:
                replica.set_label(label)

    def _acquire(self, exclude: Sequence["_Replica"] = (), reserve: bool = True) -> Optional["_Replica"]:
        """The live replica with the fewest open sessions (ties: round robin), skipping `exclude`, with
        a session slot reserved on it (released by `_release`) unless `reserve` is False (HTTP);
        None when no live replica is left."""
        with self._lock:
            candidates = [(r.open_sessions, (i - self._next) % len(self._replicas), i, r)
                          for i, r in enumerate(self._replicas) if r.healthy and r not in exclude]
            if not candidates:
                return None
            _, _, index, chosen = min(candidates, key=lambda c: (c[0], c[1]))
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
            log.warning("proxy: %s taken out of rotation: %s", replica.label, reason)

    def _failure_summary(self) -> Tuple[int, List[Dict[str, object]]]:
        with self._lock:
            failed = [{"replica": r.number, "reason": r.reason} for r in self._replicas if not r.healthy]
            return len(self._replicas), failed


class _Replica:
    """One upstream of a `ReplicaRoute`: its `Route` plus its rotation state (guarded by the
    ReplicaRoute's lock)."""

    def __init__(self, upstream: str, route: Route, number: int, where: str) -> None:
        self.upstream = upstream
        self.route = route
        self.number = number
        self.where = where  # scheme://host[:port]: no path, no secret
        self.label = ""
        self.open_sessions = 0
        self.healthy = True
        self.reason: Optional[str] = None

    def set_label(self, route_label: str) -> None:
        self.label = self.route.label = "%s replica-%d (%s)" % (route_label, self.number, self.where)


AnyRoute = Union[Route, ReplicaRoute]


class AuthProxy:
    """A loopback HTTP + WebSocket auth proxy: one listener, many routes, threads only.

    Use as a context manager, or `start()` / `stop()`. `mount(upstream, token)` returns the base URL a
    client should use in place of the upstream's URL. Subclasses may override `route_request` to map
    request targets to routes their own way (the HF Jobs emulator's token gate does).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 300.0,
        idle_timeout_s: float = CLIENT_IDLE_TIMEOUT_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s),
                            ("idle_timeout_s", idle_timeout_s), ("header_timeout_s", header_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError("%s must be a positive number of seconds, got %r" % (name, value))
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError("port must be an integer from 0 to 65535 (0 picks a free port), got %r" % (port,))
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
        self._host_pools = _HostPools()  # keep-alive connections per upstream host, shared by its routes
        self._seen_routes: "weakref.WeakSet[AnyRoute]" = weakref.WeakSet()
        self._route_count = 0
        self._server: Optional[_Server] = None
        self._serve_thread: Optional[threading.Thread] = None
        self._stopping = False

    @classmethod
    def spawn(cls, host: str = "127.0.0.1", port: int = 0, *, processes: int = 1,
              **timeouts: float) -> "AuthProxyProcess":
        """Serve an AuthProxy from a child process (same arguments as the constructor) and return its
        started handle, an `AuthProxyProcess` with the routes API; the relaying then costs this process's
        GIL nothing. Tokens reach the child over a private channel only; the child ends with this process.
        `processes=N` (Linux) starts N children sharing one port (SO_REUSEPORT), every route mounted in
        each, so the kernel spreads connections, and the relaying, over N cores."""
        if cls is not AuthProxy:
            raise TypeError("spawn() hosts a plain AuthProxy: a subclass's overrides cannot cross into the child "
                            "process; start %s in-process instead" % cls.__name__)
        _raise_if_rejected(_processes_rejection(processes))
        if processes == 1:
            return AuthProxyProcess(host, port, **timeouts).start()
        return _ProxyProcessGroup(host, port, processes, timeouts).start()  # type: ignore[return-value]

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "AuthProxy":
        """Bind the listener and start serving in a background thread; returns self."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("this AuthProxy was stopped; create a new one")
            if self._server is not None:
                return self
            if not _is_loopback_host(self.host):
                log.warning("proxy binding non-loopback address %s: anyone who can reach it and learns a "
                            "route URL can use that route's token", self.host)
            try:
                self._server = _Server(self)
            except OSError as exc:
                raise OSError(exc.errno, "AuthProxy cannot listen on %s:%d (%s); pick another port, or 0 for a "
                                         "free one" % (self.host, self._requested_port, exc.strerror or exc)) from None
            self._serve_thread = threading.Thread(target=self._server.serve_until_woken, name="proxy-listener",
                                                  daemon=True)
            _start_thread(self._serve_thread)
        _MEMORY.load()
        log.info("proxy listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving: close the listener, every client connection, upstream connection and tunnel,
        and join every thread the proxy started. Never raises; logs what it could not clean up."""
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
        leftovers: List[str] = []
        server.wake()
        if serve_thread is not None:
            serve_thread.join(STOP_JOIN_S)  # the loop must be out of select() before its sockets close
        try:
            server.server_close()
        except OSError as exc:  # pragma: no cover
            leftovers.append("listening socket (%s)" % type(exc).__name__)
        for route in routes:
            leftovers.extend(route.close())
        server.abort_connections()
        server.workers.close()
        deadline = time.monotonic() + STOP_JOIN_S
        threads = [serve_thread] if serve_thread else []
        threads += server.all_threads()
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
        return "AuthProxy(%s, %d routes, %s)" % (self.url if self._server else self.host, len(self._routes), state)

    @property
    def port(self) -> int:
        """The bound port (the requested one until `start()` binds)."""
        return self._server.server_address[1] if self._server is not None else self._requested_port

    @property
    def url(self) -> str:
        """The listener's root URL, e.g. `http://127.0.0.1:41234`."""
        host = "[%s]" % self.host if ":" in self.host else self.host
        return "http://%s:%d" % (host, self.port)

    # -- routes ------------------------------------------------------------------------------------

    def mount(self, upstream: str, token: Token, *, verify: Verify = True, headers: ExtraHeaders = None) -> str:
        """Forward `<base_url>/<rest>` to `<upstream>/<rest>` with `Authorization: Bearer <token>`.

        `token` is a string or a zero-argument callable read at each request. The upstream may carry a
        path prefix (`https://host/v1/x/proxy/8000`: `<base_url>/a?q` goes to `/v1/x/proxy/8000/a?q`).
        `headers` (a mapping, or a zero-argument callable returning one, read at each request) are
        added to every request and WebSocket upgrade, replacing any the client sent with the same
        names; their values are never logged or shown. Routes to the same upstream host (scheme, host,
        port, verify) share its keep-alive connections. Returns the base URL
        (`http://127.0.0.1:<port>/<route-id>`); the route id is unguessable (192 random bits).
        """
        if self._server is None or self._stopping:
            raise RuntimeError("AuthProxy is not serving: call start() (or use it as a context manager) before mount()")
        route = Route(upstream, token, verify, headers, self._host_pools)
        with self._lock:
            self._route_count += 1
            route.label = "route-%d (%s)" % (self._route_count, route.label)
            route_id = secrets.token_urlsafe(24)
            self._routes[route_id] = route
        log.info("mounted %s", route.label)
        return "%s/%s" % (self.url, route_id)

    def mount_replicas(self, upstreams: Sequence[str], token: Token, *, verify: Verify = True,
                       http: str = "refuse") -> str:
        """Mount one route in front of several upstreams running the same server; returns its base URL.

        Every upstream gets the same `token` (string or callable) and `verify`. Each new WebSocket
        session goes to the live replica with the fewest open sessions; a replica whose upgrade fails
        is taken out of rotation (see `replica_status`) and the session retried once on another; with
        no live replica left the client gets 502 `X-Proxy-Error: no-live-replica`. HTTP: `GET`/`HEAD`
        of /health, /metadata and /schema go to a live replica; anything else is answered 409
        `X-Proxy-Error: replicated-http-refused`, because OpenEnv's HTTP /reset and /step keep state
        per server and cannot be pinned to one replica. `http="any"` forwards every HTTP request to a
        live replica, for servers whose HTTP endpoints are stateless. `unmount` closes it like any route.
        """
        if self._server is None or self._stopping:
            raise RuntimeError("AuthProxy is not serving: call start() (or use it as a context manager) "
                               "before mount_replicas()")
        replicas = ReplicaRoute(upstreams, token, verify, http)
        with self._lock:
            self._route_count += 1
            replicas._set_label("route-%d" % self._route_count)
            route_id = secrets.token_urlsafe(24)
            self._routes[route_id] = replicas
        log.info("mounted %s with %d replicas (http=%s)", replicas.label, len(upstreams), http)
        return "%s/%s" % (self.url, route_id)

    def add_replica(self, base_url: str, upstream: str) -> bool:
        """Add `upstream` to the replica route at `base_url`, or put it back in rotation if it had
        failed. Returns False if it was already live. Same token and verify as the route's others."""
        return self._replica_route(base_url).add(upstream)

    def remove_replica(self, base_url: str, upstream: str) -> bool:
        """Remove `upstream` from the replica route at `base_url` and end its open sessions (e.g.
        before cancelling its job). Returns False if the route has no such replica."""
        return self._replica_route(base_url).remove(upstream)

    def replica_status(self, base_url: str) -> List[Dict[str, object]]:
        """Per replica of the route at `base_url`, in mount order: `{"upstream": url, "open_sessions":
        n, "healthy": bool, "reason": why it left rotation or None}`. No token, no route id."""
        return self._replica_route(base_url).status()

    def _replica_route(self, base_url: str) -> ReplicaRoute:
        with self._lock:
            route = self._routes.get(_route_id(base_url))
        if isinstance(route, ReplicaRoute):
            return route
        if route is None:
            raise ValueError("no route is mounted at that base URL (unmounted, or not from this proxy); "
                             "pass the exact URL mount_replicas() returned")
        raise ValueError("the route at that base URL fronts a single upstream; replicas need a route made "
                         "by mount_replicas()")

    def unmount(self, base_url: str) -> bool:
        """Remove the route behind `base_url` (single or replica route) and close its connections and
        tunnels. Returns False when no such route is mounted (already unmounted): safe to call twice."""
        route_id = _route_id(base_url)
        with self._lock:
            route = self._routes.pop(route_id, None)
        if route is None:
            return False
        problems = route.close()
        _MEMORY.trim_soon()
        log.info("unmounted %s%s", route.label, (" (could not close: %s)" % ", ".join(problems)) if problems else "")
        return True

    def route_request(self, target: str, headers: http.client.HTTPMessage) -> Union[Tuple[AnyRoute, str], Refusal]:
        """Overridable hook: map an origin-form request target to (route, upstream target), or refuse it.

        Default: `/<route-id>/<rest>?q` -> (mounted route, `<upstream path>/<rest>?q`); unknown id -> 404.
        For a `ReplicaRoute` the target is `/<rest>?q`: each replica's own path is added when sent.
        """
        path, sep, query = target.partition("?")
        route_id, _, rest = path.partition("/")[2].partition("/")  # "/<route-id>/<rest>" (route ids are never "")
        route = self._routes.get(route_id)
        if route is None:
            return Refusal(404, "unknown-route",
                           "No route is mounted at this path; use the exact base URL AuthProxy.mount() returned.")
        return route, "%s/%s%s%s" % (route.base_path, rest, sep, query)


# --------------------------------------------------------------------------------------------------
# Validation (each returns the reason something is refused, or None)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Shared with hf_sandbox_provider and hf_jobs_emulator: ONE copy of the loopback test, the token
# discovery order and the HF Jobs facts. It lives here because this is the bottom module (standard
# library only) that both of them import; keeping the Jobs facts out of hf_sandbox_provider means the
# emulator, and every echo-server job process it spawns, never imports requests or the provider.
# --------------------------------------------------------------------------------------------------

# Hardware flavors HF Jobs accepts: a static copy of huggingface_hub 2.4's JobHardware (the Hub's live list is
# `GET /api/jobs/hardware`). Spaces hardware such as h100 is not a Jobs flavor. The provider prefers the
# installed huggingface_hub's enum and the live list; this copy serves huggingface_hub versions without Jobs.
JOB_FLAVORS = frozenset(
    {
        "cpu-basic", "cpu-upgrade", "cpu-performance", "cpu-xl",
        "t4-small", "t4-medium", "l4x1", "l4x4", "l40sx1", "l40sx4", "l40sx8",
        "a10g-small", "a10g-large", "a10g-largex2", "a10g-largex4",
        "a100-large", "a100x4", "a100x8",
        "h200", "h200x2", "h200x4", "h200x8",
        "rtx-pro-6000", "rtx-pro-6000x2", "rtx-pro-6000x4", "rtx-pro-6000x8",
    }
)
# Job stages: the live ones in the order a job passes them, then those after which it never runs again
# (huggingface_hub's TERMINAL_JOB_STAGES).
JOB_LIVE_STAGES = ("SCHEDULING", "RUNNING")
JOB_TERMINAL_STAGES = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
# Where a token may be found, in order: the environment variables huggingface_hub itself reads first
# (so the answer is the same with or without huggingface_hub installed), then its get_token() (the
# `hf auth login` file, Colab secrets), then the token file at the documented path.
TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


# Signals a process receives to end (a scheduler's SIGTERM, Ctrl-C, a closed terminal). The kernel may hand
# a process-directed signal to any thread that does not block it (Linux prefers the main thread, but not
# when that one has a signal pending), while CPython runs Python handlers only in the main thread and a
# blocking call there (a sleep, a join) is cut short only if the signal landed on that thread. Every thread
# the library starts blocks these, so they always reach the main thread.
MAIN_THREAD_SIGNALS = frozenset(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                                if hasattr(signal, name))
# Every other asynchronous signal (timers, children, terminals, users) is blocked in library threads too.
# They have no use for one (CPython runs Python handlers only in the main thread), and one landing there
# interrupts a blocking call: CPython retries a recv or send that a signal interrupted, and for a socket
# whose timeout the kernel enforces (KERNEL_TIMEOUTS) the retry starts the whole timeout again, so a
# signal every few seconds kept a stalled upstream or client from ever timing out (a SIGUSR1 every 20 ms:
# no 504 in 15 s instead of one at 1.5 s). Left deliverable: the fault signals, which must reach the
# thread that caused them, and the CPU-time profiling timers (SIGPROF, SIGVTALRM), which the kernel
# sends only to a thread that is running, never to one waiting in a recv.
LIBRARY_THREAD_BLOCKED_SIGNALS = MAIN_THREAD_SIGNALS | frozenset(
    getattr(signal, name) for name in ("SIGALRM", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGPIPE", "SIGQUIT",
                                       "SIGWINCH", "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGIO",
                                       "SIGPWR", "SIGXCPU", "SIGXFSZ") if hasattr(signal, name))


def _start_thread(thread: threading.Thread) -> None:
    """Start a library thread with LIBRARY_THREAD_BLOCKED_SIGNALS blocked (a new thread inherits its
    creator's signal mask, so the mask is set around the start and restored: a signal arriving meanwhile
    waits, it is not lost)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no per-thread signal masks
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, LIBRARY_THREAD_BLOCKED_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _is_loopback_host(host: Optional[str]) -> bool:
    """True for a host that names this machine: `localhost`, `*.localhost` (RFC 6761), a loopback IP
    literal, with or without the `[...]` of an IPv6 URL host. The one rule for "may go in clear text"."""
    if not host:
        return False
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _discover_token() -> Optional[str]:
    """The HF token (never logged): HF_TOKEN, HUGGING_FACE_HUB_TOKEN, huggingface_hub's get_token(),
    then the token file ($HF_TOKEN_PATH, else $HF_HOME/token). Blank values count as absent."""
    for name in TOKEN_ENV_VARS:
        value = (os.environ.get(name) or "").strip()
        if value:
            return value
    try:
        try:
            from huggingface_hub import get_token  # type: ignore[attr-defined]
        except ImportError:
            from huggingface_hub.utils import get_token  # type: ignore[no-redef]
        value = (get_token() or "").strip()
        if value:
            return value
    except Exception:  # absent or too old: fall back to the documented location
        pass
    path = os.environ.get("HF_TOKEN_PATH") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"), "token")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _ip_literal_family(host: str) -> Optional[int]:
    """AF_INET or AF_INET6 when `host` is an IP address literal, else None (a name to resolve)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


def _route_id(base_url: object) -> str:
    """The route id: the last path segment of a base URL `mount` returned."""
    return base_url.rstrip("/").rsplit("/", 1)[-1] if isinstance(base_url, str) else ""


def _replicas_rejection(upstreams: object) -> Optional[str]:
    if isinstance(upstreams, (str, bytes)) or not isinstance(upstreams, (list, tuple)):
        return ("upstreams must be a list of job URLs like ['https://<job>--8000.hf.jobs', ...], got %s"
                % type(upstreams).__name__)
    if not upstreams:
        return "upstreams is empty; pass at least one job URL (use mount() for a single job)"
    for upstream in upstreams:
        reason = _upstream_rejection(upstream)
        if reason:
            return reason
    if len(set(upstreams)) != len(upstreams):
        return "upstreams lists the same URL twice; each replica must be a different job"
    return None


def _http_mode_rejection(http_mode: object) -> Optional[str]:
    if http_mode not in HTTP_MODES:
        return ("http must be 'refuse' (only GET /health, /metadata, /schema pass) or 'any' (every HTTP "
                "request goes to some live replica), got %r" % (http_mode,))
    return None


def _raise_if_rejected(reason: Optional[str]) -> None:
    """Raise the `ValueError` a `_..._rejection()` helper's reason calls for, if it gave one."""
    if reason:
        raise ValueError(reason)


def _upstream_rejection(upstream: object) -> Optional[str]:
    if not isinstance(upstream, str) or not upstream:
        return "upstream must be a URL string like 'https://<job>--8000.hf.jobs', got %r" % (type(upstream).__name__,)
    if any(c in upstream for c in "\r\n\t ") or any(ord(c) < 32 for c in upstream):
        return "upstream URL contains whitespace or control characters; pass the job URL exactly"
    try:
        parts = urllib.parse.urlsplit(upstream)
        port = parts.port
    except ValueError as exc:
        return "upstream URL is malformed (%s); pass e.g. 'https://<job>--8000.hf.jobs'" % exc
    if parts.scheme.lower() not in ("http", "https"):
        return "upstream URL must start with https:// (or http:// for a loopback host), got scheme %r" % parts.scheme
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
        return "token must be a string, a zero-argument callable returning one, or None; got %s" % type(token).__name__
    if not token:
        return "token is empty; pass your HF token (or None to inject no Authorization header)"
    if _BAD_TARGET_CHAR_RE.search(token):  # checked per request (tokens rotate): a regex, not a char loop
        return "token contains whitespace, control or non-ASCII characters; pass the bare token without 'Bearer '"
    return None


def _extra_headers_rejection(headers: object, with_token: bool) -> Optional[str]:
    """Why a route's extra headers cannot be sent (names shown, values never: they may be credentials)."""
    if headers is None or callable(headers):
        return None  # a callable's answer is checked at each request
    if not isinstance(headers, Mapping):
        return ("headers must be a mapping of header names to values, a zero-argument callable returning one, "
                "or None; got %s" % type(headers).__name__)
    for name, value in headers.items():
        if not isinstance(name, str) or not _TOKEN_RE.match(name):
            shown = name if isinstance(name, str) else type(name).__name__
            return "headers: %r is not a valid HTTP header name" % (shown,)
        low = name.lower()
        if low in PROXY_SET_HEADERS:
            return "headers: %s is set by the proxy itself (framing, host or hop-by-hop); leave it out" % name
        if low == "authorization" and with_token:
            return "headers: Authorization conflicts with the route's token; pass token=None to send your own"
        if not isinstance(value, str) or not value.isascii() or "\r" in value or "\n" in value or \
                _BAD_VALUE_CHAR_RE.search(value):
            return "headers: the value of %s is not a string of printable ASCII (the value is not shown)" % name
    return None


def _verify_rejection(verify: object) -> Optional[str]:
    if isinstance(verify, bool):
        return None
    if isinstance(verify, str):
        if not os.path.exists(verify):
            return "verify=%r: no such CA bundle file or directory; pass True, False or an existing path" % verify
        return None
    return "verify must be True, False or a CA bundle path (like requests), got %s" % type(verify).__name__


def _target_refusal(method: str, target: str) -> Optional[Refusal]:
    """Never an open proxy: only origin-form targets (`/path?query`) are forwarded."""
    if method == "CONNECT":
        return Refusal(405, "method-not-allowed", "CONNECT is not supported: this is not a forward proxy.",
                       (("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),))
    if not _TOKEN_RE.match(method):
        return Refusal(400, "bad-request", "The request method is not a valid HTTP token.")
    if target == "*":
        return Refusal(400, "bad-target", "Asterisk-form targets (OPTIONS *) are not supported; use a route path.")
    if not target.startswith("/"):
        return Refusal(400, "bad-target",
                       "Only origin-form targets (/path) are accepted: this is not a forward proxy.")
    if _BAD_TARGET_CHAR_RE.search(target):
        return Refusal(400, "bad-target", "The request target must be ASCII without spaces or control "
                                          "characters; percent-encode it.")
    return None


def _upgrade_refusal(headers: http.client.HTTPMessage) -> Optional[Refusal]:
    if not headers.get("Sec-WebSocket-Key"):
        return Refusal(400, "bad-upgrade", "WebSocket upgrade without Sec-WebSocket-Key.")
    return None


def _replicated_http_refusal(http_mode: str, method: str, target: str) -> Optional[Refusal]:
    """HTTP on a replica route: only what cannot depend on which replica answers passes (see
    STATELESS_HTTP_PATHS), unless the route was mounted with http="any"."""
    if http_mode == "any":
        return None
    path = target.split("?", 1)[0].rstrip("/")
    if method in ("GET", "HEAD") and path in STATELESS_HTTP_PATHS:
        return None
    return Refusal(409, "replicated-http-refused",
                   "This route spreads sessions over several replicas, and OpenEnv's HTTP endpoints (/reset, "
                   "/step, /state) keep state per server, so an HTTP request cannot be pinned to one replica. "
                   "Use a WebSocket session at <base_url>/ws (OpenEnv's EnvClient does), or mount a single job "
                   "for HTTP clients. Only GET /health, /metadata and /schema are forwarded here.")


def _no_live_replica_refusal(total: int, failed: List[Dict[str, object]]) -> Refusal:
    if not total:
        why = "the route has no replicas (all were removed)"
    else:
        why = "%d of %d replicas failed: %s" % (len(failed), total, "; ".join(
            "replica-%s %s" % (f["replica"], f["reason"]) for f in failed))
    return Refusal(502, "no-live-replica", "No live replica is left behind this route: %s. Check the jobs "
                                           "(replica_status() lists them) and add_replica() new ones." % why,
                   body={"replicas": total, "failed": failed})


def _header_refusal(headers: http.client.HTTPMessage) -> Optional[Refusal]:
    """Header values must not carry control characters (names were checked while parsing)."""
    if _BAD_VALUE_CHAR_RE.search("".join([value for _, value in headers.items()])):  # one search, not one a header
        return Refusal(400, "bad-header", "A request header value contains control characters.")
    return None


def _body_framing(headers: http.client.HTTPMessage) -> Union[Tuple[str, int], Refusal]:
    """How the request body is delimited: ("none", 0), ("length", n) or ("chunked", -1), or a refusal.

    Ambiguous framing is refused outright (it is how request smuggling works)."""
    encodings = headers.get_all("Transfer-Encoding") or []
    lengths = headers.get_all("Content-Length") or []
    if encodings:
        if lengths:
            return Refusal(400, "bad-framing", "Both Transfer-Encoding and Content-Length were sent; send one.")
        codings = [c.strip().lower() for value in encodings for c in value.split(",") if c.strip()]
        if codings != ["chunked"]:
            return Refusal(501, "unsupported-transfer-encoding",
                           "Only 'Transfer-Encoding: chunked' request bodies are supported.")
        return ("chunked", -1)
    if lengths:
        values = {v.strip() for value in lengths for v in value.split(",")}
        if len(values) != 1:
            return Refusal(400, "bad-content-length", "Conflicting Content-Length values were sent.")
        value = values.pop()
        if not (value.isascii() and value.isdigit()) or len(value) > 18:  # (not "²", a digit to isdigit)
            return Refusal(400, "bad-content-length", "Content-Length must be a non-negative decimal integer.")
        return ("length", int(value))
    return ("none", 0)


def _connection_tokens(headers: http.client.HTTPMessage) -> "frozenset[str]":
    """The Connection header's tokens, lower-cased; parsed once per request (three checks read them)."""
    tokens = getattr(headers, "_tokens", None)
    if tokens is None:
        tokens = frozenset(t.strip().lower() for value in headers.get_all("Connection") or []
                           for t in value.split(",") if t.strip())
        if isinstance(headers, _RequestHeaders) and headers._index is not None:
            headers._tokens = tokens  # dropped with the index by any mutation
    return tokens


def _is_websocket_upgrade(method: str, headers: http.client.HTTPMessage) -> bool:
    upgrade = {t.strip().lower() for value in headers.get_all("Upgrade") or [] for t in value.split(",")}
    return method == "GET" and "websocket" in upgrade and "upgrade" in _connection_tokens(headers)


def _upstream_request_headers(headers: http.client.HTTPMessage, route: Route, token: Optional[str],
                              extra: Tuple[Tuple[str, str], ...] = ()) -> List[Tuple[str, str]]:
    """Client headers minus hop-by-hop ones (stripped first, so a client cannot name the token away),
    minus the client's own Authorization/Host and those the route's `extra` headers replace; then Host,
    Authorization and the extra headers set for the upstream."""
    drop = HOP_BY_HOP | REPLACED_REQUEST_HEADERS | _connection_tokens(headers)
    if extra:
        drop = drop | {name.lower() for name, _ in extra}
    out = [("Host", route.host_header)]
    for name, value in headers.items():
        if name.lower() not in drop:
            out.append((name, _OBS_FOLD_RE.sub(" ", value) if "\n" in value else value))
    if token is not None:
        out.append(("Authorization", "Bearer " + token))
    out.extend(extra)
    return out


def _response_headers(headers: List[Tuple[str, str]], length: Optional[int] = None,
                      drop_length: bool = False) -> List[Tuple[str, str]]:
    """The upstream's response headers minus hop-by-hop ones (and those its Connection header names);
    with `length`, one Content-Length of that value where the upstream's first one was (repeats of the
    same value merged); with `drop_length`, none (the body is re-framed). One pass, one lower() a name."""
    lowered = [(name.lower(), name, value) for name, value in headers]
    drop = HOP_BY_HOP
    if any(low == "connection" for low, _, _ in lowered):
        drop = drop | {t.strip().lower() for low, _, v in lowered if low == "connection" for t in v.split(",")}
    out: List[Tuple[str, str]] = []
    length_sent = drop_length
    for low, name, value in lowered:
        if low in drop:
            continue
        if low == "content-length" and (length is not None or drop_length):
            if length_sent:
                continue
            length_sent, value = True, str(length)
        out.append((name, value))
    return out


# --------------------------------------------------------------------------------------------------
# Upstream failures
# --------------------------------------------------------------------------------------------------


class _UpstreamFailure(Exception):
    """An infrastructure failure talking to the upstream, already classified for the client."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _UpstreamClosed(ConnectionError):
    """The upstream closed, reset or TLS-ended the connection before sending any byte of an answer."""


class _BadResponse(Exception):
    """The upstream's answer broke HTTP/1.1 (or a proxy limit): `kind` is the X-Proxy-Error value."""

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
    """408 for a body that stopped arriving (the client is slow, not wrong), 400 for a malformed one."""
    if isinstance(exc, _ClientBodyTimeout):
        return Refusal(408, "request-timeout", "The request body stopped arriving: nothing came for %g s "
                                               "(idle_timeout_s); the request was dropped. Send the whole "
                                               "body without pausing that long." % idle_timeout_s)
    return Refusal(400, "bad-body", "The request body was malformed: %s." % exc)


class _ClientGone(Exception):
    """The client closed its connection while the proxy waited for the upstream's answer."""


def _failure_name(exc: BaseException) -> str:
    """A short, secret-free name for a connection failure (the TLS reason, else the exception type)."""
    return str(getattr(exc, "reason", None) or type(exc).__name__)


def _log_upstream_failure(route: Route, kind: str, what: str) -> None:
    """WARNING for the first failure of a run on a route, DEBUG for its repeats (a booting job fails
    every readiness probe the same way; hundreds of identical warnings would bury real problems)."""
    level = logging.WARNING if route.note_failure(kind) else logging.DEBUG
    log.log(level, "proxy: %s: %s%s", route.label, what, kind)


def _classify_upstream_error(exc: BaseException, route: Route) -> Refusal:
    """Map an exception from talking to the upstream to a 502/504 refusal (never containing the token)."""
    where = route.label
    if isinstance(exc, _BadResponse):
        return Refusal(502, exc.kind, "The upstream %s %s." % (where, exc.what))
    if isinstance(exc, _UpstreamClosed):
        return Refusal(502, "upstream-unreachable", "The upstream %s closed the connection without answering "
                                                    "(%s); did the job restart?" % (where, exc))
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return Refusal(504, "upstream-timeout",
                       "The upstream %s did not answer in time; the job may be overloaded or stuck." % where)
    if isinstance(exc, (ssl.SSLError, ssl.CertificateError)):
        return Refusal(502, "upstream-tls",
                       "TLS with the upstream %s failed (%s); check its certificate or the route's verify "
                       "setting." % (where, getattr(exc, "reason", None) or type(exc).__name__))
    if isinstance(exc, socket.gaierror):
        return Refusal(502, "upstream-unreachable",
                       "The upstream host of %s could not be resolved; check the job URL." % where)
    if isinstance(exc, ConnectionRefusedError):
        return Refusal(502, "upstream-unreachable",
                       "The upstream %s refused the connection; is the job running with its port exposed?" % where)
    if isinstance(exc, http.client.IncompleteRead):
        return Refusal(502, "upstream-unreachable",
                       "The upstream %s closed the connection in the middle of its response; did the job crash?" % where)
    if isinstance(exc, http.client.HTTPException) and not isinstance(exc, http.client.RemoteDisconnected):
        return Refusal(502, "upstream-protocol", "The upstream %s sent a malformed HTTP response." % where)
    return Refusal(502, "upstream-unreachable",
                   "The connection to the upstream %s failed (%s); is the job still running?" % (where, type(exc).__name__))


def _may_retry(method: str, reused: bool, replayable: bool, fully_sent: bool, exc: BaseException) -> bool:
    """The stale-connection retry rule: retry once, on a fresh connection, only if

    - the connection came from the pool (a fresh connection failing is a real failure), and
    - no response byte arrived (the connection was reset or closed, not slow: timeouts never retry), and
    - the request can be replayed byte for byte (its body was buffered), and
    - the method is idempotent, or the request was not completely sent (so the upstream cannot have
      acted on it). A fully sent POST that then got no answer is NOT retried: it might have run.
    """
    no_answer = isinstance(exc, (_UpstreamClosed, http.client.RemoteDisconnected, ConnectionResetError,
                                 BrokenPipeError, ConnectionAbortedError, ssl.SSLEOFError, ssl.SSLZeroReturnError))
    return reused and no_answer and replayable and (method in IDEMPOTENT_METHODS or not fully_sent)


# --------------------------------------------------------------------------------------------------
# Server and request handler
# --------------------------------------------------------------------------------------------------


class _Worker:
    """One pool thread's mailbox: the job it is given and the lock it parks on (held while parked)."""

    __slots__ = ("job", "wake", "thread")

    def __init__(self, job: Tuple[Callable[..., None], tuple]) -> None:
        self.job: Optional[Tuple[Callable[..., None], tuple]] = job
        self.wake = threading.Lock()
        self.wake.acquire()  # released by whoever hands this worker its next job
        self.thread: Optional[threading.Thread] = None


class _WorkerPool:
    """Parked threads that run jobs: `submit` hands a job to the most recently parked worker (its stack
    and caches are warm) or starts a new thread while under `max_workers`; a worker idle for `idle_s`
    ends. No thread is created while parked ones exist, so a warm proxy serves a connection with one
    lock release instead of a thread start (which cost most of a WebSocket set-up's CPU)."""

    def __init__(self, name: str, max_workers: int, idle_s: float, stack_bytes: int) -> None:
        self.name, self.max_workers, self.idle_s, self.stack_bytes = name, max_workers, idle_s, stack_bytes
        self._lock = threading.Lock()
        self._parked: Dict[_Worker, None] = {}  # insertion order: popitem() takes the latest parked
        self._threads: Set[threading.Thread] = set()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: object) -> bool:
        """Run fn(*args) on a worker; False (nothing run) if the pool is closed or at `max_workers`."""
        with self._lock:
            if self._closed:
                return False
            if self._parked:
                worker, _ = self._parked.popitem()
                worker.job = (fn, args)
                worker.wake.release()
                return True
            if len(self._threads) >= self.max_workers:
                return False
            worker = _Worker((fn, args))
            thread = threading.Thread(target=self._work, args=(worker,), name=self.name, daemon=True)
            worker.thread = thread
            self._threads.add(thread)
        try:
            _start_with_stack(thread, self.stack_bytes)
        except BaseException:  # e.g. RuntimeError: can't start new thread (a process or memory limit)
            with self._lock:
                self._threads.discard(thread)
            return False
        return True

    def close(self) -> None:
        """Refuse new jobs and end every parked worker; busy ones end after their current job."""
        with self._lock:
            self._closed = True
            parked = list(self._parked)
            self._parked.clear()
        for worker in parked:
            worker.job = None
            worker.wake.release()

    def threads(self) -> List[threading.Thread]:
        """Every thread the pool started that has not ended yet (busy or parked)."""
        with self._lock:
            return list(self._threads)

    def busy_threads(self) -> List[threading.Thread]:
        """The threads running a job now (not parked)."""
        with self._lock:
            parked = set(worker.thread for worker in self._parked)
            return [thread for thread in self._threads if thread not in parked]

    def counts(self) -> Tuple[int, int]:
        """(threads alive, of which parked)."""
        with self._lock:
            return len(self._threads), len(self._parked)

    def _work(self, worker: _Worker) -> None:
        try:
            while worker.job is not None:
                fn, args = worker.job
                worker.job = None
                try:
                    fn(*args)
                except Exception:
                    log.error("proxy: unexpected error in a worker thread", exc_info=True)
                del fn, args  # drop references to the finished job's sockets before parking
                if not self._park(worker):
                    return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _park(self, worker: _Worker) -> bool:
        """Wait for the next job; False when the pool closed or nothing came within `idle_s`."""
        with self._lock:
            if self._closed:
                return False
            self._parked[worker] = None
        if worker.wake.acquire(timeout=self.idle_s):
            return worker.job is not None
        with self._lock:
            retire = worker in self._parked
            if retire:  # nobody picked it
                del self._parked[worker]
        if retire:
            _MEMORY.trim_soon()
            return False
        # submit() or close() took it off the parked list just as the wait timed out: its release is
        # coming (or came), and with it a job or the order to end.
        worker.wake.acquire()
        return worker.job is not None


# threading.stack_size() is process-wide: starts that set it are serialized, and it is restored at once.
_STACK_SIZE_LOCK = threading.Lock()


def _start_with_stack(thread: threading.Thread, stack_bytes: int) -> None:
    """Start `thread` with a `stack_bytes` stack. A thread some other code starts in the same instant
    would get it too (the setting is process-wide); the window is one thread creation, and the pool
    creates threads only while growing."""
    with _STACK_SIZE_LOCK:
        try:
            previous = threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):  # a platform that cannot change it: keep its default
            _start_thread(thread)
            return
        try:
            _start_thread(thread)
        finally:
            threading.stack_size(previous)


class _Server(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer whose connections run on a `_WorkerPool`, tracked so `stop()` can end them all."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, proxy: AuthProxy) -> None:
        self.proxy = proxy
        self.address_family = socket.AF_INET6 if ":" in proxy.host else socket.AF_INET
        self._conn_lock = threading.Lock()
        self._conns: Set[socket.socket] = set()
        self.workers = _WorkerPool("proxy-worker", MAX_WORKERS, WORKER_IDLE_S, WORKER_STACK_BYTES)
        self.busy_warnings = _WarningRate(BUSY_WARNING_EVERY_S)  # connections refused at the thread cap
        # Client connections whose WebSocket upgrade is under way or whose tunnel is open: stop() cuts
        # those through their routes, so a set-up still answers its client (503) before the 101.
        self.tunnelling: Set[socket.socket] = set()
        super().__init__((proxy.host.strip("[]"), proxy._requested_port), _Handler)
        self._wake_r, self._wake_w = socket.socketpair()  # after super(): a failed bind leaks nothing
        self._woken = False

    def serve_until_woken(self) -> None:
        """Accept connections until `wake()`: select() on the listener and the wake-up socket, no polling.

        Unlike `serve_forever(poll_interval)`, an idle proxy costs no wake-ups and `stop()` does not wait
        for a poll (the emulator runs one proxy per job: tearing down hundreds must not cost a poll each)."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._woken:
                for key, _ in selector.select():
                    if key.fileobj is self.socket and not self._woken:
                        self._handle_request_noblock()  # type: ignore[attr-defined]  # accept + process_request

    def wake(self) -> None:
        """Make `serve_until_woken` return now (thread-safe, idempotent)."""
        self._woken = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # already closed, or the buffer is full of earlier wake-ups: it is awake
            pass

    def server_close(self) -> None:
        super().server_close()
        for sock in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):  # absent if bind failed
            if sock is not None:
                sock.close()

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall; we need none.
        http.server.socketserver.TCPServer.server_bind(self)  # type: ignore[attr-defined]
        self.server_name, self.server_port = self.proxy.host, self.server_address[1]

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self._conn_lock:
            if self.proxy._stopping:
                self.shutdown_request(request)
                return
            self._conns.add(request)
        if not self.workers.submit(self._run, request, client_address):
            with self._conn_lock:
                self._conns.discard(request)
            _answer_busy(request, self.busy_warnings)
            self.shutdown_request(request)

    def _run(self, request: socket.socket, client_address: object) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.release_connection(request)

    def release_connection(self, request: socket.socket) -> None:
        """Close a client connection the proxy is done with (its worker's, a tunnel's too)."""
        self.shutdown_request(request)
        with self._conn_lock:
            self._conns.discard(request)

    def handle_error(self, request: object, client_address: object) -> None:
        log.error("proxy: unexpected error while serving a connection", exc_info=True)

    def abort_connections(self) -> None:
        """Shut every live client socket so blocked handler threads wake up and exit; WebSocket
        connections end through their routes instead (a set-up still answers its client)."""
        with self._conn_lock:
            conns = list(self._conns - self.tunnelling)
        for sock in conns:
            _abort_socket(sock)

    def live_threads(self) -> List[threading.Thread]:
        """Worker threads serving a connection right now (parked ones excluded)."""
        return self.workers.busy_threads()

    def all_threads(self) -> List[threading.Thread]:
        """Every worker thread, busy or parked (a WebSocket session's two among them): what
        `stop()` joins."""
        return self.workers.threads()


class _ClientReader(io.RawIOBase):
    """Raw reader over the client socket that enforces a total deadline on the request head.

    The first byte of a request may take up to the idle timeout; once it arrives, the rest of the head
    must arrive within the header timeout, however slowly the client drips it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._header_timeout: Optional[float] = None
        self._deadline: Optional[float] = None
        self._timeout: Optional[float] = -1.0  # what the socket is set to (-1: unknown)
        self._stopped = False
        # Bytes the clean-request loop (`_Handler._serve_clean`) read and handed over: served before
        # the socket is read, as if they had just arrived (the header deadline starts with them).
        self.pending = b""

    def readable(self) -> bool:
        return True

    def head_phase(self, idle_timeout: float, header_timeout: float) -> None:
        self._header_timeout, self._deadline = header_timeout, None
        if idle_timeout != self._timeout:
            self._set_timeout(idle_timeout)

    def body_phase(self, timeout: Optional[float]) -> None:
        self._header_timeout = self._deadline = None
        if timeout != self._timeout:
            self._set_timeout(timeout)

    def stop(self) -> None:
        """Make every later raw read answer "no more" without touching the socket, so the buffered
        reader above gives up only what it already holds, and any handed-over bytes it has not yet
        reached (see `_Handler._take_buffered`)."""
        self._stopped = True

    def _set_timeout(self, timeout: Optional[float]) -> None:
        # Setting a timeout costs system calls every time: skip it when nothing changes (the common
        # keep-alive case, where head and body phases use the same idle timeout).
        if timeout != self._timeout:
            _set_socket_timeout(self._sock, timeout)
            self._timeout = timeout

    def readinto(self, buffer: "bytearray | memoryview") -> int:  # type: ignore[override]
        pending = self.pending
        if pending:  # (already read: served even when stopped, so a drain gives these up too)
            n = min(len(buffer), len(pending))
            buffer[:n] = pending[:n]
            self.pending = pending[n:]
            if self._header_timeout is not None and self._deadline is None:
                self._deadline = time.monotonic() + self._header_timeout
            return n
        if self._stopped:
            return 0
        if self._deadline is not None:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("request head not complete in time")
            self._set_timeout(remaining)
        try:
            n = self._sock.recv_into(buffer)
        except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
            raise socket.timeout("timed out") from None
        if self._header_timeout is not None and self._deadline is None:
            self._deadline = time.monotonic() + self._header_timeout
        return n


class _RequestHeaders(http.client.HTTPMessage):
    """The request's headers, as the `HTTPMessage` hooks expect, with O(1) `get`/`get_all`: the
    email package scans and lowercases every header on each lookup, and the proxy does a dozen."""

    _index: Optional[Dict[str, List[str]]] = None
    _tokens: "Optional[frozenset[str]]" = None  # the Connection tokens (see _connection_tokens)
    # The parsed (name, value) pairs while nothing mutated them: what `items()` answers without the
    # email policy's per-header sanitising (parsed values are latin-1 text, so it would change nothing).
    _pairs: Optional[List[Tuple[str, str]]] = None

    @classmethod
    def parsed(cls, pairs: List[Tuple[str, str]]) -> "_RequestHeaders":
        """Headers from the parser's (name, value) pairs (indexed at the first lookup: a clean request
        that no hook reads is never indexed)."""
        headers = cls()
        # A private attribute, kept on purpose: email.message.Message stores headers in `_headers`
        # (unchanged from Python 3.3 to 3.13; the proxy tests pass on 3.9.18 and 3.13.0), and
        # filling it directly skips the email policy's per-header work, the proxy's largest
        # per-request cost when it went through __setitem__.
        headers._headers = list(pairs)  # type: ignore[attr-defined]
        headers._pairs = pairs
        return headers

    def items(self) -> List[Tuple[str, str]]:  # type: ignore[override]
        if self._pairs is not None:
            return list(self._pairs)
        return super().items()  # type: ignore[return-value]

    def _lookup(self) -> Dict[str, List[str]]:
        if self._index is None:
            index: Dict[str, List[str]] = {}
            for name, value in self._pairs if self._pairs is not None else self.raw_items():
                index.setdefault(name.lower(), []).append(value)
            self._index = index
        return self._index

    def get(self, name: str, failobj: object = None) -> object:  # type: ignore[override]
        values = self._lookup().get(name.lower())
        return values[0] if values else failobj

    def get_all(self, name: str, failobj: object = None) -> object:  # type: ignore[override]
        values = self._lookup().get(name.lower())
        return list(values) if values else failobj

    # Any mutation (a subclass hook may edit headers) drops the index; it is rebuilt on next lookup.
    def __setitem__(self, name: str, value: object) -> None:
        self._index = self._pairs = self._tokens = None
        super().__setitem__(name, value)

    def __delitem__(self, name: str) -> None:
        self._index = self._pairs = self._tokens = None
        super().__delitem__(name)

    def add_header(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        self._index = self._pairs = self._tokens = None
        super().add_header(*args, **kwargs)  # type: ignore[arg-type]

    def replace_header(self, name: str, value: object) -> None:  # type: ignore[override]
        self._index = self._pairs = self._tokens = None
        super().replace_header(name, value)

    def set_raw(self, name: str, value: object) -> None:  # type: ignore[override]
        self._index = self._pairs = self._tokens = None
        super().set_raw(name, value)


class _SocketWriter(io.BufferedIOBase):
    """Unbuffered writes straight to the socket (what StreamRequestHandler does with wbufsize=0)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: "bytes | bytearray | memoryview") -> int:  # type: ignore[override]
        try:
            self._sock.sendall(data)
        except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
            raise socket.timeout("timed out") from None
        return len(data)  # (bytes: every writer here passes bytes)


_ERROR_KINDS = {400: "bad-request", 408: "request-timeout", 414: "request-line-too-long",
                431: "headers-too-large", 501: "not-implemented", 505: "http-version-not-supported"}


class _Handler(http.server.BaseHTTPRequestHandler):
    """Parses one client connection's requests and forwards each (or tunnels a WebSocket upgrade)."""

    protocol_version = "HTTP/1.1"
    server_version = "hf-sandbox-proxy"
    sys_version = ""
    server: _Server
    _route_headers: Tuple[Tuple[str, str], ...] = ()  # the current request's route headers (set per request)
    _token: Optional[str] = None  # the current request's token (set per request, see _credentials)
    # For a head the fast path parsed (see _parse_clean_head): its body framing and its header lines
    # the upstream gets as they are (hop-by-hop and replaced ones removed); None for a strict parse.
    _clean: Optional[Tuple[Tuple[str, int], str]] = None

    # -- connection plumbing ----------------------------------------------------------------------

    def setup(self) -> None:
        self.proxy: AuthProxy = self.server.proxy
        # The default route_request answers (Route, "/target") or a Refusal: only a subclass's is checked.
        self._own_routing = type(self.proxy).route_request is AuthProxy.route_request
        self._seen_route: Optional[AnyRoute] = None  # the last route known to be in proxy._seen_routes
        self._watched: Optional[_UpstreamConnection] = None  # the connection whose answer is awaited
        self.connection = self.request
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - not every socket family supports it
            pass
        self._reader = _ClientReader(self.connection)
        self.rfile = io.BufferedReader(self._reader, IO_CHUNK)
        self.wfile = _SocketWriter(self.connection)

    def finish(self) -> None:
        try:
            self.rfile.close()
        except (OSError, ValueError):
            pass

    def handle(self) -> None:
        self.close_connection = True
        if self._own_routing:  # clean requests take _serve_clean's loop; any other one request the strict way
            pending = self._serve_clean(b"")
            while pending is not None:
                self._reader.pending = pending
                self.handle_one_request()
                if self.close_connection or self.proxy._stopping:
                    return
                pending = self._serve_clean(self._take_pending())
            return
        self.handle_one_request()
        while not self.close_connection and not self.proxy._stopping:
            self.handle_one_request()

    def _serve_clean(self, buf: bytes) -> Optional[bytes]:
        """Serve the connection's requests while they are clean keep-alive HTTP/1.1 requests with a small
        body to a single route (`buf`: bytes already read), in one loop over one buffer: what the strict
        path does for them (same checks, refusals, timeouts, retries and bytes on both sides; the
        fast-path tests compare the two) without its layers (BufferedReader, header objects, dispatch).

        Returns None when the connection is done (closed, timed out, or closed after a refusal), or the
        bytes read so far when the next request is one it does not take (a head not complete in one
        read or not clean, HTTP/1.0, Connection: close, a body over SMALL_RESPONSE_BYTES, a refusal by
        routing, a replica route): the strict path (handle_one_request) then serves it from them."""
        proxy, sock = self.proxy, self.connection
        recv, sendall = sock.recv, sock.sendall
        route_request, idle_timeout_s = proxy.route_request, proxy.idle_timeout_s
        self._reader.body_phase(idle_timeout_s)  # each read waits idle_timeout_s (the strict path's first byte and body)
        self.request_version, self.close_connection = "HTTP/1.1", False
        # The last clean head, split around its Content-Length value (_head_memo), and what the loop needs of
        # its parse (method, target, forwarded lines, whether it is keep-alive HTTP/1.1): a client's requests
        # usually differ in that value alone (see _head_memo_length).
        last_head, last = (b"", None), None  # type: Tuple[bytes, Optional[bytes]], Optional[Tuple[str, str, str, bool]]
        # For that head: the routing decision (route, upstream target), kept while the route is open (the
        # default route_request reads nothing but the target and the mounted routes; unmount closes the
        # route before it returns, and a route id is never mounted twice), and the upstream lines
        # made for it with the token and extra headers that went into them (compared by identity: the
        # memo holds them, so a rotated token or new headers are new objects and make new lines).
        routed, lines_for = None, None  # type: Optional[Tuple[Route, str]], Optional[Tuple[object, object, bytes]]
        try:
            while not proxy._stopping:
                if not buf:
                    buf = recv(IO_CHUNK)
                    if not buf:
                        return None
                end = buf.find(b"\r\n\r\n") + 4
                if not 4 <= end <= MAX_HEADER_BYTES:
                    return buf
                length = _head_memo_length(buf, end, last_head) if last is not None else -3
                if length < -1:
                    clean = _clean_request_head(buf, end)
                    if clean is None:
                        return buf
                    last_head, length = _head_memo(buf, end), clean[5]
                    last = (clean[0], clean[1], clean[7], clean[2] == "HTTP/1.1" and "close" not in clean[6])
                    routed = None
                method, target, kept, keep_alive = last
                if not keep_alive or length > SMALL_RESPONSE_BYTES:
                    return buf
                if routed is None or routed[0]._closed:
                    decision = route_request(target, None)  # type: ignore[arg-type]  # (the default never reads headers)
                    if decision.__class__ is Refusal or decision[0].__class__ is not Route:
                        return buf
                    routed, lines_for = decision, None  # type: ignore[assignment]
                    route = decision[0]  # type: ignore[index]
                    if route is not self._seen_route:
                        if route not in proxy._seen_routes:
                            with proxy._lock:
                                proxy._seen_routes.add(route)
                        self._seen_route = route
                route, target = routed  # type: ignore[misc]
                self.command, has_body = method, length >= 0
                if route.token is route._checked_token and route.headers is None:  # fixed: nothing to call
                    token, extra = route.token, ()
                elif self._credentials(route, has_body):
                    token, extra = self._token, self._route_headers
                elif self.close_connection:
                    return None
                else:
                    buf = buf[end:]
                    continue
                stop = end + length if has_body else end
                while len(buf) < stop:  # the rest of the body (a client may send it after the head)
                    error = None
                    try:
                        data = recv(IO_CHUNK)
                    except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
                        error = _client_body_error(socket.timeout("timed out"))
                    except (OSError, ValueError) as exc:
                        error = _client_body_error(exc)
                    else:
                        if not data:
                            error = _ClientBodyError("the client closed the connection before sending the whole body")
                        buf += data
                    if error is not None:
                        self._refuse(_client_body_refusal(error, idle_timeout_s), close=True)
                        return None
                body, buf = buf[end:stop], buf[stop:]
                if lines_for is None or lines_for[0] is not token or lines_for[1] is not extra:
                    lines_for = (token, extra, _clean_request_lines(method, target, kept, route, token,
                                                                    extra).encode("latin-1"))
                exchange = self._exchange(route, method, lines_for[2], body, has_body, ())
                if exchange is None:
                    if self.close_connection:
                        return None
                    continue
                conn, answer, sent_all = exchange
                reader = conn.reader
                size = answer.length
                if answer.raw is None or size > SMALL_RESPONSE_BYTES:  # any other answer: the strict relay
                    self._relay_response(route, reader, answer,
                                         on_done=lambda reusable: route._checkin(conn, reusable and sent_all))
                    if self.close_connection:
                        return None
                    continue
                # What _relay_response does for a clean small answer: read it whole, give the connection
                # back to the pool, relay head and body in one send.
                body = reader._buf
                if len(body) == size:  # (the body came with the head, as most do: read_exact's answer, no frame)
                    reader._buf = b""
                else:
                    try:
                        body = reader.read_exact(size, "its response body")
                    except Exception as exc:
                        route._checkin(conn, False)
                        self._answer_body_failed(route, exc)
                        return None
                route._checkin(conn, sent_all and not reader._buf)
                try:
                    sendall(answer.raw + body)
                except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
                    raise socket.timeout("timed out") from None
        except (socket.timeout, TimeoutError, BlockingIOError):
            log.debug("proxy: client connection timed out; closing it")
        except (ConnectionError, OSError, ValueError) as exc:
            log.debug("proxy: client connection ended (%s)", type(exc).__name__)
        self.close_connection = True
        return None

    def _take_pending(self) -> bytes:
        """After a request served the strict way: the bytes read past it (the BufferedReader's, then any
        handed-over ones it did not reach), without reading the socket; the reader is ready again."""
        reader, chunks = self._reader, []
        reader._stopped = True  # raw reads answer "no more": read1 gives up only what was already read
        while True:
            chunk = self.rfile.read1(IO_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
        reader._stopped = False
        return b"".join(chunks)

    def handle_one_request(self) -> None:
        self.close_connection = True
        self._reader.head_phase(self.proxy.idle_timeout_s, self.proxy.header_timeout_s)
        self._clean = None
        try:
            if not self._parse_clean_head():
                self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE + 1)
                if not self.raw_requestline:
                    return
                if len(self.raw_requestline) > MAX_REQUEST_LINE:
                    self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
                    self.send_error(414, "The request line is longer than %d bytes." % MAX_REQUEST_LINE)
                    return
                if not self.parse_request():
                    return
            self._reader.body_phase(self.proxy.idle_timeout_s)
            self._dispatch()
        except (socket.timeout, TimeoutError):
            log.debug("proxy: client connection timed out; closing it")
            self.close_connection = True
        except (ConnectionError, OSError, ValueError) as exc:
            log.debug("proxy: client connection ended (%s)", type(exc).__name__)
            self.close_connection = True

    def parse_request(self) -> bool:
        """Parse the request line and header section; on bad input answer it and return False.

        Replaces the stdlib's parser, which runs the email package (the proxy's largest per-request
        cost), accepts HTTP/0.9, and silently ends the header section at the first malformed line,
        dropping the headers after it. This one is strict (RFC 9112): one space between the three
        request-line parts, `Name: value` lines with a token name, no obs-fold, bounded sizes.
        """
        self.command, self.request_version, self.close_connection = "", "HTTP/1.1", True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        parts = self.requestline.split(" ")
        if len(parts) != 3:
            self.send_error(400, "The request line must be 'METHOD /target HTTP/1.1'.")
            return False
        command, target, version = parts
        if not _VERSION_RE.match(version):
            self.send_error(400, "The request line must end with an HTTP version like HTTP/1.1.")
            return False
        if version[5] != "1":
            self.send_error(505, "Only HTTP/1.0 and HTTP/1.1 are supported.")
            return False
        self.command, self.path, self.request_version = command, target, version
        pairs: List[Tuple[str, str]] = []
        budget, count = MAX_HEADER_BYTES, 0
        while True:
            line = self.rfile.readline(MAX_HEADER_BYTES + 1)
            budget -= len(line)
            if budget < 0:
                self.send_error(431, "The request headers are larger than %d bytes in total." % MAX_HEADER_BYTES)
                return False
            if line in (b"\r\n", b"\n"):
                break
            if not line.endswith(b"\n"):  # the client closed mid-head
                self.send_error(400, "The request head ended before its blank line.")
                return False
            count += 1
            if count > MAX_HEADERS:
                self.send_error(431, "More than %d request headers." % MAX_HEADERS)
                return False
            text = line.decode("iso-8859-1").rstrip("\r\n")
            name, colon, value = text.partition(":")
            if not colon or not _TOKEN_RE.match(name):
                self._refuse(Refusal(400, "bad-header", "Malformed header line (expected 'Name: value', no "
                                                        "line folding)."), close=True)
                return False
            pairs.append((name, value.strip(" \t")))  # repeated headers are all kept, in order
        self.headers = headers = _RequestHeaders.parsed(pairs)
        tokens = _connection_tokens(headers)
        self.close_connection = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        if version == "HTTP/1.1" and headers.get("Expect", "").lower() == "100-continue":
            return self.handle_expect_100()
        return True

    def _parse_clean_head(self) -> bool:
        """The fast path for the common request head: if the bytes already buffered hold a whole clean
        head (see `_clean_request_head`), consume it and set what parse_request sets (the same values
        it would), plus `_clean`. Otherwise consume nothing and return False: parse_request reads the
        head and answers whatever is wrong with it."""
        buffered = self.rfile.peek(1)  # (one read if nothing is buffered yet, as readline would do)
        end = buffered.find(b"\r\n\r\n") + 4
        if not 4 <= end <= MAX_HEADER_BYTES:
            return False
        clean = _clean_request_head(buffered, end)
        if clean is None:
            return False
        command, target, version, names, values, length, tokens, kept = clean
        self.rfile.read(end)
        self.command, self.path, self.request_version = command, target, version
        self.requestline = "%s %s %s" % (command, target, version)
        self.headers = _RequestHeaders.parsed(list(zip(names, values)))
        self.close_connection = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        self._clean = (("length", length) if length >= 0 else ("none", 0), kept)
        return True

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """Malformed requests (found by the stdlib parser) get the same JSON shape as other refusals."""
        self.close_connection = True
        text = message or explain or http.HTTPStatus(code).phrase
        self._refuse(Refusal(code, _ERROR_KINDS.get(code, "bad-request"), text), close=True)

    def log_message(self, format: str, *args: object) -> None:
        # Request lines carry the route id (a secret): DEBUG only.
        log.debug("proxy: " + format, *args)

    def _refuse(self, refusal: Refusal, close: bool = False) -> None:
        """Answer a refusal: its status and headers, X-Proxy-Error, and a small JSON body."""
        fields: Dict[str, object] = {"error": refusal.kind, "message": refusal.message}
        fields.update(refusal.body or {})
        body = json.dumps(fields).encode()
        if close:
            self.close_connection = True
        if not getattr(self, "request_version", "") or self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"
        headers = list(refusal.headers)
        if refusal.proxy_error:
            headers.append(("X-Proxy-Error", refusal.kind))
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        if self.close_connection:
            headers.append(("Connection", "close"))
        self._send_head(refusal.status, None, headers, body if getattr(self, "command", "") != "HEAD" else b"")

    def _send_head(self, status: int, reason: Optional[str], headers: List[Tuple[str, str]], body: bytes = b"") -> None:
        """Send a response head and a small body in one write: one syscall, one TCP segment. Built
        here rather than with send_response_only/send_header, whose buffer is a private attribute."""
        if reason is None:
            reason = self.responses.get(status, ("",))[0]
        lines = ["%s %d %s" % (self.protocol_version, status, reason)]
        lines += ["%s: %s" % pair for pair in headers]
        lines += ["", ""]
        self.wfile.write("\r\n".join(lines).encode("latin-1") + body)

    # -- dispatch -----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        if self.request_version == "HTTP/1.0":
            self.close_connection = True  # no chunked framing for 1.0 clients: keep it simple, one per connection
        clean = self._clean
        if clean is not None:  # method, target and header values were proven clean while parsing
            framing: Union[Tuple[str, int], Refusal] = clean[0]
            malformed: Optional[Refusal] = None
        else:
            framing = _body_framing(self.headers)
            malformed = _target_refusal(self.command, self.path) or _header_refusal(self.headers)
            if malformed is None and isinstance(framing, Refusal):
                malformed = framing
        decision = malformed or self._route()
        if isinstance(decision, Refusal):
            # Malformed input, or an unread body that would be parsed as the next request: close.
            has_body = isinstance(framing, Refusal) or framing[0] != "none"
            self._refuse(decision, close=malformed is not None or has_body or decision.status >= 500)
            return
        route, target = decision
        if route is not self._seen_route:  # (a keep-alive connection usually asks for one route)
            if route not in self.proxy._seen_routes:  # so stop() also closes routes a subclass made
                with self.proxy._lock:
                    self.proxy._seen_routes.add(route)
            self._seen_route = route
        # A clean head has no Upgrade header (unless a route_request hook added one: then it is no longer
        # the parsed pairs, and the headers are read again).
        upgrade = (clean is None or self.headers._pairs is None) and _is_websocket_upgrade(self.command, self.headers)
        refusal = _upgrade_refusal(self.headers) if upgrade else (
            _replicated_http_refusal(route.http, self.command, target) if isinstance(route, ReplicaRoute) else None)
        if refusal is not None:
            self._refuse(refusal, close=upgrade or framing[0] != "none")  # type: ignore[index]
            return
        if not self._credentials(route, framing[0] != "none"):  # type: ignore[index]
            return
        token = self._token
        if isinstance(route, ReplicaRoute):
            if upgrade:
                self._tunnel_replicas(route, target, token)
                return
            replica = route._acquire(reserve=False)
            if replica is None:
                self._refuse(_no_live_replica_refusal(*route._failure_summary()), close=True)
                return
            route = replica.route
            target = route.base_path + target
        if upgrade:
            self._tunnel(route, target, token)
        else:
            self._forward(route, target, token, framing)  # type: ignore[arg-type]

    def _credentials(self, route: AnyRoute, has_body: bool) -> bool:
        """Read the route's token and extra headers for this request (`_token`, `_route_headers`); a
        callable that fails is answered 502 here (closing if a body is unread) and False returned."""
        source = "token"
        try:
            self._token = route.current_token()
            source = "headers"
            self._route_headers = route.current_headers() if isinstance(route, Route) else ()
        except Exception as exc:
            log.warning("proxy: %s %s callable failed (%s)", route.label, source, type(exc).__name__)
            self._refuse(Refusal(502, source + "-unavailable", "The route's %s callable failed (%s); check the %s "
                                                               "source." % (source, type(exc).__name__, source)),
                         close=has_body)
            return False
        return True

    def _route(self) -> Union[Tuple[AnyRoute, str], Refusal]:
        """Ask the `route_request` hook, turning a hook that raises or answers nonsense into a 500."""
        if self._own_routing:
            return self.proxy.route_request(self.path, self.headers)
        try:
            decision = self.proxy.route_request(self.path, self.headers)
        except Exception:
            log.error("proxy: route_request raised", exc_info=True)
            return Refusal(500, "proxy-error", "The proxy failed to route this request (see its log).")
        if isinstance(decision, Refusal) or (
                isinstance(decision, tuple) and len(decision) == 2 and isinstance(decision[0], (Route, ReplicaRoute))
                and isinstance(decision[1], str) and decision[1].startswith("/")):
            return decision
        log.error("proxy: route_request returned %s; expected (Route, '/target') or a Refusal", type(decision).__name__)
        return Refusal(500, "proxy-error", "The proxy failed to route this request (see its log).")

    # -- HTTP forwarding ----------------------------------------------------------------------------

    def _body_piece(self, size: int, where: str) -> Iterator[bytes]:
        """Yield exactly `size` body bytes as they arrive; the client closing first is a body error."""
        remaining = size
        while remaining:
            data = self.rfile.read1(min(IO_CHUNK, remaining))
            if not data:
                raise _ClientBodyError("the client closed the connection " + where)
            remaining -= len(data)
            yield data

    def _body_chunks(self, framing: Tuple[str, int]) -> Iterator[bytes]:
        """Yield the client's request body as it arrives (Content-Length or chunked, de-chunked).

        The client's connection failing or stalling mid-body is a _ClientBodyError, never an OSError:
        while the body streams upstream, an OSError means the upstream dropped the connection."""
        try:
            yield from self._client_body(framing)
        except (OSError, ValueError) as exc:
            raise _client_body_error(exc) from None

    def _client_body(self, framing: Tuple[str, int]) -> Iterator[bytes]:
        kind, length = framing
        if kind == "length":
            yield from self._body_piece(length, "before sending the whole body")
        elif kind == "chunked":
            while True:
                line = self.rfile.readline(MAX_CHUNK_LINE + 1)
                if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\n"):
                    raise _ClientBodyError("malformed chunked body: bad chunk-size line")
                size_text = line.split(b";", 1)[0].strip()
                if not size_text or len(size_text) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size_text):
                    raise _ClientBodyError("malformed chunked body: chunk size is not hexadecimal")
                size = int(size_text, 16)
                if size == 0:
                    break
                yield from self._body_piece(size, "in the middle of a chunk")
                if self.rfile.read(2) not in (b"\r\n",):
                    raise _ClientBodyError("malformed chunked body: chunk data not followed by CRLF")
            trailer_bytes = 0
            while True:  # trailers are read and dropped
                line = self.rfile.readline(MAX_CHUNK_LINE + 1)
                trailer_bytes += len(line)
                if not line.endswith(b"\n") or trailer_bytes > MAX_HEADER_BYTES:
                    raise _ClientBodyError("malformed chunked body: bad or oversized trailer section")
                if line in (b"\r\n", b"\n"):
                    break

    def _forward(self, route: Route, target: str, token: Optional[str], framing: Tuple[str, int]) -> None:
        method = self.command
        if self._clean is not None and self.headers._pairs is not None:  # (None: a route_request hook edited them)
            lines = _clean_request_lines(method, target, self._clean[1], route, token, self._route_headers)
        else:
            lines = _request_lines(method, target, _upstream_request_headers(self.headers, route, token,
                                                                             self._route_headers))
        try:
            body, body_iter = self._buffered_body(framing)
        except _ClientBodyError as exc:
            self._refuse(_client_body_refusal(exc, self.proxy.idle_timeout_s), close=True)
            return
        exchange = self._exchange(route, method, lines.encode("latin-1"), body, framing[0] != "none", body_iter)
        if exchange is None:
            return
        conn, answer, sent_all = exchange
        self._relay_response(route, conn.reader, answer,
                             on_done=lambda reusable: route._checkin(conn, reusable and sent_all))

    def _buffered_body(self, framing: Tuple[str, int]) -> Tuple[bytes, Iterator[bytes]]:
        """The request body's first bytes, all of it if it is at most REPLAYABLE_BODY_BYTES (then it
        can be replayed on a retry), and an iterator over the rest. A Content-Length body that small
        (every OpenEnv action) is one buffered read, without the generators a streamed body needs."""
        kind, length = framing
        if kind == "none":
            return b"", iter(())
        if kind == "length" and length <= REPLAYABLE_BODY_BYTES:
            try:
                body = self.rfile.read(length)
            except (OSError, ValueError) as exc:
                raise _client_body_error(exc) from None
            if len(body) < length:
                raise _ClientBodyError("the client closed the connection before sending the whole body")
            return body, iter(())
        body_iter = self._body_chunks(framing)
        buffered: List[bytes] = []
        size = 0
        for chunk in body_iter:
            buffered.append(chunk)
            size += len(chunk)
            if size > REPLAYABLE_BODY_BYTES:
                return b"".join(buffered), body_iter
        return b"".join(buffered), iter(())

    def _exchange(self, route: Route, method: str, lines: bytes, body: bytes, has_body: bool,
                  rest: Iterable[bytes]) -> Optional[Tuple[_UpstreamConnection, _Answer, bool]]:
        """Send the request (`lines`: its head without framing header and blank line, encoded as latin-1,
        as it was parsed; `body`, then `rest`) on a pooled (or fresh) connection, retrying once on a
        fresh one as _may_retry allows, and read its final answer head (interim ones are relayed on the
        way): (connection, answer, whether the whole request was sent), or None once the client was
        answered (a refusal) or left."""
        size = len(body)
        replayable = size <= REPLAYABLE_BODY_BYTES
        if not replayable:
            head = lines + b"Transfer-Encoding: chunked\r\n\r\n"
        elif not has_body:
            head = lines + b"\r\n"
        else:
            framing = _LENGTH_LINES.get(size)
            if framing is None:
                framing = b"Content-Length: %d\r\n\r\n" % size
                if len(_LENGTH_LINES) < MAX_CACHED_LENGTHS:
                    _LENGTH_LINES[size] = framing
            head = lines + framing
        try:
            for attempt in (1, 2):
                try:
                    conn, reused = route._checkout(self.proxy)
                except Exception as exc:
                    raise _UpstreamFailure(_classify_upstream_error(exc, route)) from None
                sent_all = False
                try:
                    try:
                        if replayable and size <= SMALL_RESPONSE_BYTES:  # one send, as send_request would
                            conn._sendall(head + body)
                            sent_all = True
                        else:
                            sent_all = conn.send_request(head, iter((body,)) if replayable else _prepend(body, rest),
                                                         chunked=not replayable)
                    except (socket.timeout, TimeoutError):
                        raise
                    except OSError:
                        # Dropped while sending: a stale pooled connection (nothing to read: the retry rule
                        # decides), or an upstream that answered early (e.g. 413) and closed: relay that.
                        pass
                    if sent_all:  # the client is watched while the upstream works on the request
                        self._watched, conn.watch = conn, self._watch_client
                    reader = conn.reader
                    try:
                        answer = _parse_answer(reader.read_head(True), method, reader)
                        if answer.status < 200:
                            answer = self._final_answer(reader, method, answer)
                    finally:
                        conn.watch = None
                    break
                except (_ClientBodyError, _ClientGone):
                    route._checkin(conn, False)
                    raise
                except Exception as exc:
                    route._checkin(conn, False)
                    if attempt == 1 and _may_retry(method, reused, replayable, sent_all, exc):
                        log.debug("proxy: %s pooled connection was stale; retrying once on a fresh one", route.label)
                        continue
                    raise _UpstreamFailure(_classify_upstream_error(exc, route)) from None
        except _ClientBodyError as exc:
            self._refuse(_client_body_refusal(exc, self.proxy.idle_timeout_s), close=True)
            return None
        except _ClientGone:
            log.debug("proxy: %s: client left before the upstream answered; request abandoned", route.label)
            self.close_connection = True
            return None
        except _UpstreamFailure as failure:
            _log_upstream_failure(route, failure.refusal.kind, "")
            self._refuse(failure.refusal, close=not replayable or failure.refusal.status == 504)
            return None
        if route._failing_kind is not None:  # (note_answer's own test, without the call)
            route.note_answer()
        if not sent_all and not replayable:
            self.close_connection = True  # the upstream answered early: the rest of the client's body is unread
        return conn, answer, sent_all

    def _final_answer(self, reader: _UpstreamReader, method: str, answer: _Answer) -> _Answer:
        """After an interim (1xx) answer head: relay it to HTTP/1.1 clients, and the next ones (102, 103,
        ...), until the final answer head, which is returned.

        100 Continue is not relayed: the proxy answered the client's Expect itself and never sends
        one upstream. A 101 without an upgrade request is a protocol error."""
        count = 0
        while answer.status < 200:
            if answer.status == 101:
                raise _BadResponse("upstream-protocol", "switched protocols without being asked to")
            if answer.status != 100 and self.request_version == "HTTP/1.1":
                self._relay_interim(answer)
            count += 1
            if count > MAX_INTERIM_RESPONSES:
                raise _BadResponse("upstream-protocol", "sent more than %d interim (1xx) responses" % MAX_INTERIM_RESPONSES)
            answer = _parse_answer(reader.read_head(first=False), method, reader)
        return answer

    def _relay_interim(self, answer: _Answer) -> None:
        try:
            self._send_head(answer.status, answer.reason, _response_headers(answer.headers))
        except OSError:
            raise _ClientGone() from None

    def _watch_client(self) -> None:
        """What an upstream read calls each ANSWER_WATCH_S it waits (as the watch of `_watched`): raise
        _ClientGone if the client hung up meanwhile (no thread and upstream connection held for
        read_timeout_s on its behalf). A client that sent more bytes instead (a pipelined request) is
        no longer watched."""
        try:
            peeked = self.connection.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
        except BlockingIOError:
            return
        except OSError:
            raise _ClientGone() from None
        if not peeked:
            raise _ClientGone()
        self._watched.watch = None

    def _await_answer(self, upstream: Union[_UpstreamConnection, socket.socket, None]) -> bool:
        """Wait until the upstream has something to say; False if the client hung up meanwhile, and
        socket.timeout if the upstream said nothing for read_timeout_s (this wait is the read timeout
        for the first byte: reading after it would wait read_timeout_s a second time).

        A trainer whose request timed out closes its socket and retries; without this, each retry
        against a stuck job would hold a proxy thread and an upstream connection for read_timeout_s.
        A client that sends more bytes instead (a pipelined request) is simply no longer watched."""
        if isinstance(upstream, _UpstreamConnection):
            if upstream.reader.buffered():
                return True
            upstream = upstream.sock
        if upstream is None or not hasattr(select, "poll"):
            return True
        if isinstance(upstream, ssl.SSLSocket) and upstream.pending():
            return True
        poller = select.poll()
        poller.register(upstream, select.POLLIN)
        poller.register(self.connection, select.POLLIN)
        client_fd = self.connection.fileno()
        deadline = time.monotonic() + self.proxy.read_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("the upstream sent nothing within read_timeout_s")
            events = poller.poll(remaining * 1000)
            if any(fd != client_fd for fd, _ in events):
                return True
            if not events:
                continue
            try:
                peeked = self.connection.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
            except BlockingIOError:
                continue
            except OSError:
                return False
            if not peeked:
                return False
            poller.unregister(self.connection)
            client_fd = -1

    def _answer_body_failed(self, route: Route, exc: BaseException) -> None:
        """Answer the client when reading a small answer's body (before its head was relayed) failed."""
        refusal = _classify_upstream_error(exc, route)
        log.warning("proxy: %s: %s while reading the response body", route.label, refusal.kind)
        self._refuse(refusal, close=True)

    def _relay_response(self, route: Route, reader: _UpstreamReader, answer: _Answer,
                        on_done: Callable[[bool], None]) -> None:
        """Stream the upstream answer to the client as it arrives; Content-Encoding untouched.

        Bodies keep their Content-Length; chunked and close-delimited ones are re-chunked for HTTP/1.1
        clients (so the client connection stays open) and close-delimited for HTTP/1.0 ones."""
        mode = answer.mode
        headers = [] if answer.raw is not None else _response_headers(
            answer.headers, answer.length if mode == "length" else None, drop_length=mode not in ("length", "none"))
        if mode not in ("length", "none"):
            if self.request_version == "HTTP/1.0":
                mode, self.close_connection = "close", True
            else:
                mode = "chunked"
                headers.append(("Transfer-Encoding", "chunked"))
        prefix = b""
        if mode == "length" and answer.length <= SMALL_RESPONSE_BYTES:
            try:
                prefix = reader.read_exact(answer.length, "its response body")
            except Exception as exc:
                on_done(False)
                self._answer_body_failed(route, exc)
                return
        whole = mode == "none" or (mode == "length" and answer.length <= SMALL_RESPONSE_BYTES)
        if whole:  # the answer is read: its connection goes back before the client can send its next request
            on_done(answer.keep_alive and not reader._buf)
        try:
            if answer.raw is not None:  # a clean head (always "length"): as it came, Connection added
                self.wfile.write((answer.raw[:-2] + b"Connection: close\r\n\r\n" if self.close_connection
                                  else answer.raw) + prefix)
            else:
                if self.close_connection:
                    headers.append(("Connection", "close"))
                self._send_head(answer.status, answer.reason, headers, prefix)
        except OSError:
            if not whole:
                on_done(False)
            raise
        if whole:
            return
        body = _answer_body(reader, answer)
        while True:
            try:
                data = next(body, b"")
            except Exception as exc:
                # Headers already went out: never fake a complete response, cut the connection.
                on_done(False)
                log.warning("proxy: %s: upstream failed mid-response (%s); closing the client connection",
                            route.label, _failure_name(exc) if not isinstance(exc, _BadResponse) else exc.what)
                self.close_connection = True
                return
            if not data:
                break
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if mode == "chunked" else data)
            except OSError:
                on_done(False)
                raise
        if mode == "chunked":
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                on_done(False)
                raise
        on_done(answer.keep_alive and answer.mode != "close" and not reader.buffered())

    # -- WebSocket tunnel ---------------------------------------------------------------------------

    def _tunnel(self, route: Route, target: str, token: Optional[str]) -> None:
        """Replay the upgrade upstream on this thread; relay a 101 verbatim and run the tunnel
        until it ends, or relay any other answer as HTTP."""
        self.close_connection = True  # whatever happens, this connection ends with the tunnel
        self.server.tunnelling.add(self.connection)  # stop() lets it answer: see abort_connections
        try:
            try:
                tunnel, head, extra, status = self._upgrade(route, target, token)
            except _ClientGone:
                log.debug("proxy: %s: client left before the upstream answered the upgrade",
                          route.label)
                return
            except Exception as exc:
                self._upgrade_failed(route, exc)
                return
            route.note_answer()
            self._finish_upgrade(route, tunnel, head, extra, status)
        finally:
            self.server.tunnelling.discard(self.connection)

    def _upgrade_failed(self, route: Route, exc: BaseException) -> None:
        """Answer an upgrade that got no answer from the upstream: 404 or 503 if its route ended
        it (unmount, stop), else the upstream failure's 502/504."""
        if isinstance(exc, _RouteGone):
            self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
            return
        refusal = _classify_upstream_error(exc, route)
        _log_upstream_failure(route, refusal.kind, "WebSocket upgrade failed: ")
        self._refuse(refusal, close=True)

    def _tunnel_replicas(self, replicas: ReplicaRoute, target: str, token: Optional[str]) -> None:
        """Open the session on the least busy live replica; if that replica fails before
        switching protocols, take it out of rotation and retry once on another (the environment
        never saw it). The session keeps its slot on the replica until its tunnel ends."""
        self.close_connection = True
        self.server.tunnelling.add(self.connection)
        try:
            self._open_on_a_replica(replicas, target, token)
        finally:
            self.server.tunnelling.discard(self.connection)

    def _open_on_a_replica(self, replicas: ReplicaRoute, target: str, token: Optional[str]) -> None:
        tried: List[_Replica] = []
        last: Optional[Refusal] = None
        for _ in range(REPLICA_ATTEMPTS):
            replica = replicas._acquire(exclude=tried)
            if replica is None:
                break
            tried.append(replica)
            route = replica.route
            try:
                try:
                    tunnel, head, extra, status = self._upgrade(
                        route, route.base_path + target, token)
                except _ClientGone:
                    log.debug("proxy: %s: client left before the upstream answered the upgrade",
                              route.label)
                    return
                except _RouteGone:
                    if replicas._closed:  # the whole route was unmounted, or the proxy is stopping
                        self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
                        return
                    last = Refusal(502, "replica-unavailable", "The replica %s was removed while "
                                   "the WebSocket upgrade was under way." % route.label)
                    continue
                except Exception as exc:
                    last = _classify_upstream_error(exc, route)
                    replicas._mark_failed(replica, "%s (%s)" % (last.kind, _failure_name(exc)))
                    continue
                if status in REPLICA_DOWN_STATUSES:
                    route._remove_tunnel(tunnel)
                    tunnel.upstream.close()  # type: ignore[union-attr]
                    last = Refusal(502, "replica-unavailable",
                                   "The replica %s answered %d to the WebSocket upgrade; its job may "
                                   "have stopped." % (route.label, status))
                    replicas._mark_failed(replica, "answered %d to the WebSocket upgrade" % status)
                    continue
                self._finish_upgrade(route, tunnel, head, extra, status)
                return
            finally:
                replicas._release(replica)
        total, failed = replicas._failure_summary()
        if last is not None and len(failed) < total:
            self._refuse(last, close=True)  # tried twice; other replicas remain for later
        else:
            self._refuse(_no_live_replica_refusal(total, failed), close=True)

    def _upgrade(self, route: Route, target: str,
                 token: Optional[str]) -> Tuple["_Tunnel", bytes, bytes, int]:
        """Open a stream to the upstream (the TLS handshake within connect_timeout_s), send the
        upgrade request and read the answer's head within read_timeout_s, watching the client
        meanwhile: (tunnel, head, bytes past the head, status). The tunnel is on its route from
        before the connect, so an unmount or a stop cuts it at any step (_RouteGone). On any
        failure the stream is closed and the tunnel off its route; _ClientGone if the client
        hung up first."""
        request = self._upgrade_head(route, target, token)
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
            head, extra = _read_head(stream, client, proxy.read_timeout_s)
        except BaseException as exc:
            route._remove_tunnel(tunnel)
            if tunnel.upstream is not None:
                tunnel.upstream.close()
            if tunnel.cut and isinstance(exc, Exception) and not isinstance(exc, _ClientGone):
                raise _RouteGone() from None
            raise
        match = _STATUS_LINE_RE.match(head)
        return tunnel, head, extra, int(match.group(1)) if match else 0

    def _upgrade_head(self, route: Route, target: str, token: Optional[str]) -> bytes:
        """The upgrade request the upstream gets: the client's, with the route's token and
        headers."""
        lines = ["GET %s HTTP/1.1" % target]
        pairs = _upstream_request_headers(self.headers, route, token, self._route_headers)
        lines += ["%s: %s" % (name, value) for name, value in pairs]
        lines += ["Upgrade: %s" % self.headers.get("Upgrade", "websocket"), "Connection: Upgrade"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _take_buffered(self) -> bytes:
        return _drain_buffered(self.rfile, self._reader)

    def _finish_upgrade(self, route: Route, tunnel: "_Tunnel", head: bytes, extra: bytes,
                        status: int) -> None:
        """Relay a non-101 answer as HTTP. On a 101: take the upstream->client thread from the
        pool (counted in the cap: at the cap the client gets 503 proxy-busy, not a half-made
        tunnel), relay the 101 verbatim and copy client->upstream on this thread until either
        side ends."""
        stream = tunnel.upstream
        assert stream is not None
        try:
            if status != 101:
                stream.settimeout(self.proxy.read_timeout_s)
                reader = _UpstreamReader(stream.recv, head + extra)
                try:
                    answer = _parse_answer(reader.read_head(first=True), "GET")
                    self._relay_response(route, reader, answer, on_done=lambda reusable: None)
                except _BadResponse as exc:
                    self._refuse(_classify_upstream_error(exc, route), close=True)
                return
            if tunnel.cut:
                self._refuse(_route_gone_refusal(self.proxy._stopping), close=True)
                return
            if not self.server.workers.submit(tunnel.pump_upstream):
                if not self.proxy._stopping:
                    _warn_busy(self.server.busy_warnings)
                self._refuse(_busy_refusal(), close=True)
                return
            try:
                self._reader.body_phase(None)  # blocking from here on: a session lasts as it likes
                stream.settimeout(None)
                tunnel.opened = True
                self.connection.sendall(head + extra)
            except OSError:
                tunnel.close()
            tunnel.run(self._take_buffered())
        finally:
            tunnel.close()  # (a no-op after run(); else it frees the upstream->client worker)
            route._remove_tunnel(tunnel)
            stream.close()


def _drain_buffered(rfile: io.BufferedReader, reader: _ClientReader) -> bytes:
    """What the client sent past the upgrade request that `rfile` already buffered (frames sent
    right behind the request), then close it: its 64 KiB buffer is freed and the tunnel reads the
    socket."""
    reader.stop()
    chunks = []
    while True:
        chunk = rfile.read1(IO_CHUNK)  # buffered bytes only: the stopped raw reader answers b""
        if not chunk:
            break
        chunks.append(chunk)
    rfile.close()
    return b"".join(chunks)


def _prepend(first: bytes, rest: Iterable[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


def _read_head(stream: "_Stream", client: socket.socket, timeout_s: float) -> Tuple[bytes, bytes]:
    """The upstream's answer to an upgrade, in within `timeout_s` while the client stays (see
    `_watching`): (head including the blank line, bytes past it)."""
    buffer = b""
    deadline = time.monotonic() + timeout_s
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            return buffer[:end + 4], buffer[end + 4:]
        if len(buffer) > MAX_HEADER_BYTES:
            raise http.client.LineTooLong("upstream response head")
        data = _watching(client, deadline, functools.partial(stream.recv, IO_CHUNK),
                         "the upstream did not answer the upgrade within read_timeout_s")
        if not data:
            raise http.client.RemoteDisconnected(
                "upstream closed the connection before answering the upgrade")
        buffer += data


def _watching(client: socket.socket, deadline: float, step: Callable[[], Optional[bytes]],
              what: str) -> Optional[bytes]:
    """step() on an upstream stream whose timeout is a slice (TUNNEL_WATCH_S), retried after each
    slice until `deadline` (then socket.timeout saying `what`) while the client is still there: one
    that hung up frees this thread and the upstream at once (_ClientGone)."""
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
        return not client.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0))
    except BlockingIOError:
        return False
    except OSError:
        return True


class _RouteGone(Exception):
    """An upgrade's route was closed (unmount, stop) before its 101 reached the client."""


def _route_gone_refusal(stopping: bool) -> Refusal:
    if stopping:
        return Refusal(503, "proxy-stopping",
                       "The proxy is stopping; this WebSocket session was not opened.")
    return Refusal(404, "unknown-route", "The route was unmounted while this WebSocket upgrade was "
                   "under way; mount it again, or use the base URL of a mounted route.")



# --------------------------------------------------------------------------------------------------
# Upstream connections: pool, streams, TLS engine, tunnel
# --------------------------------------------------------------------------------------------------


class _UpstreamConnection:
    """One keep-alive HTTP/1.1 connection to an upstream: its TCP socket, for https the TLS engine
    over it (`tls`, an `ssl.SSLObject` on memory buffers: see `over_tls`), and a reader that keeps
    what was read past the current response visible, so such a connection is never pooled.

    Its socket's receive timeout is a slice (ANSWER_WATCH_S): a read that waits longer calls `watch`
    (set while a request waits for its answer) between slices, and gives up after read_timeout_s."""

    __slots__ = ("sock", "reader", "since", "watch", "read_timeout_s", "tls", "_incoming", "_outgoing", "_poller",
                 "received", "_tls_ended", "_tls_object", "__weakref__")

    def __init__(self, sock: socket.socket, read_timeout_s: float,
                 tls: Optional[Tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]] = None) -> None:
        self.sock = sock
        self.read_timeout_s = read_timeout_s
        self._tls_object, self._incoming, self._outgoing = tls if tls is not None else (None, None, None)
        # The engine itself: an SSLObject's read and write are Python methods that call it (a frame each).
        self.tls = getattr(self._tls_object, "_sslobj", self._tls_object)
        # The liveness check's poll object, the socket registered once (not one poll object a request).
        self._poller: Optional["select.poll"] = None
        self.received = 0  # bytes read from the socket (see looks_idle)
        self._tls_ended = False  # a probe met the engine's end (close_notify) or an error: the next read meets it too
        self.watch: Optional[Callable[[], None]] = None
        self.reader = _UpstreamReader(self._recv if tls is None else self._recv_tls)
        self.since = 0.0  # when it was last checked in

    @classmethod
    def over_tls(cls, sock: socket.socket, context: ssl.SSLContext, host: str,
                 read_timeout_s: float) -> "_UpstreamConnection":
        """TLS over `sock` (connected, with the connect timeout set) through memory buffers: the
        handshake happens now. The engine never touches the socket, so reads are the plain socket's
        (kernel timeouts, whole segments at once: an SSLSocket with a timeout polls before each
        read, and OpenSSL reads each record's header and body in two calls)."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        engine = context.wrap_bio(incoming, outgoing, server_hostname=host)
        received = 0
        while True:
            try:
                engine.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            flight = outgoing.read()
            if flight:
                sock.sendall(flight)
            data = sock.recv(IO_CHUNK)
            received += len(data)
            if data:
                incoming.write(data)
            else:
                incoming.write_eof()  # the handshake then fails with SSLEOFError, as an SSLSocket's does
        flight = outgoing.read()
        if flight:
            sock.sendall(flight)
        conn = cls(sock, read_timeout_s, (engine, incoming, outgoing))
        conn.received = received
        return conn

    def _recv_tls(self, n: int) -> bytes:
        """Decrypted bytes (b"" at the end of the stream, or at once for n=0 as a socket's recv): whole
        records, so at least one byte and possibly more than n (the reader keeps what is past n, and
        a connection whose reader holds bytes is never pooled). The socket is read only when the
        buffer holds no whole record: OpenSSL takes one record at a time from it, so what it has not
        read is `incoming.pending`, and a read of TLS_RECORD_BYTES takes a whole record, so the engine
        never holds decrypted bytes between calls (asking it, `pending()`, would release the GIL: a
        hand-off to one of the other busy threads; failing a read costs an exception)."""
        engine, incoming = self.tls, self._incoming
        if n <= 0:
            return b""
        while True:
            if incoming.pending or self._tls_ended:
                try:
                    data = engine.read(TLS_RECORD_BYTES)  # type: ignore[union-attr]
                except ssl.SSLWantReadError:  # part of a record, or records without data (session tickets)
                    self._tls_ended = False
                except ssl.SSLZeroReturnError:  # the upstream's close_notify
                    return b""
                else:
                    # A record at a time: an answer whose head and body came as two records (uvicorn
                    # writes them apart) is read whole in one call while more records are buffered.
                    # Whatever ends the gathering (a partial record, an end, an error) is left for the
                    # next read to meet, after these bytes.
                    while incoming.pending and len(data) < n:
                        try:
                            data += engine.read(TLS_RECORD_BYTES)  # type: ignore[union-attr]
                        except ssl.SSLError:
                            break
                    return data
            try:  # (what _recv does, without its frame)
                data = self.sock.recv(IO_CHUNK)
            except (BlockingIOError, socket.timeout):
                data = self._recv_slices(IO_CHUNK)
            if not data:
                return b""
            self.received += len(data)
            incoming.write(data)  # type: ignore[union-attr]

    def _recv(self, n: int) -> bytes:
        try:
            data = self.sock.recv(n)
        except (BlockingIOError, socket.timeout):  # one slice passed (BlockingIOError: a kernel timeout)
            data = self._recv_slices(n)
        self.received += len(data)
        return data

    def _recv_slices(self, n: int) -> bytes:
        deadline = time.monotonic() + self.read_timeout_s - min(ANSWER_WATCH_S, self.read_timeout_s)
        while True:
            if self.watch is not None:
                self.watch()
            if time.monotonic() >= deadline:
                raise socket.timeout("timed out")
            try:
                return self.sock.recv(n)
            except (BlockingIOError, socket.timeout):
                continue

    def _sendall(self, data: bytes) -> None:
        if self.tls is not None:
            self.tls.write(data)  # (a memory buffer takes it all)
            data = self._outgoing.read()  # type: ignore[union-attr]
        if KERNEL_TIMEOUTS:
            try:
                self.sock.sendall(data)  # the kernel's send timeout is read_timeout_s
            except BlockingIOError:  # a kernel-enforced timeout (see KERNEL_TIMEOUTS)
                raise socket.timeout("timed out") from None
            return
        # Python's timeouts (no kernel ones), the read slice: send until read_timeout_s passes with no
        # progress.
        with memoryview(data) as view:
            deadline = None
            while view:
                try:
                    view = view[self.sock.send(view):]
                    deadline = None
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError, socket.timeout):
                    deadline = deadline or time.monotonic() + self.read_timeout_s - min(ANSWER_WATCH_S, self.read_timeout_s)
                    if time.monotonic() >= deadline:
                        raise socket.timeout("timed out") from None

    def looks_idle(self) -> bool:
        """Whether a pooled connection is as its last answer left it: the upstream neither closed nor
        reset it (TCP state ESTABLISHED) nor sent a byte since (the kernel's count of bytes received
        equals ours). One getsockopt(TCP_INFO), which, unlike poll(), keeps the GIL: with many busy
        threads every release is a hand-off. Where TCP_INFO is missing: not has_input(). Over TLS the
        engine's buffer must be empty too: records read with an answer's last one, not yet decrypted."""
        if self._incoming is not None and self._incoming.pending:
            return False
        if _TCP_INFO_BYTES:
            try:
                info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            except OSError:
                return False
            if len(info) == _TCP_INFO_BYTES:
                return info[0] == _TCP_ESTABLISHED and _TCP_INFO_RECEIVED.unpack_from(info)[0] == self.received
        return not self.has_input()

    def has_input(self) -> bool:
        """Whether the upstream sent something (bytes or an end of stream), without blocking.

        A TLS socket is also readable for records that carry no data (TLS 1.3 session tickets arrive
        right after the handshake): those are consumed by a non-blocking read, and only application
        bytes (kept for the reader) or an end of stream count."""
        sock, engine = self.sock, self.tls
        if engine is not None and self._incoming.pending:  # type: ignore[union-attr]  # (see _recv_tls)
            if self._has_tls_data():
                return True
        poller = self._poller
        if poller is None and hasattr(select, "poll"):
            poller = self._poller = select.poll()
            poller.register(sock, select.POLLIN)
        try:
            readable = bool(poller.poll(0)) if poller is not None else _readable(sock)
        except (OSError, ValueError):
            readable = True
        if not readable:
            return False
        if engine is None:
            return True
        try:
            data = sock.recv(IO_CHUNK, getattr(socket, "MSG_DONTWAIT", 0))
        except BlockingIOError:
            return False
        except OSError:
            return True
        if not data:
            return True
        self.received += len(data)
        self._incoming.write(data)  # type: ignore[union-attr]
        return self._has_tls_data()

    def _has_tls_data(self) -> bool:
        """Whether the engine's buffered records hold data or an end (kept for the reader); records
        without data (TLS 1.3 session tickets arrive right after the handshake) are consumed."""
        try:
            data = self.tls.read(TLS_RECORD_BYTES)  # type: ignore[union-attr]
        except ssl.SSLWantReadError:
            return False
        except OSError:  # (ssl.SSLError included: a close_notify, a bad record)
            self._tls_ended = True
            return True
        self.reader.unread(data)
        return True

    def send_request(self, head: bytes, pieces: Iterator[bytes], chunked: bool) -> bool:
        """Send the request head and body; False if the upstream answered before the body was all
        sent (it refused it early, e.g. 413 or 401, and may close): the rest is then not sent.

        A small body leaves with its head in one send. Big ones go IO_CHUNK at a time with a zero
        timeout poll between sends, so an early answer is read before the upstream's close resets
        the connection (and the kernel drops the answer)."""
        sendall, pending, sent = self._sendall, head, 0
        for piece in pieces:
            if chunked:
                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
            if pending:
                if len(pending) + len(piece) <= SMALL_RESPONSE_BYTES:
                    sendall(pending + piece)
                    pending, sent = b"", len(piece)
                    continue
                sendall(pending)
                pending = b""
            with memoryview(piece) as view:
                for offset in range(0, len(view), IO_CHUNK):
                    if sent > SMALL_RESPONSE_BYTES and self.has_input():
                        return False
                    sendall(view[offset:offset + IO_CHUNK])
                    sent += min(IO_CHUNK, len(view) - offset)
        pending += b"0\r\n\r\n" if chunked else b""
        if pending:
            sendall(pending)
        return True

    def close(self) -> None:
        self.sock.close()


class _UpstreamReader:
    """Buffered reads over a `recv(n)` callable (a socket's, or a WebSocket `_Stream`'s after a non-101
    answer). Public stdlib calls only: `io.BufferedReader` would hide how many bytes it holds."""

    __slots__ = ("_recv", "_buf", "memo")

    def __init__(self, recv: Callable[[int], bytes], prefix: bytes = b"") -> None:
        self._recv, self._buf = recv, prefix
        # The last answer head relayed as it came, as _answer_memo made it: see _parse_answer.
        self.memo: Optional[_AnswerMemo] = None

    def buffered(self) -> int:
        return len(self._buf)

    def unread(self, data: bytes) -> None:
        """Put bytes read elsewhere (a liveness probe) in front of the buffer. b"" (an end of stream
        seen by the probe) changes nothing: the next read sees the end again."""
        if data:
            self._buf = data + self._buf

    def read_head(self, first: bool) -> bytes:
        """One response head, through its blank line. Nothing at all before a close (or a reset, or a
        TLS EOF) raises _UpstreamClosed when `first` (the retry rule's 'no answer'); anything else
        cut short, or larger than MAX_RESPONSE_HEAD_BYTES, is a _BadResponse."""
        buf, searched = self._buf, 0
        while True:
            if buf:  # (nothing to search before the first read: a pooled connection's buffer is empty)
                # Just past the blank line ending the head (CRLF or bare LF lines: the first of either), or -1.
                crlf = buf.find(b"\n\r\n", searched)
                lf = buf.find(b"\n\n", searched) if crlf < 0 else buf.find(b"\n\n", searched, crlf + 1)
                end = lf + 2 if lf >= 0 else crlf + 3 if crlf >= 0 else -1
                if 0 <= end <= MAX_RESPONSE_HEAD_BYTES:
                    self._buf = buf[end:]
                    return buf[:end]
                if end > MAX_RESPONSE_HEAD_BYTES or len(buf) > MAX_RESPONSE_HEAD_BYTES:
                    raise _BadResponse("upstream-head-too-large", "sent a response head larger than %d bytes (the "
                                                                  "proxy's limit)" % MAX_RESPONSE_HEAD_BYTES)
                searched = max(0, len(buf) - 3)
            try:
                data = self._recv(IO_CHUNK)
            except (socket.timeout, TimeoutError):
                raise
            except OSError as exc:
                if first and not buf:
                    raise _UpstreamClosed(_failure_name(exc)) from None
                raise _BadResponse("upstream-unreachable", "dropped the connection in the middle of its "
                                                           "response head (%s)" % _failure_name(exc)) from None
            if not data:
                if first and not buf:
                    raise _UpstreamClosed("closed")
                raise _BadResponse("upstream-unreachable", "closed the connection in the middle of its response head")
            buf += data

    def read1(self, n: int) -> bytes:
        """Up to n bytes: buffered ones first, else one recv (what it returns past n is kept); b"" at end
        of stream."""
        buf = self._buf
        if not buf:
            buf = self._recv(n)
            if len(buf) <= n:
                return buf
        self._buf = buf[n:]
        return buf[:n]

    def read_exact(self, n: int, where: str) -> bytes:
        """Exactly n bytes (a small body, read whole): the buffered ones, then as many more as are missing;
        the upstream closing first is a _BadResponse."""
        buf = self._buf
        while len(buf) < n:
            data = self._recv(n - len(buf))
            if not data:
                raise _BadResponse("upstream-unreachable", "closed the connection in the middle of " + where)
            buf += data
        self._buf = buf[n:]
        return buf if len(buf) == n else buf[:n]

    def pieces(self, n: int, where: str) -> Iterator[bytes]:
        """Exactly n bytes, yielded as they arrive; the upstream closing first is a _BadResponse."""
        while n > 0:
            data = self.read1(min(n, IO_CHUNK))
            if not data:
                raise _BadResponse("upstream-unreachable", "closed the connection in the middle of " + where)
            n -= len(data)
            yield data

    def readline(self, limit: int) -> bytes:
        """One line (through LF), at most `limit` bytes; a longer line or the end of stream is malformed."""
        buf = self._buf
        while True:
            end = buf.find(b"\n", 0, limit)
            if end >= 0:
                self._buf = buf[end + 1:]
                return buf[:end + 1]
            if len(buf) >= limit:
                raise _BadResponse("upstream-protocol", "sent a chunk-size or trailer line longer than %d bytes" % limit)
            data = self._recv(IO_CHUNK)
            if not data:
                raise _BadResponse("upstream-unreachable", "closed the connection in the middle of a chunked body")
            buf += data
            self._buf = buf


class _Answer(NamedTuple):
    """A parsed upstream response head and how its body is delimited (RFC 9112 section 6.3)."""

    status: int
    reason: str
    headers: List[Tuple[str, str]]
    mode: str  # "none", "length", "chunked" or "close" (read until the upstream closes)
    length: int  # the Content-Length for "length", else -1
    keep_alive: bool  # the connection may carry another request once this body is read
    raw: Optional[bytes] = None  # a clean head (see _CLEAN_ANSWER_RE) to relay as it is; `headers` is then []


# Builds a NamedTuple without its generated __new__, a Python function (a frame more on the hot path).
_new_tuple = tuple.__new__


def _parse_answer(head: bytes, method: str, reader: Optional[_UpstreamReader] = None) -> _Answer:
    """Parse a response head (status line, `Name: value` lines; obs-fold joined with a space), or raise
    _BadResponse. Framing: HEAD, 1xx, 204 and 304 have no body; Transfer-Encoding wins over
    Content-Length (and then the connection is not reused); conflicting lengths are refused.

    The common head (see _CLEAN_ANSWER_RE) is recognised whole and kept to be relayed as it is;
    anything else is parsed line by line (_parse_answer_strictly). With the connection's `reader`, a
    head equal to the last one relayed as it is but in its Date and Content-Length values (an
    upstream's answers usually differ in those alone: see _answer_key) is recognised without the
    regular expressions.

    For the usual order (a Date line before the Content-Length one; see _answer_memo) the key is not
    built: the head must be the memo's bytes around a Date value and a Content-Length value that hold
    no line end, so the first Date and Content-Length lines are where the memo's were (the bytes
    before each are the memo's, which had none earlier), and the values get _answer_key's checks.
    (Slices are compared: startswith parses its arguments per call. Inline: a call is a frame.)"""
    memo = reader.memo if reader is not None and method != "HEAD" else None
    if memo is not None:
        pre, date, length = memo[3], memo[6], -1
        if pre is None:
            key, length = _answer_key(head)
            if key != memo[2]:
                length = -1
        elif head[:date] == pre:
            end = date + memo[8]  # (where it is when the Date value is as long as the memo's, as HTTP dates are)
            start = end + memo[7]
            same = head[end:start] == memo[4]
            if not same:
                end = head.find(b"\r\n", date)
                start = end + memo[7]
                same = head[end:start] == memo[4]
            if same:
                stop = len(head) - len(memo[5])  # (a value of digits holds no line end: the one after it is here)
                value = head[start:stop]
                if (head[stop:] == memo[5] and value.isdigit() and len(value) <= 18
                        and (value[0] != 48 or stop - start == 1)):  # (48: "0")
                    # A clean Date value (as _answer_key checks it): printable ASCII, no blank at either end.
                    stamp = head[date:end]
                    if stamp == _clean_stamp[0]:
                        length = _LENGTH_VALUES.get(value, -1)
                        if length < 0:
                            length = _length_value(value)
                    elif (end > date and head[date] != 32 and head[end - 1] != 32 and stamp.isascii()
                            and stamp.decode().isprintable()):
                        length, _clean_stamp[0] = _length_value(value), stamp
        if length >= 0:
            return _new_tuple(_Answer, (memo[0], memo[1], [], "length", length, True, head))
    text = head.decode("latin-1")
    clean = _CLEAN_ANSWER_RE.fullmatch(text)
    if clean is not None and method != "HEAD" and clean.group(1) not in ("204", "304"):
        special = _SPECIAL_ANSWER_RE.findall(text.lower())
        if len(special) == 1 and special[0][0] == "content-length":
            value = special[0][1]
            if value.isascii() and value.isdigit() and len(value) <= 18 and (value[0] != "0" or value == "0"):
                # nothing hop-by-hop, one canonical Content-Length: relayed as it is (headers not parsed)
                status, reason = int(clean.group(1)), clean.group(2)
                if reader is not None:
                    reader.memo = _answer_memo(head, status, reason)
                return _Answer(status, reason, [], "length", int(value), True, head)
    return _parse_answer_strictly(text, method)


def _answer_key(head: bytes) -> Tuple[bytes, int]:
    """An answer head without the values of its first Content-Length and Date lines, and its length
    (-1 when that value is not canonical decimal or the Date value not plain printable ASCII). Values
    hold no line end, so two heads with the same key have the same lines but in those two values: if
    one is clean with nothing hop-by-hop (relayed as it is), so is the other, with the same status."""
    lowered = head.lower()
    start = lowered.find(b"\r\ncontent-length: ") + 18
    stop = head.find(b"\r\n", start)
    value = head[start:stop]
    if start < 18 or not value.isdigit() or len(value) > 18 or (value[0] == 48 and stop - start > 1):  # (48: "0")
        return b"", -1
    date = lowered.find(b"\r\ndate: ") + 8
    if date < 8:
        return head[:start] + head[stop:], int(value)
    end = head.find(b"\r\n", date)
    # A clean value of printable ASCII: no control character, no blank at either end (none at all is unclean).
    if end == date or head[date] == 32 or head[end - 1] == 32 or head[date:end].translate(None, _PRINTABLE_ASCII):
        return b"", -1
    if date < start:
        return head[:date] + head[end:start] + head[stop:], int(value)
    return head[:start] + head[stop:date] + head[end:], int(value)


# A head relayed as it came, remembered to recognise the next ones (see _answer_memo): its status, reason,
# _answer_key, and for the usual order (a Date line before the Content-Length one) the head before the
# Date value, between its end and the Content-Length value, and after that value, the lengths of the
# first two, and the Date value's length.
_AnswerMemo = Tuple[int, str, bytes, Optional[bytes], bytes, bytes, int, int, int]
# The last Date value _parse_answer found clean (upstreams change it once a second): checked again only
# when another comes. Any thread may replace it; it only ever holds a clean value (one to start with).
_clean_stamp = [b"Thu, 01 Jan 1970 00:00:00 GMT"]


def _answer_memo(head: bytes, status: int, reason: str) -> Optional[_AnswerMemo]:
    """What _parse_answer needs to recognise a head with the same _answer_key as `head` (clean,
    relayed as it came, with `status` and `reason`); None when it has no usable key."""
    key, length = _answer_key(head)
    if length < 0:
        return None
    lowered = head.lower()
    date, start = lowered.find(b"\r\ndate: ") + 8, lowered.find(b"\r\ncontent-length: ") + 18
    if not 8 <= date < start:
        return status, reason, key, None, b"", b"", 0, 0, 0
    end, stop = head.find(b"\r\n", date), head.find(b"\r\n", start)
    return status, reason, key, head[:date], head[end:start], head[stop:], date, start - end, end - date


def _parse_answer_strictly(text: str, method: str) -> _Answer:
    """`_parse_answer` line by line, for any head (`text`: decoded as latin-1)."""
    lines = text.split("\n")
    match = _RESPONSE_LINE_RE.match(lines[0].rstrip("\r"))
    if not match:
        raise _BadResponse("upstream-protocol", "sent a malformed status line")
    minor, status, reason = match.group(1), int(match.group(2)), match.group(3) or ""
    if status < 100:  # "000"-"099" are not statuses (http.client and h11 refuse them too)
        raise _BadResponse("upstream-protocol", "sent the status code %03d" % status)
    headers: List[Tuple[str, str]] = []
    for line in lines[1:]:
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            continue  # the blank line ending the head
        if line[0] in " \t":
            if not headers:
                raise _BadResponse("upstream-protocol", "sent a response head starting with a folded line")
            name, value = headers.pop()
            headers.append((name, (value + " " + line.strip(" \t")).strip(" ")))
            continue
        match = _RESPONSE_HEADER_RE.match(line)  # trailing whitespace is relayed as sent: http.client keeps it
        if match is None:
            raise _BadResponse("upstream-protocol", "sent a malformed response header line")
        headers.append(match.groups())  # type: ignore[arg-type]
    codings: List[str] = []
    lengths: Set[str] = set()
    connection: Set[str] = set()
    for name, value in headers:
        lower = name.lower()
        if lower == "transfer-encoding":
            codings += [c.strip().lower() for c in value.split(",") if c.strip()]
        elif lower == "content-length":
            lengths.update(v.strip() for v in value.split(","))
        elif lower == "connection":
            connection.update(t.strip().lower() for t in value.split(","))
    keep_alive = "close" not in connection and (minor == "1" or "keep-alive" in connection)
    if method == "HEAD" or status < 200 or status in (204, 304):
        return _Answer(status, reason, headers, "none", -1, keep_alive)
    if codings:
        if codings[-1] == "chunked":
            return _Answer(status, reason, headers, "chunked", -1, keep_alive and not lengths)
        return _Answer(status, reason, headers, "close", -1, False)
    if lengths:
        value = lengths.pop()
        if lengths or not (value.isascii() and value.isdigit()) or len(value) > 18:
            raise _BadResponse("upstream-protocol", "sent an invalid or conflicting Content-Length")
        return _Answer(status, reason, headers, "length", int(value), keep_alive)
    return _Answer(status, reason, headers, "close", -1, False)


def _answer_body(reader: _UpstreamReader, answer: _Answer) -> Iterator[bytes]:
    """Yield the answer's body bytes as they arrive (de-chunked); a body cut short raises _BadResponse."""
    if answer.mode == "length":
        yield from reader.pieces(answer.length, "its response body")
    elif answer.mode == "close":
        while True:
            data = reader.read1(IO_CHUNK)
            if not data:
                return
            yield data
    elif answer.mode == "chunked":
        while True:
            size_text = reader.readline(MAX_CHUNK_LINE).split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16 or size_text.strip(b"0123456789abcdefABCDEF"):
                raise _BadResponse("upstream-protocol", "sent a malformed chunk-size line")
            size = int(size_text, 16)
            if size == 0:
                break
            yield from reader.pieces(size, "a chunk")
            if reader.readline(MAX_CHUNK_LINE).rstrip(b"\r\n"):
                raise _BadResponse("upstream-protocol", "sent chunk data not followed by CRLF")
        trailer_bytes = 0
        while True:  # trailers are read and dropped, like the request's
            line = reader.readline(MAX_CHUNK_LINE)
            trailer_bytes += len(line)
            if trailer_bytes > MAX_RESPONSE_HEAD_BYTES:
                raise _BadResponse("upstream-head-too-large", "sent an oversized trailer section")
            if line in (b"\r\n", b"\n"):
                break


def _clean_request_head(data: bytes, end: int) -> Optional[Tuple[str, str, str, List[str], List[str], int, List[str], str]]:
    """The request head `data[:end]` (through its blank line) if it is clean (see _CLEAN_HEADER_LINE_RE),
    with at most one Content-Length, at most one Connection (of keep-alive and/or close), and no
    Transfer-Encoding, Expect, Upgrade, TE or Trailer: (method, target, version, header names, their
    values, the Content-Length or -1, the Connection tokens, the header lines forwarded as they are).
    None for any other head: the strict parser (`_Handler.parse_request`) takes it."""
    text = data[:end].decode("iso-8859-1")
    line = _CLEAN_REQUEST_LINE_RE.match(text)
    if line is None:
        return None
    command, target, version = line.groups()
    # ['', line, name, value, '', line, name, value, ..., '\r\n']: any other gap is an unclean line.
    parts = _CLEAN_HEADER_LINE_RE.split(text[line.end():])
    if "".join(parts[::4]) != "\r\n" or len(parts) > 4 * MAX_HEADERS + 1 or command == "CONNECT":
        return None
    names, values = parts[2::4], parts[3::4]
    kept: List[str] = []
    length, tokens = -1, []  # type: Tuple[int, List[str]]
    lowered = ",".join(names).lower().split(",")  # (a token has no comma)
    for line_text, name, value in zip(parts[1::4], lowered, values):
        if name not in _SPECIAL_REQUEST_HEADERS:
            kept.append(line_text)
        elif name == "content-length":
            if length >= 0 or not (value.isdigit() and value.isascii()) or len(value) > 18:
                return None
            length = int(value)
        elif name == "connection":
            if tokens:  # a second Connection header
                return None
            tokens = [t.strip() for t in value.lower().split(",")]
            if not _PLAIN_CONNECTION_TOKENS.issuperset(tokens):
                return None
        elif name not in _DROPPED_PLAINLY:
            return None
    return command, target, version, names, values, length, tokens, "".join(kept)


def _head_memo(data: bytes, end: int) -> Tuple[bytes, Optional[bytes]]:
    """The request head `data[:end]` split around the value of its first `Content-Length` line (the
    head through "Content-Length: ", and from the line's end), or (the head, None) without one."""
    start = data.find(b"\r\nContent-Length: ", 0, end)
    if start < 0:  # (the usual spellings; a head with another is still parsed, only not reused)
        start = data.find(b"\r\ncontent-length: ", 0, end)
        if start < 0:
            return data[:end], None
    stop = data.find(b"\r\n", start + 18)
    return data[:start + 18], data[stop:end]


def _head_memo_length(data: bytes, end: int, memo: Tuple[bytes, Optional[bytes]]) -> int:
    """For a head `data[:end]` equal to the one `memo` was made from (_head_memo) but in the value of its
    first Content-Length line: that value (-1 without such a line, -2 if it is not 1-18 ASCII digits);
    for any other head -3. Two such heads with a valid value differ in the length alone: if one is clean
    (`_clean_request_head`), so is the other, with the same parse but the length, so a connection's
    repeated head is parsed once. The head must be the memo's bytes around a value with no line end, so
    its first Content-Length line is where the memo's was (the bytes before it are the memo's, which had
    none earlier)."""
    before, after = memo
    if after is None:
        return -1 if data[:end] == before else -3
    start = len(before)
    if data[:start] != before:  # (a slice compared: startswith parses its arguments per call)
        return -3
    stop = end - len(after)  # (where the value's line ends if the rest is the memo's)
    if stop < start or data[stop:end] != after:
        return -3
    value = data[start:stop]
    if value.isdigit() and len(value) <= 18:  # (digits hold no line end: the value's line ends at stop)
        length = _LENGTH_VALUES.get(value, -1)
        return length if length >= 0 else _length_value(value)
    return -2 if data.find(b"\r\n", start) == stop else -3


def _request_lines(method: str, target: str, headers: List[Tuple[str, str]]) -> str:
    """The upstream request's line and header lines, each ending CRLF (no blank line yet)."""
    return "%s %s HTTP/1.1\r\n%s" % (method, target, "".join(["%s: %s\r\n" % pair for pair in headers]))


def _clean_request_lines(method: str, target: str, kept: str, route: Route, token: Optional[str],
                         extra: Tuple[Tuple[str, str], ...]) -> str:
    """What `_request_lines(_upstream_request_headers(...))` makes of a clean head (see
    _parse_clean_head) whose forwarded lines are `kept`, without looking at each header: Host, the
    kept lines (minus those the route's `extra` headers replace), Authorization, the extra headers."""
    extra_lines = ""
    if extra:
        cached = route._extra_lines
        if cached is None or cached[0] is not extra:  # (a mapping's headers are one tuple for the route's life)
            route._extra_lines = cached = (extra,) + _extra_header_lines(extra)
        kept, extra_lines = cached[1].sub("", kept), cached[2]
    return "%s %s HTTP/1.1\r\nHost: %s\r\n%s%s%s" % (
        method, target, route.host_header, kept, "" if token is None else "Authorization: Bearer %s\r\n" % token,
        extra_lines)


def _extra_header_lines(extra: Tuple[Tuple[str, str], ...]) -> Tuple["re.Pattern[str]", str]:
    """For a route's extra headers: the pattern of the clean-head lines they replace, and their lines."""
    names = "|".join(re.escape(name) for name, _ in extra)
    return (re.compile(r"^(?:%s): [^\r]*\r\n" % names, re.I | re.M),
            "".join(["%s: %s\r\n" % pair for pair in extra]))


def _set_socket_timeout(sock: socket.socket, timeout: Optional[float], send_timeout: Optional[float] = None) -> None:
    """Give a plain socket `timeout` (None: block forever): with KERNEL_TIMEOUTS a blocking socket whose
    recv/send time out in the kernel (raising BlockingIOError, which callers turn into socket.timeout),
    else Python's settimeout. `send_timeout`, when given, is the kernel's send timeout instead."""
    if not KERNEL_TIMEOUTS:
        sock.settimeout(timeout)
        return
    if sock.gettimeout() is not None:  # e.g. the connect timeout, or socket.setdefaulttimeout()'s
        sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout if send_timeout is None else send_timeout))


def _timeval(timeout: Optional[float]) -> bytes:
    seconds = 0.0 if timeout is None else max(float(timeout), 1e-6)  # 0 is "never" to the kernel
    return struct.pack("@ll", int(seconds), int((seconds - int(seconds)) * 1e6))


# struct tcp_info (linux/tcp.h): tcpi_state is its first byte, tcpi_bytes_received (Linux 4.1+) the u64
# at offset 128. 0: no TCP_INFO on this platform (the liveness check polls instead).
_TCP_INFO_BYTES = 136 if hasattr(socket, "TCP_INFO") and sys.platform.startswith("linux") else 0
_TCP_INFO_RECEIVED = struct.Struct("=128xQ")
_TCP_ESTABLISHED = 1
# Request framing lines by body size, and Content-Length values by their digits (see MAX_CACHED_LENGTHS);
# dict reads and writes are atomic.
_LENGTH_LINES: Dict[int, bytes] = {}
_LENGTH_VALUES: Dict[bytes, int] = {}


def _length_value(value: bytes) -> int:
    """int(value) for 1-18 ASCII digits, remembered in _LENGTH_VALUES (read first: `.get(value, -1)`)."""
    length = int(value)
    if len(_LENGTH_VALUES) < MAX_CACHED_LENGTHS:
        _LENGTH_VALUES[value] = length
    return length


def _readable(sock: socket.socket) -> bool:
    """Whether the upstream has sent something (a zero-timeout poll; no read)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


_TLS_CONTEXTS: "collections.OrderedDict[object, ssl.SSLContext]" = collections.OrderedDict()
_TLS_CONTEXTS_LOCK = threading.Lock()


def _shared_tls_context(verify: Verify) -> ssl.SSLContext:
    """The TLS context for `verify`, shared by every route with the same one (TLS_CONTEXTS_KEPT). A CA
    bundle path is keyed with its file's size and modification time, so an edited bundle is re-read."""
    key: object = verify
    if isinstance(verify, str):
        try:
            stat = os.stat(verify)
            key = (verify, stat.st_mtime_ns, stat.st_size)
        except OSError:  # let the context creation report it
            key = (verify, None, None)
    with _TLS_CONTEXTS_LOCK:
        context = _TLS_CONTEXTS.get(key)
        if context is not None:
            _TLS_CONTEXTS.move_to_end(key)
            return context
    context = _make_tls_context(verify)  # outside the lock: loading a CA store takes milliseconds
    with _TLS_CONTEXTS_LOCK:
        context = _TLS_CONTEXTS.setdefault(key, context)
        _TLS_CONTEXTS.move_to_end(key)
        while len(_TLS_CONTEXTS) > TLS_CONTEXTS_KEPT:
            _TLS_CONTEXTS.popitem(last=False)
    return context


def _make_tls_context(verify: Verify) -> ssl.SSLContext:
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    if isinstance(verify, str):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        return ssl.create_default_context(cafile=verify)
    context = ssl.create_default_context()
    try:  # like requests: also trust certifi's bundle, for hosts with an empty system store
        import certifi  # requests depends on it

        context.load_verify_locations(cafile=certifi.where())
    except (ImportError, OSError, ssl.SSLError):  # pragma: no cover
        pass
    return context


def _abort_socket(sock: Optional[socket.socket]) -> None:
    """Wake any thread blocked on this socket (full shutdown, at the fd level even for TLS sockets)."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _quiet_close(closeable: object) -> Optional[str]:
    """Close without raising; return the error's name if closing failed."""
    try:
        closeable.close()  # type: ignore[attr-defined]
    except Exception as exc:
        return type(exc).__name__
    return None


def _busy_refusal() -> Refusal:
    return Refusal(503, "proxy-busy", "The proxy is at its limit of %d threads (each WebSocket session holds "
                                      "two); retry shortly, or spread sessions over more processes." % MAX_WORKERS,
                   headers=(("Retry-After", str(BUSY_RETRY_AFTER_S)),))


def _answer_busy(sock: socket.socket, warnings: "_WarningRate") -> None:
    """Best effort, from the listener thread (which must never block): answer a connection the pool
    had no thread for with a 503 `proxy-busy`, without reading its request."""
    refusal = _busy_refusal()
    body = json.dumps({"error": refusal.kind, "message": refusal.message}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nX-Proxy-Error: %s\r\nRetry-After: %d\r\n"
            "Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (refusal.kind, BUSY_RETRY_AFTER_S, len(body)))
    _warn_busy(warnings)
    try:
        sock.setblocking(False)
        try:
            sock.recv(IO_CHUNK)  # what already arrived: closing with unread bytes would send a reset
        except OSError:
            pass
        sock.send(head.encode("latin-1") + body)
    except OSError:
        pass


def _warn_busy(warnings: "_WarningRate") -> None:
    refused = warnings.note(time.monotonic())
    if refused:
        log.warning("proxy: no free worker thread (%d in use); answered 503 proxy-busy %d time(s) since the "
                    "previous warning (at most one per %g s)", MAX_WORKERS, refused, warnings.every_s)


class _WarningRate:
    """Counts events and says when a WARNING about them is due: the first at once, then at most one per
    `every_s` seconds, each reporting how many events happened since the previous one."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: Optional[float] = None
        self._held = 0

    def note(self, now: float) -> int:
        """Count one event at `now` (a monotonic time); the number to report (this event and those held
        back since the last warning) if a warning is due, else 0."""
        with self._lock:
            self._held += 1
            if self._last is not None and now - self._last < self.every_s:
                return 0
            self._last, held, self._held = now, self._held, 0
            return held


class _FreedMemory:
    """Hands memory that threads freed back to the system (glibc's malloc_trim), at most once per
    MALLOC_TRIM_EVERY_S; the first call after that long trims, in the calling thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._trim: Optional[Callable[[int], int]] = None
        self._loaded = False
        self.trims = 0

    def load(self) -> None:
        """Find malloc_trim (importing ctypes) when a proxy starts: importing the proxy stays cheap, and
        the one-time allocation is done before a long run's memory is measured, not in its middle."""
        with self._lock:
            if not self._loaded:
                self._trim, self._loaded = _find_malloc_trim(), True

    def trim_soon(self, every_s: float = MALLOC_TRIM_EVERY_S) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < every_s:
                return
            self._last = now
        self.load()
        if self._trim is not None:
            self._trim(0)
            self.trims += 1


def _find_malloc_trim() -> Optional[Callable[[int], int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library; musl has no malloc_trim
    except (ImportError, OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MEMORY = _FreedMemory()


class _Stream:
    """A byte stream to the upstream for one WebSocket session, over a blocking TCP socket: one
    thread may recv while another sends (one per direction)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def settimeout(self, timeout: Optional[float]) -> None:
        self.sock.settimeout(timeout)

    def abort(self) -> None:
        """Wake threads blocked on this stream; they see EOF or an error and end."""
        _abort_socket(self.sock)

    def close(self) -> None:
        self.abort()
        self.sock.close()


class _TlsStream(_Stream):
    """TLS over a blocking TCP socket through an `ssl.SSLObject` on memory buffers, for a reading
    and a sending thread at once. OpenSSL forbids two threads in one SSL object, so the engine is
    touched only under `_engine`, a lock never held across a socket call: each thread does its own
    socket I/O outside it. Output leaves in the order the engine wrote it: it is taken from the
    output buffer only under `_sending`, held while it is sent (see `_send_output`); the sending
    thread takes `_sending` before the engine lock, never the other way round."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, host: str) -> None:
        super().__init__(sock)
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self._engine = threading.Lock()
        self._sending = threading.Lock()

    def handshake(self) -> None:
        """The TLS handshake, on the socket's timeout (called again after a timeout, it goes on
        where it stopped); each flight is sent before the peer's is awaited."""
        while True:
            try:
                with self._engine:
                    self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._sending.acquire()
                self._send_output()
                self._feed()
        self._sending.acquire()
        self._send_output()

    def recv(self, n: int) -> bytes:
        """Up to `n` decrypted bytes (b"" once the peer ended the stream), reading the socket when
        the engine holds none."""
        while True:
            with self._engine:
                try:
                    data: Optional[bytes] = self._tls.read(n)
                except ssl.SSLWantReadError:
                    data = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or a TCP close
                    data = b""
                reply = self._outgoing.pending  # e.g. the answer to a key update
            # The reading thread never waits for the send lock: were it to stop reading while the
            # upstream's window for our sends is full, both ends could wait on each other. The
            # sender holding it sends this output too.
            if reply and self._sending.acquire(False):
                self._send_output()
            if data is not None:
                return data
            self._feed()

    def sendall(self, data: bytes) -> None:
        """Encrypt `data` and send it, after any output the engine wrote before it."""
        self._sending.acquire()
        self._send_output(data)

    def _feed(self) -> None:
        data = self.sock.recv(IO_CHUNK)
        with self._engine:
            if data:
                self._incoming.write(data)
            else:
                self._incoming.write_eof()

    def _send_output(self, data: bytes = b"") -> None:
        """With `_sending` held: encrypt `data` (into a memory buffer: it never waits) and send what
        the engine wrote, in order, then let go of `_sending`. It is let go only under the engine
        lock with the output buffer empty, so output another thread writes (under that lock) is
        sent by the sender still holding it, or finds it free."""
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
    """A new TCP stream to the route's upstream for one WebSocket session; for https, TLS over it
    (verified as the route says, with the context shared per `verify`; the caller handshakes)."""
    sock = route._connect(connect_timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if route.scheme != "https":
            return _Stream(sock)
        return _TlsStream(sock, route.tls_context(), route.host)
    except BaseException:
        sock.close()
        raise


class _Tunnel:
    """A WebSocket session: the client's socket and the upstream stream, copied both ways by two
    threads, one per direction: client->upstream on the handler's thread (`run`), upstream->client
    on a pool worker (`pump_upstream`, held back until the 101 is out). When either direction
    ends, both sockets close. On its route from before the upgrade's connect, so unmount and stop
    end it at any step (`cut_off`): before the 101 only the upstream side is cut, and the handler
    still answers the client as HTTP."""

    def __init__(self, client: socket.socket, label: str) -> None:
        self.client, self.label = client, label
        self.upstream: Optional[_Stream] = None  # set once connected
        self.opened = False  # the 101 is on its way to the client
        self.cut = False  # ended by its route (unmount, stop)
        self._closed = False
        # Plain locks, both held from the start: one futex each way (an Event is a Condition).
        self._go = threading.Lock()  # released once the 101 is out (or the tunnel closed before)
        self._go.acquire()
        self._pumped = threading.Lock()  # released when the upstream->client direction ended
        self._pumped.acquire()

    def cut_off(self) -> None:
        """End the session from its route (unmount, stop)."""
        self.cut = True
        if self.opened:
            self.close()
        elif self.upstream is not None:
            self.upstream.abort()

    def close(self) -> None:
        """End both directions now (from any thread; idempotent: a second shutdown is harmless)."""
        if self._closed:
            return
        self._closed = True
        self._release_go()
        _abort_socket(self.client)
        if self.upstream is not None:
            self.upstream.abort()

    def run(self, first: bytes) -> None:
        """Copy client->upstream on this thread, starting with `first` (the client's bytes already
        read), while `pump_upstream` copies the other way; return once both directions ended."""
        self._release_go()
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
            data = first
            while True:
                if data:
                    write(data)
                data = read(TUNNEL_READ_BYTES)
                if not data:
                    break
        except (OSError, ValueError, ssl.SSLError):
            pass
        finally:
            self.close()

    def _release_go(self) -> None:
        try:
            self._go.release()
        except RuntimeError:  # released already (by run() or close())
            pass


# --------------------------------------------------------------------------------------------------
# Out-of-process host: AuthProxy.spawn() runs an AuthProxy in a child Python process (this file, run by
# sys.executable; threads only inside) and returns an AuthProxyProcess, a parent-side handle with the
# API a provider uses. The relay work then runs on the child's GIL, not the trainer's.
#
# Control channel: a socketpair inherited by the child (no file, no port), carrying length-prefixed JSON
# both ways. Requests carry an id and get one answer each; the child also sends its log records. Tokens
# cross only this channel: never argv (the child's is `proxy.py --proxy-host FD PARENT_PID`), never the
# environment (the child gets an allowlist of variables, so HF_TOKEN stays in the parent), never a file.
#
# Token callables stay in the parent (they are Python objects of the trainer's): one parent thread
# re-reads every callable each TOKEN_PUSH_INTERVAL_S and pushes a changed value to the child, which
# injects the last value pushed. The alternative, the child asking the parent per request (with a cache),
# puts a round trip through the trainer's GIL in the request path: the cost the host exists to remove.
#
# The child ends with the parent: it watches the channel for EOF (the kernel closes the parent's end
# whatever kills it, SIGKILL included) and, on Linux, also asks for SIGTERM when its parent dies
# (PR_SET_PDEATHSIG), which covers a forked grandchild keeping the parent's end open. The kernel sends
# that signal when the *thread* that started the child ends, so the child is started by the handle's
# own control thread, which lives exactly as long as the child.
# --------------------------------------------------------------------------------------------------

# argv[1] that makes `python proxy.py` a proxy host child instead of the command line (internal).
HOST_CHILD_ARG = "--proxy-host"
# How often the parent re-reads token callables and pushes changed values: a rotated token reaches the
# child within this delay. HF tokens and sandbox bearers rotate in minutes, with overlap; reading 64
# callables twice a second costs the parent about 0.1 ms per second.
TOKEN_PUSH_INTERVAL_S = 0.5
# How long a control request waits for the child's answer. A mount takes microseconds; a child that
# cannot answer in this long is wedged, and the caller gets an error instead of hanging.
CONTROL_ANSWER_S = 30.0
# How long the child may take to import and bind before spawn() gives up (a loaded 2-core machine
# took about 0.3 s; the margin is for a cold disk cache).
HOST_START_S = 30.0
# A control message is a mount or a log record: anything near this size is a bug or an attack.
MAX_CONTROL_MESSAGE = 16 * 1024 * 1024
# The child's environment: only what Python, OpenSSL and the C library read to run and verify TLS.
# Everything else (HF_TOKEN first) stays in the parent; the child reads no variable of ours.
HOST_ENV_ALLOWLIST = frozenset(["PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "HOME", "SYSTEMROOT",
                                "SSL_CERT_FILE", "SSL_CERT_DIR", "OPENSSL_CONF", "OPENSSL_MODULES",
                                "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "MALLOC_ARENA_MAX"])
HOST_ENV_PREFIXES = ("LC_",)
# Errors the child may report by name, raised in the parent as the same type with the same message
# (anything else arrives as RuntimeError naming the child's type).
_REMOTE_ERRORS: Dict[str, type] = {"InsecureURLError": InsecureURLError, "ValueError": ValueError,
                                   "TypeError": TypeError, "RuntimeError": RuntimeError}
_FRAME = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class AuthProxyProcess:
    """An `AuthProxy` served by a child process; made (and started) by `AuthProxy.spawn()`.

    Same API as the in-process proxy for a provider: `mount`, `unmount`, `mount_replicas`,
    `add_replica`, `remove_replica`, `replica_status`, `port`, `url`, `stop()`, context manager. Mount
    refusals are raised here with the in-process types and messages; 502/504 answers come from the child
    as they would in-process; the child's `proxy` log records are re-emitted on this process's `proxy`
    logger (`record.process` is the child's pid). `running` says whether the child still serves.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **timeouts: float) -> None:
        AuthProxy(host, port, **timeouts)  # the same checks and messages as in-process (binds nothing)
        self._reuse_port = False  # set by a process group: bind with SO_REUSEPORT
        self.host = host
        self._requested_port = port
        self._timeouts = timeouts
        self._port = port
        self._lock = threading.Lock()  # ids, routes, the pending table, the phase
        self._send_lock = threading.Lock()  # one message at a time on the channel
        self._next_id = 0
        self._pending: Dict[int, "_PendingAnswer"] = {}
        # Routes with callables: route id -> {"token"/"headers": the callable or None, and what was sent}.
        self._routes: Dict[str, Dict[str, object]] = {}
        self._sock: Optional[socket.socket] = None
        self._process: Optional["subprocess.Popen[bytes]"] = None
        self._control: Optional[threading.Thread] = None
        self._pusher: Optional[threading.Thread] = None
        self._pusher_stop = threading.Event()
        self._ended: Optional[str] = None  # why the child no longer serves (None while it does)
        self._serving = False  # the child answered `start`
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "AuthProxyProcess":
        """Start the child and wait until it listens; returns self. `AuthProxy.spawn()` calls it."""
        with self._lock:
            if self._stopping or self._ended:
                raise RuntimeError("this AuthProxyProcess was stopped; spawn a new one")
            if self._control is not None:
                return self
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock = parent_end
            started: Dict[str, object] = {}
            ready = threading.Event()
            self._control = threading.Thread(target=self._control_thread, args=(child_end, started, ready),
                                             name="proxy-host-control", daemon=True)
            _start_thread(self._control)
        ready.wait()
        if "error" in started:
            self._abandon()
            raise started["error"]  # type: ignore[misc]
        _live_hosts.add(self)
        try:
            answer = self._call("start", timeout=HOST_START_S, host=self.host, port=self._requested_port,
                                timeouts=self._timeouts, reuse_port=self._reuse_port)
        except BaseException:
            self.stop()
            raise
        self._port = int(answer["port"])  # type: ignore[index, call-overload]
        self._serving = True
        log.debug("proxy host process %s serves %s", self.pid, self.url)  # the child logged "listening" at INFO
        return self

    def stop(self) -> None:
        """Stop the child's proxy (every connection, tunnel and thread), wait for the child to exit and
        end this handle's threads. Never raises; logs what it could not clean up."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            control, process = self._control, self._process
        leftovers: List[str] = []
        if control is not None and self._ended is None:
            try:
                self._call("stop", timeout=CONTROL_ANSWER_S)
            except Exception as exc:  # already gone, or wedged: the kill below ends it
                if self._ended is None:
                    leftovers.append("a clean stop of the host process (%s)" % exc)
        self._abandon()
        if control is not None:
            control.join(STOP_JOIN_S * 2)
            if control.is_alive():
                leftovers.append("thread %s" % control.name)
        if process is not None and process.poll() is None:
            leftovers.append("the host process %d (killed)" % process.pid)
            process.kill()
            process.wait(STOP_JOIN_S)
        if self._sock is not None:
            self._sock.close()  # only now: the control thread, which reads it, has ended
        _live_hosts.discard(self)
        if leftovers:
            log.warning("proxy host stopped but could not clean up: %s", ", ".join(leftovers))

    def __enter__(self) -> "AuthProxyProcess":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopping else (self._ended or ("serving" if self._serving else "not started"))
        return "AuthProxyProcess(%s, pid %s, %s)" % (self.url if self._serving else self.host, self.pid, state)

    @property
    def port(self) -> int:
        """The bound port (the requested one until the child has bound)."""
        return self._port

    @property
    def url(self) -> str:
        """The listener's root URL, e.g. `http://127.0.0.1:41234`."""
        host = "[%s]" % self.host if ":" in self.host else self.host
        return "http://%s:%d" % (host, self.port)

    @property
    def pid(self) -> Optional[int]:
        """The child's process id (None before `start()`)."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """True while the child serves (False before start, after stop, or once it died)."""
        return self._serving and self._ended is None and not self._stopping

    # -- routes (same contract as AuthProxy's) -----------------------------------------------------

    def mount(self, upstream: str, token: Token, *, verify: Verify = True, headers: ExtraHeaders = None) -> str:
        """As `AuthProxy.mount`; a callable token or headers is re-read here every TOKEN_PUSH_INTERVAL_S."""
        Route(upstream, token, verify, headers)  # refusals raised here, with the in-process types and messages
        return self._mount("mount", token, headers, upstream=upstream, verify=_portable_verify(verify))

    def mount_replicas(self, upstreams: Sequence[str], token: Token, *, verify: Verify = True,
                       http: str = "refuse") -> str:
        """As `AuthProxy.mount_replicas`."""
        ReplicaRoute(upstreams, token, verify, http)  # refusals raised here, as in-process
        return self._mount("mount_replicas", token, None, upstreams=list(upstreams), verify=_portable_verify(verify),
                           http=http)

    def add_replica(self, base_url: str, upstream: str) -> bool:
        """As `AuthProxy.add_replica`."""
        return bool(self._call("add_replica", route=_route_id(base_url), upstream=upstream))

    def remove_replica(self, base_url: str, upstream: str) -> bool:
        """As `AuthProxy.remove_replica`."""
        return bool(self._call("remove_replica", route=_route_id(base_url), upstream=upstream))

    def replica_status(self, base_url: str) -> List[Dict[str, object]]:
        """As `AuthProxy.replica_status`."""
        return list(self._call("replica_status", route=_route_id(base_url)))  # type: ignore[call-overload]

    def unmount(self, base_url: str) -> bool:
        """As `AuthProxy.unmount`: False when nothing is mounted there; safe to call twice."""
        route_id = _route_id(base_url)
        removed = bool(self._call("unmount", route=route_id))
        with self._lock:
            self._routes.pop(route_id, None)
        return removed

    # -- machinery ---------------------------------------------------------------------------------

    def _mount(self, op: str, token: Token, headers: ExtraHeaders, **fields: object) -> str:
        sent = {"token": _Pushed.of_token(token), "headers": _Pushed.of_headers(headers)}
        answer = self._call(op, dynamic=[name for name, source in (("token", token), ("headers", headers))
                                         if callable(source)], **_pushed_fields(sent), **fields)
        route_id = _route_id(answer)
        if callable(token) or callable(headers):
            with self._lock:
                self._routes[route_id] = {"token": token if callable(token) else None, "sent": sent,
                                          "headers": headers if callable(headers) else None}
                start_pusher = self._pusher is None
                if start_pusher:
                    self._pusher = threading.Thread(target=self._push_tokens, name="proxy-host-tokens", daemon=True)
            if start_pusher:
                _start_thread(self._pusher)  # type: ignore[arg-type]
        return str(answer)

    def _call(self, op: str, timeout: float = CONTROL_ANSWER_S, **fields: object) -> object:
        """Send one request and wait for its answer; raise the child's error as its own type."""
        with self._lock:
            if self._stopping and op != "stop":
                raise RuntimeError("this AuthProxyProcess was stopped; spawn a new one")
            if self._ended is not None or self._sock is None:
                raise RuntimeError("the proxy host process is not serving (%s); spawn a new one"
                                   % (self._ended or "not started"))
            self._next_id += 1
            request_id = self._next_id
            pending = self._pending[request_id] = _PendingAnswer()
        try:
            _send_message(self._sock, self._send_lock,
                          dict(fields, id=request_id, op=op, level=log.getEffectiveLevel()))
            if not pending.done.wait(timeout):
                raise RuntimeError("the proxy host process %s did not answer %s within %.0f s"
                                   % (self.pid, op, timeout))
        except OSError as exc:
            raise RuntimeError("the proxy host process is not serving (%s)" % (self._ended or exc)) from None
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _control_thread(self, child_end: socket.socket, started: Dict[str, object], ready: threading.Event) -> None:
        """Start the child (from this thread: PR_SET_PDEATHSIG follows the starting thread), then read
        its answers and log records until the channel closes; reap the child."""
        try:
            try:
                self._process = _spawn_host_child(child_end)
            except BaseException as exc:
                started["error"] = exc
                return
            finally:
                child_end.close()
                ready.set()
            sock = self._sock
            while sock is not None:
                try:
                    message = _recv_message(sock)
                except (OSError, ValueError) as exc:
                    log.debug("proxy host: control channel failed (%s)", type(exc).__name__)
                    message = None
                if message is None:
                    break
                if "id" in message:
                    self._deliver(message)
                elif message.get("op") == "log":
                    _emit_child_record(message, self.pid)
        finally:
            self._channel_closed()

    def _deliver(self, message: Dict[str, object]) -> None:
        with self._lock:
            pending = self._pending.get(message["id"])  # type: ignore[call-overload]
        if pending is None:  # its caller gave up waiting
            return
        if message.get("ok"):
            pending.result = message.get("result")
        else:
            pending.error = _remote_error(message.get("error"))
        pending.done.set()

    def _channel_closed(self) -> None:
        """The child closed the channel (it stopped, or died): fail waiters, reap it, say why."""
        process = self._process
        code: Optional[int] = None
        if process is not None:
            try:
                code = process.wait(STOP_JOIN_S * 2)
            except subprocess.TimeoutExpired:  # closed its end but does not exit: it is of no use
                process.kill()
                code = process.wait(STOP_JOIN_S)
        why = "the host process exited with code %s" % code
        with self._lock:
            self._ended = self._ended or why
            waiting = list(self._pending.values())
        for pending in waiting:
            pending.error = RuntimeError("the proxy host process is not serving (%s)" % why)
            pending.done.set()
        self._pusher_stop.set()
        if not self._stopping and code is not None:
            log.warning("proxy host process %s ended on its own (code %s): its routes are gone", self.pid, code)

    def _abandon(self) -> None:
        """Close the parent's end of the channel (the child sees EOF and exits) and stop the pusher."""
        self._pusher_stop.set()
        sock = self._sock
        if sock is not None:
            _abort_socket(sock)
        pusher = self._pusher
        if pusher is not None and pusher is not threading.current_thread():
            pusher.join(STOP_JOIN_S)

    def _push_tokens(self) -> None:
        """Re-read every token and headers callable each TOKEN_PUSH_INTERVAL_S; send the child what changed."""
        while not self._pusher_stop.wait(TOKEN_PUSH_INTERVAL_S):
            with self._lock:
                routes = list(self._routes.items())
            for route_id, entry in routes:
                sent: Dict[str, _Pushed] = entry["sent"]  # type: ignore[assignment]
                now = dict(sent)
                if entry["token"] is not None:
                    now["token"] = _Pushed.of_token(entry["token"])  # type: ignore[arg-type]
                if entry["headers"] is not None:
                    now["headers"] = _Pushed.of_headers(entry["headers"])  # type: ignore[arg-type]
                if now == sent:
                    continue
                try:
                    self._call("refresh", route=route_id, **_pushed_fields(now))
                except Exception as exc:  # the child is gone (logged once there) or the route was unmounted
                    log.debug("proxy host: could not push a token (%s)", type(exc).__name__)
                    continue
                entry["sent"] = now

    def _after_fork(self) -> None:
        """In a forked child: the channel and threads belong to the parent; close our copy of its end."""
        self._ended = "this handle belongs to the process that spawned it (this one was forked from it)"
        self._pending = {}
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class _ProxyProcessGroup:
    """`AuthProxy.spawn(processes=N)`: N proxy host children sharing one port (SO_REUSEPORT), each route
    mounted in every one under the same route id, so whichever child the kernel hands a connection to
    serves it. Same API as `AuthProxyProcess` except replica routes: each child would balance its own
    sessions, so `mount_replicas` is refused (use processes=1)."""

    def __init__(self, host: str, port: int, processes: int, timeouts: Dict[str, float]) -> None:
        self.host = host
        self.members = [AuthProxyProcess(host, port, **timeouts) for _ in range(processes)]
        for member in self.members:
            member._reuse_port = True

    def start(self) -> "_ProxyProcessGroup":
        try:
            first = self.members[0].start()
            for member in self.members[1:]:
                member._requested_port = first.port
                member.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every child (never raises; each logs what it could not clean up)."""
        for member in self.members:
            member.stop()

    def __enter__(self) -> "_ProxyProcessGroup":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return "AuthProxyProcess(%s, pids %s, %s)" % (self.url, self.pids, "serving" if self.running else "not serving")

    port = property(lambda self: self.members[0].port, doc="The shared port.")
    url = property(lambda self: self.members[0].url, doc="The listener's root URL.")
    pid = property(lambda self: self.members[0].pid, doc="The first child's process id.")
    pids = property(lambda self: [m.pid for m in self.members], doc="Every child's process id.")
    running = property(lambda self: all(m.running for m in self.members), doc="True while every child serves.")

    def mount(self, upstream: str, token: Token, *, verify: Verify = True, headers: ExtraHeaders = None) -> str:
        """As `AuthProxy.mount`, in every child; undone in all if one refuses."""
        base_url = self.members[0].mount(upstream, token, verify=verify, headers=headers)
        try:
            for member in self.members[1:]:
                member._mount("mount", token, headers, upstream=upstream, verify=_portable_verify(verify),
                              route_id=_route_id(base_url))
        except BaseException:
            self.unmount(base_url)
            raise
        return base_url

    def unmount(self, base_url: str) -> bool:
        """As `AuthProxy.unmount`, in every child (one that has died is skipped)."""
        removed = False
        for member in self.members:
            try:
                removed = member.unmount(base_url) or removed
            except RuntimeError:
                pass
        return removed

    def mount_replicas(self, *args: object, **kwargs: object) -> str:
        raise RuntimeError(_GROUP_REPLICAS_REFUSAL)

    add_replica = remove_replica = replica_status = mount_replicas


# Why a process group has no replica routes.
_GROUP_REPLICAS_REFUSAL = ("replica routes need one proxy process: each child would balance its own sessions; "
                           "spawn with processes=1 for mount_replicas()")


def _processes_rejection(processes: object) -> Optional[str]:
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        return "processes must be a whole number of child processes, 1 or more, got %r" % (processes,)
    if processes > 1 and not hasattr(socket, "SO_REUSEPORT"):
        return "processes > 1 needs SO_REUSEPORT (Linux, BSD, macOS); this platform has none: use processes=1"
    return None


class _ReusePortServer(_Server):
    """The child's listener when it shares its port with sibling children (`spawn(processes=N)`)."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def _rekey_route(proxy: AuthProxy, route_id: str, wanted: str) -> str:
    """Serve the route just mounted at `route_id` under `wanted` instead (a group's shared id)."""
    with proxy._lock:
        if wanted in proxy._routes:
            raise ValueError("route id already mounted")
        proxy._routes[wanted] = proxy._routes.pop(route_id)
    return "%s/%s" % (proxy.url, wanted)


class _PendingAnswer:
    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: object = None
        self.error: Optional[BaseException] = None


class _Pushed(NamedTuple):
    """What a route's token or headers (or its callable, read now) gave: the value to send the child,
    or the name of the error the in-process proxy would have met reading it."""

    value: object
    error: Optional[str]

    @classmethod
    def of_token(cls, token: Token) -> "_Pushed":
        if not callable(token):
            return cls(token, None)
        try:
            value = token()
        except Exception as exc:
            return cls(None, type(exc).__name__)
        if value is not None and not isinstance(value, str):
            return cls(None, "ValueError")  # in-process: "not a usable token string"
        return cls(value, None)

    @classmethod
    def of_headers(cls, headers: ExtraHeaders) -> "_Pushed":
        try:
            value = headers() if callable(headers) else headers
        except Exception as exc:
            return cls(None, type(exc).__name__)
        if value is None:
            return cls(None, None)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return cls(None, "ValueError")  # in-process: "not a mapping" / "not a string of printable ASCII"
        return cls(dict(value), None)


def _pushed_fields(sent: Dict[str, "_Pushed"]) -> Dict[str, object]:
    """The control-message fields for a route's token and headers."""
    return {"token": sent["token"].value, "token_error": sent["token"].error,
            "headers": sent["headers"].value, "headers_error": sent["headers"].error}


# Handles of this process whose children are alive: closed in a forked child (see _after_fork_in_child).
_live_hosts: "weakref.WeakSet[AuthProxyProcess]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for host in list(_live_hosts):
        host._after_fork()
    _live_hosts.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _portable_verify(verify: Verify) -> Verify:
    """`verify` as the child must see it: a CA bundle path made absolute (the parent may chdir)."""
    return os.path.abspath(verify) if isinstance(verify, str) else verify


def _remote_error(error: object) -> BaseException:
    kind, message = (error.get("type"), error.get("message")) if isinstance(error, dict) else (None, None)
    if kind == "OSError":
        return OSError(error.get("errno"), str(message))  # type: ignore[union-attr]
    known = _REMOTE_ERRORS.get(str(kind))
    if known is not None:
        return known(str(message))
    return RuntimeError("the proxy host process failed (%s: %s)" % (kind, message))


def _host_environment() -> Dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name in HOST_ENV_ALLOWLIST or name.startswith(HOST_ENV_PREFIXES)}


def _spawn_host_child(child_end: socket.socket) -> "subprocess.Popen[bytes]":
    script = os.path.abspath(__file__)
    if os.name != "posix" or not sys.executable:
        raise RuntimeError("AuthProxy.spawn() needs a POSIX system and sys.executable (it hands the child a "
                           "socket by file descriptor); use the in-process AuthProxy here")
    if not script.endswith(".py") or not os.path.exists(script):
        raise RuntimeError("AuthProxy.spawn() runs this module's source file as the child, but %s is not a .py "
                           "file; use the in-process AuthProxy" % script)
    # -I: the child imports only the standard library, so it reads no PYTHON* variable and no user site.
    args = [sys.executable, "-I", script, HOST_CHILD_ARG, str(child_end.fileno()), str(os.getpid())]
    return subprocess.Popen(args, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, env=_host_environment(), close_fds=True)


def _emit_child_record(message: Dict[str, object], pid: Optional[int]) -> None:
    """Re-emit a child's log record on this process's logger of the same name, if that level is on."""
    name, level = str(message.get("name") or "proxy"), int(message.get("level") or logging.INFO)  # type: ignore[call-overload]
    logger = logging.getLogger(name)
    if not logger.isEnabledFor(level):
        return
    created = float(message.get("created") or time.time())  # type: ignore[arg-type]
    record = logging.makeLogRecord({
        "name": name, "levelno": level, "levelname": logging.getLevelName(level), "msg": message.get("msg", ""),
        "args": None, "created": created, "msecs": (created - int(created)) * 1000,
        "threadName": message.get("thread"), "process": pid, "processName": "proxy-host",
        "exc_text": message.get("exc")})
    logger.handle(record)


def _send_message(sock: socket.socket, lock: threading.Lock, message: Dict[str, object]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    with lock:
        sock.sendall(_FRAME.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, size: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < size:
        piece = sock.recv(size - len(buf))
        if not piece:
            return None
        buf += piece
    return bytes(buf)


def _recv_message(sock: socket.socket) -> Optional[Dict[str, object]]:
    """The next message, or None at EOF."""
    head = _recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    (size,) = _FRAME.unpack(head)
    if size > MAX_CONTROL_MESSAGE:
        raise ValueError("control message of %d bytes" % size)
    body = _recv_exact(sock, size)
    if body is None:
        return None
    message = json.loads(body.decode("utf-8"))
    if not isinstance(message, dict):
        raise ValueError("control message is not an object")
    return message


# -- the child side ------------------------------------------------------------------------------------


class _PushedValue:
    """A route's token or headers in the child: the last value the parent pushed, as the callable the
    route reads per request (raising the error the parent's callable raised, by name)."""

    def __init__(self, value: object, error: Optional[str]) -> None:
        self.set(value, error)

    def set(self, value: object, error: Optional[str]) -> None:
        self.value, self.error = value, error

    def __call__(self) -> object:
        if self.error is not None:
            raise _error_named(self.error)()
        return self.value


_ERROR_TYPES: Dict[str, type] = {}


def _error_named(name: str) -> type:
    """An exception type called `name`, so the child logs "token callable failed (KeyError)" as in-process."""
    if name not in _ERROR_TYPES:
        _ERROR_TYPES[name] = type(name, (Exception,), {})
    return _ERROR_TYPES[name]


class _ForwardingHandler(logging.Handler):
    """The child's `proxy` log records, sent to the parent over the channel (already formatted)."""

    def __init__(self, host: "_ProxyHost") -> None:
        super().__init__(logging.DEBUG)
        self.host = host
        self.formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = self.formatter.formatException(record.exc_info) if record.exc_info else None
            self.host.send({"op": "log", "name": record.name, "level": record.levelno, "msg": record.getMessage(),
                            "created": record.created, "thread": record.threadName, "exc": exc})
        except Exception:  # the parent is gone: nobody to tell
            pass


class _ProxyHost:
    """The child's main thread: serve control requests on the channel until EOF, `stop`, or a signal."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.proxy: Optional[AuthProxy] = None
        self.pushed: Dict[str, Dict[str, _PushedValue]] = {}  # route id -> "token"/"headers" -> value

    def send(self, message: Dict[str, object]) -> None:
        _send_message(self.sock, self.send_lock, message)

    def end_input(self, signum: int = 0, frame: object = None) -> None:
        """SIGTERM/SIGHUP (or the parent's death): make the next read see EOF, so the loop stops cleanly."""
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def serve(self) -> int:
        try:
            while True:
                message = _recv_message(self.sock)
                if message is None:
                    break
                if "level" in message:
                    log.setLevel(int(message["level"]))  # type: ignore[call-overload]
                try:
                    result = self.handle(message)
                    answer: Dict[str, object] = {"id": message.get("id"), "ok": True, "result": result}
                except Exception as exc:
                    answer = {"id": message.get("id"), "ok": False,
                              "error": {"type": type(exc).__name__, "message": str(exc),
                                        "errno": getattr(exc, "errno", None)}}
                if message.get("op") == "stop":
                    self.stop_proxy()
                self.send(answer)
                if message.get("op") == "stop":
                    break
        except (OSError, ValueError):  # the parent is gone or spoke nonsense: stop like on EOF
            pass
        finally:
            self.stop_proxy()
        return 0

    def stop_proxy(self) -> None:
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.stop()

    def handle(self, message: Dict[str, object]) -> object:
        op = message.get("op")
        if op == "start":
            if self.proxy is not None:
                raise RuntimeError("the proxy host is already serving")
            if message.get("reuse_port"):
                # This process serves nothing but this proxy: its listener may share the port.
                globals()["_Server"] = _ReusePortServer
            self.proxy = AuthProxy(str(message["host"]), int(message["port"]),  # type: ignore[call-overload]
                                   **dict(message.get("timeouts") or {})).start()  # type: ignore[arg-type]
            return {"port": self.proxy.port, "pid": os.getpid()}
        if op == "stop":
            return None
        proxy = self.proxy
        if proxy is None:
            raise RuntimeError("the proxy host is not serving")
        if op in ("mount", "mount_replicas"):
            # A callable (or one whose first read failed) becomes a _PushedValue the parent refreshes.
            pushed = {name: _PushedValue(message.get(name), message.get(name + "_error")) for name in ("token", "headers")
                      if name in (message.get("dynamic") or ()) or message.get(name + "_error")}
            token: Token = pushed.get("token") or message.get("token")  # type: ignore[assignment]
            headers: ExtraHeaders = pushed.get("headers") or message.get("headers")  # type: ignore[assignment]
            if op == "mount":
                base_url = proxy.mount(str(message["upstream"]), token, verify=message["verify"],  # type: ignore[arg-type]
                                       headers=headers)
            else:
                base_url = proxy.mount_replicas(message["upstreams"], token, verify=message["verify"],  # type: ignore[arg-type]
                                                http=str(message.get("http")))
            if message.get("route_id"):  # a process group: every child serves the route at the first one's id
                base_url = _rekey_route(proxy, _route_id(base_url), str(message["route_id"]))
            if pushed:
                self.pushed[_route_id(base_url)] = pushed
            return base_url
        route = str(message.get("route"))
        base_url = "%s/%s" % (proxy.url, route)
        if op == "refresh":
            values = self.pushed.get(route, {})
            for name, value in values.items():
                value.set(message.get(name), message.get(name + "_error"))
            return bool(values)
        if op == "unmount":
            self.pushed.pop(route, None)
            return proxy.unmount(base_url)
        if op == "add_replica":
            return proxy.add_replica(base_url, str(message.get("upstream")))
        if op == "remove_replica":
            return proxy.remove_replica(base_url, str(message.get("upstream")))
        if op == "replica_status":
            return proxy.replica_status(base_url)
        raise ValueError("unknown control request %r" % (op,))


def _host_child_main(argv: List[str]) -> int:
    """`python proxy.py --proxy-host FD PARENT_PID`: serve an AuthProxy for the parent over channel FD."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    if hasattr(signal, "pthread_sigmask"):  # a child started from a library thread inherits its blocked set
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    _ask_for_parent_death_signal()
    sock = socket.socket(fileno=fd)
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        return 1
    host = _ProxyHost(sock)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), host.end_input)
    # Ctrl-C in a terminal reaches the whole foreground group: the parent decides (its teardown still
    # unmounts routes here), and this child ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.addHandler(_ForwardingHandler(host))
    log.propagate = False
    sys.setswitchinterval(CLI_SWITCH_INTERVAL_S)  # this process only runs the proxy (see the constant)
    _resolve_localhost_names_to_loopback()
    code = host.serve()
    sock.close()
    return code


def _resolve_localhost_names_to_loopback() -> None:
    """In the child: `<name>.localhost` resolves as `localhost` (RFC 6761 6.3: loopback), as the library's
    loopback rule (`_is_loopback_host`) already assumes. glibc does not do it by itself, and a resolver
    patch made in the parent (the TLS emulator's, for `*.jobs.localhost`) does not cross into the child."""
    original = socket.getaddrinfo

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        name = host.decode("idna") if isinstance(host, bytes) else host
        if isinstance(name, str) and name.lower().rstrip(".").endswith(".localhost"):
            host = "localhost"
        return original(host, *args, **kwargs)  # type: ignore[arg-type]

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]


def _ask_for_parent_death_signal() -> None:
    """Linux: SIGTERM this process when its parent (thread) dies. Elsewhere EOF on the channel does it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the channel's EOF still ends the child
        pass



# --------------------------------------------------------------------------------------------------
# CLI: python proxy.py UPSTREAM_URL [--port P]
# --------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    """Front one upstream URL on loopback; print the base URL first; stop cleanly on Ctrl-C/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python proxy.py", description="Front a job URL with a local auth proxy.")
    parser.add_argument("upstream", metavar="UPSTREAM_URL", help="e.g. https://<job_id>--8000.hf.jobs")
    parser.add_argument("--port", type=int, default=0, help="local port (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="local address to bind (default: 127.0.0.1)")
    parser.add_argument("--insecure", action="store_true", help="do not verify the upstream's TLS certificate")
    parser.add_argument("--ca-bundle", help="CA bundle file to verify the upstream with")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    reason = _upstream_rejection(args.upstream)
    if reason:
        parser.error(reason)
    sys.setswitchinterval(CLI_SWITCH_INTERVAL_S)
    log.debug("proxy: GIL switch interval %.3g s (this process only runs the proxy)", CLI_SWITCH_INTERVAL_S)
    token = _discover_token()
    host = urllib.parse.urlsplit(args.upstream).hostname or ""
    if not token and not _is_loopback_host(host):
        print("error: no HF token found: set HF_TOKEN or run `hf auth login`", file=sys.stderr)
        return 2
    verify: Verify = False if args.insecure else (args.ca_bundle or True)
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
    try:
        proxy = AuthProxy(args.host, args.port).start()
    except (OSError, ValueError) as exc:
        print("error: cannot listen on %s:%d (%s)" % (args.host, args.port, exc), file=sys.stderr)
        return 2
    try:
        try:
            base_url = proxy.mount(args.upstream, token or None, verify=verify)
        except ValueError as exc:
            print("error: %s" % exc, file=sys.stderr)
            return 2
        print(base_url, flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [HOST_CHILD_ARG]:  # AuthProxy.spawn()'s child, not the command line
        sys.exit(_host_child_main(sys.argv[2:]))
    sys.exit(main())
