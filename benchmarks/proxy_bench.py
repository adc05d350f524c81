"""Latency cost of AuthProxy on loopback: direct vs proxied, interleaved in one run.

Measures, against the OpenEnv-compatible echo environment (`hf_jobs_emulator echo-server`, run as a
subprocess so it does not share this process's GIL):

- HTTP: `POST /step` on a keep-alive `requests.Session`, direct and through the proxy, alternating
  request by request (the order flips every iteration) so machine noise hits both equally;
- WebSocket: OpenEnv `step` message round trips on one `websockets` session each, alternating too;
- CPU: process CPU seconds per proxied request (the proxy runs in this process, as it does inside a
  training job, so CPU(proxied block) - CPU(direct block) is the proxy's own cost per request).

Prints a table and (with --write) replaces the proxy section of benchmarks/RESULTS.md. Targets: proxied
HTTP p50 <= 1.5x direct; WebSocket round trip adds <= 60 us at p50.

    .venv/bin/python benchmarks/proxy_bench.py --write
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(1, HERE)  # _results: the shared marked-section rewrite

import requests  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from _results import replace_marked_section  # noqa: E402
from proxy import AuthProxy  # noqa: E402

RESULTS = os.path.join(HERE, "RESULTS.md")
START, END = "<!-- proxy_bench:start -->", "<!-- proxy_bench:end -->"
STEP_BODY = {"action": {"message": "hello"}}
WS_STEP = json.dumps({"type": "step", "data": {"message": "hello"}})


def start_upstream(kind: str) -> Tuple[subprocess.Popen, str]:
    """Run the upstream on a free loopback port in its own process; return (process, base URL)."""
    if kind == "echo":
        argv = [sys.executable, "-m", "hf_jobs_emulator", "echo-server", "--port", "0"]
    else:
        argv = [sys.executable, os.path.abspath(__file__), "--serve-upstream"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    match = re.search(r"(http://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit("echo server did not start: %r" % line)
    return proc, match.group(1).rstrip("/")


def serve_upstream() -> int:
    """A minimal OpenEnv-shaped server, like uvicorn on the wire: TCP_NODELAY, each response in one
    write. /reset and /step answer an observation; /ws answers each message with one (wsproto)."""
    import http.server
    import signal
    import socket

    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, CloseConnection, Ping, Request, TextMessage

    observation = json.dumps({"observation": {"echoed_message": "hello", "message_length": 5},
                              "reward": 0.5, "done": False}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if "websocket" in self.headers.get("Upgrade", "").lower():
                self.websocket()
                return
            self.do_POST()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            head = ("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % len(observation)).encode()
            self.wfile.write(head + observation)

        def websocket(self) -> None:
            self.close_connection = True
            ws = WSConnection(ConnectionType.SERVER)
            ws.receive_data(("%s\r\n%s\r\n" % (self.requestline, "".join(
                "%s: %s\r\n" % kv for kv in self.headers.items()))).encode("latin-1"))
            while True:
                out = b""
                for event in ws.events():
                    if isinstance(event, Request):
                        out += ws.send(AcceptConnection())
                    elif isinstance(event, TextMessage):
                        out += ws.send(TextMessage(data='{"type": "observation", "data": %s}' % observation.decode()))
                    elif isinstance(event, Ping):
                        out += ws.send(event.response())
                    elif isinstance(event, CloseConnection):
                        self.connection.sendall(ws.send(event.response()))
                        return
                if out:
                    self.connection.sendall(out)
                data = self.rfile.read1(65536)
                if not data:
                    return
                ws.receive_data(data)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("bench upstream listening on http://127.0.0.1:%d" % server.server_address[1], flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def percentile(samples: List[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def interleave(n: int, direct: Callable[[], None], proxied: Callable[[], None]) -> Tuple[List[float], List[float]]:
    """Time n calls of each, alternating which goes first; seconds per call."""
    a: List[float] = []
    b: List[float] = []
    clock = time.perf_counter
    for i in range(n):
        order = ((direct, a), (proxied, b)) if i % 2 == 0 else ((proxied, b), (direct, a))
        for fn, out in order:
            t0 = clock()
            fn()
            out.append(clock() - t0)
    return a, b


def cpu_per_call(n: int, fn: Callable[[], None]) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def bench(http_n: int, ws_n: int, upstream: str) -> Dict[str, float]:
    echo, url = start_upstream(upstream)
    try:
        with AuthProxy() as proxy:
            base = proxy.mount(url, "bench-token")
            direct_s, proxied_s = requests.Session(), requests.Session()

            def http_direct() -> None:
                r = direct_s.post(url + "/step", json=STEP_BODY)
                assert r.status_code == 200, r.text

            def http_proxied() -> None:
                r = proxied_s.post(base + "/step", json=STEP_BODY)
                assert r.status_code == 200, r.text

            for fn in (http_direct, http_proxied):
                fn_reset = direct_s if fn is http_direct else proxied_s
                fn_reset.post((url if fn is http_direct else base) + "/reset", json={})
                for _ in range(200):
                    fn()
            h_direct, h_proxied = interleave(http_n, http_direct, http_proxied)
            cpu_direct = cpu_per_call(http_n // 2, http_direct)
            cpu_proxied = cpu_per_call(http_n // 2, http_proxied)

            with connect(url.replace("http://", "ws://") + "/ws", proxy=None, max_size=None) as wd, \
                    connect(base.replace("http://", "ws://") + "/ws", proxy=None, max_size=None) as wp:
                for ws in (wd, wp):
                    ws.send(json.dumps({"type": "reset", "data": {}}))
                    ws.recv(10)

                def ws_direct() -> None:
                    wd.send(WS_STEP)
                    wd.recv(10)

                def ws_proxied() -> None:
                    wp.send(WS_STEP)
                    wp.recv(10)

                for _ in range(200):
                    ws_direct()
                    ws_proxied()
                w_direct, w_proxied = interleave(ws_n, ws_direct, ws_proxied)
                ws_cpu_direct = cpu_per_call(ws_n // 2, ws_direct)
                ws_cpu_proxied = cpu_per_call(ws_n // 2, ws_proxied)
            direct_s.close()
            proxied_s.close()
    finally:
        echo.terminate()
        try:
            echo.wait(10)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait(10)
    us = 1e6
    return {
        "http_direct_p50": statistics.median(h_direct) * us, "http_proxied_p50": statistics.median(h_proxied) * us,
        "http_direct_p99": percentile(h_direct, 0.99) * us, "http_proxied_p99": percentile(h_proxied, 0.99) * us,
        "http_cpu_direct": cpu_direct * us, "http_cpu_proxied": cpu_proxied * us,
        "ws_direct_p50": statistics.median(w_direct) * us, "ws_proxied_p50": statistics.median(w_proxied) * us,
        "ws_direct_p99": percentile(w_direct, 0.99) * us, "ws_proxied_p99": percentile(w_proxied, 0.99) * us,
        "ws_cpu_direct": ws_cpu_direct * us, "ws_cpu_proxied": ws_cpu_proxied * us,
    }


def report(r: Dict[str, float], command: str, http_n: int, ws_n: int, upstream: str) -> str:
    ratio50 = r["http_proxied_p50"] / r["http_direct_p50"]
    ratio99 = r["http_proxied_p99"] / r["http_direct_p99"]
    added = r["ws_proxied_p50"] - r["ws_direct_p50"]
    lines = [
        "## Proxy latency (benchmarks/proxy_bench.py)",
        "",
        "Command: `%s`  " % command,
        "Machine: %s, Python %s, %d CPUs; %s; load average at the end %.1f (other work on the machine "
        "shows up in the p99 rows first). Upstream: %s, in its own process; "
        "proxy in the benchmark process (as inside a trainer); direct and proxied calls interleaved."
        % (platform.platform(), platform.python_version(), os.cpu_count() or 0,
           time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0],
           "`hf_jobs_emulator echo-server`" if upstream == "echo" else
           "the script's minimal OpenEnv-shaped server (one write per response, TCP_NODELAY, like uvicorn)"),
        "",
        "| measure | direct | proxied | proxied / direct | added |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| HTTP POST /step p50 (%d each) | %.0f us | %.0f us | %.2fx | %.0f us |"
        % (http_n, r["http_direct_p50"], r["http_proxied_p50"], ratio50, r["http_proxied_p50"] - r["http_direct_p50"]),
        "| HTTP POST /step p99 | %.0f us | %.0f us | %.2fx | %.0f us |"
        % (r["http_direct_p99"], r["http_proxied_p99"], ratio99, r["http_proxied_p99"] - r["http_direct_p99"]),
        "| WebSocket step round trip p50 (%d each) | %.0f us | %.0f us | %.2fx | %.0f us |"
        % (ws_n, r["ws_direct_p50"], r["ws_proxied_p50"], r["ws_proxied_p50"] / r["ws_direct_p50"], added),
        "| WebSocket step round trip p99 | %.0f us | %.0f us | %.2fx | %.0f us |"
        % (r["ws_direct_p99"], r["ws_proxied_p99"], r["ws_proxied_p99"] / r["ws_direct_p99"],
           r["ws_proxied_p99"] - r["ws_direct_p99"]),
        "| CPU per HTTP request (client + proxy, this process) | %.0f us | %.0f us | | %.0f us |"
        % (r["http_cpu_direct"], r["http_cpu_proxied"], r["http_cpu_proxied"] - r["http_cpu_direct"]),
        "| CPU per WebSocket round trip (this process) | %.0f us | %.0f us | | %.0f us |"
        % (r["ws_cpu_direct"], r["ws_cpu_proxied"], r["ws_cpu_proxied"] - r["ws_cpu_direct"]),
        "",
        "Targets: HTTP p50 ratio <= 1.5x: **%s** (%.2fx). WebSocket p50 added <= 60 us: **%s** (%.0f us)."
        % ("met" if ratio50 <= 1.5 else "NOT met", ratio50, "met" if added <= 60 else "NOT met", added),
    ]
    return "\n".join(lines) + "\n"


def write_results(section: str) -> None:
    """Replace only the proxy section of RESULTS.md (other benchmarks own the rest)."""
    replace_marked_section(RESULTS, START, END, "%s\n%s%s\n" % (START, section, END))


def main(argv: List[str] = None) -> int:  # type: ignore[assignment]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--http-n", type=int, default=3000, help="timed HTTP requests per side (default 3000)")
    parser.add_argument("--ws-n", type=int, default=5000, help="timed WebSocket round trips per side (default 5000)")
    parser.add_argument("--upstream", choices=["bench", "echo"], default="bench",
                        help="bench: a minimal server that answers in one write with TCP_NODELAY, like uvicorn "
                             "(default); echo: hf_jobs_emulator's echo-server")
    parser.add_argument("--write", action="store_true", help="update the proxy section of benchmarks/RESULTS.md")
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_upstream:
        return serve_upstream()
    if args.http_n < 10 or args.ws_n < 10:
        parser.error("--http-n and --ws-n must be at least 10")
    results = bench(args.http_n, args.ws_n, args.upstream)
    command = "python benchmarks/proxy_bench.py" + "".join(
        " %s" % a for a in (argv if argv is not None else sys.argv[1:]))
    section = report(results, command, args.http_n, args.ws_n, args.upstream)
    print(section)
    if args.write:
        write_results(section)
        print("wrote %s" % RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
