"""`AuthProxy` served from a child process: `AuthProxy.spawn()` and
`HFSandboxProvider(proxy="process")`.

A layer over `proxy.py`, imported only when used. `AuthProxy.spawn()` runs an `AuthProxy` in a child
Python process (this file, run by sys.executable; threads only inside) and returns an
`AuthProxyProcess`, a parent-side handle with the API a provider uses. The relay work then runs on
the child's GIL, not the trainer's.

Control channel: a socketpair inherited by the child (no file, no port), carrying length-prefixed
JSON both ways. Requests carry an id and get one answer each; the child also sends its log records.
Tokens cross only this channel: never argv (the child's is `proxy_host.py --proxy-host FD
PARENT_PID`), never the environment (the child gets an allowlist of variables, so HF_TOKEN stays in
the parent), never a file.

Token callables stay in the parent (they are Python objects of the trainer's): one parent thread
re-reads every callable each TOKEN_PUSH_INTERVAL_S and pushes a changed value to the child, which
injects the last value pushed. The alternative, the child asking the parent per request (with a
cache), puts a round trip through the trainer's GIL in the request path: the cost the host exists to
remove.

A child that dies without being asked (a signal, a crash: any exit but 0) is replaced on the same
port, every route mounted again under its id, so base URLs keep working (see MAX_REVIVALS).

The child ends with the parent: it watches the channel for EOF (the kernel closes the parent's end
whatever kills it, SIGKILL included) and, on Linux, also asks for SIGTERM when its parent dies
(PR_SET_PDEATHSIG), which covers a forked grandchild keeping the parent's end open. The kernel sends
that signal when the *thread* that started the child ends, so the child is started by the handle's
own control thread, which lives exactly as long as the child.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple


def _sibling_proxy_module() -> object:
    """The child's `proxy`: the `proxy.py` beside this file, loaded by path (`python -I` leaves this
    file's folder off sys.path, and the child must run the very copy its parent runs)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy.py")
    spec = importlib.util.spec_from_file_location("proxy", path)
    if spec is None or spec.loader is None:
        raise ImportError("proxy_host.py needs proxy.py beside it (%s)" % path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["proxy"] = module
    spec.loader.exec_module(module)
    return module


if __package__:  # vendored inside a package
    from . import proxy as _proxy
elif __name__ == "__main__":  # the child process
    _proxy = _sibling_proxy_module()  # type: ignore[assignment]
else:
    import proxy as _proxy

AuthProxy, Route, ReplicaRoute = _proxy.AuthProxy, _proxy.Route, _proxy.ReplicaRoute
InsecureURLError = _proxy.InsecureURLError
Token, Verify, ExtraHeaders = _proxy.Token, _proxy.Verify, _proxy.ExtraHeaders
log = _proxy.log

__all__ = ["AuthProxyProcess", "spawn"]

def spawn(cls: type, host: str = "127.0.0.1", port: int = 0, *, processes: int = 1,
          **timeouts: float) -> "AuthProxyProcess":
    """`AuthProxy.spawn()`: start the child (or `processes` children sharing one port) and return
    its started handle."""
    if cls is not AuthProxy:
        raise TypeError("spawn() hosts a plain AuthProxy: a subclass's overrides cannot cross into "
                        "the child process; start %s in-process instead" % cls.__name__)
    _proxy._raise_if_rejected(_processes_rejection(processes))
    if processes == 1:
        return AuthProxyProcess(host, port, **timeouts).start()
    return _ProxyProcessGroup(host, port, processes, timeouts).start()  # type: ignore[return-value]


# argv[1] of the child (`python proxy_host.py --proxy-host FD PARENT_PID`): says what it is in `ps`.
HOST_CHILD_ARG = "--proxy-host"
# How often the parent re-reads token callables and pushes changed values: a rotated token reaches
# the child within this delay. HF tokens and sandbox bearers rotate in minutes, with overlap;
# reading 64 callables twice a second costs the parent about 0.1 ms per second.
TOKEN_PUSH_INTERVAL_S = 0.5
# How long a control request waits for the child's answer. A mount takes microseconds; a child that
# cannot answer in this long is wedged, and the caller gets an error instead of hanging.
CONTROL_ANSWER_S = 30.0
# How long the child may take to import and bind before spawn() gives up (a loaded 2-core machine
# took about 0.3 s; the margin is for a cold disk cache).
HOST_START_S = 30.0
# A child that died of something it did not ask for (the OOM killer's SIGKILL, a crash: any end but
# the clean exit 0 that SIGTERM, SIGHUP or the channel's EOF give) is replaced by a new one on the
# same port, serving every route under its same URL, at most this many times within
# REVIVAL_WINDOW_S: a child that keeps dying has a cause that a new one will not cure.
MAX_REVIVALS = 3
REVIVAL_WINDOW_S = 600.0
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
    `add_replica`, `remove_replica`, `replica_status`, `port`, `url`, `stop()`, context manager.
    Mount refusals are raised here with the in-process types and messages; 502/504 answers come from
    the child as they would in-process; the child's `proxy` log records are re-emitted on this
    process's `proxy` logger (`record.process` is the child's pid). `running` says whether the child
    still serves. """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **timeouts: float) -> None:
        # the same checks and messages as in-process (binds nothing)
        AuthProxy(host, port, **timeouts)
        self._reuse_port = False  # set by a process group: bind with SO_REUSEPORT
        self.host = host
        self._requested_port = port
        self._timeouts = timeouts
        self._port = port
        self._lock = threading.Lock()  # ids, routes, the pending table, the phase
        self._send_lock = threading.Lock()  # one message at a time on the channel
        self._next_id = 0
        self._pending: Dict[int, "_PendingAnswer"] = {}
        # Every route: id -> how it was mounted ("op", "fields", "dynamic"), what was last sent
        # ("sent"), and "token"/"headers": a callable re-read by the pusher, or None.
        self._routes: Dict[str, Dict[str, Any]] = {}
        self._sock: Optional[socket.socket] = None
        self._process: Optional["subprocess.Popen[bytes]"] = None
        self._control: Optional[threading.Thread] = None
        self._pusher: Optional[threading.Thread] = None
        self._pusher_stop = threading.Event()
        self._ended: Optional[str] = None  # why the child no longer serves (None while it does)
        # A revival under way (see MAX_REVIVALS): set when it ends; calls wait for it meanwhile.
        self._revival: Optional[threading.Event] = None
        self._reviver: Optional[threading.Thread] = None
        self._revived_at: List[float] = []  # monotonic times of the revivals made
        self._serving = False  # the child answered `start`
        self._stopping = False
        self._stopped = threading.Event()  # set once stop() has returned

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> "AuthProxyProcess":
        """Start the child and wait until it listens; returns self. `AuthProxy.spawn()` calls it."""
        with self._lock:
            if self._stopping or self._ended:
                raise RuntimeError("this AuthProxyProcess was stopped; spawn a new one")
            if self._control is not None:
                return self
            started, ready = self._launch()
        try:
            ready.wait()
        except BaseException:  # e.g. Ctrl-C while the child starts: it must not outlive this call
            ready.wait(HOST_START_S)
            self.stop()
            raise
        if "error" in started:
            self._abandon()
            raise started["error"]  # type: ignore[misc]
        _live_hosts.add(self)
        try:
            self._port = self._start_child_proxy(self._requested_port)
        except BaseException:
            self.stop()
            raise
        self._serving = True
        # the child logged "listening" at INFO
        log.debug("proxy host process %s serves %s", self.pid, self.url)
        return self

    def stop(self) -> None:
        """Stop the child's proxy (every connection, tunnel and thread), wait for the child to exit
        and end this handle's threads. Never raises; logs what it could not clean up."""
        with self._lock:
            stopping, self._stopping = self._stopping, True
            revival, control, reviver = self._revival, self._control, self._reviver
        if stopping:  # another thread's stop(): returns once it has (unless that one waits for us)
            if threading.current_thread() not in (control, reviver):
                self._stopped.wait(HOST_START_S + CONTROL_ANSWER_S + _proxy.STOP_JOIN_S * 4)
            return
        if revival is not None and threading.current_thread() not in (control, reviver):
            # (its calls fail at once now: it ends soon)
            revival.wait(HOST_START_S + CONTROL_ANSWER_S)
        with self._lock:
            control, process = self._control, self._process
        leftovers: List[str] = []
        # From a log handler on the control thread (a child's record) or the revival's: the control
        # thread may wait for that handler's lock, so no answer is awaited from it, nor its end.
        on_control = threading.current_thread() in (control, reviver)
        if control is not None and self._ended is None and not on_control:
            try:
                self._call("stop")
            except Exception as exc:  # already gone, or wedged: the kill below ends it
                if self._ended is None:
                    leftovers.append("a clean stop of the host process (%s)" % exc)
        leftovers.extend(self._abandon())
        if control is not None and not on_control:
            control.join(_proxy.STOP_JOIN_S * 2)
            if control.is_alive():
                leftovers.append("thread %s" % control.name)
        if on_control and process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_proxy.STOP_JOIN_S)  # ending on the channel's EOF
        if process is not None and process.poll() is None:
            leftovers.append("the host process %d (killed)" % process.pid)
            process.kill()
            process.wait(_proxy.STOP_JOIN_S)
        if self._sock is not None:
            self._sock.close()  # only now: the control thread, which reads it, has ended
        _live_hosts.discard(self)
        self._stopped.set()
        if leftovers:
            log.warning("proxy host stopped but could not clean up: %s", ", ".join(leftovers))

    def __enter__(self) -> "AuthProxyProcess":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopping else self._ended or (
            "replacing its child" if self._revival else
            "serving" if self._serving else "not started")
        return ("AuthProxyProcess(%s, pid %s, %s)" % (self.url if self._serving else self.host,
                                                      self.pid, state))

    @property
    def port(self) -> int:
        """The bound port (the requested one until the child has bound)."""
        return self._port

    @property
    def url(self) -> str:
        """The listener's root URL, e.g. `http://127.0.0.1:41234`."""
        host = self.host.strip("[]")
        return "http://%s:%d" % ("[%s]" % host if ":" in host else host, self.port)

    @property
    def pid(self) -> Optional[int]:
        """The child's process id (None before `start()`)."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        """True while the child serves or is being replaced (False before start, after stop, or once
        it ended for good)."""
        return self._serving and self._ended is None and not self._stopping

    # -- routes (same contract as AuthProxy's) -----------------------------------------------------

    def mount(self, upstream: str, token: Token, *, verify: Verify = True,
              headers: ExtraHeaders = None) -> str:
        """As `AuthProxy.mount`; a callable token or headers is re-read here every
        TOKEN_PUSH_INTERVAL_S."""
        # refusals raised here, with the in-process types and messages
        Route(upstream, token, verify, headers)
        return self._mount("mount", token, headers, upstream=upstream,
                           verify=_portable_verify(verify))

    def mount_replicas(self, upstreams: Sequence[str], token: Token, *, verify: Verify = True,
                       http: str = "refuse") -> str:
        """As `AuthProxy.mount_replicas`."""
        ReplicaRoute(upstreams, token, verify, http)  # refusals raised here, as in-process
        return self._mount("mount_replicas", token, None, upstreams=list(upstreams),
                           verify=_portable_verify(verify),
                           http=http)

    def add_replica(self, base_url: str, upstream: str) -> bool:
        """As `AuthProxy.add_replica`."""
        _proxy._raise_if_rejected(_proxy._replicas_rejection([upstream]))  # the in-process message
        return self._change_replicas("add_replica", base_url, upstream)

    def remove_replica(self, base_url: str, upstream: str) -> bool:
        """As `AuthProxy.remove_replica`."""
        return self._change_replicas("remove_replica", base_url, upstream)

    def replica_status(self, base_url: str) -> List[Dict[str, Any]]:
        """As `AuthProxy.replica_status`."""
        return list(self._call("replica_status", route=_proxy._route_id(base_url)))

    def unmount(self, base_url: str) -> bool:
        """As `AuthProxy.unmount`: False when nothing is mounted there (also once the handle is
        stopped or the child is gone, taking its routes with it); safe to call twice."""
        route_id = _proxy._route_id(base_url)
        with self._lock:
            recorded = self._routes.pop(route_id, None) is not None
            gone = self._stopping or self._ended is not None
        # (a revival that took its list before this pop mounts it again, then this unmounts it)
        try:
            return False if gone else bool(self._call("unmount", route=route_id)) or recorded
        except RuntimeError:
            if self._ended is None and not self._stopping:  # wedged, not gone
                raise
            return False

    # -- machinery ---------------------------------------------------------------------------------

    def _mount(self, op: str, token: Token, headers: ExtraHeaders, **fields: object) -> str:
        sent = {"token": _Pushed.of_token(token), "headers": _Pushed.of_headers(headers)}
        dynamic = [name for name, source in (("token", token), ("headers", headers))
                   if callable(source)]
        answer = self._call(op, dynamic=dynamic, **_pushed_fields(sent), **fields)
        route_id = _proxy._route_id(answer)
        fields.pop("route_id", None)  # (a revival names the id it had)
        with self._lock:  # kept for a revival, and for the pusher if a callable is in it
            self._routes[route_id] = {"op": op, "fields": fields, "dynamic": dynamic, "sent": sent,
                                      "token": token if callable(token) else None,
                                      "headers": headers if callable(headers) else None}
            start_pusher = bool(dynamic) and self._pusher is None
            if start_pusher:
                self._pusher = threading.Thread(target=self._push_tokens,
                                                name="proxy-host-tokens", daemon=True)
        if start_pusher:
            try:
                _proxy._start_thread(self._pusher)  # type: ignore[arg-type]
            except BaseException:  # e.g. a thread limit: this mount is undone, the next tries again
                with self._lock:
                    self._pusher = None
                    self._routes.pop(route_id, None)
                with contextlib.suppress(Exception):
                    self._call("unmount", route=route_id)
                raise
        return str(answer)

    def _change_replicas(self, op: str, base_url: str, upstream: str) -> bool:
        """add_replica/remove_replica in the child, then in the route's record (for a revival)."""
        route_id = _proxy._route_id(base_url)
        changed = bool(self._call(op, route=route_id, upstream=upstream))
        with self._lock:
            entry = self._routes.get(route_id)
            if changed and entry is not None and entry["op"] == "mount_replicas":
                kept = [url for url in entry["fields"]["upstreams"] if url != upstream]
                entry["fields"] = dict(entry["fields"], upstreams=kept + [upstream] * (
                    op == "add_replica"))
                # (a revival mounts an emptied route with this one, then removes it)
                entry["removed"] = upstream
        return changed

    def _call(self, op: str, timeout: Optional[float] = None, **fields: object) -> object:
        """Send one request and wait for its answer (CONTROL_ANSWER_S by default); raise the child's
        error as its own type. During a revival it first waits for the new child."""
        timeout = CONTROL_ANSWER_S if timeout is None else timeout
        if threading.current_thread() is self._control:
            raise RuntimeError("AuthProxyProcess.%s was called from a handler of a log record "
                               "re-emitted from the proxy host process, on the one thread that "
                               "reads the host's answers, so its answer could never be read; call "
                               "it from another thread" % op)
        for _ in range(MAX_REVIVALS + 1):  # (sent again to each new child of a revival, at most)
            pending = self._call_once(op, timeout, fields)
            if not pending.retry:
                break
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _call_once(self, op: str, timeout: float, fields: Dict[str, object]) -> "_PendingAnswer":
        """One attempt of `_call`: its answer, or one marked `retry` (its child died meanwhile)."""
        while True:
            with self._lock:
                if self._stopping and op != "stop":
                    raise RuntimeError("this AuthProxyProcess was stopped; spawn a new one")
                if self._ended is not None or self._sock is None:
                    raise RuntimeError("the proxy host process is not serving (%s); spawn a new "
                                       "one" % (self._ended or "not started"))
                revival, sock = self._revival, self._sock
                if revival is None or threading.current_thread() is self._reviver:
                    self._next_id += 1
                    request_id = self._next_id
                    pending = self._pending[request_id] = _PendingAnswer()
                    break
            revival.wait(HOST_START_S)  # (bounded: a stop ends the revival's calls at once)
        try:
            _send_message(sock, self._send_lock,
                          dict(fields, id=request_id, op=op, level=log.getEffectiveLevel()),
                          timeout)
            if not pending.done.wait(timeout):
                raise RuntimeError("the proxy host process %s did not answer %s within %.0f s"
                                   % (self.pid, op, timeout))
        except socket.timeout:  # (TimeoutError from 3.10) the child reads nothing: it is wedged
            with self._lock:
                self._ended = self._ended or ("it took no request for %.0f s, and was killed"
                                              % timeout)
            # a request may be cut mid-frame: the channel is done, and so is the child
            _proxy._abort_socket(sock)
            if self._process is not None:
                self._process.kill()
            raise RuntimeError("the proxy host process %s did not take %s within %.0f s (%s)"
                               % (self.pid, op, timeout, self._ended)) from None
        except OSError as exc:  # the channel broke: if the child is replaced, its end marks this
            pending.done.wait(_proxy.STOP_JOIN_S * 3)  # (once the child is reaped)
            if not pending.retry:
                raise RuntimeError("the proxy host process is not serving "
                                   "(%s)" % (self._ended or exc)) from None
        finally:
            with self._lock:
                self._pending.pop(request_id, None)
        return pending

    def _launch(self) -> Tuple[Dict[str, Any], threading.Event]:
        """(Under the lock.) A fresh channel, and a control thread starting a child on it: wait for
        the event, then `started` holds any error."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        started: Dict[str, Any] = {}
        ready = threading.Event()
        control = threading.Thread(target=self._control_thread, args=(parent_end, child_end,
                                                                      started, ready),
                                   name="proxy-host-control", daemon=True)
        self._process = None
        try:
            _proxy._start_thread(control)
        except BaseException:  # e.g. a thread limit: nothing of it is left open
            parent_end.close()
            child_end.close()
            raise
        self._sock, self._control = parent_end, control
        return started, ready

    def _start_child_proxy(self, port: int, held: bool = False) -> int:
        """Have the child start its AuthProxy on `port` (`held`: accepting nothing until `serve`);
        returns the port it bound."""
        answer = self._call("start", timeout=HOST_START_S, host=self.host, port=port,
                            timeouts=self._timeouts, reuse_port=self._reuse_port, held=held)
        return int(answer["port"])  # type: ignore[index, call-overload]

    def _control_thread(self, sock: socket.socket, child_end: socket.socket,
                        started: Dict[str, Any], ready: threading.Event) -> None:
        """Start the child (from this thread: PR_SET_PDEATHSIG follows the starting thread), then
        read its answers and log records until the channel closes; reap the child."""
        try:
            try:
                self._process = _spawn_host_child(child_end)
            except BaseException as exc:
                started["error"] = exc
                return
            finally:
                child_end.close()
                ready.set()
            while True:
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
                    try:
                        _emit_child_record(message, self.pid)
                    except Exception:  # a user's filter or handler failing must not end the channel
                        traceback.print_exc(file=sys.stderr)
        finally:
            self._channel_closed()

    def _deliver(self, message: Dict[str, Any]) -> None:
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
        """The child closed the channel (it stopped, or died): fail waiters, reap it, say why, and
        replace a child that died of something it did not ask for (see MAX_REVIVALS)."""
        process = self._process
        code: Optional[int] = None
        if process is not None:
            try:
                code = process.wait(_proxy.STOP_JOIN_S * 2)
            except subprocess.TimeoutExpired:  # closed its end but does not exit: it is of no use
                process.kill()
                code = process.wait(_proxy.STOP_JOIN_S)
        why = "the host process exited with code %s" % code
        if code is not None and code < 0:
            why += " (%s)" % _signal_name(-code)
        now = time.monotonic()
        with self._lock:  # (one critical section: a call made after it waits for the revival)
            recent = [at for at in self._revived_at if now - at < REVIVAL_WINDOW_S]
            revive = (code not in (None, 0) and self._serving and self._revival is None
                      and self._ended is None and not self._stopping and len(recent) < MAX_REVIVALS)
            if revive:
                self._revival, self._revived_at = threading.Event(), recent + [now]
            else:
                self._ended = self._ended or why
            waiting = list(self._pending.values())
        for pending in waiting:  # (sent again to the new child, or failed)
            pending.retry = revive
            pending.error = None if revive else RuntimeError(
                "the proxy host process is not serving (%s)" % why)
            pending.done.set()
        if revive:
            log.warning("proxy host process %s ended on its own (code %s): starting another on "
                        "port %d for its %d routes", self.pid, code, self._port, len(self._routes))
            self._start_revival(why)
            return
        self._pusher_stop.set()
        if not self._stopping and code is not None and self._ended == why:  # (not a revival's end)
            log.warning("proxy host process %s ended on its own (code %s): its routes are gone%s",
                        self.pid, code, " (replaced %d times in %.0f s: not again)" % (
                            len(recent), REVIVAL_WINDOW_S) if len(recent) >= MAX_REVIVALS else "")

    def _start_revival(self, why: str) -> None:
        reviver = threading.Thread(target=self._revive, args=(why,), name="proxy-host-revival",
                                   daemon=True)
        with self._lock:
            self._reviver = reviver
        try:
            _proxy._start_thread(reviver)
        except BaseException as exc:  # e.g. a thread limit: the routes are gone after all
            self._revival_failed(why, exc)
            self._end_revival()

    def _revive(self, why: str) -> None:
        """Start a new child on the same port and mount every route in it again under its id."""
        old_pid, old_control, old_sock = self.pid, self._control, self._sock
        try:
            if old_control is not None:
                old_control.join(_proxy.STOP_JOIN_S)  # returning now: then its socket can close
            if old_sock is not None:
                old_sock.close()
            with self._lock:
                if self._stopping:  # stop() goes on once this ends: there is no child to stop
                    self._ended = self._ended or why
                    return
                started, ready = self._launch()
            ready.wait()
            if "error" in started:
                raise started["error"]
            self._start_child_proxy(self._port, held=True)  # (bound: the port is ours again)
            with self._lock:
                routes = list(self._routes.items())
            lost = []
            for route_id, entry in routes:
                fields = entry["fields"]
                emptied = entry["op"] == "mount_replicas" and not fields["upstreams"]
                try:  # (a replica route with none left is mounted with one, then emptied again)
                    self._call(entry["op"], route_id=route_id, dynamic=entry["dynamic"],
                               **_pushed_fields(entry["sent"]),
                               **dict(fields, upstreams=[entry["removed"]]) if emptied else fields)
                    if emptied:
                        self._call("remove_replica", route=route_id, upstream=entry["removed"])
                except Exception as exc:  # that route only (e.g. its CA file is gone since)
                    if self._ended is not None or self._stopping:  # (the new child is gone too)
                        raise
                    lost.append("%s (%s)" % (fields.get("upstream") or fields.get("upstreams"),
                                             exc))
            self._call("serve")  # the connections waiting in the backlog meet every route
            log.warning("proxy host process %s replaced process %s on port %d: %d of its %d "
                        "routes serve again under their URLs%s", self.pid, old_pid, self._port,
                        len(routes) - len(lost), len(routes),
                        "; not mounted again: " + ", ".join(lost) if lost else "")
        except BaseException as exc:
            self._revival_failed(why, exc)
        finally:
            self._end_revival()

    def _revival_failed(self, why: str, error: BaseException) -> None:
        with self._lock:
            if self._stopping:
                return
            self._ended = "%s, and no new child could take its place (%s)" % (why, error)
        log.error("proxy host: %s: its routes are gone", self._ended)
        self._pusher_stop.set()
        if self._sock is not None:  # a new child that did start ends on the channel's EOF
            _proxy._abort_socket(self._sock)

    def _end_revival(self) -> None:
        with self._lock:
            revival, self._revival, self._reviver = self._revival, None, None
        if revival is not None:
            revival.set()

    def _abandon(self) -> List[str]:
        """Close the parent's end of the channel (the child sees EOF and exits) and stop the
        pusher; returns the pusher's name if it did not end."""
        self._pusher_stop.set()
        sock = self._sock
        if sock is not None:
            _proxy._abort_socket(sock)
        pusher = self._pusher
        if (pusher is not None and pusher.ident is not None
                and pusher is not threading.current_thread()):
            pusher.join(_proxy.STOP_JOIN_S)
            if pusher.is_alive():  # in a token callable that has not returned
                return ["thread %s" % pusher.name]
        return []

    def _push_tokens(self) -> None:
        """Re-read every token and headers callable each TOKEN_PUSH_INTERVAL_S; send the child
        what changed."""
        while not self._pusher_stop.wait(TOKEN_PUSH_INTERVAL_S):
            with self._lock:  # (a route with neither callable has nothing to re-read)
                routes = [(route_id, entry) for route_id, entry in self._routes.items()
                          if entry["dynamic"]]
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
                # the child is gone (logged once there) or the route was unmounted
                except Exception as exc:
                    log.debug("proxy host: could not push a token (%s)", type(exc).__name__)
                    continue
                entry["sent"] = now

    def _after_fork(self) -> None:
        """In a forked child: the channel and threads belong to the parent; close our copy of its
        end."""
        self._ended = ("this handle belongs to the process that spawned it (this one was forked "
                       "from it)")
        self._pending, self._revival, self._reviver = {}, None, None
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class _ProxyProcessGroup:
    """`AuthProxy.spawn(processes=N)`: N proxy host children sharing one port (SO_REUSEPORT), each
    route mounted in every one under the same route id, so whichever child the kernel hands a
    connection to serves it. Same API as `AuthProxyProcess` except replica routes: each child would
    balance its own sessions, so `mount_replicas` is refused (use processes=1)."""

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
        state = "serving" if self.running else "not serving"
        return "AuthProxyProcess(%s, pids %s, %s)" % (self.url, self.pids, state)

    port = property(lambda self: self.members[0].port, doc="The shared port.")
    url = property(lambda self: self.members[0].url, doc="The listener's root URL.")
    pid = property(lambda self: self.members[0].pid, doc="The first child's process id.")
    pids = property(lambda self: [m.pid for m in self.members], doc="Every child's process id.")
    running = property(lambda self: all(m.running for m in self.members), doc="True while every "
                                                                              "child serves.")

    def mount(self, upstream: str, token: Token, *, verify: Verify = True,
              headers: ExtraHeaders = None) -> str:
        """As `AuthProxy.mount`, in every child; undone in all if one refuses."""
        base_url = self.members[0].mount(upstream, token, verify=verify, headers=headers)
        try:
            for member in self.members[1:]:
                member._mount("mount", token, headers, upstream=upstream,
                              verify=_portable_verify(verify),
                              route_id=_proxy._route_id(base_url))
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
_GROUP_REPLICAS_REFUSAL = ("replica routes need one proxy process: each child would balance its "
                           "own sessions; spawn with processes=1 for mount_replicas()")


