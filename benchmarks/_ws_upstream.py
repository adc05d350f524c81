"""Minimal non-blocking OpenEnv-compatible WebSocket upstream for benchmarks/ws_scale.py.

It speaks the same `/ws` messages as OpenEnv's server and the emulator's echo server (`reset`,
`step`, `state`, `close`; replies `{"type": "observation"|"state"|"error", "data": {...}}`) and
answers each `step` after a fixed server-side wait, like the scaling tutorial's benchmark
environment. One `selectors` loop holds every session and a timer heap replaces a sleeping thread
per step, so thousands of concurrent sessions cost it almost nothing: the benchmark then measures
the proxy, not the environment server. Run by ws_scale.py as a subprocess:

    python benchmarks/_ws_upstream.py --port 0 --step-delay-s 1.0

It prints `{"port": P}` on stdout once listening and serves until stdin closes (or SIGTERM).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import List, Optional, Tuple

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

# Listen backlog: at most net.core.somaxconn is used by the kernel; ask for plenty so a burst of
# thousands of simultaneous connects is queued rather than dropped (the generator opens all at once).
LISTEN_BACKLOG = 65535
RECV_BYTES = 65536
# Loopback only: a benchmark upstream has no business listening on other interfaces.
LOOPBACK_HOSTS = ("127.0.0.1", "::1")


class Conn:
    """One client connection: its wsproto state, pending output and partial text message."""

    __slots__ = ("sock", "ws", "out", "parts", "steps", "closing", "mask")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ws = WSConnection(ConnectionType.SERVER)
        self.out = b""
        self.parts: List[str] = []
        self.steps = 0
        self.closing = False
        self.mask = 0


class MiniUpstream:
    """The single-threaded server: accept, handshake, answer messages, delay steps by a timer."""

    def __init__(self, host: str, port: int, step_delay_s: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen(LISTEN_BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.step_delay_s = step_delay_s
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.timers: List[Tuple[float, int, Conn, str]] = []
        self.seq = itertools.count()
        self.running = True

    def serve(self, stop_fd: Optional[int] = None) -> None:
        """Serve until `stop()` or until `stop_fd` (the parent's stdin) reaches EOF."""
        if stop_fd is not None:
            self.sel.register(stop_fd, selectors.EVENT_READ, "stop")
        while self.running:
            wait = 1.0
            if self.timers:
                wait = max(0.0, min(wait, self.timers[0][0] - time.monotonic()))
            for key, mask in self.sel.select(wait):
                if key.data is None:
                    self._accept_all()
                elif key.data == "stop":
                    if not os.read(stop_fd, 4096):
                        self.running = False
                else:
                    self._on_event(key.data, mask)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, conn, payload = heapq.heappop(self.timers)
                if conn.sock is not None:
                    self._send_text(conn, payload)
        self.sel.close()
        self.listener.close()

    def stop(self) -> None:
        self.running = False

    # -- machinery -------------------------------------------------------------------------------

    def _accept_all(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # EMFILE and friends: the client sees a refused/queued connect
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock)
            conn.mask = selectors.EVENT_READ
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _on_event(self, conn: Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if conn.sock is None or not mask & selectors.EVENT_READ:
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        try:
            conn.ws.receive_data(data or None)
            for event in conn.ws.events():
                self._on_ws_event(conn, event)
        except (LocalProtocolError, RemoteProtocolError):
            self._drop(conn)
            return
        if not data and conn.sock is not None:
            self._drop(conn)

    def _on_ws_event(self, conn: Conn, event: object) -> None:
        if isinstance(event, Request):
            if event.target.split("?")[0] != "/ws":
                self._send(conn, conn.ws.send(RejectConnection(status_code=404)))
                conn.closing = True
            else:
                self._send(conn, conn.ws.send(AcceptConnection()))
        elif isinstance(event, TextMessage):
            conn.parts.append(event.data)
            if event.message_finished:
                text, conn.parts = "".join(conn.parts), []
                self._on_message(conn, text)
        elif isinstance(event, Ping):
            self._send(conn, conn.ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            if conn.ws.state.name == "REMOTE_CLOSING":
                self._send(conn, conn.ws.send(event.response()))
            conn.closing = True
            self._flush(conn)

    def _on_message(self, conn: Conn, text: str) -> None:
        """OpenEnv message rules: reset answers at once, step after the wait, close ends."""
        try:
            msg = json.loads(text)
            kind = msg.get("type")
        except (ValueError, AttributeError):
            self._send_text(conn, _error("Invalid JSON", "INVALID_JSON"))
            return
        if kind == "reset":
            conn.steps = 0
            self._send_text(conn, _observation("", 0, 0.0))
        elif kind == "step":
            conn.steps += 1
            message = str((msg.get("data") or {}).get("message", ""))
            reply = _observation(message, conn.steps, 0.1 * len(message))
            due = time.monotonic() + self.step_delay_s
            heapq.heappush(self.timers, (due, next(self.seq), conn, reply))
        elif kind == "state":
            self._send_text(conn, json.dumps({"type": "state",
                                              "data": {"step_count": conn.steps}}))
        elif kind == "close":
            self._send(conn, conn.ws.send(CloseConnection(code=1000)))
        else:
            self._send_text(conn, _error("Unknown message type: %s" % kind, "UNKNOWN_TYPE"))

    def _send_text(self, conn: Conn, text: str) -> None:
        try:
            self._send(conn, conn.ws.send(TextMessage(data=text)))
        except LocalProtocolError:
            pass  # the client already closed; a late step reply is simply dropped

    def _send(self, conn: Conn, data: bytes) -> None:
        conn.out += data
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        if conn.sock is None:
            return
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                conn.out = conn.out[sent:]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(conn)
                return
        if conn.closing and not conn.out:
            self._drop(conn)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if mask != conn.mask:
            self.sel.modify(conn.sock, mask, conn)
            conn.mask = mask

    def _drop(self, conn: Conn) -> None:
        if conn.sock is not None:
            try:
                self.sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
            conn.sock.close()
            conn.sock = None


def _observation(echoed: str, step: int, reward: float) -> str:
    return json.dumps({"type": "observation", "data": {
        "observation": {"echoed_message": echoed, "message_length": len(echoed)},
        "reward": reward, "done": False, "step_count": step}})


def _error(message: str, code: str) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code}})


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", choices=LOOPBACK_HOSTS)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-delay-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.step_delay_s < 0:
        parser.error("--step-delay-s must be >= 0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _loadgen import raise_nofile_limit
    raise_nofile_limit()
    server = MiniUpstream(args.host, args.port, args.step_delay_s)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(json.dumps({"port": server.port}), flush=True)
    server.serve(stop_fd=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
