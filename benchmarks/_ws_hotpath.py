"""Instructions and system calls per WebSocket round trip and per session, AuthProxy against the floor.

    python benchmarks/_ws_hotpath.py [--round-trips 1000] [--sessions 256] [--upstreams plain,tls]
                                     [--targets floor,proxy] [--baseline DIR] [--tool callgrind|strace|both]

The WebSocket companion of benchmarks/_hotpath.py (HTTP), load-independent where vs_nginx.py's `ws_rt`
and `upgrades` figures move with whatever else the shared machine runs. The forwarder (the floor,
benchmarks/_floor.py, or AuthProxy in its own process, benchmarks/_proxy_host.py; `--baseline DIR` adds
the AuthProxy of another checkout, e.g. main's, as target "baseline") runs under callgrind with
instrumentation off; after a warm-up (64 sessions, 50 round trips), instrumentation is on for
`--round-trips` round trips on one open session (a step message echoed by the upstream), dumped, then
on for `--sessions` sessions opened in batches of SESSION_BATCH (connect, upgrade, one reset, close).
strace -c -f counts each process's system calls over the same load (futex included: on this path they
are the GIL changing hands), warm-up excluded by difference. Neither is a time. The upstream is
benchmarks/_asgi_upstream.py (uvicorn), plain or TLS, as in vs_nginx.py; the client is this process.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(REPO, "tests"))  # support.make_test_ca: the tests' throwaway CA
import ws_scale as scale  # noqa: E402
from _hotpath import _control, _spawn, _strace_counts  # noqa: E402
from vs_nginx import _ws_wait as _wait  # noqa: E402

# Sessions opened at once per batch: enough that set-ups overlap (as in a burst), few enough that the
# client, one blocking thread, keeps up.
SESSION_BATCH = 32
# Warm-up before counting: every worker parked, the relay thread started, every code path translated
# (callgrind translates code on first use; that is not per-session work).
WARMUP_SESSIONS, WARMUP_ROUND_TRIPS = 64, 50
# How long a forwarder under valgrind may take to start (Python's start-up runs 30-50x slower there).
START_TIMEOUT_S = 180.0
STEP = '{"type": "step", "data": {"message": "x"}}'
RESET = '{"type": "reset", "data": {}}'


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--upstreams", default="plain,tls")
    parser.add_argument("--targets", default="floor,proxy")
    parser.add_argument("--baseline", metavar="DIR", help="a checkout whose AuthProxy runs as target 'baseline'")
    parser.add_argument("--tool", choices=("callgrind", "strace", "both"), default="both")
    args = parser.parse_args(argv)
    for tool in (["valgrind", "callgrind_control"] if args.tool != "strace" else []) + (
            ["strace"] if args.tool != "callgrind" else []):
        if not shutil.which(tool):
            raise SystemExit("%s is not installed: apt-get install -y valgrind strace" % tool)
    workdir = tempfile.mkdtemp(prefix="ws-hotpath-")
    import support

    ca = support.make_test_ca(workdir)
    targets = args.targets.split(",") + (["baseline"] if args.baseline else [])
    rows: List[Dict[str, object]] = []
    upstreams: Dict[str, Tuple[int, subprocess.Popen]] = {}
    try:
        for kind in args.upstreams.split(","):
            extra = ["--certfile", ca.cert_path, "--keyfile", ca.key_path] if kind == "tls" else []
            proc, info = _spawn([sys.executable, os.path.join(HERE, "_asgi_upstream.py")] + extra, 30.0, REPO)
            upstreams[kind] = (int(info["port"]), proc)
        for kind in args.upstreams.split(","):
            url = "%s://127.0.0.1:%d" % ("https" if kind == "tls" else "http", upstreams[kind][0])
            verify = ["--verify", ca.ca_path] if kind == "tls" else []
            for target in targets:
                root = args.baseline if target == "baseline" else REPO
                script = "_floor.py" if target == "floor" else "_proxy_host.py"
                cmd = [sys.executable, os.path.join(root, "benchmarks", script), url] + verify
                row: Dict[str, object] = {"target": target, "upstream": kind}
                if args.tool in ("callgrind", "both"):
                    row.update(_instructions(cmd, root, workdir, args.round_trips, args.sessions))
                if args.tool in ("strace", "both"):
                    row.update(_syscalls(cmd, root, workdir, args.round_trips, args.sessions))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for _, proc in upstreams.values():
            scale._stop_child(proc, terminate_first=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print(_table(rows))
    return 0


def _instructions(cmd: List[str], root: str, workdir: str, round_trips: int, sessions: int) -> Dict[str, float]:
    """User-space instructions per round trip and per session of the forwarder `cmd` (callgrind)."""
    out = os.path.join(workdir, "callgrind.out.%d" % time.monotonic_ns())
    proc, info = _spawn(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=" + out] + cmd,
                        START_TIMEOUT_S, root)
    try:
        port, path = _port_path(str(info["base_url"]))
        _sessions(port, path, WARMUP_SESSIONS)
        sock, conn = _open(port, path, WARMUP_ROUND_TRIPS)
        _control(proc.pid, "-i", "on")
        _round_trips(sock, conn, round_trips)
        _control(proc.pid, "-i", "off")
        _control(proc.pid, "-d")  # the round trips' counts go to their own dump (out.1); counters reset
        sock.close()
        time.sleep(0.5)  # the relay (or the pump threads) ends that session uncounted
        _control(proc.pid, "-i", "on")
        _sessions(port, path, sessions)
        time.sleep(1.0)  # the last sessions' ends
        _control(proc.pid, "-i", "off")
    finally:
        scale._stop_child(proc, terminate_first=True)
    totals = {path: _total(path) for path in glob.glob(out + "*")}
    return {"instr_per_round_trip": totals.get(out + ".1", 0) / round_trips,
            "instr_per_session": totals.get(out, 0) / sessions}


def _total(path: str) -> int:
    total = 0
    with open(path) as fh:
        for line in fh:
            if line.startswith(("totals:", "summary:")):
                total = max(total, int(line.split()[1]))
    return total


def _syscalls(cmd: List[str], root: str, workdir: str, round_trips: int, sessions: int) -> Dict[str, object]:
    """System calls per round trip and per session (strace -c -f), warm-up excluded by difference: one run
    with the warm-up only, one with the round trips added, one with the sessions added."""
    counts = []
    for rts, n in ((0, 0), (round_trips, 0), (0, sessions)):
        out = os.path.join(workdir, "strace.%d" % time.monotonic_ns())
        proc, info = _spawn(["strace", "-f", "-c", "-o", out] + cmd, START_TIMEOUT_S, root)
        try:
            port, path = _port_path(str(info["base_url"]))
            _sessions(port, path, WARMUP_SESSIONS + n)
            sock, conn = _open(port, path, WARMUP_ROUND_TRIPS + rts)
            sock.close()
            time.sleep(0.5)
        finally:
            scale._stop_child(proc, terminate_first=True)
        counts.append(_strace_counts(out))

    def per(later: Dict[str, int], n: int) -> Dict[str, float]:
        names = set(counts[0]) | set(later)
        each = {name: (later.get(name, 0) - counts[0].get(name, 0)) / float(n) for name in names}
        return {name: round(v, 2) for name, v in sorted(each.items(), key=lambda kv: -kv[1]) if v >= 0.05}

    rt, ss = per(counts[1], round_trips), per(counts[2], sessions)
    return {"syscalls_per_round_trip": round(sum(rt.values()), 1), "futex_per_round_trip": rt.get("futex", 0.0),
            "syscalls_per_session": round(sum(ss.values()), 1), "futex_per_session": ss.get("futex", 0.0),
            "top_per_session": list(ss.items())[:6]}





def _port_path(base_url: str) -> Tuple[int, str]:
    """(port, WebSocket request target) of a forwarder's base URL (the proxy's has a route path)."""
    rest = base_url.split("://", 1)[1]
    hostport, _, path = rest.partition("/")
    return int(hostport.rsplit(":", 1)[1]), ("/" + path if path else "") + "/ws"



def _open(port: int, path: str, round_trips: int) -> Tuple[socket.socket, WSConnection]:
    """One session, upgraded, after one reset and `round_trips` steps."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = WSConnection(ConnectionType.CLIENT)
    sock.sendall(conn.send(Request(host="localhost", target=path)))
    _wait(sock, conn, AcceptConnection)
    sock.sendall(conn.send(TextMessage(data=RESET)))
    _wait(sock, conn, TextMessage)
    _round_trips(sock, conn, round_trips)
    return sock, conn