def _processes_rejection(processes: object) -> Optional[str]:
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        return ("processes must be a whole number of child processes, 1 or more, got "
                "%r" % (processes,))
    if processes > 1 and not hasattr(socket, "SO_REUSEPORT"):
        return ("processes > 1 needs SO_REUSEPORT (Linux, BSD, macOS); this platform has none: use "
                "processes=1")
    return None


class _ChildServer(_proxy._Server):
    """The child's listener: bound with SO_REUSEPORT when it shares its port with sibling children
    (`spawn(processes=N)`), and accepting nothing until its proxy's `gate` opens. A revival opens it
    once every route is mounted again: a client arriving meanwhile waits in the listen backlog
    instead of meeting an unknown route (a 404 a trainer would take for its job's end)."""

    def __init__(self, proxy: "_ChildProxy") -> None:
        self.gate = proxy.gate
        self.reuse_port = proxy.reuse_port  # (read by server_bind, which the constructor calls)
        super().__init__(proxy)

    def server_bind(self) -> None:
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    def serve_until_woken(self) -> None:
        self.gate.wait()  # (wake() opens it too)
        super().serve_until_woken()

    def wake(self) -> None:
        super().wake()
        self.gate.set()


class _ChildProxy(AuthProxy):
    """The child's AuthProxy (see _ChildServer); `held`: it accepts nothing until `gate` is set."""

    def __init__(self, host: str, port: int, reuse_port: bool = False, held: bool = False,
                 **timeouts: float) -> None:
        super().__init__(host, port, **timeouts)
        self.reuse_port, self.gate = reuse_port, threading.Event()
        if not held:
            self.gate.set()

    def _new_server(self) -> _proxy._Server:
        return _ChildServer(self)


