"""A tiny OpenEnv-shaped ASGI app served by uvicorn: the upstream "no one here wrote" for
benchmarks/vs_nginx.py (uvicorn is what OpenEnv servers run on).

    python benchmarks/_asgi_upstream.py [--certfile server.pem --keyfile server.key]

Binds a free loopback port, prints `{"port": P, "pid": PID}` and serves until SIGTERM or stdin closes.
HTTP: `POST /reset`, `POST /step` and `GET /health` answer a small JSON observation. WebSocket at any
path: `reset` / `step` / `close` messages as OpenEnv's `/ws`; a step waits `?delay=<seconds>` (query
of the upgrade request) before answering, like an environment doing work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
from typing import Any, Awaitable, Callable, Dict
from urllib.parse import parse_qs

Receive = Callable[[], Awaitable[Dict[str, Any]]]
Send = Callable[[Dict[str, Any]], Awaitable[None]]

_OBSERVATION = json.dumps({"observation": {"echoed_message": "ok", "message_length": 2},
                           "reward": 0.0, "done": False}).encode()


async def app(scope: Dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_OBSERVATION)).encode())]})
        await send({"type": "http.response.body", "body": _OBSERVATION})
        return
    if scope["type"] == "websocket":
        await _websocket(scope, receive, send)


async def _websocket(scope: Dict[str, Any], receive: Receive, send: Send) -> None:
    query = parse_qs(scope.get("query_string", b"").decode())
    delay = float(query.get("delay", ["0"])[0])
    steps = 0
    while True:
        message = await receive()
        if message["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})
            continue
        if message["type"] == "websocket.disconnect":
            return
        try:
            kind = json.loads(message.get("text") or "{}").get("type")
        except ValueError:
            kind = None
        if kind == "close":
            await send({"type": "websocket.close", "code": 1000})
            return
        if kind == "step":
            steps += 1
            if delay:
                await asyncio.sleep(delay)
        elif kind == "reset":
            steps = 0
        await send({"type": "websocket.send", "text": json.dumps(
            {"type": "observation", "data": {"observation": {"step": steps}, "reward": 0.0, "done": False}})})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--certfile", default=None)
    parser.add_argument("--keyfile", default=None)
    args = parser.parse_args()
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # uvicorn takes an inherited fd for a Unix socket and so never sets TCP_NODELAY on its connections;
    # on Linux accepted sockets inherit it from the listener (without it, Nagle adds 40 ms per answer).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    print(json.dumps({"port": sock.getsockname()[1], "pid": os.getpid()}), flush=True)
    # stdin closing (the harness went away) ends the server too.
    threading.Thread(target=lambda: (sys.stdin.read(), os.kill(os.getpid(), 15)), daemon=True).start()
    uvicorn.run(app, fd=sock.fileno(), ws="wsproto", log_level="warning", access_log=False, lifespan="on",
                backlog=4096, timeout_keep_alive=60, ssl_certfile=args.certfile, ssl_keyfile=args.keyfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
