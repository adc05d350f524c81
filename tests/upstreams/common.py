"""What both differential upstreams (uvicorn's ASGI app and the stdlib http.server one) answer, so
one request generator drives either: `GET|POST|... /r?size=N&mode=length|chunked|close&status=S
&gzip=1&slow=1&interim=103&close=1`. Every answer echoes the request it saw in X-Echo-* headers
(method, path, query, body length and SHA-256), so a proxy that alters a request shows up too.
"""
from __future__ import annotations

import gzip
import hashlib
import urllib.parse
from typing import Dict, List, Tuple

TOKEN_HEADER = "authorization"
# Incompressible, non-repeating within any 4 KiB window: truncation or reordering shows.
_BLOCK = b"".join(hashlib.sha256(b"%d" % i).digest() for i in range(128))  # 4 KiB


def body_of(size: int) -> bytes:
    """The deterministic response body of `size` bytes."""
    reps = size // len(_BLOCK) + 1
    return (_BLOCK * reps)[:size]


async def receive_body(receive) -> bytes:  # type: ignore[no-untyped-def]
    """The whole request body of an ASGI HTTP request (its `http.request` messages joined)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def read_chunked(rfile) -> bytes:  # type: ignore[no-untyped-def]
    """A chunked request body from a binary file object (extensions and trailers dropped)."""
    pieces = []
    while True:
        size = int(rfile.readline().split(b";")[0], 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(pieces)
        pieces.append(rfile.read(size))
        rfile.read(2)


def plan(method: str, target: str, body: bytes, headers: Dict[str, str], token: str
         ) -> Tuple[int, List[Tuple[str, str]], bytes, Dict[str, str]]:
    """(status, headers, body, options) for a request; options carry mode/slow/interim/close."""
    parts = urllib.parse.urlsplit(target)
    query = dict(urllib.parse.parse_qsl(parts.query))
    echo = [("X-Echo-Method", method), ("X-Echo-Path", parts.path), ("X-Echo-Query", parts.query),
            ("X-Echo-Body-Len", str(len(body))), ("X-Echo-Body-Sha", hashlib.sha256(body).hexdigest()[:16]),
            ("X-Echo-Custom", headers.get("x-custom", "-"))]
    if headers.get(TOKEN_HEADER) != "Bearer " + token:
        return 401, echo + [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")], b"no token", {}
    try:
        status, size = int(query.get("status", 200)), int(query.get("size", 0))
    except ValueError:  # the fuzz tests send mangled queries
        return 400, echo + [("Content-Type", "text/plain")], b"bad query", {}
    if not 100 <= status <= 599 or size < 0:
        return 400, echo + [("Content-Type", "text/plain")], b"bad query", {}
    payload = body_of(size)
    out = echo + [("Content-Type", "application/octet-stream"), ("X-Multi", "a"), ("X-Multi", "b")]
    if query.get("gzip"):
        payload = gzip.compress(payload, compresslevel=1, mtime=0)
        out.append(("Content-Encoding", "gzip"))
    if status in (204, 304) or 100 <= status < 200:
        payload = b""
    return status, out, payload, query