def _rekey_route(proxy: AuthProxy, route_id: str, wanted: str) -> str:
    """Serve the route just mounted at `route_id` under `wanted` instead (a group's shared id)."""
    with proxy._lock:
        if wanted in proxy._routes:
            raise ValueError("route id already mounted")
        proxy._routes[wanted] = proxy._routes.pop(route_id)
    return "%s/%s" % (proxy.url, wanted)


class _PendingAnswer:
    __slots__ = ("done", "result", "error", "retry")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: object = None
        self.error: Optional[BaseException] = None
        self.retry = False  # its child died before answering and is being replaced: send it again


class _Pushed(NamedTuple):
    """What a route's token or headers (or its callable, read now) gave: the value to send the
    child, or the name of the error the in-process proxy would have met reading it."""

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
        if not isinstance(value, str):  # (None too: a callable's None is no token, as in-process)
            return cls(None, "ValueError")  # in-process: "not a usable token string"
        return cls(value, None)

    @classmethod
    def of_headers(cls, headers: ExtraHeaders) -> "_Pushed":
        try:  # (a mapping's own items() is user code too)
            value = headers() if callable(headers) else headers
            if value is None:
                return cls(None, None)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in value.items()):
                # in-process: "not a mapping" / "not a string of printable ASCII"
                return cls(None, "ValueError")
            return cls(dict(value), None)
        except Exception as exc:
            return cls(None, type(exc).__name__)


