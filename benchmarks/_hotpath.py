"""Instructions and system calls per proxied HTTP request, AuthProxy against the CPython floor.

    python benchmarks/_hotpath.py [--requests 2000] [--connections 64] [--upstreams plain,tls]
                                  [--targets floor,proxy] [--tool callgrind|strace|both] [--write]

A load-independent companion to benchmarks/vs_nginx.py's `http` measure (whose CPU figures move with
whatever else the shared machine runs): the forwarder (benchmarks/_proxy_host.py, or the floor,
benchmarks/_floor.py) runs under `valgrind --tool=callgrind` with instrumentation off; once a warm-up
has filled its pools, instrumentation is switched on (`callgrind_control -i on`) for exactly
`--requests` requests and off again, so the count covers steady-state requests only. The client is
this process: `--connections` keep-alive connections, one `POST /step` in flight on each (wrk's
request, byte for byte), against the same uvicorn upstream as vs_nginx.py (benchmarks/_asgi_upstream.py,
plain or TLS). User-space instructions are the forwarder's own work (Python, OpenSSL, libc); the
kernel's share is counted separately as system calls per request (`strace -f -c` over the same load,
warm-up excluded by difference; futex calls, the GIL's hand-offs, are left out of the table: strace
slows every call and so changes how often threads contend). The callgrind run also counts the GIL's
releases per request (calls of PyEval_SaveThread: around each system call and each ssl call; with
many busy threads each can hand the GIL over, a futex and a context switch) and the upstream connections opened while counting: a run that opened any (a TLS handshake
is ~5.6M instructions) is redone, as that is not per-request work, and if the last attempt opened
some too, their connect and handshake are left out of the count. Both figures then repeat to within
a percent or two whatever the machine's load, plain or TLS, which is what a cut of a few percent
needs. Neither is a time: vs_nginx.py stays the published CPU figure. `--write` puts the table in
RESULTS.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(REPO, "tests"))  # support.make_test_ca: the tests' throwaway CA
import ws_scale as scale  # noqa: E402
from _results import replace_marked_section  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_START, SECTION_END = "<!-- hotpath:start -->", "<!-- hotpath:end -->"

# The body of vs_nginx.py's POST /step (an OpenEnv action).
STEP_BODY = b'{"action": {"message": "hello"}}'
# Warm-up requests per connection before counting: every pooled upstream connection exists and every
# code path has run (callgrind translates code on first use; that is not per-request work).
WARMUP_ROUNDS = 5
# How long a forwarder under valgrind may take to start (Python's start-up runs 30-50x slower there).
START_TIMEOUT_S = 180.0
# Counting runs per forwarder: one that opened an upstream connection while counting is redone (see _instructions).
COUNT_ATTEMPTS = 3
# C functions whose calls are counted: the interpreter releasing the GIL (around a system call, or an
# ssl call, even on memory buffers; with many busy threads each release can hand the GIL to another
# thread: a futex and a context switch), and a socket connecting (an upstream connection opened).
COUNTED_CALLS = ("PyEval_SaveThread", "sock_connect")
# The C work of opening an upstream connection (connect, TLS engine, handshake), left out of the
# per-request figure when a run opened some anyway: about 95% of a new connection's cost (the rest,
# its Python and socket options, ~0.35M instructions a connection, stays in).
CONNECTION_SETUP = ("sock_connect", "_ssl__SSLContext__wrap_bio", "_ssl__SSLContext__wrap_socket",
                    "_ssl__SSLSocket_do_handshake")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="counted requests per target (default 2000)")
    parser.add_argument("--connections", type=int, default=64, help="client connections (default 64)")
    parser.add_argument("--upstreams", default="plain,tls")
    parser.add_argument("--targets", default="floor,proxy")
    parser.add_argument("--tool", choices=("callgrind", "strace", "both"), default="both")
    parser.add_argument("--write", action="store_true", help="update the hotpath section of RESULTS.md")
    args = parser.parse_args(argv)
    for tool in (["valgrind", "callgrind_control"] if args.tool != "strace" else []) + (
            ["strace"] if args.tool != "callgrind" else []):
        if not shutil.which(tool):
            raise SystemExit("%s is not installed: apt-get install -y valgrind strace" % tool)
    workdir = tempfile.mkdtemp(prefix="hotpath-")
    import support

    ca = support.make_test_ca(workdir)
    upstreams: Dict[str, Tuple[int, subprocess.Popen]] = {}
    results: List[Dict[str, object]] = []
    try:
        for kind in args.upstreams.split(","):
            extra = ["--certfile", ca.cert_path, "--keyfile", ca.key_path] if kind == "tls" else []
            proc, info = _spawn([sys.executable, os.path.join(HERE, "_asgi_upstream.py")] + extra, 30.0)
            upstreams[kind] = (int(info["port"]), proc)
        for kind in args.upstreams.split(","):
            url = "%s://127.0.0.1:%d" % ("https" if kind == "tls" else "http", upstreams[kind][0])
            for target in args.targets.split(","):
                script = "_proxy_host.py" if target == "proxy" else "_floor.py"
                cmd = [sys.executable, os.path.join(HERE, script), url] + (["--verify", ca.ca_path] if kind == "tls" else [])
                row: Dict[str, object] = {"target": target, "upstream": kind}
                if args.tool in ("callgrind", "both"):
                    row.update(_instructions(cmd, workdir, args.requests, args.connections))
                if args.tool in ("strace", "both"):
                    row["syscalls"] = _syscalls(cmd, workdir, args.requests, args.connections)
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for _, proc in upstreams.values():
            scale._stop_child(proc, terminate_first=True)
        shutil.rmtree(workdir, ignore_errors=True)
    table = _table(results)
    print(table)
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        replace_marked_section(DEFAULT_RESULTS, SECTION_START, SECTION_END, "\n".join([
            SECTION_START,
            "## Instructions and system calls per proxied HTTP request (benchmarks/_hotpath.py)",
            "",
            "`python benchmarks/_hotpath.py --requests %d --connections %d --write` at %s: user-space instructions "
            "(callgrind, warm-up excluded) and system calls other than futex (strace -c) per `POST /step`, with %d "
            "connections each keeping one request in flight, with the GIL's releases per request (PyEval_SaveThread "
            "calls) and the upstream connections opened while counting (a run that opened any is redone, and their "
            "connect and handshake, ~5.6M instructions over TLS and not per-request work, are left out). Both "
            "repeat whatever the load, within a percent or two; neither is a time (the CPU figures are "
            "vs_nginx.py's)." % (args.requests, args.connections, commit,
                                                                       args.connections),
            "", table, "", SECTION_END, ""]))
    return 0


def _instructions(cmd: List[str], workdir: str, requests: int, connections: int) -> Dict[str, float]:
    """User-space instructions per request of the forwarder `cmd`, counted by callgrind, with the GIL
    releases per request and the upstream connections opened during the count.

    A forwarder that opens an upstream connection while counting (AuthProxy's pool grows when more
    requests are in flight than during the warm-up, which under callgrind's slow, serialised threads
    depends on the machine's load) pays a TLS handshake there: ~5.6M instructions, 5.6k per request
    over 1,000. That is not per-request work, and it was most of the spread between runs over TLS
    (91-190k), so such a run is redone (COUNT_ATTEMPTS in all), the one with the fewest kept, and
    the C work of those connections (CONNECTION_SETUP) is left out of its `instructions`
    (`all_instructions` keeps it)."""
    best: Dict[str, float] = {}
    for _ in range(COUNT_ATTEMPTS):
        out = os.path.join(workdir, "callgrind.out.%d" % time.monotonic_ns())
        proc, info = _spawn(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=" + out]
                            + cmd, START_TIMEOUT_S)
        try:
            client = _Client(str(info["base_url"]), connections)
            client.run(connections * WARMUP_ROUNDS)
            _control(proc.pid, "-i", "on")
            client.run(requests)
            _control(proc.pid, "-i", "off")
            client.close()
        finally:
            scale._stop_child(proc, terminate_first=True)
        total, calls, setup = 0, {}, 0  # type: int, Dict[str, int], int
        for path in glob.glob(out + "*"):
            total = max(total, _callgrind_total(path))
            for name, (count, cost) in _callgrind_calls(path, COUNTED_CALLS + CONNECTION_SETUP).items():
                calls[name] = calls.get(name, 0) + count
                setup += cost if name in CONNECTION_SETUP else 0
        run = {"instructions": (total - setup) / requests, "all_instructions": total / requests,
               "gil_releases": calls["PyEval_SaveThread"] / requests, "connects": calls["sock_connect"]}
        if not best or run["connects"] < best["connects"]:
            best = run
        if not run["connects"]:
            break
    return best


def _callgrind_total(path: str) -> int:
    with open(path) as fh:
        return max([int(line.split()[1]) for line in fh if line.startswith(("totals:", "summary:"))] or [0])


def _callgrind_calls(path: str, names: Tuple[str, ...]) -> Dict[str, Tuple[int, int]]:
    """How many times the counted code called each C function in `names`, and those calls' inclusive
    instructions (callgrind's `calls=` lines, each followed by the call's cost, under the compressed
    `cfn=(id) name` names)."""
    ids: Dict[str, str] = {}
    counts = {name: [0, 0] for name in names}
    called, tally = None, None  # type: Optional[str], Optional[List[int]]
    with open(path) as fh:
        for line in fh:
            if tally is not None:  # the line after calls=: "<position> <inclusive Ir>"
                fields = line.split()
                tally[1] += int(fields[1]) if len(fields) > 1 else 0
                tally = None
            elif line.startswith(("fn=(", "cfn=(")):
                ref, _, name = line.rstrip("\n").partition(" ")
                number = ref[ref.index("(") + 1:ref.index(")")]
                if name:
                    ids[number] = name
                called = ids.get(number) if line.startswith("cfn=") else called
            elif line.startswith("calls=") and called in counts:
                tally = counts[called]  # type: ignore[index]
                tally[0] += int(line[6:].split()[0])
    return {name: (count, cost) for name, (count, cost) in counts.items()}


def _syscalls(cmd: List[str], workdir: str, requests: int, connections: int) -> Dict[str, float]:
    """System calls per request of the forwarder `cmd` (strace -f -c), warm-up excluded by difference."""
    counts = []
    for n in (requests // 4, requests):
        out = os.path.join(workdir, "strace.%d" % time.monotonic_ns())
        proc, info = _spawn(["strace", "-f", "-c", "-o", out] + cmd, START_TIMEOUT_S)
        try:
            client = _Client(str(info["base_url"]), connections)
            client.run(connections * WARMUP_ROUNDS + n)
            client.close()
        finally:
            scale._stop_child(proc, terminate_first=True)
        counts.append(_strace_counts(out))
    names = set(counts[0]) | set(counts[1])
    per = {name: (counts[1].get(name, 0) - counts[0].get(name, 0)) / (requests - requests // 4) for name in names}
    per = {name: round(value, 2) for name, value in sorted(per.items(), key=lambda kv: -kv[1]) if value >= 0.05}
    per["total"] = round(sum(v for v in per.values()), 2)
    return per


def _strace_counts(path: str) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    with open(path) as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                counts[fields[-1]] = int(fields[3])
    return counts


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control"] + list(args) + [str(pid)], check=True, capture_output=True, timeout=120)


def _spawn(cmd: List[str], timeout: float, root: str = REPO) -> Tuple[subprocess.Popen, Dict[str, object]]:
    """Start `cmd` with `root`'s modules first on its path; (the process, the JSON line it printed)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=root), cwd=root)
    line = scale._read_line(proc, timeout)
    try:
        return proc, json.loads(line)
    except ValueError:
        scale._stop_child(proc, terminate_first=True)
        raise RuntimeError("%s did not start: %r%s" % (cmd[0], line, scale._stderr_tail(proc)))


class _Client:
    """`connections` keep-alive connections, each with one request in flight: what wrk -cN does,
    minus its timing."""

    def __init__(self, base_url: str, connections: int) -> None:
        match = re.match(r"http://([^:/]+):(\d+)(/.*)?$", base_url)
        assert match, base_url
        host, port, path = match.group(1), int(match.group(2)), (match.group(3) or "").rstrip("/")
        self.request = (b"POST %s/step HTTP/1.1\r\nHost: %s:%d\r\nContent-Length: %d\r\n"
                        b"Content-Type: application/json\r\n\r\n%s"
                        % (path.encode(), host.encode(), port, len(STEP_BODY), STEP_BODY))
        self.socks = [socket.create_connection((host, port), timeout=120) for _ in range(connections)]
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.bufs = [b""] * connections

    def run(self, requests: int) -> None:
        """Send `requests` requests, keeping one in flight per connection, and read every answer."""
        sent = 0
        live = []
        for i, sock in enumerate(self.socks):
            if sent == requests:
                break
            sock.sendall(self.request)
            sent += 1
            live.append(i)
        while live:
            still = []
            for i in live:
                self._answer(i)
                if sent < requests:
                    self.socks[i].sendall(self.request)
                    sent += 1
                    still.append(i)
            live = still

    def _answer(self, i: int) -> None:
        sock, buf = self.socks[i], self.bufs[i]
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the forwarder closed the connection")
            buf += data
        end = buf.index(b"\r\n\r\n") + 4
        head = buf[:end].lower()
        assert head.startswith(b"http/1.1 200"), head[:200]
        start = head.index(b"\r\ncontent-length:") + 17
        length = int(head[start:head.index(b"\r\n", start)])
        while len(buf) < end + length:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the forwarder closed the connection")
            buf += data
        self.bufs[i] = buf[end + length:]

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def _table(results: List[Dict[str, object]]) -> str:
    lines = ["| upstream | target | instructions / request | GIL releases / request | upstream connections opened while "
             "counting | system calls / request (futex apart) | of which |",
             "|---|---|---|---|---|---|---|"]
    floor = {r["upstream"]: r for r in results if r["target"] == "floor"}
    for r in results:
        ins = r.get("instructions")
        sc = r.get("syscalls")
        f = floor.get(r["upstream"])
        ratio = ""
        if ins and f and f.get("instructions") and r is not f:
            ratio = " (%.2fx floor)" % (ins / f["instructions"])  # type: ignore[operator]
        calls = {k: v for k, v in sc.items() if k not in ("total", "futex")} if sc else {}  # type: ignore[union-attr]
        lines.append("| %s | %s | %s%s | %s | %s | %s | %s |" % (
            r["upstream"], r["target"], "{:,.0f}".format(ins) if ins else "-", ratio,
            "%.2f" % r["gil_releases"] if "gil_releases" in r else "-", r.get("connects", "-"),
            "%.2f" % sum(calls.values()) if sc else "-", ", ".join("%s %.2f" % kv for kv in calls.items()) or "-"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
