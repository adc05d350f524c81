"""Environment steps at a fixed rate, from a process of its own, for benchmarks/trainer_cost.py.

    python benchmarks/_paced.py --port P --path /route/step --kind http|ws --rate 1000 --seconds 5 [--connections 16]

One selectors loop (no thread per connection, so this process costs the machine little) keeps
`--connections` keep-alive HTTP connections (POST `--path`) or WebSocket sessions (`step` messages on
`--path`) and starts one step every 1/rate seconds on a connection that is free; a step that finds no
free connection waits for one (the achieved rate is reported, so a proxy that cannot keep up shows).
Prints `{"ready": true}` once connected, then one JSON line: {"steps", "errors", "seconds", "achieved_per_s", "p50_us", "p99_us", "cpu_s"}.
"""
from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time
from typing import List, Optional

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

# One step's HTTP request body and WebSocket message: an OpenEnv action.
STEP_BODY = b'{"action": {"message": "hello"}}'
STEP_MESSAGE = '{"type": "step", "data": {"message": "hello"}}'
READ_BYTES = 65536
CONNECT_TIMEOUT_S = 10.0


class _Conn:
    __slots__ = ("sock", "ws", "busy", "buf", "started")

    def __init__(self, sock: socket.socket, ws: Optional[WSConnection]) -> None:
        self.sock, self.ws, self.busy, self.buf, self.started = sock, ws, False, b"", 0.0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--kind", choices=("http", "ws"), required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.port, args.path, args.kind, args.rate, args.seconds, args.connections)), flush=True)
    return 0


def run(port: int, path: str, kind: str, rate: float, seconds: float, connections: int) -> dict:
    conns = [_open(port, path, kind) for _ in range(connections)]
    request = (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (path.encode(), len(STEP_BODY), STEP_BODY))
    sel = selectors.DefaultSelector()
    for conn in conns:
        conn.sock.setblocking(False)
        sel.register(conn.sock, selectors.EVENT_READ, conn)
    latencies: List[float] = []
    errors = 0
    print(json.dumps({"ready": True}), flush=True)  # connected (and upgraded): the caller starts its clock
    cpu0, t0 = time.process_time(), time.monotonic()
    due, end = t0, t0 + seconds
    free = list(conns)
    while True:
        now = time.monotonic()
        while due <= now and due < end and free:  # start every step that is due, on a free connection
            conn = free.pop()
            data = request if conn.ws is None else conn.ws.send(TextMessage(data=STEP_MESSAGE))
            conn.busy, conn.started = True, now
            try:
                conn.sock.sendall(data)
            except OSError:
                errors += 1
                continue
            due += 1.0 / rate
        if now >= end and len(free) == len(conns):
            break
        if now >= end + CONNECT_TIMEOUT_S:
            errors += len(conns) - len(free)
            break
        wait = max(0.0, min(due, end) - now) if free and due < end else 0.05
        for key, _ in sel.select(wait):
            conn = key.data
            try:
                data = conn.sock.recv(READ_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(conn.sock)
                errors += 1
                continue
            answer = _answer_complete(conn, data)
            if answer is not None:
                if answer:
                    latencies.append(time.monotonic() - conn.started)
                else:
                    errors += 1
                conn.busy = False
                free.append(conn)
    wall = time.monotonic() - t0
    for conn in conns:
        conn.sock.close()
    latencies.sort()
    pick = lambda q: round(latencies[min(len(latencies) - 1, int(len(latencies) * q))] * 1e6, 1) if latencies else None
    return {"steps": len(latencies), "errors": errors, "seconds": round(wall, 3),
            "achieved_per_s": round(len(latencies) / wall, 1), "p50_us": pick(0.5), "p99_us": pick(0.99),
            "cpu_s": round(time.process_time() - cpu0, 3)}


def _open(port: int, path: str, kind: str) -> _Conn:
    sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if kind == "http":
        return _Conn(sock, None)
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(ws.send(Request(host="127.0.0.1", target=path)))
    while not any(isinstance(e, AcceptConnection) for e in ws.events()):
        data = sock.recv(READ_BYTES)
        if not data:
            raise ConnectionError("the WebSocket upgrade to %s was refused or cut" % path)
        ws.receive_data(data)
    return _Conn(sock, ws)


def _answer_complete(conn: _Conn, data: bytes) -> Optional[bool]:
    """Feed what arrived; None until the step's whole answer is in (HTTP: Content-Length framed), then
    whether it was a success (HTTP 200; a WebSocket observation)."""
    if conn.ws is not None:
        conn.ws.receive_data(data)
        for event in conn.ws.events():
            if isinstance(event, TextMessage) and event.message_finished:
                return '"observation"' in event.data
        return None
    conn.buf += data
    end = conn.buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = conn.buf[:end].lower()
    start = head.find(b"content-length:")
    length = int(head[start + 15:head.find(b"\r\n", start) if head.find(b"\r\n", start) >= 0 else None]) if start >= 0 else 0
    if len(conn.buf) < end + 4 + length:
        return None
    ok = conn.buf.startswith(b"HTTP/1.1 200 ")
    conn.buf = conn.buf[end + 4 + length:]
    return ok


if __name__ == "__main__":
    sys.exit(main())
