"""The rollout-slot layer for training loops, on top of the core's public API.

`EnvSession` (one blocking OpenEnv WebSocket session: no event loop, no thread), `Sandbox` (a job begun in
the background when an environment object is built, optionally shared by many environments via
`replicas=K`), `stop_sandboxes()` (explicit teardown of all of them) and `install_signal_teardown()`
(cancel every job of the process on SIGTERM/SIGHUP), with the session errors. See docs/training.md.

Imports the core (`hf_sandbox_provider`), relatively inside a package and absolutely at top level, like the
core imports `proxy`; the core never imports this module, it re-exports these names lazily, so
`from hf_sandbox_provider import Sandbox` works too. Vendoring: copy this file next to the core.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import itertools
import json
import os
import random
import signal
import socket
import ssl
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

import requests
from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection, RejectData,
                            Request, TextMessage)
from wsproto.utilities import RemoteProtocolError

if __package__:  # vendored inside a package: the core sits next to this module
    from . import hf_sandbox_provider as _core
else:
    import hf_sandbox_provider as _core

# What this layer uses of the core: the provider, its errors and a few shared helpers (one copy each).
HFSandboxProvider = _core.HFSandboxProvider
SandboxError, SandboxConfigError, JobStartTimeout = _core.SandboxError, _core.SandboxConfigError, _core.JobStartTimeout
DEFAULT_MAX_PARALLEL = _core.DEFAULT_MAX_PARALLEL
_raise_if_rejected, _positive_number_rejection = _core._raise_if_rejected, _core._positive_number_rejection
_in_parallel, _start_thread = _core._in_parallel, _core._start_thread
# The proxy's TLS contexts: one per `verify`, shared with the routes, trusting certifi's bundle like requests.
_shared_tls_context, _verify_rejection = _core._proxy._shared_tls_context, _core._proxy._verify_rejection
logger = _core.logger  # one logger for the library: "hf_sandbox_provider"

__all__ = ["EnvSession", "SessionError", "SessionRefusedError", "SessionTimeout", "EnvError",
           "EpisodeLost", "Sandbox", "stop_sandboxes", "install_signal_teardown",
           "uninstall_signal_teardown"]


# --------------------------------------------------------------------------------------------------
# --- Training-loop helpers: WebSocket session, background starts, shared jobs, signal teardown ---
# --------------------------------------------------------------------------------------------------
# What a training loop with many rollout slots needs on top of the provider, built on its public API:
# `EnvSession` (one blocking OpenEnv WebSocket session), `Sandbox` (a job begun in the background when an
# environment object is built, optionally shared by many environments via `replicas=K`),
# `stop_sandboxes()` (explicit teardown of all of them) and `install_signal_teardown()` (cancel every
# job of the process on SIGTERM/SIGHUP, then let the signal do what it did before).

# Longest wait for one reply: OpenEnv's own client waits 60 s per message; raise it for slow steps.
SESSION_TIMEOUT_S = 60.0
# TCP connect plus the WebSocket handshake through the local proxy (which gives the upstream 10 s).
SESSION_CONNECT_TIMEOUT_S = 30.0
# How long close() waits for the server's close frame before dropping the socket anyway.
SESSION_CLOSE_WAIT_S = 2.0
# Largest message accepted from the environment (observations may carry images): 64 MiB.
SESSION_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How much of a refused upgrade's body goes into the error message (the proxy's JSON fits).
SESSION_REFUSAL_BODY_CHARS = 300
# The proxy's refusals of an upgrade (X-Proxy-Error) that say the job is gone, so a slot replaces it. The
# others are about the proxy (proxy-busy, proxy-stopping), the request, a token callable, TLS settings or a
# slow job (upstream-timeout): replacing a job for those would cancel a healthy one, or loop on a bad setting.
JOB_GONE_PROXY_ERRORS = frozenset(["upstream-unreachable", "unknown-route", "no-live-replica", "replica-unavailable"])
# Upstream answers to an upgrade that a front serving many jobs' names may give for one that has ended (what the
# Hub's gives is not known): with /health no 200 either, the job is gone (it answered 200 to become ready).
JOB_GONE_STATUSES = frozenset([404, 410])
# A slot's reset refused with `proxy-busy` tries again after this long (the proxy's Retry-After).
PROXY_BUSY_RETRY_S = 1.0
# A slot's reset refused a connection by a proxy="process" child being replaced waits this long at most
# for the new child (about 0.15 s with 100 routes; proxy_host gives a child's start 30 s).
PROXY_REPLACEMENT_WAIT_S = 30.0
# Meanwhile a connection is tried again this often: a few tries a replacement, each a loopback connect.
PROXY_REPLACEMENT_POLL_S = 0.05
# Background starts in flight at once per process; each holds one thread for its cold start, like
# start_many's workers. More wait for a free slot (still in the background).
BACKGROUND_MAX_PARALLEL = DEFAULT_MAX_PARALLEL
# stop(): how long to wait for a start in flight to end (its create answered and the job cancelled).
BACKGROUND_STOP_WAIT_S = 30.0
# How often stop() repeats its stop request to a start still in flight (see _BackgroundStart.stop).
BACKGROUND_STOP_REPEAT_S = 0.1
# On SIGTERM/SIGHUP: the teardown's budget before the previous disposition runs anyway. TRL's async
# rollout worker is SIGKILLed 5 s after its SIGTERM, so cancels must be sent well within that.
SIGNAL_TEARDOWN_BUDGET_S = 4.0
# At interpreter exit: how long to wait for background starts in flight (their job is then cancelled).
EXIT_TEARDOWN_BUDGET_S = 15.0

# Rollout slots (docs/training.md, "Slots that outlive their jobs"). A successor begins this long
# before the job's lifetime ends, beyond the slot's measured start: the readiness check, an episode
# still running on the old job, and noise in the next start.
RENEW_MARGIN_S = 10.0
# ... plus this many of the slot's last measured starts (create to ready): a cold start varies.
RENEW_START_FACTOR = 2.0
# The least lead a renewal gets, whatever the measured start.
RENEW_LEAD_FLOOR_S = 15.0
# Renewals spread over this fraction of a lifetime (random per job), so slots built together do not
# send their creates together at every lifetime.
RENEW_SPREAD_FRACTION = 0.1
# A job serves at least this fraction of its lifetime before its successor begins: a lead that asks
# for more is cut, with a warning (the job_timeout is too short for the starts).
RENEW_EARLIEST_FRACTION = 0.5
# A successor or replacement that failed to start is tried again after this long, doubling to the cap.
RENEW_RETRY_FIRST_S = 5.0
RENEW_RETRY_CAP_S = 300.0
# How often the core's job watcher refreshes a slot's running jobs (one `list` per token for all of
# them): the longest a death goes unseen while no session is on the job.
SLOT_WATCH_INTERVAL_S = 5.0
# The keeper thread wakes at least this often (it is woken on each change; this bounds a missed one).
KEEPER_MAX_SLEEP_S = 5.0
# A slot session's timeout (the upgrade or a reset) on its job is followed by a /health probe through the proxy,
# whose answer is awaited `timeout_s` but at least this long: no 200 means the job is gone (e.g. frozen), and the
# slot replaces it as a killed one.
HEALTH_AFTER_TIMEOUT_FLOOR_S = 2.0
# A reset tries this many times (a kept connection found broken, a job the proxy refuses, its
# replacement) before raising.
SLOT_RESET_ATTEMPTS = 4
# huggingface_hub's SandboxPool runs its host jobs for 24 h (SANDBOX_MAX_LIFETIME): a pooled sandbox
# ends then at the latest when the host's answer does not say.
POOL_HOST_LIFETIME_S = 24 * 3600


class SessionError(SandboxError, ConnectionError):
    """The WebSocket session could not be opened or was lost: the job is gone, the proxy or the
    environment refused the upgrade, the connection closed, or a reply did not come in time."""


class SessionRefusedError(SessionError):
    """The upgrade was answered with HTTP `status_code` instead of 101. `proxy_error` is the proxy's
    `X-Proxy-Error` kind (e.g. `upstream-unreachable`: the job is gone or not listening) or None when
    the environment itself refused."""

    def __init__(self, status_code: int, proxy_error: Optional[str], body: str) -> None:
        self.status_code = status_code
        self.proxy_error = proxy_error
        self.body = body
        if proxy_error in JOB_GONE_PROXY_ERRORS:
            source, body = "from the proxy (%s: the job is gone or not serving; start a new one)" % proxy_error, ""
        else:
            source = "from the proxy (%s)" % proxy_error if proxy_error else "from the environment"
            if proxy_error:  # the proxy's JSON says why and what to do, e.g. "retry shortly"
                try:
                    body = str(json.loads(body).get("message") or body)
                except (ValueError, AttributeError):
                    pass
        super().__init__("the WebSocket was refused: HTTP %d %s%s"
                         % (status_code, source, (": " + body) if body else ""))


class SessionTimeout(SessionError, TimeoutError):
    """No reply (or handshake) within the timeout. The session is closed: a late reply would otherwise
    be read as the answer to the next request."""


class EpisodeLost(SessionError):
    """The job under an episode died (or the connection to it broke) mid-episode: drop this rollout.
    The session stays usable: its next `reset()` begins an episode on the slot's current job."""


class _EpisodeTimedOut(EpisodeLost, SessionTimeout):
    """A slot session's step got no reply within `timeout_s`: the episode is lost (`EpisodeLost`), and
    the cause is a timeout (`SessionTimeout`, a `TimeoutError`), so either `except` catches it."""


