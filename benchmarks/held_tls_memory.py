"""Where a held TLS WebSocket session's memory goes (docs/performance.md, "Memory per held TLS session").

    python benchmarks/held_tls_memory.py            # about a minute; prints, writes nothing

Two parts, both against vs_nginx.py's TLS uvicorn upstream (its own process):
1. SESSIONS sessions upgraded and held through an AuthProxy in this process (raw client sockets, so
   the clients cost only kernel memory): per session, RSS growth, glibc's heap in use and free-but-held
   (`mallinfo2()`), Python objects (`tracemalloc`), and RSS after one `malloc_trim(0)`.
2. CONNECTIONS bare OpenSSL client connections (no proxy): heap in use per connection after the
   handshake, after the first application bytes were read (TLS 1.3: the server's session tickets are
   processed then), the same with OP_NO_TICKET, and over TLS 1.2.
Linux with glibc only (mallinfo2, malloc_trim).
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
import tracemalloc
from typing import Callable, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import vs_nginx as vs  # noqa: E402
import proxy  # noqa: E402

SESSIONS = 1024  # enough that per-session figures dwarf the proxy's one-time allocations
CONNECTIONS = 400
UPGRADE = (b"GET %s HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL(None)
LIBC.mallinfo2.restype = _MallInfo2


def snapshot() -> Dict[str, float]:
    """KiB: RSS, glibc heap in use and free-but-held, Python objects traced (0 if not tracing)."""
    info = LIBC.mallinfo2()
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return {"rss": rss, "heap_in_use": (info.uordblks + info.hblkhd) / 1024.0, "heap_free": info.fordblks / 1024.0,
            "python": tracemalloc.get_traced_memory()[0] / 1024.0 if tracemalloc.is_tracing() else 0.0}


def per_item(before: Dict[str, float], after: Dict[str, float], n: int) -> Dict[str, float]:
    return {key: round((after[key] - before[key]) / n, 1) for key in before}


def held_sessions(port: int, ca_path: str) -> Dict[str, object]:
    with proxy.AuthProxy() as auth:
        base = auth.mount("https://127.0.0.1:%d" % port, "unused", verify=ca_path)
        request = UPGRADE % (base[len(auth.url):] + "/ws?delay=600").encode()

        def upgrade() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", auth.port), timeout=30)
            sock.sendall(request)
            return sock

        with upgrade() as warm:  # the proxy's one-time allocations (worker threads, TLS context) before measuring
            warm.recv(4096)
        time.sleep(0.5)
        gc.collect()
        LIBC.malloc_trim(0)
        tracemalloc.start()
        before = snapshot()
        socks = [upgrade() for _ in range(SESSIONS)]
        try:
            for sock in socks:
                assert sock.recv(4096).startswith(b"HTTP/1.1 101 ")
            time.sleep(1.0)
            held = snapshot()
            threads = threading.active_count()
            LIBC.malloc_trim(0)
            trimmed = snapshot()
        finally:
            tracemalloc.stop()
            for sock in socks:
                sock.close()
    return {"sessions": SESSIONS, "threads": threads, "per_session_kib": per_item(before, held, SESSIONS),
            "rss_per_session_after_trim_kib": round((trimmed["rss"] - before["rss"]) / SESSIONS, 1)}


def openssl_connections(port: int, context: ssl.SSLContext, read: bool) -> float:
    """Heap in use per bare client connection, KiB, after the handshake (and an upgrade answer read)."""
    LIBC.malloc_trim(0)
    before = snapshot()["heap_in_use"]
    conns = []
    for _ in range(CONNECTIONS):
        tls = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30), server_hostname="localhost")
        if read:
            tls.sendall(UPGRADE % b"/ws")
            tls.recv(65536)
        conns.append(tls)
    grown = (snapshot()["heap_in_use"] - before) / CONNECTIONS
    for tls in conns:
        tls.close()
    return round(grown, 1)


def main() -> int:
    vs.raise_nofile_limit()
    stack = vs.Stack(tempfile.mkdtemp(prefix="held-tls-memory-"))
    try:
        stack.start()
        port, ca = stack.up["tls"][0], stack.ca.ca_path
        print(json.dumps({"held_through_proxy": held_sessions(port, ca)}))

        def context(change: Callable[[ssl.SSLContext], None] = lambda c: None) -> ssl.SSLContext:
            made = ssl.create_default_context(cafile=ca)
            change(made)
            return made

        no_ticket = context(lambda c: setattr(c, "options", c.options | ssl.OP_NO_TICKET))
        tls12 = context(lambda c: setattr(c, "maximum_version", ssl.TLSVersion.TLSv1_2))
        print(json.dumps({"openssl_client_kib_per_connection": {
            "handshake": openssl_connections(port, context(), False),
            "handshake_and_first_read": openssl_connections(port, context(), True),
            "same_with_OP_NO_TICKET": openssl_connections(port, no_ticket, True),
            "tls12_handshake_and_first_read": openssl_connections(port, tls12, True),
            "openssl": ssl.OPENSSL_VERSION}}))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