def _pushed_fields(sent: Dict[str, "_Pushed"]) -> Dict[str, Any]:
    """The control-message fields for a route's token and headers."""
    return {"token": sent["token"].value, "token_error": sent["token"].error,
            "headers": sent["headers"].value, "headers_error": sent["headers"].error}


# Handles of this process whose children are alive: closed in a forked child (see
# _after_fork_in_child).
_live_hosts: "weakref.WeakSet[AuthProxyProcess]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for host in list(_live_hosts):
        host._after_fork()
    _live_hosts.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def _portable_verify(verify: Verify) -> Verify:
    """`verify` as the child must see it: a CA bundle path made absolute (the parent may chdir)."""
    return os.path.abspath(verify) if isinstance(verify, str) else verify


def _error_fields(exc: Exception) -> Dict[str, Any]:
    """How the child reports an error: an OSError by errno and strerror, as the parent rebuilds it
    (its str() already starts with "[Errno N]")."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return {"type": "OSError", "errno": exc.errno, "message": exc.strerror}
    return {"type": type(exc).__name__, "message": str(exc)}


def _remote_error(error: object) -> BaseException:
    kind, message = (error.get("type"), error.get("message")) if isinstance(error,
                                                                            dict) else (None, None)
    if kind == "OSError" and error.get("errno") is not None:  # type: ignore[union-attr]
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
        raise RuntimeError("AuthProxy.spawn() needs a POSIX system and sys.executable (it hands "
                           "the child a socket by file descriptor); use the in-process AuthProxy "
                           "here")
    if not script.endswith(".py") or not os.path.exists(script):
        raise RuntimeError("AuthProxy.spawn() runs this module's source file as the child, but %s "
                           "is not a .py file; use the in-process AuthProxy" % script)
    # -I: the child imports only the standard library, so it reads no PYTHON* variable and no user
    # site.
    args = [sys.executable, "-I", script, HOST_CHILD_ARG, str(child_end.fileno()), str(os.getpid())]
    return subprocess.Popen(args, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, env=_host_environment(), close_fds=True)


def _emit_child_record(message: Dict[str, Any], pid: Optional[int]) -> None:
    """Re-emit a child's log record on this process's logger of the same name, if that level is
    on."""
    name, level = str(message.get("name") or "proxy"), int(message.get("level") or logging.INFO)
    logger = logging.getLogger(name)
    if not logger.isEnabledFor(level):
        return
    created = float(message.get("created") or time.time())  # type: ignore[arg-type]
    record = logging.makeLogRecord({
        "name": name, "levelno": level, "levelname": logging.getLevelName(level),
            "msg": message.get("msg", ""),
        "args": (), "created": created, "msecs": (created - int(created)) * 1000,
        "threadName": message.get("thread"), "process": pid, "processName": "proxy-host",
        "exc_text": message.get("exc")})
    logger.handle(record)


def _send_message(sock: socket.socket, lock: threading.Lock, message: Dict[str, Any],
                  timeout: Optional[float] = None) -> None:
    """Send one frame; with `timeout`, raise socket.timeout when the lock or the peer's reading
    takes longer (the frame may then be cut: the channel is unusable)."""
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_CONTROL_MESSAGE:  # the receiver would end the channel (a child: every route)
        raise ValueError("the proxy host's %s request is %d bytes, over its %d-byte control "
                         "message limit (a token or header value that large cannot cross to the "
                         "child process); use the in-process proxy"
                         % (message.get("op"), len(data), MAX_CONTROL_MESSAGE))
    frame = memoryview(_FRAME.pack(len(data)) + data)
    if timeout is None:
        with lock:
            sock.sendall(frame)
        return
    deadline = time.monotonic() + timeout
    if not lock.acquire(timeout=timeout):
        raise socket.timeout("another request's send is stuck")
    try:
        writable = select.poll()  # one socket: a blocking wait for room to write, not a reactor
        try:
            writable.register(sock, select.POLLOUT)
        except ValueError:  # closed since the caller took it: a revival closes the dead child's
            raise OSError(errno.EBADF, "the control channel is closed") from None
        while frame:
            left = deadline - time.monotonic()
            if left <= 0 or not writable.poll(left * 1000):
                raise socket.timeout("the child reads nothing")
            try:
                frame = frame[sock.send(frame, socket.MSG_DONTWAIT):]
            except BlockingIOError:
                continue
    finally:
        lock.release()


def _recv_exact(sock: socket.socket, size: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < size:
        piece = sock.recv(size - len(buf))
        if not piece:
            return None
        buf += piece
    return bytes(buf)


def _recv_message(sock: socket.socket) -> Optional[Dict[str, Any]]:
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


# -- the child side
# ------------------------------------------------------------------------------------


class _PushedValue:
    """A route's token or headers in the child: the last value the parent pushed, as the callable
    the route reads per request (raising the error the parent's callable raised, by name)."""

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
    """An exception type called `name`, so the child logs "token callable failed (KeyError)" as
    in-process."""
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
            self.host.send({"op": "log", "name": record.name, "level": record.levelno,
                            "msg": record.getMessage(),
                            "created": record.created, "thread": record.threadName, "exc": exc})
        except Exception:  # the parent is gone: nobody to tell
            pass


class _ProxyHost:
    """The child's main thread: serve control requests on the channel until EOF, `stop`, or a
    signal."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()
        self.proxy: Optional[AuthProxy] = None
        # route id -> "token"/"headers" -> value
        self.pushed: Dict[str, Dict[str, _PushedValue]] = {}

    def send(self, message: Dict[str, Any]) -> None:
        _send_message(self.sock, self.send_lock, message)

    def end_input(self, signum: int = 0, frame: object = None) -> None:
        """SIGTERM/SIGHUP (or the parent's death): make the next read see EOF, so the loop stops
        cleanly."""
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
                    answer: Dict[str, Any] = {"id": message.get("id"), "ok": True,
                                                 "result": result}
                except Exception as exc:
                    answer = {"id": message.get("id"), "ok": False, "error": _error_fields(exc)}
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

    def handle(self, message: Dict[str, Any]) -> object:
        op = message.get("op")
        if op == "start":
            if self.proxy is not None:
                raise RuntimeError("the proxy host is already serving")
            # A process group's children share one port (this process serves nothing else).
            self.proxy = _ChildProxy(str(message["host"]), int(message["port"]),
                                     bool(message.get("reuse_port")), bool(message.get("held")),
                                     **dict(message.get("timeouts") or {})).start()
            return {"port": self.proxy.port, "pid": os.getpid()}
        if op == "stop":
            return None
        proxy = self.proxy
        if proxy is None:
            raise RuntimeError("the proxy host is not serving")
        if op == "serve":  # a revival's routes are mounted again: accept connections
            proxy.gate.set()
            return None
        if op in ("mount", "mount_replicas"):
            # A callable (or one whose first read failed) becomes a _PushedValue the parent
            # refreshes.
            pushed = {name: _PushedValue(message.get(name),
                                         message.get(name + "_error")) for name in ("token",
                                                                                    "headers")
                      if name in (message.get("dynamic") or ()) or message.get(name + "_error")}
            token: Token = pushed.get("token") or message.get("token")  # type: ignore[assignment]
            headers: ExtraHeaders = pushed.get("headers") or message.get("headers")
            if op == "mount":
                base_url = proxy.mount(str(message["upstream"]), token, verify=message["verify"],
                                       headers=headers)
            else:
                base_url = proxy.mount_replicas(message["upstreams"], token,
                                                verify=message["verify"],
                                                http=str(message.get("http")))
            # a process group: every child serves the route at the first one's id
            if message.get("route_id"):
                base_url = _rekey_route(proxy, _proxy._route_id(base_url), str(message["route_id"]))
            if pushed:
                self.pushed[_proxy._route_id(base_url)] = pushed
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
            return proxy.add_replica(base_url, message.get("upstream"))  # type: ignore[arg-type]
        if op == "remove_replica":
            return proxy.remove_replica(base_url, str(message.get("upstream")))
        if op == "replica_status":
            return proxy.replica_status(base_url)
        raise ValueError("unknown control request %r" % (op,))


def _host_child_main(argv: List[str]) -> int:
    """`python proxy.py --proxy-host FD PARENT_PID`: serve an AuthProxy for the parent over
    channel FD."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    # a child started from a library thread inherits its blocked set
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    _ask_for_parent_death_signal()
    sock = socket.socket(fileno=fd)
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        return 1
    host = _ProxyHost(sock)
    for name in ("SIGTERM", "SIGHUP"):
        # An ignored signal stays ignored (inherited from the parent: `nohup` ignores SIGHUP), else
        # a hang-up would end this child while its trainer runs on.
        if hasattr(signal, name) and signal.getsignal(getattr(signal, name)) != signal.SIG_IGN:
            signal.signal(getattr(signal, name), host.end_input)
    # Ctrl-C in a terminal reaches the whole foreground group: the parent decides (its teardown
    # still unmounts routes here), and this child ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log.addHandler(_ForwardingHandler(host))
    log.propagate = False
    # this process only runs the proxy (see the constant and the function)
    sys.setswitchinterval(_proxy.CLI_SWITCH_INTERVAL_S)
    _proxy._raise_open_files_limit()
    code = host.serve()
    sock.close()
    return code


def _ask_for_parent_death_signal() -> None:
    """Linux: SIGTERM this process when its parent (thread) dies. Elsewhere EOF on the channel
    does it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the channel's EOF still ends the child
        pass


if __name__ == "__main__":
    if sys.argv[1:2] != [HOST_CHILD_ARG]:
        sys.exit("proxy_host.py is started by AuthProxy.spawn(); to front a job, run `python "
                 "proxy.py URL`")
    sys.exit(_host_child_main(sys.argv[2:]))
