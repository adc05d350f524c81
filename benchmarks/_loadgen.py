"""Non-blocking WebSocket load generator for benchmarks/ws_scale.py.

One process drives N OpenEnv WebSocket sessions at once from a single `selectors` loop with wsproto:
each session connects, sends `reset`, K `step`s, then `close`, and its phase times are recorded. A
single event loop (no thread per session) keeps the generator cheap, so what the benchmark measures
is the server or proxy under test, not this process. Run by ws_scale.py as a subprocess:

    python benchmarks/_loadgen.py --port 8000 --path /ws --sessions 512 --steps 1 [--wait-go]

It prints one JSON object on stdout: per-session results, the process's own CPU time and wall time.
"""
from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import socket
import sys
import time
from typing import Dict, List, Optional

from wsproto import ConnectionState, ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

# recv size: OpenEnv replies here are a few hundred bytes; 64 KiB drains any burst in one call.
RECV_BYTES = 65536
# Upper bound on one select() wait so the deadline is checked even when nothing happens.
MAX_SELECT_WAIT_S = 0.5
# Only loopback targets: the generator is a benchmark tool, never pointed at another machine.
LOOPBACK_HOSTS = ("127.0.0.1", "::1")

# Session phases, in order. A failed session reports the phase it was in.
CONNECTING, HANDSHAKE, RESET, STEP, BARRIER, CLOSING, DONE = (
    "connect", "handshake", "reset", "step", "barrier", "close", "done")


class Session:
    """One WebSocket session's state machine and its timings (monotonic seconds)."""

    __slots__ = ("idx", "sock", "ws", "phase", "steps_left", "out", "t_start", "t_connected",
                 "t_reset", "step_times", "t_step_sent", "t_done", "error", "text_parts", "sel",
                 "events_mask")

    def __init__(self, idx: int, steps: int) -> None:
        self.idx = idx
        self.sock: Optional[socket.socket] = None
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.phase = CONNECTING
        self.steps_left = steps
        self.out = b""
        self.t_start = 0.0
        self.t_connected = 0.0
        self.t_reset = 0.0
        self.step_times: List[float] = []
        self.t_step_sent = 0.0
        self.t_done = 0.0
        self.error: Optional[str] = None
        self.text_parts: List[str] = []
        self.sel: Optional[selectors.BaseSelector] = None
        self.events_mask = 0

    def result(self) -> Dict[str, object]:
        """Compact, JSON-ready record: phase durations in seconds, None where not reached."""
        def span(a: float, b: float) -> Optional[float]:
            return round(b - a, 6) if a and b else None
        return {
            "ok": self.error is None and self.phase == DONE,
            "error": self.error,
            "start": self.t_start,
            "connect": span(self.t_start, self.t_connected),
            "reset": span(self.t_connected, self.t_reset),
            "steps": [round(s, 6) for s in self.step_times],
            "total": span(self.t_start, self.t_done),
        }