class EnvError(SandboxError):
    """The environment answered a message with OpenEnv's `{"type": "error"}`: `code`, `message` and the
    full `data`. The session stays open and usable."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.code = self.data.get("code")
        self.message = self.data.get("message")
        super().__init__("environment error %s: %s" % (self.code, self.message))


class EnvSession:
    """One OpenEnv WebSocket session (`<base_url>/ws`) on one blocking socket: no event loop, no thread.

    `reset()`, `step(action)`, `state()` return the reply's `data`; an error reply raises `EnvError` (the
    session stays usable); a lost connection `SessionError`, a slow reply `SessionTimeout` (both close it).
    One caller at a time (a lock); open one session per rollout slot.
    """

    def __init__(self, base_url: str, *, timeout_s: float = SESSION_TIMEOUT_S,
                 connect_timeout_s: float = SESSION_CONNECT_TIMEOUT_S, verify: Union[bool, str] = True,
                 path: str = "/ws") -> None:
        _raise_if_rejected(_positive_number_rejection("timeout_s", timeout_s)
                           or _positive_number_rejection("connect_timeout_s", connect_timeout_s)
                           or _session_url_rejection(base_url) or _verify_rejection(verify))
        parts = urlsplit(_session_url(base_url, path))
        # For messages and repr: scheme and host only. The path holds the proxy's route id, a secret.
        self.where = "%s://%s" % (parts.scheme, parts.netloc)
        self.timeout_s = float(timeout_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._pid = os.getpid()  # a forked child's copy shares the parent's socket: it refuses, and closes only its own
        self._lock = threading.Lock()
        self._closed = False
        self._events: deque = deque()
        self._ws = WSConnection(ConnectionType.CLIENT)
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        deadline = time.monotonic() + float(connect_timeout_s)
        try:
            self._sock: Any = _dial(parts.hostname, port, deadline)
        except socket.timeout:
            raise SessionTimeout("could not connect to %s within %gs" % (self.where, connect_timeout_s)) from None
        except OSError as exc:
            raise SessionError("could not connect to %s: %s (%s)" % (
                self.where, exc.strerror or exc, _ended_proxy_note(parts.hostname, port)
                or "is the provider still running?")) from exc
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/reply frames
            if parts.scheme == "wss":
                self._sock = self._tls(verify, parts.hostname, deadline)
            target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
            self._send(Request(host=parts.netloc, target=target))
            self._handshake(deadline)
        except SessionError:  # (a ConnectionError, so before OSError) refused, timed out, closed, TLS
            self._abort()
            raise
        except socket.timeout as exc:  # the upgrade request could not be sent in time
            self._abort()
            raise SessionTimeout("the WebSocket upgrade to %s did not finish within connect_timeout_s=%gs"
                                 % (self.where, self._connect_timeout_s)) from exc
        except OSError as exc:  # reset, broken pipe, TLS failure mid-upgrade: the peer or the path is gone
            self._abort()
            note = _ended_proxy_note(parts.hostname, port)
            raise SessionError("the connection to %s broke during the WebSocket upgrade: %s%s"
                               % (self.where, exc.strerror or exc, " (%s)" % note if note else "")) from exc
        except RemoteProtocolError as exc:  # e.g. a 101 with a wrong Sec-WebSocket-Accept, or not HTTP at all
            self._abort()
            raise SessionError("the answer to the WebSocket upgrade from %s broke the protocol (%s): is this an "
                               "OpenEnv server?" % (self.where, exc)) from exc
        except BaseException:  # e.g. KeyboardInterrupt
            self._abort()
            raise

    def _tls(self, verify: Union[bool, str], hostname: str, deadline: float) -> ssl.SSLSocket:
        """The connected socket wrapped in TLS, handshaken by `deadline`; failures as session errors."""
        self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            return _shared_tls_context(verify).wrap_socket(self._sock, server_hostname=hostname)
        except ssl.SSLCertVerificationError as exc:
            raise SessionError("TLS with %s failed: its certificate is not trusted (%s); pass verify=<CA bundle "
                               "path> for a private CA, or verify=False for a test server"
                               % (self.where, exc.verify_message or exc.reason)) from None
        except socket.timeout:
            raise SessionTimeout("the TLS handshake with %s did not finish within %gs"
                                 % (self.where, self._connect_timeout_s)) from None
        except OSError as exc:  # (ssl.SSLError is one)
            raise SessionError("TLS with %s failed: %s" % (self.where, getattr(exc, "reason", None)
                                                           or exc.strerror or type(exc).__name__)) from None

    # -- OpenEnv's messages -------------------------------------------------------------------------

    def reset(self, **kwargs: Any) -> Dict[str, Any]:
        """Start an episode (`seed`, `episode_id`, ... are passed on); returns the observation payload."""
        return self.request({"type": "reset", "data": kwargs})

    def step(self, action: Mapping[str, Any]) -> Dict[str, Any]:
        """Apply `action` (the environment's action fields); returns `observation`, `reward`, `done`."""
        if not isinstance(action, Mapping):
            raise SandboxConfigError("step() takes the action as a mapping of its fields, e.g. {'message': 'hi'}; "
                                     "got %s" % type(action).__name__)
        return self.request({"type": "step", "data": dict(action)})

    def state(self) -> Dict[str, Any]:
        """The environment's state (e.g. `episode_id`, `step_count`)."""
        return self.request({"type": "state"})

    def request(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        """Send one JSON message and return its reply's `data`; an error reply raises `EnvError`."""
        reply = self.exchange(message)
        if reply.get("type") == "error":
            raise EnvError(reply.get("data") or {})
        data = reply.get("data")
        return data if isinstance(data, dict) else {}

    def exchange(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        """Send one JSON message and return the whole JSON reply (`type` and `data`), whatever its type."""
        _raise_if_rejected(_message_rejection(message))
        text = json.dumps(message)
        if self._pid != os.getpid():  # checked before the lock, which a parent's thread may have held at the fork
            raise SessionError("this EnvSession was opened by process %d and its connection is that process's; "
                               "open a new EnvSession in this (forked) process" % self._pid)
        with self._lock:
            if self._closed:
                raise SessionError("this EnvSession is closed (close() ran or the connection was lost); open a new one")
            try:
                self._send_message(text)
                return self._receive(time.monotonic() + self.timeout_s)
            except SessionError:  # timeouts included: a late reply must never answer the next request
                self._abort()
                raise
            except OSError as exc:  # reset, broken pipe, TLS failure: the session is gone
                self._abort()
                raise SessionError("the WebSocket session to %s broke: %s" % (self.where, exc)) from None
            except BaseException:  # e.g. KeyboardInterrupt: the reply is still due and would answer the next request
                self._abort()
                raise

    @property
    def closed(self) -> bool:
        """True once close() ran or the session was lost."""
        return self._closed

    def close(self) -> None:
        """Send OpenEnv's `close` and a close frame, then release the socket; idempotent, never raises. While
        another thread waits for a reply it shuts the socket down, so that thread gets `SessionError` at once."""
        if self._pid != os.getpid():  # a forked child's copy: release this process's descriptor, send nothing
            self._closed = True
            return self._sock.close()
        if not self._lock.acquire(blocking=False):
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # the waiting thread sees EOF and releases the socket
            except OSError:
                pass
            return
        try:
            if self._closed:
                return
            self._closed = True
            self._send_message(json.dumps({"type": "close"}))
            self._send(CloseConnection(code=1000))
            deadline = time.monotonic() + SESSION_CLOSE_WAIT_S
            while not isinstance(self._next_event(deadline), CloseConnection):
                pass
        except Exception:
            pass  # the peer is gone or slow: the socket closes below either way
        finally:
            self._sock.close()
            self._lock.release()

    def __enter__(self) -> "EnvSession":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:  # host only: the path holds the proxy's route id (a secret)
        return "<EnvSession %s %s>" % (self.where, "closed" if self._closed else "open")

    # -- machinery ------------------------------------------------------------------------------------

    def _break(self) -> None:
        """From any thread: mark the session lost and shut its socket down, so a request in flight
        (or the next one) raises SessionError at once; close() releases the socket."""
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _abort(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _handshake(self, deadline: float) -> None:
        event = self._next_event(deadline, handshake=True)
        if isinstance(event, RejectConnection):
            status, headers = event.status_code, {k.lower(): v for k, v in event.headers}
            body, more = b"", event.has_body
            while more:  # read the (small) body for the message
                data = self._next_event(deadline, handshake=True)
                if not isinstance(data, RejectData):
                    break
                body, more = body + data.data, not data.body_finished
            raise SessionRefusedError(status, headers.get(b"x-proxy-error", b"").decode("latin-1") or None,
                                      body.decode("utf-8", "replace").strip()[:SESSION_REFUSAL_BODY_CHARS])
        if not isinstance(event, AcceptConnection):
            raise SessionError("unexpected answer to the WebSocket upgrade: %s" % type(event).__name__)

    def _send(self, event: Any) -> None:
        self._sock.sendall(self._ws.send(event))

    def _send_message(self, text: str) -> None:
        self._send(TextMessage(data=text))

    def _receive(self, deadline: float) -> Dict[str, Any]:
        parts: List[Any] = []
        size = 0
        while True:
            event = self._next_event(deadline)
            if isinstance(event, Ping):
                self._send(event.response())
            elif isinstance(event, CloseConnection):
                raise SessionError("the environment closed the session (code %s%s): its job may have ended"
                                   % (event.code, ", " + event.reason if event.reason else ""))
            elif isinstance(event, (TextMessage, BytesMessage)):
                parts.append(event.data)
                size += len(event.data)
                if size > SESSION_MAX_MESSAGE_BYTES:
                    raise SessionError("a reply exceeded %d bytes" % SESSION_MAX_MESSAGE_BYTES)
                if event.message_finished:
                    raw: Any = "".join(parts) if isinstance(event, TextMessage) else b"".join(parts)
                    try:
                        reply = json.loads(raw if isinstance(raw, str) else raw.decode("utf-8"))
                    except ValueError:  # (UnicodeDecodeError is one)
                        raise SessionError("the environment sent a reply that is not JSON: %r" % raw[:100]) from None
                    if not isinstance(reply, dict):
                        raise SessionError("the environment sent a reply that is not a JSON object: %r" % raw[:100])
                    return reply

    def _next_event(self, deadline: float, handshake: bool = False) -> Any:
        while not self._events:
            self._events.extend(self._ws.events())
            if self._events:
                break
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise socket.timeout()
                self._sock.settimeout(remaining)
                data = self._sock.recv(65536)
            except socket.timeout:
                if handshake:
                    raise SessionTimeout("no answer to the WebSocket upgrade from %s within connect_timeout_s=%gs"
                                         % (self.where, self._connect_timeout_s)) from None
                raise SessionTimeout("no answer from %s within %gs; the session is closed (raise timeout_s "
                                     "for slow environments)" % (self.where, self.timeout_s)) from None
            if not data:
                raise SessionError("the connection to %s closed mid-session: the job or the proxy route is gone"
                                   % self.where)
            self._ws.receive_data(data)
        return self._events.popleft()


def _own_proxy(host: Optional[str], port: int, running: bool) -> Any:
    """This process's proxy (shared, or one a Sandbox was given) listening at `host:port` whose `running`
    is `running`, or None (also when the layer cannot tell)."""
    proxies = list(_core._shared_proxies.values())
    proxies += [provider._mounted_on for provider in _listed(_sandbox_providers)]
    for proxy in proxies:
        try:
            if proxy is None or bool(proxy.running) != running:
                continue
            parts = urlsplit(proxy.url)
            if parts.port == port and (parts.hostname or "").lower() == (host or "").lower():
                return proxy
        except Exception:  # a proxy object of another shape: no verdict from it
            continue
    return None


def _dial(host: Optional[str], port: int, deadline: float) -> socket.socket:
    """A TCP connection to `host:port`, opened by `deadline` (else socket.timeout). Refused by a proxy of
    this process that still runs, it is tried again until then: a proxy="process" child being replaced
    (see proxy_host.MAX_REVIVALS) has no listener for a moment, and its routes come back at the same URLs.
    Only the port can say when: the refusal may come before the handle has noticed the child's death."""
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
        except ConnectionRefusedError:
            if (time.monotonic() + PROXY_REPLACEMENT_POLL_S >= deadline
                    or _own_proxy(host, port, running=True) is None):
                raise
            time.sleep(PROXY_REPLACEMENT_POLL_S)


def _replaced_proxy_waited(base_url: str) -> bool:
    """After a session could not be opened at `base_url` (refused, or cut during its upgrade): whether that
    is a proxy of this process that still runs and listens within PROXY_REPLACEMENT_WAIT_S. A proxy="process"
    child being replaced refuses connections for a moment, and its death resets those it had not accepted."""
    if not _own_proxy_runs(base_url):
        return False
    parts = urlsplit(base_url)
    try:
        _dial(parts.hostname, parts.port, time.monotonic() + PROXY_REPLACEMENT_WAIT_S).close()  # type: ignore[arg-type]
    except OSError:
        return False
    return True


def _own_proxy_runs(base_url: str) -> bool:
    """Whether this process's proxy at `base_url` runs: then a `proxy-stopping` refusal there is not its own
    but relayed from upstream (e.g. the gateway of a job going down), a 5xx like any other."""
    parts = urlsplit(base_url)
    return parts.port is not None and _own_proxy(parts.hostname, parts.port, running=True) is not None


def _ended_proxy_note(host: Optional[str], port: int) -> Optional[str]:
    """Why nothing answers at `host:port` when it is the URL of one of this process's proxies that is no
    longer running (e.g. proxy="process" and its child ended), or None when the layer cannot tell."""
    proxy = _own_proxy(host, port, running=False)
    if proxy is not None:
        pid = getattr(proxy, "pid", None)
        what = ("the proxy process (pid %s) serving this URL ended" % pid if pid
                else "the proxy serving this URL stopped")
        return ("%s: its routes are gone, so every environment of this process on it fails until the providers "
                "are restarted (stop them, e.g. stop_sandboxes() / stop_all(), and start again)" % what)
    return None


def _session_url_rejection(base_url: Any) -> Optional[str]:
    """Why `base_url` cannot carry a WebSocket session, or None."""
    if not isinstance(base_url, str) or not base_url:
        return "EnvSession needs the provider's base_url (a string such as http://127.0.0.1:<port>/<route>)"
    try:
        parts = urlsplit(base_url)
        parts.port  # raises on a port out of range or not a number
    except ValueError as exc:  # e.g. "Port out of range 0-65535", "Invalid IPv6 URL"
        return "EnvSession's base_url is not a valid URL (%s); pass the provider's base_url" % exc
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        return ("EnvSession needs an http(s):// or ws(s):// base_url such as the provider's "
                "http://127.0.0.1:<port>/<route>; got a %r URL" % (parts.scheme or "schemeless"))
    return None


def _message_rejection(message: Any) -> Optional[str]:
    """Why `message` cannot be sent as an OpenEnv message, or None."""
    if isinstance(message, Mapping):
        return None
    return ("request() and exchange() take the message as a mapping, e.g. {'type': 'step', 'data': {...}}; got %s"
            % type(message).__name__)


def _optional_seconds_rejection(name: str, value: Any) -> Optional[str]:
    """Why `value` is neither None (no bound) nor a positive number of seconds, or None."""
    return None if value is None else _positive_number_rejection(name, value)


def _session_url(base_url: str, path: str) -> str:
    """The session's ws(s):// URL: http -> ws, https -> wss, `path` appended to the base path."""
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return "%s://%s%s/%s%s" % (scheme, parts.netloc, parts.path.rstrip("/"), path.lstrip("/"),
                               "?" + parts.query if parts.query else "")


# -- background starts ------------------------------------------------------------------------------

_background_lock = threading.Lock()
_background_starts: "set[_BackgroundStart]" = set()  # starts still in flight
# Slots' cancels of jobs they are done with (renewed, retired), in flight: every teardown waits for them, as
# a daemon thread dies at exit with its cancel unsent (the job's safety net is retired when its cancel begins).
_slot_cancels: "set[threading.Event]" = set()
_background_slots = threading.BoundedSemaphore(BACKGROUND_MAX_PARALLEL)


class _BackgroundStart:
    """`start_container()` + `wait_for_ready()` of one provider in a daemon thread, begun at once; `wait()`
    returns its base URL or raises its error, `stop()` cancels the job, mid-start too. One job (or
    one group of replicas) of a slot: the slot's lock guards `users` and `dead`."""

    def __init__(self, provider: HFSandboxProvider, slot: Optional["_Slot"] = None,
                 first: Optional[Callable[[], None]] = None) -> None:
        self.provider = provider
        # Told when the start ends; weak, as the slot holds its starts: no cycle keeps a dropped Sandbox (and its
        # jobs) until a full collection, which a trainer's large heap may make rare.
        self._slot = None if slot is None else weakref.ref(slot)
        self.base_url: Optional[str] = None
        self.error: Optional[BaseException] = None
        self._error_tb: Any = None  # its traceback when it was stored (see raisable())
        self.began = time.monotonic()  # just before the create: its lifetime cannot begin earlier
        self.ready_at: Optional[float] = None
        self.deadline = float("inf")  # when its lifetime ends at the latest (`began` + job_timeout)
        self.jitter = 0.0  # how much earlier than its due time this job's renewal begins
        self.users = 0  # sessions with an episode on this job
        self.sessions: "weakref.WeakSet[_SlotSession]" = weakref.WeakSet()  # connected to it
        self.dead: Optional[str] = None  # why the job is gone (seen ended, refused by the proxy)
        self.renew_now: Optional[str] = None  # why to renew it before its time (a replica ended)
        self.stages_lock = threading.Lock()  # (replicas) one Jobs API refresh of the group at a time
        self.stages: Tuple[float, List[Optional[str]]] = (float("-inf"), [])  # its last: when, each job's stage
        self.watches: List[Any] = []  # the core's job watcher's registrations for its job(s)
        self.why = "first start"  # for the log: why this job was started
        self.replaces: List[str] = []  # for the log: the job(s) it takes over from
        self._first = first  # run before the create (the dead job it replaces is cancelled first)
        self._stopped = False
        self._done = threading.Event()
        with _background_lock:
            _background_starts.add(self)
        _start_thread(threading.Thread(target=self._run, name="hf-sandbox-background-start", daemon=True))

    def wait(self, timeout_s: Optional[float] = None) -> str:
        if not self._done.wait(timeout_s):
            raise JobStartTimeout("sandbox job %s still starting after %gs (stage %s); the start goes on"
                                  % (self.provider.job_id or "(being created)", timeout_s, self.provider.stage),
                                  self.provider.job_id, self.provider.stage)
        if self.error is not None:
            raise self.raisable()
        return self.base_url or ""

    def raisable(self) -> BaseException:
        """The start's error with the traceback it was stored with: raising the one object again would
        otherwise add this raise's frames to its traceback each time (CPython does), without bound. Those
        frames (the slot's `serving`, the Sandbox's `wait`) stay in the stored error until the next raise:
        a Sandbox whose failed start was raised waits for a collection once dropped (known, not fixed)."""
        assert self.error is not None
        return self.error.with_traceback(self._error_tb)

    @property
    def slot(self) -> Optional["_Slot"]:
        return None if self._slot is None else self._slot()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def serving(self) -> bool:
        """Started, ready, and not seen dead."""
        return self._done.is_set() and self.error is None and self.dead is None

    def stop(self, wait_s: float = BACKGROUND_STOP_WAIT_S) -> None:
        """Make the start give up, wait (up to `wait_s`) for its thread, then cancel what is left. Never raises."""
        self._stopped = True
        deadline = time.monotonic() + wait_s
        self.provider._request_stop()
        while not self._done.wait(BACKGROUND_STOP_REPEAT_S) and time.monotonic() < deadline:
            self.provider._request_stop()  # a start that claimed the provider since cleared the last request
        self.provider.stop_container()  # a start that succeeded just before: cancel its job
        _unwatch(self)

    def _run(self) -> None:
        try:
            if self._first is not None:
                self._first()
            while not _background_slots.acquire(timeout=BACKGROUND_STOP_REPEAT_S):
                if self._stopped:
                    raise SandboxError("the sandbox was stopped before its start began")
            try:
                if self._stopped:
                    raise SandboxError("the sandbox was stopped before its start began")
                self.began = time.monotonic()
                self.deadline = self.began + _lifetime_s(self.provider)
                base_url = self.provider.start_container()
                self.provider.wait_for_ready(base_url)
            finally:
                _background_slots.release()
            if self._stopped:  # stopped during the start: the stop's own requests cancel the job
                raise SandboxError("the sandbox was stopped while job %s was starting" % self.provider.job_id)
            self.ready_at = time.monotonic()
            self.base_url = base_url
        except BaseException as exc:  # kept for wait(); the provider has torn the job down already
            self.error, self._error_tb = exc, exc.__traceback__
        finally:
            with _background_lock:
                _background_starts.discard(self)
            self._done.set()
            self._tell_slot()

    def _tell_slot(self) -> None:
        # (not in _run: a failed start keeps its traceback, and _run's frame must not hold the slot)
        if (slot := self.slot) is not None:
            slot._start_ended(self)


def _ids(start: _BackgroundStart) -> str:
    """The start's job id(s), for the log."""
    return ", ".join(start.provider.job_ids) or "?"


def _lifetime_s(provider: HFSandboxProvider) -> float:
    """The job's server-side lifetime (`job_timeout`) in seconds."""
    return float(_core._parse_duration(provider.job_timeout) or _core.DEFAULT_JOB_TIMEOUT_S)


# -- rollout slots: a job renewed before its lifetime ends, replaced when it dies ---------------------

_slots_lock = threading.Lock()
# Every slot begun and not stopped: the keeper tends them. Weak: a slot whose Sandbox and sessions are
# gone is collected, and its providers' safety nets cancel its jobs (shared slots stay named below).
_live_slots: "weakref.WeakSet[_Slot]" = weakref.WeakSet()
_keeper_wake = threading.Event()  # set by the job watcher on a stage change, and on any slot change
_keeper: List[threading.Thread] = []  # the keeper thread, while one runs
_slot_numbers = itertools.count(1)  # names slots in the log
_STOPPED = ("this sandbox was stopped (stop() or stop_sandboxes()); begin() or a new session() starts "
            "it again")
_CLOSED_WHILE_WAITING = "this EnvSession was closed while its reset() waited; open a new one with Sandbox.session()"


class _Slot:
    """The jobs behind one Sandbox (or one shared group): `current` serves (or starts), `successor`
    starts to take over (a renewal, or the replacement of a dead job), `retiring` still carries an
    episode. At most two of them hold a job at any moment. `_cond` guards them; the keeper thread,
    the start threads and the sessions move them; nothing slow runs under it."""

    def __init__(self, name: str, new_provider: Callable[[], HFSandboxProvider], renew: bool,
                 renew_before_s: Optional[float]) -> None:
        self.name = name
        self.renew = renew
        self.renew_before_s = renew_before_s
        self._new_provider = new_provider
        # Entered as `with self._lock` (the C lock), never `with self._cond`: a Condition's __enter__ is Python code,
        # and a Ctrl-C or teardown signal raising just after its acquire left the slot locked for ever.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.current: Optional[_BackgroundStart] = None
        self.successor: Optional[_BackgroundStart] = None
        self.retiring: Optional[_BackgroundStart] = None
        self.stopped = False
        # The last failed start (a successor's, or a first one a reset gave up), raised to resets until
        # `retry_at`: no job starts before then, whoever asks.
        self.failed: Optional[_BackgroundStart] = None
        self.retry_at = 0.0
        self._retry_s = RENEW_RETRY_FIRST_S
        self._cancels: "set[threading.Event]" = set()  # its cancels in flight, set when done (also in _slot_cancels)
        self.last_start_s = 0.0  # how long this slot's last start took (create to ready)
        self._warned_short = False

    def begin(self) -> None:
        with self._lock:
            if self.current is None and not self.stopped:
                self.current = _BackgroundStart(self._new_provider(), self)
        with _slots_lock:
            _live_slots.add(self)
            if not _keeper:
                _keeper.append(threading.Thread(target=_keep_slots, name="hf-sandbox-slot-keeper",
                                                daemon=True))
                _start_thread(_keeper[0])
        _keeper_wake.set()

    def serving(self, timeout_s: Optional[float], hold: bool,
                closed: Optional[Callable[[], bool]] = None) -> _BackgroundStart:
        """The slot's current job once ready (counted as used when `hold`), starting one if none
        serves and none is coming. A failed first start raises its error (to a holder: the next one
        starts again after the retry backoff); a failed replacement raises its error until its retry
        time. `closed()` turning true (see `wake()`) raises SessionError at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self.stopped:
                    raise SessionError(_STOPPED)
                if closed is not None and closed():
                    raise SessionError(_CLOSED_WHILE_WAITING)
                current = self.current
                if current is not None and current.serving:
                    if hold:
                        current.users += 1
                    return current
                failed = current is not None and current.done and current.error is not None
                if failed and self.successor is None:
                    if hold:
                        self.current = None
                        self._failed_locked(current)
                    raise current.raisable()
                if self.successor is None and (current is None or current.dead is not None):
                    if self.failed is not None and time.monotonic() < self.retry_at:
                        raise self.failed.raisable()  # within the backoff: no start, however many resets ask
                    self._replace_locked("a reset found no job serving")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    waited = self.successor or self.current
                    job_id = waited.provider.job_id if waited is not None else None
                    raise JobStartTimeout("sandbox job %s still starting after %gs; the start goes on"
                                          % (job_id or "(being created)", timeout_s), job_id, None)
                self._cond.wait(remaining)

    def wake(self) -> None:
        """Wake the resets waiting in `serving()`, so they look at their `closed()` again."""
        with self._lock:
            self._cond.notify_all()

    def release(self, start: _BackgroundStart) -> None:
        """An episode on `start` ended: a job the slot has moved on from goes once none uses it."""
        cancel = None
        try:
            with self._lock:
                start.users -= 1
                if start is self.retiring and start.users <= 0:
                    self.retiring, cancel = None, self._cancel_thread(start, "no episode uses it any more")
        finally:  # (a cancel listed is always started, or marked done: a stop waits for it)
            if cancel is not None:
                self._start_cancel(cancel)

    def report_dead(self, start: _BackgroundStart, why: str) -> None:
        """`start`'s job is gone: its sessions lose their episode, and a current job is replaced at
        once (with renew=False, by the next reset)."""
        cancel = None
        try:
            with self._lock:
                if start.dead is not None or self.stopped:
                    return
                start.dead = why
                sessions = list(start.sessions)
                if start is self.retiring:
                    self.retiring, cancel = None, self._cancel_thread(start, "it ended")
                elif start is self.current:
                    if self.successor is not None:
                        cancel = self._cancel_thread(start, "it ended")  # the renewal under way is its replacement
                    elif self.renew:
                        self._replace_locked(why)
                self._cond.notify_all()
            logger.warning("slot %s: job %s ended (%s)%s", self.name, _ids(start), why,
                           "; its replacement is starting" if self.renew and cancel is None else "")
            for session in sessions:
                session._job_died(start)
        finally:  # (as in release)
            if cancel is not None:
                self._start_cancel(cancel)
        _keeper_wake.set()

    def replace_if_lost(self) -> None:
        """Sandbox.restart() of a shared group: replace it unless a job of it still serves or a
        replacement is under way (however many environments ask)."""
        with self._lock:
            current, coming = self.current, self.successor is not None
        if coming or (current is not None and not current.done):
            return
        if current is not None and current.serving:
            if _group_serves(current):
                return
            self.report_dead(current, "restart(): no job of the group serves")  # renew=True replaces it
        with self._lock:
            serving = self.current is not None and self.current.serving
            if not self.stopped and self.successor is None and not serving:
                self._replace_locked("restart()")

    def stop(self, wait_s: float = BACKGROUND_STOP_WAIT_S) -> None:
        """Cancel every job of the slot (starting ones too) and wait until each is released."""
        with self._lock:
            self.stopped = True
            starts = [s for s in (self.current, self.successor, self.retiring) if s is not None]
            self.current = self.successor = self.retiring = None
            self._cond.notify_all()
        with _slots_lock:
            _live_slots.discard(self)
        with _background_lock:
            cancels = list(self._cancels)  # jobs it was done with: their cancels count as its own
        _in_parallel([lambda start=start: start.stop(wait_s) for start in starts]
                     + [lambda done=done: done.wait(wait_s) for done in cancels], wait_s)

    def tend(self, now: float) -> float:
        """The keeper's turn: see the watcher's news, begin a renewal that is due. Returns when the
        slot needs its next turn."""
        with self._lock:
            if self.stopped or not self.renew:
                return float("inf")
            starts = [s for s in (self.current, self.retiring) if s is not None and s.serving]
        for start in starts:
            self._see(start, now)
        with self._lock:
            current = self.current
            if (self.stopped or current is None or not current.done or current.error is not None
                    or self.successor is not None):
                return float("inf")
            if current.dead is not None or self.retiring is not None:  # a dead one: its retry time
                due = self.retry_at if current.dead is not None else now + KEEPER_MAX_SLEEP_S
            else:
                due = max(self._renew_at(current, now), self.retry_at)
            if now < due:
                return due
            if current.dead is not None:
                self._replace_locked(current.dead)
            else:
                self._replace_locked(current.renew_now or "renewal: its job_timeout ends in %.0fs"
                                     % (current.deadline - now))
            return float("inf")

    # -- machinery --------------------------------------------------------------------------------

    def _replace_locked(self, why: str) -> None:
        """Start the job that takes over (under the lock): the first one, or a successor (a dead
        current job is cancelled first, so the slot never holds three)."""
        current = self.current
        if current is None:
            self.current = start = _BackgroundStart(self._new_provider(), self)
        else:
            first = current.stop if current.dead is not None or current.error is not None else None
            self.successor = start = _BackgroundStart(self._new_provider(), self, first)
            start.replaces = current.provider.job_ids
        start.why = why
        logger.info("slot %s: starting a job (%s)", self.name, why)

    def _start_ended(self, start: _BackgroundStart) -> None:
        """A start of this slot ended: a successor takes over, or its failure is kept for retries."""
        cancel = None
        try:
            with self._lock:
                if start.error is None:
                    self.last_start_s = (start.ready_at or start.began) - start.began
                    lifetime = start.deadline - start.began
                    start.jitter = random.uniform(0.0, RENEW_SPREAD_FRACTION * lifetime)
                if start.error is None and start in (self.current, self.successor):
                    self.failed, self.retry_at, self._retry_s = None, 0.0, RENEW_RETRY_FIRST_S
                if start is self.successor:
                    self.successor = None
                    if start.error is not None:
                        logger.warning("slot %s: starting the job to take over from %s failed (%s); "
                                       "trying again in %gs", self.name, ", ".join(start.replaces) or "?",
                                       _core._first_line(start.error), self._retry_s)
                        self._failed_locked(start)
                    else:
                        old, self.current = self.current, start
                        if old is not None and (old.dead is not None or old.users <= 0):
                            cancel = self._cancel_thread(old, "it ended" if old.dead else "its successor serves")
                        elif old is not None:
                            self.retiring = old
                        logger.info("slot %s: job %s -> job %s (%s)", self.name,
                                    ", ".join(start.replaces) or "?", _ids(start), start.why)
                self._cond.notify_all()
        finally:  # (as in release)
            if cancel is not None:
                self._start_cancel(cancel)
        _keeper_wake.set()

    def _failed_locked(self, start: _BackgroundStart) -> None:
        """`start` failed: the next start waits the backoff (RENEW_RETRY_FIRST_S doubling to the cap)."""
        self.failed = start
        self.retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(RENEW_RETRY_CAP_S, self._retry_s * 2)

    def _renew_at(self, start: _BackgroundStart, now: float) -> float:
        """When `start`'s successor is due: a lead (the setting, or twice the last start plus a
        margin) and the job's jitter before its lifetime ends, but not before it served half of it."""
        if start.renew_now is not None:
            return now
        lead = self.renew_before_s
        if lead is None:
            lead = max(RENEW_LEAD_FLOOR_S, RENEW_START_FACTOR * self.last_start_s + RENEW_MARGIN_S)
        earliest = start.began + RENEW_EARLIEST_FRACTION * (start.deadline - start.began)
        due = start.deadline - lead - start.jitter
        if due < earliest and not self._warned_short:
            self._warned_short = True
            logger.warning("slot %s: job_timeout=%s is short for starts of %.1fs: each job is renewed "
                           "after half its lifetime and its successor may not be ready in time; raise "
                           "job_timeout", self.name, start.provider.job_timeout, self.last_start_s)
        return max(due, earliest)

    def _see(self, start: _BackgroundStart, now: float) -> None:
        """Read the job watcher's latest answers for `start`'s job(s): all ended is a dead job, some
        (replicas) a renewal now; a pooled sandbox also ends with its host's lifetime."""
        if not start.watches:
            _watch(start)
        ended = []
        for watch in start.watches:
            job, error = watch.job, watch.error
            stage = (job.get("status") or {}).get("stage") if job else None
            if stage in _core.TERMINAL_STAGES:
                ended.append("%s %s" % (watch.job_id, stage))
            elif getattr(error, "status_code", None) == 404:
                ended.append("%s not found" % watch.job_id)
            elif error is not None:  # the refresh failed for good (API trouble): watch again
                _unwatch(start)
                return
            if job and start.provider.pool is not None:
                start.deadline = min(start.deadline, _host_deadline(job, now))
        if ended and len(ended) == len(start.watches):
            self.report_dead(start, "the job watcher saw " + ", ".join(ended))
        elif ended and start.renew_now is None:
            start.renew_now = "replacing the group early: " + ", ".join(ended)

    def _cancel_thread(self, start: _BackgroundStart, why: str) -> Tuple[threading.Thread, threading.Event]:
        """The thread that cancels a job the slot is done with (a cancel is an API call), and the event it sets when
        done, listed at once so that a stop from now on waits for it, even before `_start_cancel`: made under the
        slot's lock where the job leaves the slot (a stop that ran between the two found it in neither, and
        returned with the job running)."""
        job_ids, done = _ids(start), threading.Event()

        def cancel() -> None:
            try:
                start.stop()
                logger.info("slot %s: job %s cancelled (%s)", self.name, job_ids, why)
            finally:
                self._cancel_done(done)
        thread = threading.Thread(target=cancel, name="hf-sandbox-slot-cancel", daemon=True)
        with _background_lock:
            _slot_cancels.add(done)
            self._cancels.add(done)
        return thread, done

    def _start_cancel(self, cancel: Tuple[threading.Thread, threading.Event]) -> None:
        try:
            _start_thread(cancel[0])
        except BaseException:
            self._cancel_done(cancel[1])
            raise

    def _cancel_done(self, done: threading.Event) -> None:
        with _background_lock:
            _slot_cancels.discard(done)
            self._cancels.discard(done)
        done.set()


def _keep_slots() -> None:
    """The keeper thread: tends every live slot at its due time (or when woken); ends with the last."""
    while True:
        due = _tend_slots()
        if due is None:
            return
        _keeper_wake.wait(max(0.0, due - time.monotonic()))


def _tend_slots() -> Optional[float]:
    """One turn of the keeper over every live slot: when the next is due, or None (and the keeper
    ends) when none is left. The slots are referenced only during the turn, so a dropped one goes."""
    with _slots_lock:
        slots = list(_live_slots)
        if not slots:
            _keeper.clear()
            return None
    _keeper_wake.clear()
    now = time.monotonic()
    due = now + KEEPER_MAX_SLEEP_S
    for slot in slots:
        try:
            due = min(due, slot.tend(now))
        except Exception:  # one slot's trouble must not stop the others' renewals
            logger.error("slot %s: unexpected error while tending it:\n%s", slot.name, traceback.format_exc())
    return due


def _watch(start: _BackgroundStart) -> None:
    """Register `start`'s job(s) with the core's job watcher (a pooled sandbox: its host job); the
    watcher wakes the keeper when one changes stage."""
    provider = start.provider
    pooled = getattr(provider, "_pooled", None)
    job_ids = provider.job_ids if pooled is None else [pooled.host_id] if pooled.host_id else []
    token, namespace = provider._resolve_token(), provider._job_namespace or ""
    start.watches = [_core._watcher.register(provider.endpoint, token, provider._new_session,
                                             namespace, job_id, SLOT_WATCH_INTERVAL_S, _keeper_wake,
                                             since=start.began) for job_id in job_ids]
    weakref.finalize(start, _unregister, list(start.watches))  # a start collected unstopped too
    if start._stopped:  # stopped meanwhile: its stop may have unwatched before these were recorded
        _unwatch(start)


def _unwatch(start: _BackgroundStart) -> None:
    watches, start.watches = start.watches, []
    _unregister(watches)


def _unregister(watches: List[Any]) -> None:
    for watch in watches:
        _core._watcher.unregister(watch)


def _answers_health(base_url: str, read_timeout_s: Optional[float] = None) -> bool:
    """Whether the job behind `base_url` still answers /health with 200 (through the local proxy), its
    answer awaited the core's probe timeout or, when shorter, `read_timeout_s`. A probe that could not
    connect to a proxy child being replaced is made again on the new child: a wrong "no" replaces a
    healthy job."""
    connect_s, read_s = _core.HEALTH_PROBE_TIMEOUT_S
    if read_timeout_s is not None:
        read_s = min(read_s, read_timeout_s)
    url = base_url.rstrip("/") + "/health"
    with requests.Session() as session:
        session.trust_env = False  # loopback proxy: never through HTTP(S)_PROXY
        try:
            try:
                return session.get(url, timeout=(connect_s, read_s)).status_code == 200
            except requests.ConnectionError:
                if not _replaced_proxy_waited(base_url):
                    raise
            return session.get(url, timeout=(connect_s, read_s)).status_code == 200
        except requests.RequestException:
            return False


def _host_deadline(job: Mapping[str, Any], now: float) -> float:
    """When a pooled sandbox's host job ends at the latest (its creation plus its timeout), on the
    monotonic clock; infinity when its answer has no creation time."""
    created = str(job.get("createdAt") or "")
    try:
        began = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return float("inf")
    lifetime = float(job.get("timeoutSeconds") or POOL_HOST_LIFETIME_S)
    if began.tzinfo is None:
        began = began.replace(tzinfo=datetime.timezone.utc)
    left = (began - datetime.datetime.now(datetime.timezone.utc)).total_seconds() + lifetime
    return now + left


class _SlotSession(EnvSession):
    """The `EnvSession` of `Sandbox.session()`: it follows its slot's jobs. Each `reset()` begins
    the episode on the slot's current job (reconnecting when the slot moved on, waiting only when no
    job is ready); a job lost mid-episode raises `EpisodeLost` and the next `reset()` works again."""

    def __init__(self, sandbox: "Sandbox", timeout_s: float,
                 wait_timeout_s: Optional[float]) -> None:
        # No connection yet: one is opened per job, at the first message on it.
        _raise_if_rejected(_positive_number_rejection("timeout_s", timeout_s))
        self._sandbox = sandbox
        self.timeout_s = float(timeout_s)
        self._wait_timeout_s = wait_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._conn: Optional[EnvSession] = None
        self._job: Optional[_BackgroundStart] = None  # the job `_conn` runs on
        self._held = False  # an episode runs on `_job` (counted in its users)
        self._lost: Optional[str] = None  # why the episode was lost, until the next reset

    @property
    def where(self) -> str:  # type: ignore[override]  # the job under it changes
        conn = self._conn
        return conn.where if conn is not None else "a sandbox slot"

    def exchange(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        _raise_if_rejected(_message_rejection(message))
        with self._lock:
            if self._closed:
                raise SessionError("this EnvSession is closed (close() ran); open a new one with "
                                   "Sandbox.session()")
            if message.get("type") == "reset" or (self._conn is None and self._lost is None):
                return self._begin_episode(message)
            if self._lost is not None:
                raise EpisodeLost("the episode was lost (%s); call reset() to begin the next one"
                                  % self._lost)
            return self._continue_episode(message)

    def close(self) -> None:
        """End the episode and close the connection; idempotent, never raises. While another thread
        waits for a reply it shuts the connection down, so that thread gets `EpisodeLost` at once."""
        if not self._lock.acquire(blocking=False):
            self._closed = True
            conn = self._conn
            if conn is not None:
                conn._break()
            slot = self._sandbox._slot
            if slot is not None:  # a reset waiting for the slot's job ends now, not after the cold start
                slot.wake()
            return
        try:
            self._closed = True
            self._drop_connection(polite=True)
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        job = self._job
        return "<EnvSession of a Sandbox slot on job %s%s>" % (
            job.provider.job_id if job is not None else None, " closed" if self._closed else "")

    def _begin_episode(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        slot = self._sandbox._slot_for_sessions()
        if self._job is not None and self._job is not slot.current:
            self._drop_connection()  # the slot moved on: off the old job before it may be cancelled
        self._end_episode()
        self._lost = None
        error: Optional[BaseException] = None
        deadline = None if self._wait_timeout_s is None else time.monotonic() + self._wait_timeout_s
        retried: Optional[_BackgroundStart] = None  # (replicas) the group tried again after a 404: once per group
        for _ in range(SLOT_RESET_ATTEMPTS):  # wait_timeout_s bounds the reset's waits together, not each
            job = slot.serving(None if deadline is None else max(0.0, deadline - time.monotonic()), hold=True,
                               closed=lambda: self._closed)
            if job is not self._job or self._conn is None or self._conn.closed:
                self._drop_connection()  # holds nothing here: ended above or in the last pass
                self._job = job
            self._held = True
            if self._conn is None:
                if self._closed:  # close() ran since serving() returned: open nothing
                    self._drop_connection()
                    raise SessionError(_CLOSED_WHILE_WAITING)
                # The upgrade waits no longer than a reply would: a frozen job must not cost 30 s a reset.
                upgrade_s, upgrade_began = min(SESSION_CONNECT_TIMEOUT_S, self.timeout_s), time.monotonic()
                try:
                    self._conn = EnvSession(job.base_url or "", timeout_s=self.timeout_s, connect_timeout_s=upgrade_s)
                except SessionRefusedError as exc:
                    self._end_episode()
                    if exc.proxy_error in JOB_GONE_PROXY_ERRORS:
                        slot.report_dead(job, "the proxy refused a session: %s" % exc.proxy_error)
                    elif exc.proxy_error == "proxy-busy":  # the proxy sheds load, the job is fine: try again
                        time.sleep(PROXY_BUSY_RETRY_S)
                    elif exc.proxy_error is None and exc.status_code in JOB_GONE_STATUSES and job.provider.replicas > 1:
                        ended = [stage in _core.TERMINAL_STAGES
                                 for stage in _replica_stages(job, upgrade_began)]
                        if not any(ended) or (retried is job and not all(ended)):
                            raise  # every job runs (or the Jobs API could not say): the environment's own answer
                        if all(ended):
                            slot.report_dead(job, "the upgrade got HTTP %d and every job of the group ended"
                                             % exc.status_code)
                        retried = job  # (once: the jobs that ended have left the route, try the others)
                    elif (exc.proxy_error is None and exc.status_code in JOB_GONE_STATUSES
                          and not _answers_health(job.base_url or "")):
                        slot.report_dead(job, "the upgrade got HTTP %d and /health no 200" % exc.status_code)
                    elif exc.status_code < 500 or (exc.proxy_error not in (None, "upstream-timeout") and not (
                            exc.proxy_error == "proxy-stopping" and _own_proxy_runs(job.base_url or ""))):
                        raise  # not the job's death (a setting, the proxy, the request): the caller's to see
                    elif not _answers_health(job.base_url or ""):
                        # e.g. a pooled sandbox whose server died (its host answers for it), or a frozen job
                        slot.report_dead(job, "the upgrade got HTTP %d%s and /health no 200" % (
                            exc.status_code, " (%s)" % exc.proxy_error if exc.proxy_error else ""))
                    else:  # the environment itself refused, or is slow but alive
                        raise
                    error = exc
                    continue
                except SessionTimeout as exc:
                    self._end_episode()
                    if not self._gone_after_timeout(slot, job, "no answer to the WebSocket upgrade within %gs"
                                                    % upgrade_s, self.timeout_s):
                        raise  # slow but alive: replacing it would cancel a healthy job
                    error = exc
                    continue
                except SessionError as exc:  # refused or cut by the proxy: its child is being replaced?
                    self._end_episode()
                    if not _replaced_proxy_waited(job.base_url or ""):
                        raise
                    error = exc
                    continue
                except BaseException:
                    self._end_episode()
                    raise
                job.sessions.add(self)
            if self._closed:  # close() ran in another thread while this reset connected: hold nothing
                self._drop_connection()
                raise SessionError(_CLOSED_WHILE_WAITING)
            self._conn.timeout_s = self.timeout_s  # set by the user since the connection opened, maybe
            try:
                return self._conn.exchange(message)
            except SessionTimeout as exc:
                self._drop_connection()  # (the session closed itself: a late reply must answer nothing)
                if not self._gone_after_timeout(slot, job, "no answer to a reset within %gs" % self.timeout_s,
                                                self.timeout_s):
                    raise
                error = exc
            except SessionError as exc:  # a kept connection closed since (job or proxy): reconnect
                self._drop_connection()
                error = exc
        assert error is not None
        raise error

    @staticmethod
    def _gone_after_timeout(slot: _Slot, job: _BackgroundStart, what: str, timeout_s: float) -> bool:
        """After a timeout on `job`: whether the reset tries again on the slot's job. True (and the job
        reported dead, so the slot replaces it as a killed one) when its /health does not answer 200 either
        (within `timeout_s`, at least HEALTH_AFTER_TIMEOUT_FLOOR_S), e.g. a frozen server; True when the
        slot has moved on from it; False when it still answers (slow, not gone: the timeout is raised)."""
        if job.dead is not None or job is not slot.current:  # seen dead meanwhile, or the slot moved on: retry
            return True
        if _answers_health(job.base_url or "", max(timeout_s, HEALTH_AFTER_TIMEOUT_FLOOR_S)):
            return False
        slot.report_dead(job, "%s and /health no 200 (frozen?)" % what)
        return True

    def _continue_episode(self, message: Mapping[str, Any]) -> Dict[str, Any]:
        assert self._conn is not None
        job = self._job
        self._conn.timeout_s = self.timeout_s
        try:
            reply = self._conn.exchange(message)
        except SessionError as exc:
            self._lost = (job.dead if job is not None else None) or str(exc)
            self._drop_connection()
            lost = _EpisodeTimedOut if isinstance(exc, SessionTimeout) else EpisodeLost
            raise lost("the episode on job %s was lost: %s; call reset() to begin the next "
                       "one" % (_ids(job) if job is not None else "?", self._lost)) from exc
        data = reply.get("data")
        if message.get("type") == "step" and isinstance(data, dict) and data.get("done"):
            self._end_episode()  # the job may go now; the connection stays for the next reset
        return reply

    def _end_episode(self) -> None:
        job, held, self._held = self._job, self._held, False
        if held and job is not None and (slot := job.slot) is not None:
            slot.release(job)

    def _drop_connection(self, polite: bool = False) -> None:
        """End the episode and let go of the connection, closing it before the job is released (which
        may cancel it): with OpenEnv's close handshake when the user closes the session, else at once
        (a reset moving to another job must not wait on the old one's answer)."""
        conn = self._conn
        if conn is not None:
            if not polite:
                conn._break()
            conn.close()
        self._end_episode()
        self._conn = self._job = None

    def _job_died(self, job: _BackgroundStart) -> None:
        """From the slot (another thread): `job` is gone; a step on it fails at once, not later."""
        conn = self._conn
        if self._job is job and conn is not None:
            conn._break()


# -- Sandbox: what an environment object holds --------------------------------------------------------

_shared_lock = threading.Lock()
# A Sandbox's first use from two threads at once (wait(), session()) must begin one slot, not two: the
# other's job would run unseen by its stop(). Taken before any other lock.
_begin_lock = threading.Lock()
# name -> (settings the group was made with, its slot); one group of replicas=K jobs per name.
_shared_slots: Dict[str, Tuple[Tuple[Any, ...], _Slot]] = {}
# Every provider a Sandbox started in this process (for stop_sandboxes()).
_sandbox_providers: "weakref.WeakSet[HFSandboxProvider]" = weakref.WeakSet()


def _new_provider(image: Optional[str], provider_kwargs: Dict[str, Any]) -> HFSandboxProvider:
    provider = HFSandboxProvider(image, **provider_kwargs)
    with _background_lock:  # (stop_sandboxes() lists them under it: a WeakSet must not change meanwhile)
        _sandbox_providers.add(provider)
    return provider


class Sandbox:
    """An environment's remote sandbox (a rollout slot): begun in the background when built, waited
    for only when used, renewed before its job's lifetime ends and replaced when its job dies.

    `Sandbox(image, **provider_kwargs)` starts its job in a background thread; `session()` gives an
    `EnvSession` that follows the slot's jobs (each reset on the current one; `EpisodeLost` when a
    job dies mid-episode). `shared="name"`: every Sandbox of the process with that name uses one
    slot (`replicas=K` jobs). `renew=False`: no successor before the lifetime ends, no replacement
    until a reset needs one. `stop_sandboxes()` cancels them all. See docs/training.md.
    """

    def __init__(self, image: Optional[str] = None, *, shared: Optional[str] = None,
                 begin: bool = True, renew: bool = True, renew_before_s: Optional[float] = None,
                 **provider_kwargs: Any) -> None:
        if shared is not None and (not isinstance(shared, str) or not shared):
            raise SandboxConfigError("shared=%r must be a non-empty name (environments with the same name "
                                     "share one group of jobs)" % (shared,))
        if not isinstance(renew, bool):
            raise SandboxConfigError("renew=%r must be True (renew jobs before their lifetime ends, "
                                     "replace dead ones at once) or False" % (renew,))
        if renew_before_s is not None:
            _raise_if_rejected(_positive_number_rejection("renew_before_s", renew_before_s))
        if "proxy" in provider_kwargs and not isinstance(provider_kwargs["proxy"], str):  # "process" travels
            raise SandboxConfigError("Sandbox uses the process-wide proxy (a proxy object cannot travel with a "
                                     "pickled environment); leave out proxy=, or pass proxy=\"process\"")
        # Bad settings and a missing token fail here, in the caller's thread, before any thread or job.
        HFSandboxProvider(image, **provider_kwargs)._resolve_token()
        self.image = image
        self.shared = shared
        self.renew = renew
        self.renew_before_s = renew_before_s
        self._provider_kwargs = dict(provider_kwargs)
        self._slot: Optional[_Slot] = None
        if begin:
            self.begin()

    def begin(self) -> "Sandbox":
        """Begin the start in the background. A no-op once begun (a failed start keeps raising its error
        until `restart()`); a stopped sandbox starts a new job."""
        if self._slot is not None and not self._slot.stopped:
            return self
        with _begin_lock:
            slot = self._slot
            if slot is not None and not slot.stopped:  # another thread began it meanwhile
                return self
            if self.shared is not None:
                slot = self._slot = _shared_slot(self.shared, self._settings_key(), self._new_slot)
            else:
                slot = self._slot = self._new_slot()
        slot.begin()
        return self

    def wait(self, timeout_s: Optional[float] = None) -> str:
        """Begin if needed and block until the slot's current job answers /health; returns its base
        URL or raises what the start raised. `timeout_s` bounds this wait only (`JobStartTimeout`;
        the start goes on)."""
        _raise_if_rejected(_optional_seconds_rejection("timeout_s", timeout_s))
        self.begin()
        assert self._slot is not None
        return self._slot.serving(timeout_s, hold=False).base_url or ""

    def session(self, *, timeout_s: float = SESSION_TIMEOUT_S, wait_timeout_s: Optional[float] = None) -> EnvSession:
        """`wait()`, then an `EnvSession` that follows this slot's jobs (one per rollout slot): each
        `reset()` runs on the current job; a job that dies mid-episode raises `EpisodeLost`."""
        _raise_if_rejected(_positive_number_rejection("timeout_s", timeout_s)
                           or _optional_seconds_rejection("wait_timeout_s", wait_timeout_s))
        self.wait(wait_timeout_s)
        return _SlotSession(self, timeout_s, wait_timeout_s)

    def restart(self) -> "Sandbox":
        """Replace a lost job now. A shared group is replaced once none of its jobs serves, however
        many of its environments ask (the others adopt the new one)."""
        if self.shared is not None and self._slot is not None and not self._slot.stopped:
            self._slot.replace_if_lost()
        else:
            self.stop()
            self.begin()
        return self

    def stop(self) -> None:
        """Cancel this sandbox's own jobs (mid-start, successors and replacements too) and wait until
        they are released; a shared sandbox lets go of its group, which runs on for the others.
        Idempotent; never raises."""
        with _begin_lock:
            slot, self._slot = self._slot, None
        if slot is not None and self.shared is None:
            slot.stop()

    @property
    def provider(self) -> Optional[HFSandboxProvider]:
        """The provider of the slot's current job (None before it begins)."""
        slot = self._slot
        current = slot.current if slot is not None else None
        return current.provider if current is not None else None

    @property
    def ready(self) -> bool:
        """True when the slot's current job answered /health: episodes can begin on it at once."""
        slot = self._slot
        return slot is not None and slot.current is not None and slot.current.serving

    @property
    def job_ids(self) -> List[str]:
        """The job(s) serving this sandbox now (K for a shared group with replicas=K; empty before
        a start)."""
        provider = self.provider
        return provider.job_ids if provider is not None else []

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        slot = self._slot
        current = slot.current if slot is not None else None
        state = "not begun" if current is None else ("ready" if current.serving else (
            "failed" if current.done else "starting"))
        return "<Sandbox image=%r%s %s jobs=%r>" % (self.image, " shared=%r" % self.shared if self.shared else "",
                                                    state, self.job_ids)

    def __getstate__(self) -> Dict[str, Any]:
        if self.shared is None and self._slot is not None and not self._slot.stopped:
            raise TypeError("cannot pickle a Sandbox that has begun its job (%s): build it with begin=False, or "
                            "pickle the environment factory instead (each process then starts its own)"
                            % (_ids(self._slot.current) if self._slot.current else "being created"))
        return dict(self.__dict__, _slot=None)

    def _settings_key(self) -> Tuple[Any, ...]:
        return (self.image, self.renew, self.renew_before_s, _canonical(self._provider_kwargs))

    def _new_slot(self) -> _Slot:
        name = "shared %r" % self.shared if self.shared is not None else str(next(_slot_numbers))
        # (not a bound method: a slot holding its Sandbox would keep a dropped one alive)
        return _Slot(name, functools.partial(_new_provider, self.image, dict(self._provider_kwargs)), self.renew,
                     self.renew_before_s)

    def _slot_for_sessions(self) -> _Slot:
        slot = self._slot
        if slot is None or slot.stopped:
            raise SessionError(_STOPPED)
        return slot


def _canonical(value: Any) -> Any:
    """A comparable form of a setting: mappings by sorted items (their order does not matter), lists
    and tuples item by item, sets sorted, anything else by repr."""
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted(((repr(k), _canonical(v)) for k, v in value.items()),
                                        key=lambda item: item[0])))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_canonical(item) for item in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_canonical(item) for item in value), key=repr)))
    return repr(value)


