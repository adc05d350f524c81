"""An ASGI app, served by uvicorn in its own process, that stalls and floods on demand: the peer the
proxy's timeout and back-pressure tests need. `python tests/upstreams/pressure_app.py [--tls CERT KEY]`
prints its port, then serves. No token check (the tests mount it with a dummy token).

HTTP `GET /r?size=N&stall_after=K&stall_s=S&wait_s=W`: waits W seconds before answering, then sends
N bytes of `common.body_of(N)` with a Content-Length, pausing S seconds after the first K bytes. Every
answer carries `X-Client-Port`, the port of the connection it came in on (which pooled connection the
proxy used), and `X-Body-Sha`, the SHA-256 hex of the request body it read.

WebSocket at any path; `/ws-wait/S` waits S seconds before accepting. Text commands (anything else is
echoed, text or binary):
  "flood:N:SIZE"  answer N binary messages of SIZE bytes (message i ends with its number)
  "deaf:S"        stop reading for S seconds (uvicorn then stops reading the socket: back-pressure),
                  then answer "awake" and echo again
  "close:CODE"    close the WebSocket with CODE (reason "asked")
  "sha"           answer the SHA-256 hex of every binary byte received so far, and the count
  "die:SIZE"      start sending a SIZE-byte message, then end the server process at once: the
                  peer sees the frame cut short and a bare TCP close (no WebSocket close, no TLS
                  close_notify)
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import sys
import urllib.parse
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "lifespan":
        return
    if scope["type"] == "websocket":
        if scope["path"].startswith("/ws-wait/"):
            await asyncio.sleep(float(scope["path"].rsplit("/", 1)[1]))
        await _websocket(receive, send)
        return
    body = await common.receive_body(receive)
    query = dict(urllib.parse.parse_qsl(scope["query_string"].decode()))
    size, stall_after = int(query.get("size", 0)), int(query.get("stall_after", -1))
    await asyncio.sleep(float(query.get("wait_s", 0)))
    payload = common.body_of(size)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(size).encode()), (b"content-type", b"application/octet-stream"),
                            (b"x-client-port", str(scope["client"][1]).encode()),
                            (b"x-body-sha", hashlib.sha256(body).hexdigest().encode())]})
    if 0 <= stall_after < size:
        await send({"type": "http.response.body", "body": payload[:stall_after], "more_body": True})
        await asyncio.sleep(float(query.get("stall_s", 3600)))
        payload = payload[stall_after:]
    await send({"type": "http.response.body", "body": payload})


async def _websocket(receive, send):  # type: ignore[no-untyped-def]
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    digest, count = hashlib.sha256(), 0
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        text, data = message.get("text"), message.get("bytes")
        if data is not None:
            digest.update(data)
            count += len(data)
            await send({"type": "websocket.send", "bytes": data})
        elif text.startswith("flood:"):
            _, n, size = text.split(":")
            block = common.body_of(int(size))
            for i in range(int(n)):
                await send({"type": "websocket.send", "bytes": block + b"%d" % i})
        elif text.startswith("deaf:"):
            await asyncio.sleep(float(text.split(":")[1]))
            await send({"type": "websocket.send", "text": "awake"})
        elif text.startswith("close:"):
            await send({"type": "websocket.close", "code": int(text.split(":")[1]), "reason": "asked"})
            return
        elif text == "sha":
            await send({"type": "websocket.send", "text": "%s %d" % (digest.hexdigest(), count)})
        elif text.startswith("die:"):  # queue one big message, then end before it is all on the wire
            await send({"type": "websocket.send", "bytes": common.body_of(int(text.split(":")[1]))})
            os._exit(0)
        else:
            await send({"type": "websocket.send", "text": text})


def main() -> None:
    import uvicorn

    # uvicorn warns that its "websockets" implementation is deprecated; it is the one the other test
    # upstreams use, and it stops reading the socket while the app does not receive (back-pressure).
    warnings.filterwarnings("ignore", message=".*websockets. implementation is deprecated")
    args = sys.argv[1:]
    tls = args[args.index("--tls") + 1:args.index("--tls") + 3] if "--tls" in args else None
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="critical", lifespan="off", ws="websockets",
                            ws_max_size=64 * 1024 * 1024, ws_ping_interval=None,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