class LoadGenerator:
    """Drives many Sessions against one host:port/path until all finish or the deadline passes."""

    def __init__(self, host: str, port: int, path: str, sessions: int, steps: int,
                 deadline_s: float, message: str = "hi", lockstep: bool = False) -> None:
        self.host, self.port, self.path = host, port, path
        self.n, self.steps, self.deadline_s = sessions, steps, deadline_s
        self.reset_payload = json.dumps({"type": "reset", "data": {}})
        self.step_payload = json.dumps({"type": "step", "data": {"message": message}})
        self.close_payload = json.dumps({"type": "close"})
        self.sel = selectors.DefaultSelector()
        self.sessions = [Session(i, steps) for i in range(sessions)]
        self.active = 0
        # lockstep: like a trainer's batched env.step, every session waits at a barrier until all
        # live sessions have their previous reply, then all send the next step at once.
        self.lockstep = lockstep
        self.waiting: List[Session] = []
        self.family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.host_header = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)

    # -- driving ---------------------------------------------------------------------------------

    def run(self) -> Dict[str, object]:
        """Open every session at once, run the loop to completion or deadline, return results."""
        t0 = time.monotonic()
        cpu0 = time.process_time()
        for s in self.sessions:
            self._open(s)
        deadline = t0 + self.deadline_s
        while self.active > 0:
            now = time.monotonic()
            if now >= deadline:
                break
            for key, mask in self.sel.select(min(MAX_SELECT_WAIT_S, deadline - now)):
                s = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._on_writable(s)
                    if mask & selectors.EVENT_READ and s.phase != DONE and s.error is None:
                        self._on_readable(s)
                except (LocalProtocolError, RemoteProtocolError) as exc:
                    self._fail(s, "protocol:%s:%s" % (s.phase, type(exc).__name__))
        self.lockstep = False  # past the deadline: no barrier releases while failing the rest
        for s in self.sessions:
            if s.phase != DONE and s.error is None:
                self._fail(s, "timeout:%s" % s.phase)
        wall = time.monotonic() - t0
        self.sel.close()
        return {
            "t0": t0,
            "wall_s": wall,
            "cpu_s": time.process_time() - cpu0,
            "sessions": [s.result() for s in self.sessions],
        }

    def _open(self, s: Session) -> None:
        s.t_start = time.monotonic()
        try:
            sock = socket.socket(self.family, socket.SOCK_STREAM)
        except OSError as exc:
            s.error = "socket:%s" % errno.errorcode.get(exc.errno or 0, str(exc))
            s.t_done = time.monotonic()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sock = sock
        s.sel = self.sel
        rc = sock.connect_ex((self.host, self.port))
        if rc not in (0, errno.EINPROGRESS):
            self.active += 1
            self._fail(s, "connect:%s" % errno.errorcode.get(rc, str(rc)))
            return
        self.active += 1
        self._watch(s, selectors.EVENT_WRITE, register=True)

    def _watch(self, s: Session, mask: int, register: bool = False) -> None:
        if register:
            self.sel.register(s.sock, mask, s)
        elif mask != s.events_mask:
            self.sel.modify(s.sock, mask, s)
        s.events_mask = mask

    # -- events ----------------------------------------------------------------------------------

    def _on_writable(self, s: Session) -> None:
        if s.phase == CONNECTING:
            err = s.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._fail(s, "connect:%s" % errno.errorcode.get(err, str(err)))
                return
            s.phase = HANDSHAKE
            self._send(s, s.ws.send(Request(host=self.host_header, target=self.path)))
            return
        self._flush(s)

    def _on_readable(self, s: Session) -> None:
        try:
            data = s.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(s, "%s:%s" % (s.phase, errno.errorcode.get(exc.errno or 0, str(exc))))
            return
        s.ws.receive_data(data or None)
        for event in s.ws.events():
            self._on_ws_event(s, event)
            if s.phase == DONE or s.error is not None:
                return
        if not data:
            # EOF: fine once our close is under way (the server may drop TCP after its close frame).
            if s.phase == CLOSING:
                self._finish(s)
            else:
                self._fail(s, "eof:%s" % s.phase)

    def _on_ws_event(self, s: Session, event: object) -> None:
        if isinstance(event, AcceptConnection):
            s.t_connected = time.monotonic()
            s.phase = RESET
            self._send(s, s.ws.send(TextMessage(data=self.reset_payload)))
        elif isinstance(event, (RejectConnection, RejectData)):
            code = getattr(event, "status_code", "")
            self._fail(s, "rejected:%s" % code if code else "rejected")
        elif isinstance(event, TextMessage):
            s.text_parts.append(event.data)
            if event.message_finished:
                text, s.text_parts = "".join(s.text_parts), []
                self._on_reply(s, text)
        elif isinstance(event, BytesMessage):
            self._fail(s, "binary-reply:%s" % s.phase)
        elif isinstance(event, Ping):
            # A ping that crosses our close (uvicorn pings every 20 s) gets no pong: wsproto refuses to
            # send one once the close is sent, and the session is ending anyway.
            if s.ws.state is ConnectionState.OPEN:
                self._send(s, s.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            if s.phase == CLOSING:
                self._finish(s)
            else:
                self._fail(s, "closed-by-peer:%s:%s" % (s.phase, event.code))

    def _on_reply(self, s: Session, text: str) -> None:
        now = time.monotonic()
        reply_rejection = _reply_rejection(text)
        if reply_rejection is not None:
            self._fail(s, "reply:%s:%s" % (s.phase, reply_rejection))
            return
        if s.phase == RESET:
            s.t_reset = now
        elif s.phase == STEP:
            s.step_times.append(now - s.t_step_sent)
            s.steps_left -= 1
        else:
            return  # a stray message while closing: harmless, ignored
        if s.steps_left > 0 and self.lockstep:
            s.phase = BARRIER
            self.waiting.append(s)
            self._release_barrier()
        elif s.steps_left > 0:
            self._send_step(s)
        else:
            s.phase = CLOSING
            self._send(s, s.ws.send(TextMessage(data=self.close_payload))
                       + s.ws.send(CloseConnection(code=1000)))

    def _send_step(self, s: Session) -> None:
        s.phase = STEP
        s.t_step_sent = time.monotonic()
        self._send(s, s.ws.send(TextMessage(data=self.step_payload)))

    def _release_barrier(self) -> None:
        """In lockstep, send everyone's next step once every live session is waiting."""
        if self.waiting and len(self.waiting) >= self.active:
            released, self.waiting = self.waiting, []
            for s in released:
                if s.sock is not None and s.error is None:
                    self._send_step(s)

    # -- I/O helpers -----------------------------------------------------------------------------

    def _send(self, s: Session, data: bytes) -> None:
        s.out += data
        self._flush(s)

    def _flush(self, s: Session) -> None:
        if s.out:
            try:
                sent = s.sock.send(s.out)
                s.out = s.out[sent:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self._fail(s, "send:%s:%s" % (s.phase, errno.errorcode.get(exc.errno or 0, "")))
                return
        self._watch(s, selectors.EVENT_READ | (selectors.EVENT_WRITE if s.out else 0))

    def _finish(self, s: Session) -> None:
        s.t_done = time.monotonic()
        s.phase = DONE
        self._drop(s)

    def _fail(self, s: Session, reason: str) -> None:
        if s.error is None:
            s.error = reason
        s.t_done = time.monotonic()
        self._drop(s)

    def _drop(self, s: Session) -> None:
        if s.sock is not None:
            try:
                self.sel.unregister(s.sock)
            except (KeyError, ValueError):
                pass
            s.sock.close()
            s.sock = None
            self.active -= 1
            if self.lockstep:
                if s.phase == BARRIER:
                    self.waiting.remove(s)
                self._release_barrier()


def _reply_rejection(text: str) -> Optional[str]:
    """Why an OpenEnv WebSocket reply is not a successful observation, or None when it is."""
    try:
        reply = json.loads(text)
    except ValueError:
        return "not-json"
    if not isinstance(reply, dict):
        return "not-an-object"
    if reply.get("type") != "observation":
        data = reply.get("data") if isinstance(reply.get("data"), dict) else {}
        return "%s:%s" % (reply.get("type"), data.get("code", ""))
    return None


def raise_nofile_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", choices=LOOPBACK_HOSTS)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", default="/ws")
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="stop waiting after this long; unfinished sessions count as timeouts")
    parser.add_argument("--lockstep", action="store_true",
                        help="all sessions step together, like a trainer's batched env.step")
    parser.add_argument("--wait-go", action="store_true",
                        help="print 'ready', then wait for a line on stdin before starting")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.steps < 0 or args.deadline_s <= 0:
        parser.error("--sessions must be >= 1, --steps >= 0 and --deadline-s > 0")
    limit = raise_nofile_limit()
    if args.sessions + 32 > limit:
        parser.error("--sessions %d needs more open files than RLIMIT_NOFILE allows (%d); raise "
                     "the hard limit (ulimit -Hn) or split sessions across processes"
                     % (args.sessions, limit))
    gen = LoadGenerator(args.host, args.port, args.path, args.sessions, args.steps, args.deadline_s,
                        lockstep=args.lockstep)
    if args.wait_go:
        print("ready", flush=True)
        if not sys.stdin.readline():
            return 1  # the harness went away before saying go
    out = gen.run()
    json.dump(out, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