def _replica_stages(start: _BackgroundStart, since: float) -> List[Optional[str]]:
    """The stage of each job of a group of replicas, asked of the Jobs API (one call each; the provider takes a
    job that ended out of the route) unless asked since `since` (when the failed upgrade began): the sessions
    that failed meanwhile take that answer. [] when it cannot be asked (stopped or replaced meanwhile); the last
    answer when another session's question holds the group past SESSION_CONNECT_TIMEOUT_S."""
    if not start.stages_lock.acquire(timeout=SESSION_CONNECT_TIMEOUT_S):
        return start.stages[1]
    try:
        if start.stages[0] < since:
            asked_at = time.monotonic()
            try:
                stages = [entry["stage"] for entry in start.provider.replica_status(refresh=True)]
            except Exception:
                stages = []
            start.stages = (asked_at, stages)
        return start.stages[1]
    finally:
        start.stages_lock.release()


def _group_serves(start: Optional[_BackgroundStart]) -> bool:
    """Whether a shared group still has a job serving: its one job's /health, or with replicas the Jobs
    API about each."""
    if start is None or not start.done or start.error is not None:
        return False
    if start.provider.replicas <= 1:
        return _answers_health(start.base_url or "")
    try:
        status = start.provider.replica_status(refresh=True)
    except Exception:  # stopped or replaced meanwhile
        return False
    return any(entry["healthy"] and entry["stage"] == "RUNNING" for entry in status)


