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
import json
import os
import signal
import socket
import ssl
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Ping, RejectConnection, RejectData,
                            Request, TextMessage)

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
_live_finalizers = _core._live_finalizers  # the providers' safety nets (a set the core never rebinds)
logger = _core.logger  # one logger for the library: "hf_sandbox_provider"

__all__ = ["EnvSession", "SessionError", "SessionRefusedError", "SessionTimeout", "EnvError", "Sandbox",
           "stop_sandboxes", "install_signal_teardown", "uninstall_signal_teardown"]


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
        source = ("from the proxy (%s: the job is gone or not serving; start a new one)" % proxy_error
                  if proxy_error else "from the environment")
        super().__init__("the WebSocket was refused: HTTP %d %s%s" % (
            status_code, source, (": " + body) if body and not proxy_error else ""))


class SessionTimeout(SessionError, TimeoutError):
    """No reply (or handshake) within the timeout. The session is closed: a late reply would otherwise
    be read as the answer to the next request."""


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
                           or _session_url_rejection(base_url))
        parts = urlsplit(_session_url(base_url, path))
        # For messages and repr: scheme and host only. The path holds the proxy's route id, a secret.
        self.where = "%s://%s" % (parts.scheme, parts.netloc)
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._events: deque = deque()
        self._ws = WSConnection(ConnectionType.CLIENT)
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        deadline = time.monotonic() + float(connect_timeout_s)
        try:
            self._sock: Any = socket.create_connection((parts.hostname, port), timeout=float(connect_timeout_s))
        except socket.timeout:
            raise SessionTimeout("could not connect to %s within %gs" % (self.where, connect_timeout_s)) from None
        except OSError as exc:
            raise SessionError("could not connect to %s: %s (is the provider still running?)"
                               % (self.where, exc.strerror or exc)) from None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/reply frames
            if parts.scheme == "wss":
                self._sock = _session_tls_context(verify).wrap_socket(self._sock, server_hostname=parts.hostname)
            target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
            self._send(Request(host=parts.netloc, target=target))
            self._handshake(deadline)
        except BaseException:
            self._closed = True
            self._sock.close()
            raise

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
        text = json.dumps(message)
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

    @property
    def closed(self) -> bool:
        """True once close() ran or the session was lost."""
        return self._closed

    def close(self) -> None:
        """Send OpenEnv's `close` and a close frame, then release the socket; idempotent, never raises. While
        another thread waits for a reply it shuts the socket down, so that thread gets `SessionError` at once."""
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

    def _abort(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _handshake(self, deadline: float) -> None:
        event = self._next_event(deadline)
        if isinstance(event, RejectConnection):
            status, headers = event.status_code, {k.lower(): v for k, v in event.headers}
            body, more = b"", event.has_body
            while more:  # read the (small) body for the message
                data = self._next_event(deadline)
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
                    raw = "".join(parts) if isinstance(event, TextMessage) else b"".join(parts).decode("utf-8")
                    try:
                        reply = json.loads(raw)
                    except ValueError:
                        raise SessionError("the environment sent a reply that is not JSON: %r" % raw[:100]) from None
                    if not isinstance(reply, dict):
                        raise SessionError("the environment sent a reply that is not a JSON object: %r" % raw[:100])
                    return reply

    def _next_event(self, deadline: float) -> Any:
        while not self._events:
            self._events.extend(self._ws.events())
            if self._events:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SessionTimeout("no answer from %s in time (timeout_s=%g); the session is closed"
                                     % (self.where, self.timeout_s))
            self._sock.settimeout(remaining)
            try:
                data = self._sock.recv(65536)
            except socket.timeout:
                raise SessionTimeout("no answer from %s within %gs; the session is closed (raise timeout_s "
                                     "for slow environments)" % (self.where, self.timeout_s)) from None
            if not data:
                raise SessionError("the connection to %s closed mid-session: the job or the proxy route is gone"
                                   % self.where)
            self._ws.receive_data(data)
        return self._events.popleft()


def _session_url_rejection(base_url: Any) -> Optional[str]:
    """Why `base_url` cannot carry a WebSocket session, or None."""
    if not isinstance(base_url, str) or not base_url:
        return "EnvSession needs the provider's base_url (a string such as http://127.0.0.1:<port>/<route>)"
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname:
        return ("EnvSession needs an http(s):// or ws(s):// base_url such as the provider's "
                "http://127.0.0.1:<port>/<route>; got a %r URL" % (parts.scheme or "schemeless"))
    return None


def _session_url(base_url: str, path: str) -> str:
    """The session's ws(s):// URL: http -> ws, https -> wss, `path` appended to the base path."""
    parts = urlsplit(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return "%s://%s%s/%s%s" % (scheme, parts.netloc, parts.path.rstrip("/"), path.lstrip("/"),
                               "?" + parts.query if parts.query else "")


def _session_tls_context(verify: Union[bool, str]) -> ssl.SSLContext:
    """TLS for wss:// URLs, following `requests`' `verify` (True, False or a CA bundle path)."""
    context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


# -- background starts ------------------------------------------------------------------------------

_background_lock = threading.Lock()
_background_starts: "set[_BackgroundStart]" = set()  # starts still in flight
_background_slots = threading.BoundedSemaphore(BACKGROUND_MAX_PARALLEL)


class _BackgroundStart:
    """`start_container()` + `wait_for_ready()` of one provider in a daemon thread, begun at once; `wait()`
    returns its base URL or raises its error, `stop()` cancels the job, mid-start too."""

    def __init__(self, provider: HFSandboxProvider) -> None:
        self.provider = provider
        self.base_url: Optional[str] = None
        self.error: Optional[BaseException] = None
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
            raise self.error
        return self.base_url or ""

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def stop(self, wait_s: float = BACKGROUND_STOP_WAIT_S) -> None:
        """Make the start give up, wait (up to `wait_s`) for its thread, then cancel what is left. Never raises."""
        self._stopped = True
        deadline = time.monotonic() + wait_s
        self.provider._request_stop()
        while not self._done.wait(BACKGROUND_STOP_REPEAT_S) and time.monotonic() < deadline:
            self.provider._request_stop()  # a start that claimed the provider since cleared the last request
        self.provider.stop_container()  # a start that succeeded just before: cancel its job

    def _run(self) -> None:
        try:
            while not _background_slots.acquire(timeout=BACKGROUND_STOP_REPEAT_S):
                if self._stopped:
                    raise SandboxError("the sandbox was stopped before its start began")
            try:
                if self._stopped:
                    raise SandboxError("the sandbox was stopped before its start began")
                base_url = self.provider.start_container()
                self.provider.wait_for_ready(base_url)
            finally:
                _background_slots.release()
            if self._stopped:  # stopped during the start: the stop's own requests cancel the job
                raise SandboxError("the sandbox was stopped while job %s was starting" % self.provider.job_id)
            self.base_url = base_url
        except BaseException as exc:  # kept for wait(); the provider has torn the job down already
            self.error = exc
        finally:
            with _background_lock:
                _background_starts.discard(self)
            self._done.set()


# -- Sandbox: what an environment object holds --------------------------------------------------------

_shared_lock = threading.Lock()
# name -> (settings the group was made with, its current start); one group of replicas=K jobs per name.
_shared_groups: Dict[str, Tuple[Tuple[Any, ...], _BackgroundStart]] = {}
# Every provider a Sandbox started in this process (for stop_sandboxes()).
_sandbox_providers: "weakref.WeakSet[HFSandboxProvider]" = weakref.WeakSet()


class Sandbox:
    """An environment's remote sandbox: begun in the background when built, waited for only when used.

    `Sandbox(image, **provider_kwargs)` starts its job in a background thread; `session()` waits for THAT
    job and opens an `EnvSession`. `shared="name"`: every Sandbox of the process with that name uses one
    provider (`replicas=K` jobs); `stop_sandboxes()` cancels it. See docs/training.md.
    """

    def __init__(self, image: Optional[str] = None, *, shared: Optional[str] = None, begin: bool = True,
                 **provider_kwargs: Any) -> None:
        if shared is not None and (not isinstance(shared, str) or not shared):
            raise SandboxConfigError("shared=%r must be a non-empty name (environments with the same name "
                                     "share one group of jobs)" % (shared,))
        if "proxy" in provider_kwargs:
            raise SandboxConfigError("Sandbox uses the process-wide proxy (a proxy object cannot travel with a "
                                     "pickled environment); leave out proxy=")
        # Bad settings and a missing token fail here, in the caller's thread, before any thread or job.
        HFSandboxProvider(image, **provider_kwargs)._resolve_token()
        self.image = image
        self.shared = shared
        self._provider_kwargs = dict(provider_kwargs)
        self._start: Optional[_BackgroundStart] = None
        if begin:
            self.begin()

    def begin(self) -> "Sandbox":
        """Begin the start in the background. A no-op once begun (a failed start keeps raising its error
        until `restart()`); a stopped sandbox starts a new job."""
        if self._start is not None:
            return self
        if self.shared is not None:
            self._start = _shared_start(self.shared, self._settings_key(), self._new_provider, replace=None)
        else:
            self._start = _BackgroundStart(self._new_provider())
        return self

    def wait(self, timeout_s: Optional[float] = None) -> str:
        """Begin if needed and block until the job answers /health; returns its base URL or raises what the
        start raised. `timeout_s` bounds this wait only (`JobStartTimeout`; the start goes on)."""
        self.begin()
        assert self._start is not None
        return self._start.wait(timeout_s)

    def session(self, *, timeout_s: float = SESSION_TIMEOUT_S, wait_timeout_s: Optional[float] = None) -> EnvSession:
        """`wait()`, then open a new `EnvSession` on the sandbox (one per rollout slot)."""
        return EnvSession(self.wait(wait_timeout_s), timeout_s=timeout_s)

    def restart(self) -> "Sandbox":
        """Replace a lost job. A shared group is replaced once none of its jobs serves, however many of its
        environments ask (the others adopt the new one)."""
        if self.shared is not None:
            if not _group_serves(self._start):
                self._start = _shared_start(self.shared, self._settings_key(), self._new_provider,
                                            replace=self._start)
        else:
            self.stop()
            self.begin()
        return self

    def stop(self) -> None:
        """Cancel this sandbox's own job (mid-start too) and wait until it is released; a shared sandbox
        lets go of its group, which runs on for the others. Idempotent; never raises."""
        start, self._start = self._start, None
        if start is not None and self.shared is None:
            start.stop()

    @property
    def provider(self) -> Optional[HFSandboxProvider]:
        """The provider behind this sandbox (None before it begins)."""
        return self._start.provider if self._start is not None else None

    @property
    def ready(self) -> bool:
        """True when the job answered /health and this sandbox can open sessions at once."""
        return self._start is not None and self._start.done and self._start.error is None

    @property
    def job_ids(self) -> List[str]:
        """The job(s) serving this sandbox (K for a shared group with replicas=K; empty before a start)."""
        provider = self.provider
        return provider.job_ids if provider is not None else []

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "not begun" if self._start is None else ("ready" if self.ready else (
            "failed" if self._start.done else "starting"))
        return "<Sandbox image=%r%s %s jobs=%r>" % (self.image, " shared=%r" % self.shared if self.shared else "",
                                                    state, self.job_ids)

    def __getstate__(self) -> Dict[str, Any]:
        if self.shared is None and self._start is not None:
            raise TypeError("cannot pickle a Sandbox that has begun its job (%s): build it with begin=False, or "
                            "pickle the environment factory instead (each process then starts its own)"
                            % (self.provider.job_id if self.provider else "being created"))
        return dict(self.__dict__, _start=None)

    def _settings_key(self) -> Tuple[Any, ...]:
        return (self.image, sorted((k, repr(v)) for k, v in self._provider_kwargs.items()))

    def _new_provider(self) -> HFSandboxProvider:
        provider = HFSandboxProvider(self.image, **self._provider_kwargs)
        _sandbox_providers.add(provider)
        return provider


def _group_serves(start: Optional[_BackgroundStart]) -> bool:
    """Whether a shared group still has a job serving: asks the Jobs API about each (replicas > 1)."""
    if start is None or not start.done or start.error is not None or start.provider.replicas <= 1:
        return False
    try:
        status = start.provider.replica_status(refresh=True)
    except Exception:  # stopped or replaced meanwhile
        return False
    return any(entry["healthy"] and entry["stage"] == "RUNNING" for entry in status)


def _shared_start(name: str, key: Tuple[Any, ...], new_provider: Callable[[], HFSandboxProvider],
                  replace: Optional[_BackgroundStart]) -> _BackgroundStart:
    """The running (or starting) group called `name`, begun on first use. A failed group, or the one
    `replace` names (a caller saw it lost), is stopped and replaced; other callers adopt the new one."""
    with _shared_lock:
        entry = _shared_groups.get(name)
        if entry is not None and entry[0] != key:
            raise SandboxConfigError("shared sandbox %r already runs with other settings; give environments with "
                                     "different images or settings different shared= names" % name)
        old = entry[1] if entry is not None else None
        if old is not None and old is not replace and old.error is None:
            return old
        start = _BackgroundStart(new_provider())
        _shared_groups[name] = (key, start)
    if old is not None:
        old.stop()
    return start


def stop_sandboxes() -> None:
    """Cancel the job of every Sandbox of this process (own, shared, starting) in parallel and wait until
    each is released, then close the named pools of pooled ones (their host jobs this process booted).
    Never raises. The explicit teardown for trainers that never close environments (TRL)."""
    _in_parallel([s.stop for s in _take_starts()] + [p.stop_container for p in list(_sandbox_providers)])
    pools = sys.modules.get(__name__.rpartition(".")[0] + ".hf_sandbox_pool" if __package__ else "hf_sandbox_pool")
    if pools is not None:  # loaded only once something used pool=
        pools.close_pools()


def _take_starts() -> List[_BackgroundStart]:
    """Every shared group (forgotten: the next use starts a new one) and every start still in flight."""
    with _shared_lock:
        groups = [start for _, start in _shared_groups.values()]
        _shared_groups.clear()
    with _background_lock:
        in_flight = list(_background_starts)
    return list({id(s): s for s in groups + in_flight}.values())


def _teardown_process(budget_s: float) -> None:
    """Cancel every job this process runs or is starting, in parallel, within `budget_s`: background
    starts (waiting for creates in flight), every Sandbox, then every provider's safety net."""
    deadline = time.monotonic() + budget_s
    stop_starts = [lambda start=start: start.stop(budget_s) for start in _take_starts()]
    safety_nets = list(_live_finalizers)  # each cancels one running job at most once, provider or not
    _in_parallel(stop_starts + safety_nets, budget_s)
    _in_parallel(list(_live_finalizers), max(0.0, deadline - time.monotonic()))  # jobs recorded meanwhile


def _stop_background_starts_at_exit() -> None:
    """At exit, before the provider's own exit hook (atexit runs in reverse order): end the background
    starts in flight, whose daemon threads would otherwise die with a create unanswered."""
    with _background_lock:
        in_flight = list(_background_starts)
    if in_flight:
        _in_parallel([lambda start=start: start.stop(EXIT_TEARDOWN_BUDGET_S) for start in in_flight],
                     EXIT_TEARDOWN_BUDGET_S)


atexit.register(_stop_background_starts_at_exit)


def _reset_sandboxes_after_fork() -> None:
    """A forked child has none of the parent's start threads, and the parent's shared groups live on
    the parent's proxy: the child starts its own."""
    global _background_lock, _shared_lock, _background_slots
    _background_lock, _shared_lock = threading.Lock(), threading.Lock()
    _background_slots = threading.BoundedSemaphore(BACKGROUND_MAX_PARALLEL)
    _background_starts.clear()
    _shared_groups.clear()


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
    for signum in [int(s) for s in signals]:
        if signum in _signal_previous:
            continue  # installed already (possibly under a handler set later, which may chain to ours)
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            logger.debug("install_signal_teardown: signal %d is ignored by this process; left alone", signum)
            continue
        signal.signal(signum, _on_teardown_signal)
        _signal_previous[signum] = previous
    return bool(_signal_previous)


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
        worker = threading.Thread(target=_teardown_process, args=(SIGNAL_TEARDOWN_BUDGET_S,),
                                  name="hf-sandbox-signal-teardown", daemon=True)
        _start_thread(worker)
        worker.join(SIGNAL_TEARDOWN_BUDGET_S + 1.0)
        previous = _signal_previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous is not signal.SIG_IGN:  # SIG_DFL (or a handler set outside Python): die of the signal
            _signal_previous.pop(signum, None)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    finally:
        _signal_teardown_active.clear()