def _round_trips(sock: socket.socket, conn: WSConnection, n: int) -> None:
    step = conn.send(TextMessage(data=STEP))
    for _ in range(n):
        sock.sendall(step)
        _wait(sock, conn, TextMessage)


def _sessions(port: int, path: str, n: int) -> None:
    """n sessions, SESSION_BATCH open at once: each upgraded, reset once, then closed (close handshake, EOF)."""
    done = 0
    while done < n:
        batch = [_open(port, path, 0) for _ in range(min(SESSION_BATCH, n - done))]
        for sock, conn in batch:
            sock.sendall(conn.send(CloseConnection(code=1000)))
        for sock, _ in batch:
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
            sock.close()
        done += len(batch)


def _table(rows: List[Dict[str, object]]) -> str:
    lines = ["| upstream | target | instructions per round trip | per session | system calls per round trip (futex) "
             "| per session (futex) |", "|---|---|--:|--:|--:|--:|"]
    for row in rows:
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            row["upstream"], row["target"], _k(row.get("instr_per_round_trip")), _k(row.get("instr_per_session")),
            _calls(row, "round_trip"), _calls(row, "session")))
    return "\n".join(lines)


def _k(x: object) -> str:
    return "%.1fk" % (float(x) / 1000) if isinstance(x, (int, float)) else "-"  # type: ignore[arg-type]


def _calls(row: Dict[str, object], per: str) -> str:
    total = row.get("syscalls_per_" + per)
    return "-" if total is None else "%s (%s)" % (total, row.get("futex_per_" + per))


if __name__ == "__main__":
    sys.exit(main())