def _shared_slot(name: str, key: Tuple[Any, ...], new_slot: Callable[[], _Slot]) -> _Slot:
    """The slot of the shared group called `name`, made on first use (again once stopped)."""
    with _shared_lock:
        entry = _shared_slots.get(name)
        if entry is not None and entry[0] != key and not entry[1].stopped:
            raise SandboxConfigError("shared sandbox %r already runs with other settings; give environments with "
                                     "different images or settings different shared= names" % name)
        if entry is None or entry[1].stopped:
            entry = _shared_slots[name] = (key, new_slot())
        return entry[1]


def stop_sandboxes() -> None:
    """Cancel the jobs of every Sandbox of this process (own, shared, starting, successors and
    replacements) in parallel and wait until each is released, then close the named pools of pooled
    ones (their host jobs this process booted). Never raises. The explicit teardown for trainers that
    never close environments (TRL)."""
    _in_parallel([s.stop for s in _take_slots() + _listed(_background_starts)]
                 + [p.stop_container for p in _listed(_sandbox_providers)]
                 + [lambda d=d: d.wait(BACKGROUND_STOP_WAIT_S) for d in _listed(_slot_cancels)])
    pools = _pool_layer()
    if pools is not None:
        pools.close_pools()


def _pool_layer() -> Any:
    """The pool layer's module when it is loaded (only once something used pool=), else None."""
    return sys.modules.get(__name__.rpartition(".")[0] + ".hf_sandbox_pool" if __package__ else "hf_sandbox_pool")


