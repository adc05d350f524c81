"""An ASGI app for the differential suite, served by uvicorn (OpenEnv's server) in its own process:
`python tests/upstreams/asgi_app.py [--tls CERT KEY] [--keep-alive S]` prints its port, then serves.

HTTP: see common.py. WebSocket at /ws (token required): echoes text and binary messages; the text
"burst:N:SIZE" answers N binary messages of SIZE bytes; "close:CODE" closes with that code.
"""
from __future__ import annotations

import asyncio
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TOKEN = os.environ.get("DIFF_TOKEN", "")


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "lifespan":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    if scope["type"] == "websocket":
        await _websocket(scope, receive, send, headers)
        return
    body = await common.receive_body(receive)
    target = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
    status, out, payload, options = common.plan(scope["method"], target, body, headers, TOKEN)
    raw = [(n.lower().encode(), v.encode()) for n, v in out]
    if options.get("mode", "length") == "length" or status in (204, 304):
        raw.append((b"content-length", str(len(payload)).encode()))
    if options.get("close"):
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    if options.get("slow"):
        step = max(1, len(payload) // 4)
        for i in range(0, len(payload), step):
            await send({"type": "http.response.body", "body": payload[i:i + step], "more_body": True})
            await asyncio.sleep(0.003)
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": payload})


async def _websocket(scope, receive, send, headers):  # type: ignore[no-untyped-def]
    message = await receive()  # websocket.connect
    if headers.get("authorization") != "Bearer " + TOKEN:
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        text, data = message.get("text"), message.get("bytes")
        if text is not None and text.startswith("burst:"):
            _, n, size = text.split(":")
            for i in range(int(n)):
                await send({"type": "websocket.send", "bytes": common.body_of(int(size))[:int(size)] + b"%d" % i})
        elif text is not None and text.startswith("close:"):
            await send({"type": "websocket.close", "code": int(text.split(":")[1]), "reason": "asked"})
            return
        elif text is not None:
            await send({"type": "websocket.send", "text": text})
        else:
            await send({"type": "websocket.send", "bytes": data})


def main() -> None:
    import uvicorn

    args = sys.argv[1:]
    tls = args[args.index("--tls") + 1:args.index("--tls") + 3] if "--tls" in args else None
    keep_alive = float(args[args.index("--keep-alive") + 1]) if "--keep-alive" in args else 5.0
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="critical", lifespan="off", timeout_keep_alive=keep_alive,
                            ws="websockets", ws_max_size=16 * 1024 * 1024, ws_ping_interval=None,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
