"""The CPython floor: the least a thread-per-connection Python forwarder can do, for benchmarks/vs_nginx.py.

    python benchmarks/_floor.py http://127.0.0.1:PORT [--verify CA_PEM] [--processes N] [--busy N]   # or https://

One thread per client connection; HTTP/1.1 keep-alive with one persistent upstream socket per client
connection; request and response heads found with `bytes.find`; bodies framed by Content-Length only;
the bearer token set on every request. A request carrying `Upgrade:` becomes a WebSocket tunnel on a
fresh upstream socket, one thread per direction. With an https upstream both run over TLS (verified
against --verify). No validation, no limits, no error answers, no pool, no logging: everything
`proxy.AuthProxy` does beyond this is what its figures are compared against (ratios "proxy / floor").

`--processes N` forks N-1 more forwarders sharing the port (SO_REUSEPORT, like
`AuthProxy.spawn(processes=N)`), listed in `pids`; they end with the first. `--busy N` spins N empty
loop iterations per request, half before each send: pure Python standing in for a proxy's own work, to
show what that much Python per request costs at 64 connections (benchmarks/gil_convoy.py
--floor-busy); never on in vs_nginx.py.

Prints `{"base_url": ..., "pid": ..., "pids": [...]}` once listening, serves until stdin closes or
SIGTERM. Never a library: it trusts its peers and exists only to be measured.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import sys
import threading
import urllib.parse
from typing import Callable, Optional, Tuple

# What a read asks for: a benchmark request or response fits many times over.
READ_BYTES = 65536
# Thread stacks like the proxy's workers (proxy.WORKER_STACK_BYTES), so RSS compares like for like.
STACK_BYTES = 1024 * 1024
# Any string; nothing checks it (the same role as the proxy's benchmark token). Never a real credential.
BENCH_TOKEN = b"vs-nginx-benchmark-token"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream")
    parser.add_argument("--verify", default=None, metavar="CA_PEM")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--busy", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    busy = (range(args.busy // 2), range(args.busy - args.busy // 2)) if args.busy else None
    parts = urllib.parse.urlsplit(args.upstream)
    address = (parts.hostname, parts.port)
    context = ssl.create_default_context(cafile=args.verify) if parts.scheme == "https" else None
    auth = b"\r\nAuthorization: Bearer " + BENCH_TOKEN

    def connect() -> socket.socket:
        sock = socket.create_connection(address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return context.wrap_socket(sock, server_hostname="localhost") if context else sock

    port, pids = 0, [os.getpid()]
    for index in range(args.processes):  # (forked before any thread starts)
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if args.processes > 1:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(4096)
        port = listener.getsockname()[1]
        if index == args.processes - 1:
            break
        child = os.fork()
        if child == 0:
            pids = []
            break
        pids.append(child)
        listener.close()
    threading.stack_size(STACK_BYTES)

    def end(*_: object) -> None:
        for pid in pids[1:]:  # (the first forwarder's children: theirs is empty)
            os.kill(pid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    threading.Thread(target=lambda: (sys.stdin.read(), end()), daemon=True).start()
    if pids:  # (a forked forwarder's list is empty: only the first reports)
        print(json.dumps({"base_url": "http://127.0.0.1:%d" % port, "pid": os.getpid(), "pids": pids}), flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve, args=(client, connect, auth, busy), daemon=True).start()


def _serve(client: socket.socket, connect: Callable[[], socket.socket], auth: bytes,
           busy: Optional[Tuple[range, range]] = None) -> None:
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    upstream = None
    buf = b""
    try:
        while True:
            head, buf = _read_head(client, buf)
            if head is None:
                return
            lower = head.lower()
            if b"\r\nupgrade:" in lower:
                tunnel = connect()
                tunnel.sendall(head[:-4] + auth + b"\r\n\r\n" + buf)
                _tunnel(client, tunnel)
                return
            length = _content_length(lower)
            while len(buf) < length:
                data = client.recv(READ_BYTES)
                if not data:
                    return
                buf += data
            body, buf = buf[:length], buf[length:]
            if upstream is None:
                upstream = connect()
            if busy:
                for _ in busy[0]:
                    pass
            upstream.sendall(head[:-4] + auth + b"\r\n\r\n" + body)
            answer, rest = _read_head(upstream, b"")
            if answer is None:
                return
            length = _content_length(answer.lower())
            while len(rest) < length:
                data = upstream.recv(READ_BYTES)
                if not data:
                    return
                rest += data
            if busy:
                for _ in busy[1]:
                    pass
            client.sendall(answer + rest)
    except OSError:
        pass
    finally:
        client.close()
        if upstream is not None:
            upstream.close()


def _read_head(sock: socket.socket, buf: bytes):
    """(head through its blank line, bytes past it), or (None, b"") when the peer closed."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            return buf[:end + 4], buf[end + 4:]
        data = sock.recv(READ_BYTES)
        if not data:
            return None, b""
        buf += data


def _content_length(lower_head: bytes) -> int:
    start = lower_head.find(b"\r\ncontent-length:")
    if start < 0:
        return 0
    start += 17
    return int(lower_head[start:lower_head.find(b"\r\n", start)])


def _tunnel(client: socket.socket, upstream: socket.socket) -> None:
    """Copy bytes both ways, one thread per direction, until either side ends."""
    other = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    other.start()
    _pump(client, upstream)
    other.join()
    upstream.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(READ_BYTES)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    for sock in (src, dst):  # wake the other direction
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