def _take_slots() -> List[_Slot]:
    """Every live slot (shared groups forgotten: the next use starts a new one)."""
    with _shared_lock:
        shared = list(_shared_slots.values())  # held while listed: forgotten, a group nobody uses would go at once
        _shared_slots.clear()
    with _slots_lock:
        slots = list(_live_slots)
    del shared
    return slots


def _listed(guarded: Iterable[Any]) -> List[Any]:
    """A copy of a set `_background_lock` guards: the starts in flight, the providers, the slots' cancels."""
    with _background_lock:
        return list(guarded)


def _teardown_process(budget_s: float, interrupted: Optional[int] = None) -> None:
    """Cancel every job this process runs or is starting, in parallel, within `budget_s`: every
    slot, background starts (waiting for creates in flight), then every provider's safety net.
    `interrupted`: the thread a signal interrupted, whose create in flight cannot end meanwhile."""
    deadline = time.monotonic() + budget_s
    # The named pools' closes go first, in a thread of their own (one waiting for a create in flight must not hold
    # up the batches below): their sandboxes' releases wait briefly for those host cancels instead of racing them.
    pools = _pool_layer()
    pool_closes = pools._closes_first(budget_s) if pools is not None else []
    closes = threading.Thread(target=_in_parallel, args=(pool_closes, budget_s), name="hf-sandbox-stop", daemon=True)
    try:
        _start_thread(closes)
    except RuntimeError:  # no thread to spare: they lead the batches below
        safety_nets = list(pool_closes)
    else:
        safety_nets = []
    safety_nets += _core._reaper.now()  # each cancels one running job at most once, provider or not
    # The slots and starts come from under locks an interrupted main thread may hold (a signal's teardown):
    # they are listed in a thread of their own, so the safety nets, which take none, go out meanwhile.
    _in_parallel(safety_nets + [lambda: _in_parallel(_stops(budget_s), budget_s)], budget_s)
    _in_parallel(_core._reaper.now(), max(0.0, deadline - time.monotonic()))  # jobs recorded meanwhile
    # Creates and cancels still under way (start_many's, a user's threads'): waited for, rescued, or named;
    # then the safety nets of the jobs those creates recorded meanwhile.
    _core._settle(max(0.0, deadline - time.monotonic()), stuck=interrupted)
    _in_parallel(_core._reaper.now(), max(0.0, deadline - time.monotonic()))
    if closes.ident is not None:
        closes.join(max(0.0, deadline - time.monotonic()))
    if pools is not None:  # a start made during the teardown found its pool closed; one made after makes a new pool
        pools._forget_closed()


def _stop_background_starts_at_exit() -> None:
    """At exit, before the provider's own exit hook (atexit runs in reverse order): stop the slots
    (no renewal may begin now) and end the background starts in flight, whose daemon threads would
    otherwise die with a create unanswered."""
    stops = _stops(EXIT_TEARDOWN_BUDGET_S)
    if stops:
        _in_parallel(stops, EXIT_TEARDOWN_BUDGET_S)


atexit.register(_stop_background_starts_at_exit)


def _stops(wait_s: float) -> List[Callable[[], None]]:
    """Stopping every slot and every start in flight, each waiting up to `wait_s`."""
    stoppable: List[Any] = _take_slots() + _listed(_background_starts)
    return ([lambda s=s: s.stop(wait_s) for s in stoppable]
            + [lambda d=d: d.wait(wait_s) for d in _listed(_slot_cancels)])


def _reset_sandboxes_after_fork() -> None:
    """A forked child has none of the parent's threads and owns none of its jobs: every inherited slot is
    stopped for the child without cancelling anything (an inherited Sandbox starts its own job at its next
    use), so stop(), stop_sandboxes(), the signal teardown and the exit hook reach only what the child starts."""
    global _background_lock, _shared_lock, _begin_lock, _background_slots, _slots_lock, _keeper_wake
    global _signal_teardown_active
    for slot in set(_live_slots) | {entry[1] for entry in _shared_slots.values()}:
        _disown_in_child(slot)
    _sandbox_providers.clear()
    _signal_teardown_active = threading.Event()  # a fork during the parent's teardown must not absorb the child's
    _background_lock, _shared_lock, _begin_lock = threading.Lock(), threading.Lock(), threading.Lock()
    _slots_lock = threading.Lock()
    _background_slots = threading.BoundedSemaphore(BACKGROUND_MAX_PARALLEL)
    _keeper_wake = threading.Event()
    _background_starts.clear()
    _slot_cancels.clear()
    _shared_slots.clear()
    _live_slots.clear()
    _keeper.clear()


def _disown_in_child(slot: _Slot) -> None:
    """After a fork: `slot` is the parent's. Stopped here without its lock (held at the fork, it stays held)
    and without a cancel; its sessions let go of their connections, which are the parent's sockets too."""
    starts = [start for start in (slot.current, slot.successor, slot.retiring) if start is not None]
    slot._lock = threading.Lock()
    slot._cond = threading.Condition(slot._lock)
    slot.stopped = True
    slot.current = slot.successor = slot.retiring = None
    slot._cancels = set()
    for start in starts:
        start.watches = []  # registered with the parent's job watcher, which the child does not have
        for session in list(start.sessions):
            session._lock = threading.Lock()
            session._conn = session._job = None  # not closed: a close frame would end the parent's session
            session._held, session._lost = False, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_sandboxes_after_fork)


# -- teardown on SIGTERM / SIGHUP ---------------------------------------------------------------------

# signal number -> the disposition it had before install_signal_teardown() (restored on uninstall).
_signal_previous: Dict[int, Any] = {}
_signal_teardown_active = threading.Event()


def install_signal_teardown(signals: Optional[Sequence[int]] = None) -> bool:
    """Opt in: on SIGTERM or SIGHUP (or `signals`), cancel every job of this process, then let the signal
    do what it did before (a previous handler, or death by the signal). SIGTERM skips atexit: without
    this, jobs bill until `job_timeout`. Ignored signals are left alone. Main thread only (else False)."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("install_signal_teardown() called off the main thread: nothing installed (Python sets "
                     "signal handlers from the main thread only)")
        return False
    if signals is None:
        signals = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    for signum in _signal_numbers(signals):  # all checked before any is installed
        if signum in _signal_previous:
            continue  # installed already (possibly under a handler set later, which may chain to ours)
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            logger.debug("install_signal_teardown: signal %d is ignored by this process; left alone", signum)
            continue
        signal.signal(signum, _on_teardown_signal)
        _signal_previous[signum] = previous
    return bool(_signal_previous)


def _signal_numbers(signals: Any) -> List[int]:
    """`signals` as signal numbers a handler can be installed for; SandboxConfigError naming the first
    that is not one."""
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Iterable):
        raise SandboxConfigError("install_signal_teardown(signals=%r) takes a list of signal numbers, e.g. "
                                 "[signal.SIGTERM]" % (signals,))
    signals = list(signals)
    uncatchable = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
    for signum in signals:
        if (isinstance(signum, bool) or not isinstance(signum, int) or signum not in signal.valid_signals()
                or signum in uncatchable):
            raise SandboxConfigError("install_signal_teardown(signals=...): %r is not a signal a handler can be "
                                     "installed for (give numbers such as signal.SIGTERM; SIGKILL and SIGSTOP "
                                     "cannot be caught)" % (signum,))
    return [int(signum) for signum in signals]


def uninstall_signal_teardown() -> None:
    """Restore the dispositions install_signal_teardown() replaced (where ours is still the one set)."""
    if threading.current_thread() is not threading.main_thread():
        logger.debug("uninstall_signal_teardown() called off the main thread: nothing changed")
        return
    for signum, previous in list(_signal_previous.items()):
        if signal.getsignal(signum) is _on_teardown_signal:
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        else:  # someone installed their own on top of ours: theirs stays, and may still chain to ours
            logger.debug("uninstall_signal_teardown: signal %d has another handler now; left as is", signum)
        del _signal_previous[signum]


def _on_teardown_signal(signum: int, frame: Any) -> None:
    """Cancel every job within SIGNAL_TEARDOWN_BUDGET_S (in a helper thread: the interrupted main thread
    may hold a lock the teardown needs), then run the previous disposition. A second signal is absorbed."""
    if _signal_teardown_active.is_set():
        return
    _signal_teardown_active.set()
    try:
        logger.warning("signal %d: cancelling this process's HF jobs before it exits", signum)
        worker = threading.Thread(target=_teardown_process, args=(SIGNAL_TEARDOWN_BUDGET_S, threading.get_ident()),
                                  name="hf-sandbox-signal-teardown", daemon=True)
        try:
            _start_thread(worker)
        except RuntimeError:  # no thread to be had: the exit hooks cancel the jobs (they run inline)
            logger.warning("signal %d: no thread for the teardown; the exit hooks cancel the jobs", signum)
        else:
            worker.join(SIGNAL_TEARDOWN_BUDGET_S + 1.0)
        previous = _signal_previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous is not signal.SIG_IGN and worker.ident is None:  # dying of it would skip the exit hooks
            raise SystemExit(128 + signum)
        elif previous is not signal.SIG_IGN:  # SIG_DFL (or a handler set outside Python): die of the signal
            _signal_previous.pop(signum, None)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    finally:
        _signal_teardown_active.clear()
