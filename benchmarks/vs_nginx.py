"""AuthProxy side by side with nginx and with no proxy at all, on a plain and a TLS upstream.

    python benchmarks/vs_nginx.py --write          # about 6 minutes on 2 cores; updates RESULTS.md
    python benchmarks/vs_nginx.py --quick          # a short look, nothing written

Every party is its own process, so each one's CPU and memory can be read from /proc/<pid>: the
upstream (uvicorn serving benchmarks/_asgi_upstream.py, plain and TLS), nginx (one process:
`master_process off`, one worker's work), AuthProxy (benchmarks/_proxy_host.py, one per upstream)
and the load generators (wrk for HTTP, benchmarks/_loadgen.py for WebSocket sessions, a blocking
wsproto client in this process for round trips). Targets are measured interleaved (direct, nginx,
proxy, rotating the order), repeated, and the median kept; the machine's load average and the CPU
other processes used are recorded with every run, and a run during which other processes used more
than NOISY_CORES is redone (up to NOISY_RETRIES times). nginx comes from the system
(`apt-get install -y nginx wrk`); without nginx or wrk the script says so and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request, TextMessage

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(REPO, "tests"))  # support.make_test_ca: the tests' throwaway CA
import ws_scale as scale  # noqa: E402  (needs HERE on sys.path)
from _loadgen import raise_nofile_limit  # noqa: E402
from _results import replace_marked_section  # noqa: E402

DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_START, SECTION_END = "<!-- vs_nginx:start -->", "<!-- vs_nginx:end -->"
# A run limited with --measures writes its own section, so it never replaces a full run's tables.
SUBSET_START, SUBSET_END = "<!-- vs_nginx:subset:start -->", "<!-- vs_nginx:subset:end -->"
TARGETS = ("direct", "nginx", "floor", "proxy")
# "floor": benchmarks/_floor.py, a minimal thread-per-connection CPython forwarder (keep-alive with one
# upstream socket per client connection, heads found with bytes.find, Content-Length only, the token set;
# a WebSocket tunnel with a thread per direction; TLS upstream for both): what this language and thread
# model can do at all, so every AuthProxy figure is also a ratio to it ("proxy / floor").
# Also in the session grid: AuthProxy in its own process with `python proxy.py`'s GIL switch interval
# (proxy.CLI_SWITCH_INTERVAL_S), which a library inside a trainer cannot set.
CLI_TARGET = "proxy-cli"
CLI_SWITCH_INTERVAL_S = 0.1
UPSTREAMS = ("plain", "tls")
# wrk run length: long enough for thousands of requests, short enough that a noisy neighbour rarely
# lands in it (a noisy run is redone anyway).
WRK_SECONDS = 3.0
QUICK_WRK_SECONDS = 2.0
# Interleaved repetitions per measure; the median is reported.
REPS = 2
QUICK_REPS = 1
# WebSocket round trips per target (after WS_WARMUP untimed ones) for the added-latency measure.
WS_ROUND_TRIPS = 2000
WS_WARMUP = 200
# Sessions opened at once for the upgrade rate (each: connect, upgrade, reset, close).
UPGRADE_SESSIONS = 1024
# Session batches (each: connect, reset, one 1 s step, close), the grid.
SESSION_BATCHES = (512, 2048, 4096)
QUICK_SESSION_BATCHES = (512,)
STEP_DELAY_S = 1.0
# RSS per open session: this many sessions held open at once (each one step of HELD_STEP_S, long
# enough that every session is set up before the first one ends) on a proxy process started for it,
# so memory freed by earlier runs cannot hide what a session costs.
HELD_SESSIONS = 2048
HELD_STEP_S = 12.0
# The GIL switch interval of the proxy's process (--proxy-switch-interval); None: Python's default, as
# inside a trainer.
PROXY_SWITCH_INTERVAL_S: Optional[float] = None
# A run during which other processes kept more than this many cores busy is redone.
NOISY_CORES = 0.75
NOISY_RETRIES = 1
# How long py-spy samples the proxy during each profiled load (a separate, unpublished-timing run).
PROFILE_SECONDS = 4
# Sessions traced with strace -c to count each process's system calls per WebSocket session.
STRACE_SESSIONS = 400
# The JSON body of a /step request (an OpenEnv action).
STEP_BODY = '{"action": {"message": "hello"}}'
# The benchmark token: any string works, nothing checks it; never a real credential.
BENCH_TOKEN = "vs-nginx-benchmark-token"
# The targets.
TARGET_UPGRADES_VS_NGINX = 1.0
TARGET_P99_VS_NGINX = 1.25
TARGET_CPU_PER_REQUEST_US = 150.0
TARGET_RPS_64 = 5000.0
TARGET_P50_VS_NGINX = 2.0
TARGET_RSS_PER_SESSION_KIB = 32.0
TARGET_WS_ADDED_US = 60.0
# The design card's targets (DESIGN.md, "No event loop"), against the CPython floor measured in the
# same run; a held session may cost no more memory than the floor's (TARGET_HELD_VS_FLOOR).
TARGET_CPU_VS_FLOOR = 1.5
TARGET_RPS_VS_FLOOR = 0.67
TARGET_UPGRADES_VS_FLOOR = 0.8
TARGET_ADDED_VS_FLOOR = 1.2
TARGET_HELD_VS_FLOOR = 1.0
# Measures a run can be limited to (--measures): a targeted re-run after a change costs minutes, not 15.
MEASURES = ("http", "ws_rt", "upgrades", "sessions", "held", "syscalls", "profiles")


# --------------------------------------------------------------------------------------------------
# The processes under test
# --------------------------------------------------------------------------------------------------


class Stack:
    """Two uvicorn upstreams (plain, TLS), nginx fronting both, and one AuthProxy per upstream."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.procs: List[subprocess.Popen] = []
        self.env = dict(os.environ, PYTHONPATH=REPO)
        import support

        self.ca = support.make_test_ca(workdir)
        self.up: Dict[str, Tuple[int, int]] = {}  # upstream -> (port, pid)
        self.nginx_ports: Dict[str, int] = {}
        self.nginx_pid = 0
        self.proxy: Dict[Tuple[str, str], Tuple[str, int]] = {}  # (target, upstream) -> (base_url, pid)
        self.floor: Dict[str, Tuple[str, int]] = {}  # upstream -> (base_url, pid) of benchmarks/_floor.py

    def start(self) -> "Stack":
        for kind in UPSTREAMS:
            extra = ["--certfile", self.ca.cert_path, "--keyfile", self.ca.key_path] if kind == "tls" else []
            info = self._spawn([sys.executable, os.path.join(HERE, "_asgi_upstream.py")] + extra)
            self.up[kind] = (int(info["port"]), int(info["pid"]))
        self._start_nginx()
        for kind in UPSTREAMS:
            info = self._spawn(self.floor_command(kind))
            self.floor[kind] = (str(info["base_url"]), int(info["pid"]))
        for target in ("proxy", CLI_TARGET):
            for kind in UPSTREAMS:
                cmd = self.proxy_host_command(kind)
                if target == CLI_TARGET:
                    cmd += ["--switch-interval", str(CLI_SWITCH_INTERVAL_S)]
                info = self._spawn(cmd)
                self.proxy[target, kind] = (str(info["base_url"]), int(info["pid"]))
        return self

    def stop(self) -> None:
        for proc in reversed(self.procs):
            scale._stop_child(proc, terminate_first=True)

    def pid(self, target: str, upstream: str) -> int:
        if target == "direct":
            return self.up[upstream][1]
        if target == "floor":
            return self.floor[upstream][1]
        return self.nginx_pid if target == "nginx" else self.proxy[target, upstream][1]

    def http_url(self, target: str, upstream: str, path: str) -> str:
        """The URL a client uses for `path` on this target (the upstream's own for direct)."""
        if target == "direct":
            scheme = "https" if upstream == "tls" else "http"
            return "%s://127.0.0.1:%d%s" % (scheme, self.up[upstream][0], path)
        if target == "nginx":
            return "http://127.0.0.1:%d/r%s" % (self.nginx_ports[upstream], path)
        if target == "floor":
            return self.floor[upstream][0] + path
        return self.proxy[target, upstream][0] + path

    def ws_target(self, target: str, upstream: str, path: str) -> Tuple[int, str, bool]:
        """(port, request target, client speaks TLS) for a WebSocket session on this target."""
        url = self.http_url(target, upstream, path)
        return _port_and_path(url) + (url.startswith("https"),)

    def proxy_host_command(self, upstream: str) -> List[str]:
        """The command that runs one AuthProxy for `upstream` in its own process (benchmarks/_proxy_host.py)."""
        cmd = [sys.executable, os.path.join(HERE, "_proxy_host.py"), _proxy_upstream_url(self, upstream)]
        if PROXY_SWITCH_INTERVAL_S is not None:
            cmd += ["--switch-interval", str(PROXY_SWITCH_INTERVAL_S)]
        return cmd + ["--verify", self.ca.ca_path] if upstream == "tls" else cmd

    def floor_command(self, upstream: str) -> List[str]:
        """The command that runs the CPython floor forwarder for `upstream` (benchmarks/_floor.py)."""
        cmd = [sys.executable, os.path.join(HERE, "_floor.py"), _proxy_upstream_url(self, upstream)]
        return cmd + ["--verify", self.ca.ca_path] if upstream == "tls" else cmd

    def _spawn(self, cmd: List[str]) -> Dict[str, Any]:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.env, cwd=REPO)
        self.procs.append(proc)
        line = scale._read_line(proc, scale.CHILD_START_TIMEOUT_S)
        try:
            return json.loads(line)
        except ValueError:
            raise RuntimeError("%s did not start: %r%s" % (os.path.basename(cmd[1]), line, scale._stderr_tail(proc)))

    def _start_nginx(self) -> None:
        for kind in UPSTREAMS:
            self.nginx_ports[kind] = _free_port()
        conf = os.path.join(self.workdir, "nginx.conf")
        with open(conf, "w") as fh:
            fh.write(_nginx_conf(self.workdir, self.up, self.nginx_ports, self.ca.ca_path))
        proc = subprocess.Popen(["nginx", "-p", self.workdir, "-c", conf], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        self.nginx_pid = proc.pid
        deadline = time.monotonic() + 10
        while not all(_port_open(p) for p in self.nginx_ports.values()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nginx did not start: %s" % scale._stderr_tail(proc))
            time.sleep(0.05)


def _nginx_conf(workdir: str, up: Dict[str, Tuple[int, int]], ports: Dict[str, int], ca_path: str) -> str:
    """One process (the work of one worker), no logging, keep-alive upstream pools, WebSocket upgrades
    passed through, the bearer header set like AuthProxy does; the TLS upstream verified against the
    test CA, with TLS session reuse (nginx's default)."""
    common = """
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Authorization "Bearer %s";
            proxy_read_timeout 300s;""" % BENCH_TOKEN
    return """
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 20000;
error_log %(dir)s/error.log warn;
pid %(dir)s/nginx.pid;
events { worker_connections 16384; multi_accept on; }
http {
    access_log off;
    client_body_temp_path %(dir)s/body;
    proxy_temp_path %(dir)s/proxy;
    fastcgi_temp_path %(dir)s/fastcgi;
    uwsgi_temp_path %(dir)s/uwsgi;
    scgi_temp_path %(dir)s/scgi;
    map $http_upgrade $connection_upgrade { default upgrade; '' ''; }
    upstream up_plain { server 127.0.0.1:%(plain)d; keepalive 64; }
    upstream up_tls { server 127.0.0.1:%(tls)d; keepalive 64; }
    server {
        listen 127.0.0.1:%(nplain)d backlog=4096;
        location /r/ { proxy_pass http://up_plain/; %(common)s }
    }
    server {
        listen 127.0.0.1:%(ntls)d backlog=4096;
        location /r/ {
            proxy_pass https://up_tls/; %(common)s
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate %(ca)s;
            proxy_ssl_name localhost;
            proxy_ssl_server_name on;
            proxy_ssl_session_reuse on;
        }
    }
}
""" % {"dir": workdir, "plain": up["plain"][0], "tls": up["tls"][0], "nplain": ports["plain"],
       "ntls": ports["tls"], "common": common, "ca": ca_path}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------
# Measuring one run: the target's CPU, everyone else's, the load
# --------------------------------------------------------------------------------------------------


class Meter:
    """CPU of the measured process and of the whole machine across one run, and the load average."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)

    def __enter__(self) -> "Meter":
        self._cpu0 = [scale._cpu_seconds(pid) for pid in self.pids]
        self._sys0 = scale._cpu_seconds(self.pids[0], kernel_only=True) if self.pids else 0.0
        self._busy0 = scale._machine_busy_seconds()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.monotonic() - self._t0
        self.cpu = [scale._cpu_seconds(pid) - c0 for pid, c0 in zip(self.pids, self._cpu0)]
        # the measured (first) process's kernel share: futex and scheduling show up there
        self.sys = scale._cpu_seconds(self.pids[0], kernel_only=True) - self._sys0 if self.pids else 0.0
        self.busy = scale._machine_busy_seconds() - self._busy0
        self.loadavg = _loadavg()

    def others(self, own_cpu: float) -> float:
        """Cores other processes kept busy: machine busy time minus ours (the pids plus `own_cpu`)."""
        return max(0.0, self.busy - sum(self.cpu) - own_cpu) / self.wall if self.wall else 0.0


def _loadavg() -> float:
    try:
        with open("/proc/loadavg") as fh:
            return float(fh.read().split()[0])
    except (OSError, ValueError):
        return -1.0


def _quietest(measure: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """Run `measure` until a run is quiet (others < NOISY_CORES) or the retries are spent; keep the
    quietest run, and count the redone ones."""
    runs = []
    for _ in range(NOISY_RETRIES + 1):
        run = measure()
        runs.append(run)
        if run["others"] <= NOISY_CORES:
            break
    best = min(runs, key=lambda r: r["others"])
    best["redone"] = len(runs) - 1
    return best


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------------
# HTTP: wrk
# --------------------------------------------------------------------------------------------------


def wrk(stack: Stack, target: str, upstream: str, connections: int, seconds: float, script: str) -> Dict[str, Any]:
    url = stack.http_url(target, upstream, "/step")
    threads = 1 if connections == 1 else 2
    pids = [stack.pid(target, upstream)] + ([stack.up[upstream][1]] if target != "direct" else [])

    def once() -> Dict[str, Any]:
        gen0 = _children_cpu()
        with Meter(pids) as meter:
            out = subprocess.run(["wrk", "-t%d" % threads, "-c%d" % connections, "-d%gs" % seconds, "--latency",
                                  "-s", script, url], capture_output=True, text=True, timeout=seconds + 30)
        gen_cpu = _children_cpu() - gen0
        parsed = _parse_wrk(out.stdout)
        requests = parsed["requests"] or 1
        return dict(parsed, cpu_us_per_request=meter.cpu[0] / requests * 1e6, sys_us_per_request=meter.sys / requests * 1e6,
                    target_cpu=meter.cpu[0] / meter.wall,
                    wrk_cpu=gen_cpu / meter.wall, others=meter.others(gen_cpu), loadavg=meter.loadavg)

    return _quietest(once)


def _parse_wrk(text: str) -> Dict[str, Any]:
    def number(pattern: str) -> Optional[float]:
        match = re.search(pattern, text)
        return float(match.group(1)) if match else None

    def latency_us(label: str) -> Optional[float]:
        match = re.search(r"^\s+%s\s+([\d.]+)(us|ms|s)\s*$" % re.escape(label), text, re.M)
        if not match:
            return None
        return float(match.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[match.group(2)]

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    socket_errors = re.search(r"Socket errors: (.*)", text)
    return {"p50_us": latency_us("50%"), "p99_us": latency_us("99%"), "rps": number(r"Requests/sec:\s+([\d.]+)"),
            "requests": int(number(r"(\d+) requests in") or 0),
            "errors": (int(errors.group(1)) if errors else 0), "socket_errors": socket_errors.group(1) if socket_errors else ""}


# --------------------------------------------------------------------------------------------------
# WebSocket: round trips (one blocking client) and sessions at scale (benchmarks/_loadgen.py)
# --------------------------------------------------------------------------------------------------


def ws_round_trips(stack: Stack, target: str, upstream: str, n: int) -> Dict[str, Any]:
    port, path, tls = stack.ws_target(target, upstream, "/ws")

    def once() -> Dict[str, Any]:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            sock = ssl.create_default_context(cafile=stack.ca.ca_path).wrap_socket(sock, server_hostname="localhost")
        conn = WSConnection(ConnectionType.CLIENT)
        times: List[float] = []
        cpu0 = time.process_time()
        with Meter([stack.pid(target, upstream)]) as meter:
            try:
                sock.sendall(conn.send(Request(host="localhost", target=path)))
                _ws_wait(sock, conn, AcceptConnection)
                step = conn.send(TextMessage(data='{"type": "step", "data": {"message": "x"}}'))
                for i in range(n + WS_WARMUP):
                    t0 = time.perf_counter()
                    sock.sendall(step)
                    _ws_wait(sock, conn, TextMessage)
                    if i >= WS_WARMUP:
                        times.append(time.perf_counter() - t0)
                sock.sendall(conn.send(CloseConnection(code=1000)))
            finally:
                sock.close()
        own = time.process_time() - cpu0
        times.sort()
        return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
                "cpu_us_per_rt": meter.cpu[0] / len(times) * 1e6, "others": meter.others(own),
                "loadavg": meter.loadavg}

    return _quietest(once)


def _ws_wait(sock: socket.socket, conn: WSConnection, kind: type) -> None:
    while True:
        for event in conn.events():
            if isinstance(event, kind):
                return
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("peer closed the WebSocket before %s" % kind.__name__)
        conn.receive_data(data)


def ws_sessions(stack: Stack, target: str, upstream: str, n: int, steps: int,
                delay_s: float = STEP_DELAY_S, pid: Optional[int] = None, port_path: Optional[Tuple[int, str]] = None,
                redo_noisy: bool = True) -> Dict[str, Any]:
    """N sessions at once (connect, reset, `steps` x `delay_s` step, close): upgrades/s, total p99, RSS."""
    port, path = port_path or stack.ws_target(target, upstream, "/ws?delay=%g" % delay_s)[:2]
    pid = pid or stack.pid(target, upstream)
    env = dict(stack.env)

    def once() -> Dict[str, Any]:
        before = scale._proc_status(pid)
        sampler = scale._PeakSampler(pid)
        sampler.start()
        try:
            with Meter([pid]) as meter:
                outputs = scale._run_generators(port, path, n, steps, 60.0 + 3 * steps * delay_s, 1, env)
        finally:
            sampler.stop()
        sessions = [s for out in outputs for s in out["sessions"]]
        ok = [s for s in sessions if s["ok"]]
        connected, span = scale.connect_span(sessions)
        peak_open = scale.peak_open_sessions(sessions)
        grown = max(0, sampler.peak_rss_kib - before["rss_kib"])
        gen_cpu = sum(out["cpu_s"] for out in outputs)
        return {"n": n, "success": len(ok) / float(len(sessions)),
                "upgrades_per_s": connected / span if span > 0 else None,
                "total_p99_s": scale.percentile([s["total"] for s in ok], 99),
                "total_p50_s": scale.percentile([s["total"] for s in ok], 50),
                "peak_open": peak_open, "rss_before_kib": before["rss_kib"], "rss_peak_kib": sampler.peak_rss_kib,
                "rss_kib_per_open": grown / peak_open if peak_open else None,
                "threads_peak": sampler.peak_threads, "target_cpu": meter.cpu[0] / meter.wall,
                "cpu_us_per_session": meter.cpu[0] / n * 1e6, "sys_us_per_session": meter.sys / n * 1e6,
                "errors": dict(Counter(s["error"] for s in sessions if not s["ok"]).most_common(3)),
                "others": meter.others(gen_cpu), "loadavg": meter.loadavg}

    return _quietest(once) if redo_noisy else once()


def held_sessions(stack: Stack, upstream: str, target: str = "proxy") -> Dict[str, Any]:
    """RSS per open session: HELD_SESSIONS sessions all open at once through a proxy (or floor) process
    started for this measure (its RSS before them is its idle RSS), peak RSS and threads while they are open.
    A noisy run is redone on a fresh process too: a second batch on the same one reuses what the first freed."""
    def fresh() -> Dict[str, Any]:
        info = stack._spawn(stack.proxy_host_command(upstream) if target == "proxy" else stack.floor_command(upstream))
        proc = stack.procs.pop()
        try:
            return ws_sessions(stack, target, upstream, HELD_SESSIONS, 1, delay_s=HELD_STEP_S, pid=int(info["pid"]),
                               port_path=_port_and_path("%s/ws?delay=%g" % (info["base_url"], HELD_STEP_S)),
                               redo_noisy=False)
        finally:
            scale._stop_child(proc, terminate_first=True)

    return _quietest(fresh)


# --------------------------------------------------------------------------------------------------
# Where the proxy's time goes: py-spy
# --------------------------------------------------------------------------------------------------


def profile(stack: Stack, upstream: str, load: Callable[[str], object], label: str) -> Optional[Dict[str, Any]]:
    """Run a second AuthProxy for `upstream` under py-spy (started by it: attaching to a running
    process fails on this machine) while `load(base_url)` runs; the top functions by inclusive and
    by own samples. Only active samples count (py-spy leaves out threads blocked in I/O)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return {"error": "py-spy not installed (pip install py-spy)"}
    out = os.path.join(stack.workdir, "pyspy-%s-%s.txt" % (label, upstream))
    cmd = [spy, "record", "--gil", "--nonblocking", "-r", "250", "-f", "raw", "-o", out, "--"] + \
        stack.proxy_host_command(upstream)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=stack.env, cwd=REPO)
    try:
        base_url = None
        for _ in range(20):
            line = scale._read_line(proc, scale.CHILD_START_TIMEOUT_S)
            if line.startswith("{"):
                base_url = json.loads(line)["base_url"]
                break
        if base_url is None:
            return {"error": "the profiled proxy did not start" + scale._stderr_tail(proc)}
        deadline = time.monotonic() + PROFILE_SECONDS
        while time.monotonic() < deadline:
            load(base_url)
    finally:
        scale._stop_child(proc)
    if not os.path.exists(out):
        return {"error": "py-spy wrote no profile"}
    return _summarize_stacks(out)


def _port_and_path(url: str) -> Tuple[int, str]:
    """(port, request target) of a loopback http(s) URL."""
    match = re.match(r"https?://127\.0\.0\.1:(\d+)(/.*)$", url)
    assert match, url
    return int(match.group(1)), match.group(2)


def _proxy_upstream_url(stack: Stack, upstream: str) -> str:
    # By address (the test certificate covers 127.0.0.1): a name would add a resolver lookup per new
    # connection that a benchmark on loopback should not measure.
    return "%s://127.0.0.1:%d" % ("https" if upstream == "tls" else "http", stack.up[upstream][0])


def syscalls_per_session(stack: Stack, target: str, upstream: str, n: int = STRACE_SESSIONS) -> Optional[Dict[str, Any]]:
    """System calls the target process makes per WebSocket session (strace -c -f over n sessions,
    set-up to close; its pool warmed first). strace slows every call, so only the counts are kept."""
    if shutil.which("strace") is None:
        return None
    port, path, _ = stack.ws_target(target, upstream, "/ws")
    scale._run_generators(port, path, n, 0, 60.0, 1, stack.env)  # warm: workers parked, pools filled
    out = os.path.join(stack.workdir, "strace-%s-%s.txt" % (target, upstream))
    tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(stack.pid(target, upstream)), "-o", out],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # attaching to thousands of threads takes a moment
        scale._run_generators(port, path, n, 0, 120.0, 1, stack.env)
        time.sleep(0.5)
    finally:
        tracer.terminate()
        tracer.wait(30)
    counts: Dict[str, int] = {}
    try:
        with open(out) as fh:
            for line in fh:
                fields = line.split()
                if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
                    counts[fields[-1]] = int(fields[3])
    except OSError:
        return None
    total = sum(counts.values())
    return {"sessions": n, "per_session": total / float(n), "futex_per_session": counts.get("futex", 0) / float(n),
            "top": sorted(((k, v / float(n)) for k, v in counts.items()), key=lambda kv: -kv[1])[:6]}


def _summarize_stacks(path: str) -> Dict[str, Any]:
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            if "importlib._bootstrap" in stack or "AuthProxy.__exit__" in stack:
                continue  # the proxy process starting up before the load, or stopping after it
            total += n
            frames = [_frame_name(f) for f in stack.split(";") if not f.startswith("process ") and
                      not f.startswith("thread ")]
            for name in set(frames):
                if not name.startswith(_PLUMBING):
                    inclusive[name] += n
            if frames:
                own[frames[-1]] += n
    share = lambda c: [(name, count / float(total)) for name, count in c.most_common(12)] if total else []
    return {"samples": total, "inclusive": share(inclusive), "own": share(own)}


# Frames every sample of a worker passes through (thread start, the pool, the handler's request loop):
# left out of the inclusive list so that it shows where the work is.
_PLUMBING = ("threading.", "socketserver.", "proxy._WorkerPool._work", "proxy._Server._run",
             "proxy._Handler.handle", "proxy._Handler._dispatch")


def _frame_name(frame: str) -> str:
    """`readinto (socket.py:706)` -> `socket.readinto`."""
    match = re.match(r"(.+?) \((?:.*/)?([^/:]+?)(?:\.py)?:\d+\)$", frame.strip())
    return "%s.%s" % (match.group(2), match.group(1)) if match else frame.strip()


# --------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------


def post_script(workdir: str) -> str:
    """Write wrk's Lua script for the POST /step every HTTP measure sends; return its path."""
    script = os.path.join(workdir, "post.lua")
    with open(script, "w") as fh:
        fh.write('wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n'
                 % json.dumps(STEP_BODY))
    return script


def run(quick: bool, say: Callable[[str], None], measures: Sequence[str] = MEASURES) -> Dict[str, Any]:
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit("%s is not installed: apt-get update && apt-get install -y nginx wrk" % tool)
    raise_nofile_limit()
    reps = QUICK_REPS if quick else REPS
    seconds = QUICK_WRK_SECONDS if quick else WRK_SECONDS
    batches = QUICK_SESSION_BATCHES if quick else SESSION_BATCHES
    workdir = tempfile.mkdtemp(prefix="vs-nginx-")
    script = post_script(workdir)
    stack = Stack(workdir)
    result: Dict[str, Any] = {"machine": scale.machine_info(), "reps": reps, "wrk_seconds": seconds,
                              "nginx": subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip(),
                              "runs": [], "profiles": {}}
    try:
        stack.start()
        for target in ("nginx", "floor", "proxy"):
            for upstream in UPSTREAMS:
                result.setdefault("idle_rss_kib", {})["%s/%s" % (target, upstream)] = \
                    scale._proc_status(stack.pid(target, upstream))["rss_kib"]
        order = list(TARGETS)
        for rep in range(reps):
            for upstream in UPSTREAMS:
                for target in order:
                    for measure, fn in (("http_c1", lambda: wrk(stack, target, upstream, 1, seconds, script)),
                                        ("http_c64", lambda: wrk(stack, target, upstream, 64, seconds, script)),
                                        ("ws_rt", lambda: ws_round_trips(stack, target, upstream, WS_ROUND_TRIPS))):
                        if measure.split("_")[0] not in measures and measure not in measures:
                            continue
                        row = dict(fn(), measure=measure, target=target, upstream=upstream, rep=rep)
                        result["runs"].append(row)
                        say(_progress(row))
                    if "upgrades" in measures and (target != "direct" or upstream == "plain"):  # plain ws only
                        row = dict(ws_sessions(stack, target, upstream, UPGRADE_SESSIONS, 0), measure="upgrades",
                                   target=target, upstream=upstream, rep=rep)
                        result["runs"].append(row)
                        say(_progress(row))
            order = order[1:] + order[:1]
        for n in (batches if "sessions" in measures else ()):
            for upstream in UPSTREAMS:
                for target in TARGETS + (CLI_TARGET,):
                    if target == "direct" and upstream == "tls":
                        continue
                    row = dict(ws_sessions(stack, target, upstream, n, 1), measure="sessions", target=target,
                               upstream=upstream, rep=0)
                    result["runs"].append(row)
                    say(_progress(row))
        if "held" in measures:
            result["thread_rss_kib"] = thread_rss_kib()
        for upstream in (UPSTREAMS if "held" in measures else ()):
            for target in ("floor", "proxy"):
                row = dict(held_sessions(stack, upstream, target), measure="held", target=target, upstream=upstream,
                           rep=0)
                result["runs"].append(row)
                say(_progress(row))
        for upstream in (UPSTREAMS if "syscalls" in measures else ()):
            for target in ("nginx", "floor", "proxy"):
                result.setdefault("syscalls", {})["%s/%s" % (target, upstream)] = syscalls_per_session(
                    stack, target, upstream)
        for upstream in (UPSTREAMS if "profiles" in measures else ()):
            result["profiles"]["http_c64/" + upstream] = profile(
                stack, upstream, lambda base: subprocess.run(
                    ["wrk", "-t2", "-c64", "-d1s", "-s", script, base + "/step"], capture_output=True, timeout=30), "http")
            result["profiles"]["upgrades/" + upstream] = profile(
                stack, upstream, lambda base: scale._run_generators(
                    *_port_and_path(base + "/ws"), 512, 0, 60.0, 1, stack.env), "upgrades")
        for target in ("nginx", "floor", "proxy"):
            for upstream in UPSTREAMS:
                result.setdefault("after_rss_kib", {})["%s/%s" % (target, upstream)] = \
                    scale._proc_status(stack.pid(target, upstream))["rss_kib"]
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _progress(row: Dict[str, Any]) -> str:
    keys = [k for k in ("p50_us", "rps", "cpu_us_per_request", "upgrades_per_s", "total_p99_s", "rss_kib_per_open",
                        "success", "errors", "socket_errors") if row.get(k) not in (None, "", {}, 0)]
    shown = " ".join("%s=%s" % (k, ("%.4g" % row[k]) if isinstance(row[k], float) else row[k]) for k in keys)
    return "%-9s %-6s %-5s %s others=%.2f load=%.1f%s" % (row["measure"], row["target"], row["upstream"], shown,
                                                          row["others"], row["loadavg"],
                                                          " (redone %d)" % row["redone"] if row.get("redone") else "")


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def median_of(result: Dict[str, Any], measure: str, target: str, upstream: str, key: str) -> Optional[float]:
    values = [r[key] for r in result["runs"] if r["measure"] == measure and r["target"] == target
              and r["upstream"] == upstream and r.get(key) is not None]
    return statistics.median(values) if values else None


def render(result: Dict[str, Any], command: str) -> str:
    m = result["machine"]
    runs = result["runs"]
    lines = [SECTION_START, "## AuthProxy vs nginx vs direct, plain and TLS upstreams (benchmarks/vs_nginx.py)", "",
             "Command: `%s`  " % command,
             "Machine: %s, %d cores, %s, %s, Python %s; %s (nginx %s). proxy.py at %s. Finished %s." % (
                 m["cpu"], m["cores"], m["mem"], m["kernel"], m["python"], "wrk 4.1", result["nginx"].split("/")[-1],
                 m["proxy_version"], m["when"]),
             "",
             "Upstream: uvicorn (httptools, uvloop, wsproto) serving benchmarks/_asgi_upstream.py, plain and TLS "
             "(test CA, ECDSA P-256). nginx: one process doing one worker's work, keep-alive upstream pools, "
             "TLS session reuse. AuthProxy: benchmarks/_proxy_host.py, one process per upstream, " + (
                 "Python's default GIL switch interval (as inside a trainer)" if PROXY_SWITCH_INTERVAL_S is None
                 else "a GIL switch interval of %g s (--proxy-switch-interval)" % PROXY_SWITCH_INTERVAL_S) + ". Each measure runs direct, nginx and proxy interleaved "
             "(order rotated), %d time(s), median shown; wrk runs last %g s. CPU per request is the measured "
             "process's own /proc/<pid>/stat utime+stime over the run divided by wrk's request count. `direct` "
             "over TLS means the client itself speaks TLS to uvicorn." % (result["reps"], result["wrk_seconds"]),
             ""]
    lines += ["| measure | upstream | direct | nginx | CPython floor | AuthProxy | proxy / floor | proxy / nginx | "
              "proxy / direct |", "|---|---|--:|--:|--:|--:|--:|--:|--:|"]

    def row(label: str, measure: str, key: str, fmt: str, upstream: str) -> None:
        direct, nginx, floor, proxy = [median_of(result, measure, t, upstream, key) for t in TARGETS]
        cells = [fmt % v if v is not None else "-" for v in (direct, nginx, floor, proxy)]
        ratio = lambda a, b: "%.2fx" % (a / b) if a is not None and b else "-"
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            label, upstream, cells[0], cells[1], cells[2], cells[3], ratio(proxy, floor), ratio(proxy, nginx),
            ratio(proxy, direct)))

    for upstream in UPSTREAMS:
        row("HTTP POST /step p50, wrk -c1", "http_c1", "p50_us", "%.0f us", upstream)
        row("CPU per HTTP request (own process), wrk -c1", "http_c1", "cpu_us_per_request", "%.0f us", upstream)
        row("HTTP req/s, wrk -c64", "http_c64", "rps", "%.0f", upstream)
        row("CPU per HTTP request (own process), wrk -c64", "http_c64", "cpu_us_per_request", "%.0f us", upstream)
        row("WebSocket step round trip p50", "ws_rt", "p50_us", "%.0f us", upstream)
        row("WebSocket upgrades/s, %d at once" % UPGRADE_SESSIONS, "upgrades", "upgrades_per_s", "%.0f", upstream)
        row("CPU per WebSocket session (upgrade, reset, close; own process)", "upgrades", "cpu_us_per_session",
            "%.0f us", upstream)
    sessions = [r for r in runs if r["measure"] == "sessions"]
    if sessions:
        lines += ["", "Sessions at once (connect, reset, one 1 s step, close; total = connect to close done):", "",
                  "| sessions | upstream | target | success | total p50 | total p99 | p99 / nginx | upgrades/s | "
                  "open at peak | RSS peak | RSS per open session | threads peak | CPU per session | others | load |",
                  "|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for r in sessions:
            nginx = next((x for x in sessions if x["target"] == "nginx" and x["n"] == r["n"]
                          and x["upstream"] == r["upstream"]), None)
            ratio = "%.2fx" % (r["total_p99_s"] / nginx["total_p99_s"]) if nginx and r["total_p99_s"] and \
                nginx["total_p99_s"] else "-"
            lines.append("| %d | %s | %s | %.1f%% | %s | %s | %s | %s | %d | %.1f MiB | %s | %d | %.0f us | %.2f | %.1f |" % (
                r["n"], r["upstream"], r["target"], 100 * r["success"], _s(r["total_p50_s"]), _s(r["total_p99_s"]),
                ratio, "%.0f" % r["upgrades_per_s"] if r["upgrades_per_s"] else "-", r["peak_open"],
                r["rss_peak_kib"] / 1024.0, "%.1f KiB" % r["rss_kib_per_open"] if r["rss_kib_per_open"] else "-",
                r["threads_peak"], r["cpu_us_per_session"], r["others"], r["loadavg"]))
    held = [r for r in runs if r["measure"] == "held"]
    if held:
        lines += ["", "RSS per open session, measured alone: %d sessions held open at once (one %g s step each) through a "
                  "proxy (or floor) process started for the measure: %s. One CPython thread blocked in recv() costs %s KiB of RSS "
                  "on this machine." % (HELD_SESSIONS, HELD_STEP_S, "; ".join(
                      "%s %s %s KiB per session (%d open, %d threads, RSS %.1f -> %.1f MiB)" % (
                          r["target"], r["upstream"], _n(r["rss_kib_per_open"]), r["peak_open"], r["threads_peak"],
                          r["rss_before_kib"] / 1024.0, r["rss_peak_kib"] / 1024.0) for r in held),
                      _n(result.get("thread_rss_kib")))]
    idle = result.get("idle_rss_kib", {})
    lines += ["", "Idle RSS (after start and one mount, before any request): " + ", ".join(
        "%s %.1f MiB" % (k, v / 1024.0) for k, v in sorted(idle.items())) + ". After the whole run: " + ", ".join(
        "%s %.1f MiB" % (k, v / 1024.0) for k, v in sorted(result.get("after_rss_kib", {}).items())) + "."]
    noisy = [r for r in runs if r["others"] > NOISY_CORES]
    lines += [] if not runs else ["", "Load: load average %.1f-%.1f over the runs; other processes used %.2f cores on average (max %.2f); "
              "%d run(s) redone for noise, %d still above %.1f cores after %d retries (kept, marked by the max)." % (
                  min(r["loadavg"] for r in runs), max(r["loadavg"] for r in runs),
                  statistics.mean(r["others"] for r in runs), max(r["others"] for r in runs),
                  sum(r.get("redone", 0) for r in runs), len(noisy), NOISY_CORES, NOISY_RETRIES)]
    lines += ["", "### Where the proxy's time goes (py-spy --gil, %d s at 250 Hz per load: where the GIL is held, numbers not timed)" % PROFILE_SECONDS, ""]
    for label, prof in sorted(result.get("profiles", {}).items()):
        if not prof or "inclusive" not in prof:
            lines.append("- %s: no profile (%s)" % (label, (prof or {}).get("error", "py-spy not installed")))
            continue
        lines.append("- %s (%d samples) inclusive: %s; own: %s." % (
            label, prof["samples"],
            ", ".join("`%s` %.0f%%" % (n, 100 * s) for n, s in prof["inclusive"][:8]),
            ", ".join("`%s` %.0f%%" % (n, 100 * s) for n, s in prof["own"][:6])))
    calls = {k: v for k, v in result.get("syscalls", {}).items() if v}
    if calls:
        lines += ["", "System calls per WebSocket session (strace -c -f, %d warm sessions, upgrade to close; "
                  "futex is mostly the GIL changing hands): " % STRACE_SESSIONS + "; ".join(
                      "%s %.0f (futex %.0f; %s)" % (k, v["per_session"], v["futex_per_session"],
                                                    ", ".join("%s %.1f" % kv for kv in v["top"] if kv[0] != "futex"))
                      for k, v in sorted(calls.items())) + "."]
    lines += ["", "### Against the targets", ""] + _verdicts(result) + [SECTION_END]
    return "\n".join(lines) + "\n"


def _verdicts(result: Dict[str, Any]) -> List[str]:
    out = []

    def verdict(text: str, ok: Optional[bool], why: str = "") -> None:
        out.append("- %s: **%s**%s" % (text, "met" if ok else ("NOT met" if ok is not None else "not measured"),
                                       " " + why if ok is False and why else ""))

    for upstream in UPSTREAMS:
        up = lambda measure, target, key: median_of(result, measure, target, upstream, key)
        proxy_up, nginx_up = up("upgrades", "proxy", "upgrades_per_s"), up("upgrades", "nginx", "upgrades_per_s")
        setup_why = _setup_bottleneck(result, upstream)
        verdict("%s: upgrades/s >= nginx's (%s vs %s)" % (upstream, _n(proxy_up), _n(nginx_up)),
                None if not proxy_up or not nginx_up else proxy_up >= TARGET_UPGRADES_VS_NGINX * nginx_up, setup_why)
        for n in (2048, 4096):
            p = next((r for r in result["runs"] if r["measure"] == "sessions" and r["n"] == n
                      and r["upstream"] == upstream and r["target"] == "proxy"), None)
            g = next((r for r in result["runs"] if r["measure"] == "sessions" and r["n"] == n
                      and r["upstream"] == upstream and r["target"] == "nginx"), None)
            c = next((r for r in result["runs"] if r["measure"] == "sessions" and r["n"] == n
                      and r["upstream"] == upstream and r["target"] == CLI_TARGET), None)
            if c and g and c["total_p99_s"] and g["total_p99_s"]:
                out.append("- %s: (for comparison, not a target) %s, its own process at a %.1f s GIL switch "
                           "interval like `python proxy.py`: total p99 at %d sessions %.2fx nginx's (%.3f s)" % (
                               upstream, CLI_TARGET, CLI_SWITCH_INTERVAL_S, n, c["total_p99_s"] / g["total_p99_s"],
                               c["total_p99_s"]))
            if p and g and p["total_p99_s"] and g["total_p99_s"]:
                verdict("%s: total p99 at %d sessions <= %.2fx nginx's (%.2fx: %.3f s vs %.3f s)" % (
                    upstream, n, TARGET_P99_VS_NGINX, p["total_p99_s"] / g["total_p99_s"], p["total_p99_s"],
                    g["total_p99_s"]), p["total_p99_s"] <= TARGET_P99_VS_NGINX * g["total_p99_s"] and p["success"] == 1,
                    setup_why)
        cpu = up("http_c64", "proxy", "cpu_us_per_request")
        verdict("%s: proxy CPU per HTTP request <= %.0f us (%s us at 64 connections, %s us at 1)" % (
            upstream, TARGET_CPU_PER_REQUEST_US, _n(cpu), _n(up("http_c1", "proxy", "cpu_us_per_request"))),
            None if cpu is None else cpu <= TARGET_CPU_PER_REQUEST_US, _http_bottleneck(result, upstream, "http_c64"))
        rps = up("http_c64", "proxy", "rps")
        verdict("%s: req/s at 64 connections >= %.0f (%s; direct %s, nginx %s)" % (
            upstream, TARGET_RPS_64, _n(rps), _n(up("http_c64", "direct", "rps")), _n(up("http_c64", "nginx", "rps"))),
            None if rps is None else rps >= TARGET_RPS_64, _http_bottleneck(result, upstream, "http_c64"))
        p50, n50 = up("http_c1", "proxy", "p50_us"), up("http_c1", "nginx", "p50_us")
        verdict("%s: HTTP p50 with wrk -c1 <= %.0fx nginx's (%s us vs %s us)" % (upstream, TARGET_P50_VS_NGINX, _n(p50), _n(n50)),
                None if not p50 or not n50 else p50 <= TARGET_P50_VS_NGINX * n50, _http_bottleneck(result, upstream, "http_c1"))
        added = None
        if up("ws_rt", "proxy", "p50_us") is not None and up("ws_rt", "direct", "p50_us") is not None:
            added = up("ws_rt", "proxy", "p50_us") - up("ws_rt", "direct", "p50_us")
        verdict("%s: WebSocket round trip added <= %.0f us (%s us; nginx adds %s us)" % (
            upstream, TARGET_WS_ADDED_US, _n(added), _n(None if up("ws_rt", "nginx", "p50_us") is None or
                                                         up("ws_rt", "direct", "p50_us") is None else
                                                         up("ws_rt", "nginx", "p50_us") - up("ws_rt", "direct", "p50_us"))),
            None if added is None else added <= TARGET_WS_ADDED_US, _round_trip_bottleneck(result, upstream))
        held = next((r for r in result["runs"] if r["measure"] == "held" and r["upstream"] == upstream
                     and r["target"] == "proxy" and r.get("rss_kib_per_open")), None)
        verdict("%s: RSS per open session <= %.0f KiB (%s KiB with %d sessions held open on a fresh proxy process)" % (
            upstream, TARGET_RSS_PER_SESSION_KIB, _n(held["rss_kib_per_open"] if held else None), HELD_SESSIONS),
            None if not held else held["rss_kib_per_open"] <= TARGET_RSS_PER_SESSION_KIB, _rss_bottleneck(result, upstream))
    out += _floor_verdicts(result)
    return out


def _floor_verdicts(result: Dict[str, Any]) -> List[str]:
    """Issue 22's targets: AuthProxy against the CPython floor (benchmarks/_floor.py) of the same run."""
    out = ["", "Against the CPython floor (issue 22; `proxy / floor` measured side by side):", ""]

    def verdict(text: str, value: Optional[float], limit: float, at_most: bool) -> None:
        ok = None if value is None else (value <= limit if at_most else value >= limit)
        out.append("- %s: %s (%s %.2fx): **%s**" % (text, "-" if value is None else "%.2fx" % value,
                                                    "limit" if at_most else "floor", limit,
                                                    "not measured" if ok is None else ("met" if ok else "NOT met")))

    def ratio(measure: str, key: str, upstream: str) -> Optional[float]:
        p, f = median_of(result, measure, "proxy", upstream, key), median_of(result, measure, "floor", upstream, key)
        return p / f if p is not None and f else None

    for upstream in UPSTREAMS:
        verdict("%s: CPU per HTTP request at 64 connections, proxy / floor <= %.1fx" % (upstream, TARGET_CPU_VS_FLOOR),
                ratio("http_c64", "cpu_us_per_request", upstream), TARGET_CPU_VS_FLOOR, True)
        verdict("%s: req/s at 64 connections, proxy / floor >= %.2fx" % (upstream, TARGET_RPS_VS_FLOOR),
                ratio("http_c64", "rps", upstream), TARGET_RPS_VS_FLOOR, False)
        verdict("%s: WebSocket upgrades/s (%d at once), proxy / floor >= %.1fx" % (
            upstream, UPGRADE_SESSIONS, TARGET_UPGRADES_VS_FLOOR), ratio("upgrades", "upgrades_per_s", upstream),
            TARGET_UPGRADES_VS_FLOOR, False)
        direct = median_of(result, "ws_rt", "direct", upstream, "p50_us")
        p, f = median_of(result, "ws_rt", "proxy", upstream, "p50_us"), median_of(result, "ws_rt", "floor", upstream, "p50_us")
        added = None
        if None not in (direct, p, f) and f - direct > 0:
            added = (p - direct) / (f - direct)  # type: ignore[operator]
        verdict("%s: WebSocket round trip added, proxy / floor <= %.1fx (%s us vs %s us)" % (
            upstream, TARGET_ADDED_VS_FLOOR, _n(None if None in (p, direct) else p - direct),  # type: ignore[operator]
            _n(None if None in (f, direct) else f - direct)), added, TARGET_ADDED_VS_FLOOR, True)  # type: ignore[operator]
    for upstream in UPSTREAMS:
        p, f = median_of(result, "held", "proxy", upstream, "rss_kib_per_open"), \
            median_of(result, "held", "floor", upstream, "rss_kib_per_open")
        verdict("%s: RSS per held session (%d held), proxy / floor <= %.1fx (%s KiB vs %s KiB)" % (
            upstream, HELD_SESSIONS, TARGET_HELD_VS_FLOOR, _n(p), _n(f)),
            ratio("held", "rss_kib_per_open", upstream), TARGET_HELD_VS_FLOOR, True)
    return out


# What would remove each bottleneck: one fixed sentence per kind (the reasoning is in docs/performance.md);
# the measured part of each "why" comes from the run being reported.
REMEDY_SETUP = ("a session costs one hand-off from the listener to a worker, which parses the request, "
                "connects upstream and sets the session up, and one to a second worker for the upstream->client "
                "direction; the rest is Python work per session: one proxy process per core (SO_REUSEPORT) "
                "would spread it")
REMEDY_HTTP = ("what is left is Python work per request (parsing, header building, checks) and one GIL hand-off "
               "per system call with one thread per connection: a C HTTP parser, or one proxy process per core, "
               "would remove it")
REMEDY_ROUND_TRIP = ("each frame is a recv and a send on each direction's thread, a GIL hand-off each way (TLS "
                     "adds the engine's calls under its lock); only a relay outside the interpreter (splice(), or "
                     "nginx) removes it")
REMEDY_RSS = ("an open session holds two threads (one per direction, as the floor's), each a touched stack and "
              "a Python frame stack, and two sockets; an open TLS session also an OpenSSL connection (~35 KiB "
              "with OpenSSL 3.0 once the server's TLS 1.3 session tickets were read), which the proxy cannot "
              "shrink (docs/performance.md)")


def _top_own(result: Dict[str, Any], label: str, n: int = 3) -> str:
    """Where the GIL was held most (py-spy's own time), as a clause of a sentence."""
    prof = result.get("profiles", {}).get(label) or {}
    own = prof.get("own") or []
    top = ", ".join("`%s` %.0f%%" % (name, 100 * share) for name, share in own[:n])
    return "GIL held most in %s" % top if top else "the GIL was not profiled in this run"


def _setup_bottleneck(result: Dict[str, Any], upstream: str) -> str:
    """WebSocket set-up: system calls and futex per session (strace), CPU per session split user/sys,
    and where the GIL is held (py-spy)."""
    calls = (result.get("syscalls") or {}).get("proxy/" + upstream) or {}
    nginx_calls = (result.get("syscalls") or {}).get("nginx/" + upstream) or {}
    cpu = median_of(result, "upgrades", "proxy", upstream, "cpu_us_per_session")
    sys_cpu = median_of(result, "upgrades", "proxy", upstream, "sys_us_per_session")
    parts = []
    if calls:
        parts.append("%.0f system calls per session, %.0f of them futex (nginx %s)" % (
            calls["per_session"], calls["futex_per_session"], _n(nginx_calls.get("per_session"))))
    if cpu is not None:
        parts.append("%.0f us CPU per session (%s us of it in the kernel)" % (cpu, _n(sys_cpu)))
    parts.append(_top_own(result, "upgrades/" + upstream))
    return "Measured: %s. What would remove it: %s." % ("; ".join(parts), REMEDY_SETUP)


def _http_bottleneck(result: Dict[str, Any], upstream: str, measure: str) -> str:
    cpu = median_of(result, measure, "proxy", upstream, "cpu_us_per_request")
    sys_cpu = median_of(result, measure, "proxy", upstream, "sys_us_per_request")
    return "Measured: %s us CPU per request at %s (%s us user, %s us kernel); %s. " \
           "What would remove it: %s." % (
               _n(cpu), "64 connections" if measure == "http_c64" else "1 connection",
               _n(None if cpu is None or sys_cpu is None else cpu - sys_cpu), _n(sys_cpu),
               _top_own(result, "http_c64/" + upstream), REMEDY_HTTP)


def _round_trip_bottleneck(result: Dict[str, Any], upstream: str) -> str:
    cpu = median_of(result, "ws_rt", "proxy", upstream, "cpu_us_per_rt")
    return "Measured: %s us of proxy CPU per round trip. What would remove it: %s." % (_n(cpu), REMEDY_ROUND_TRIP)


def _rss_bottleneck(result: Dict[str, Any], upstream: str) -> str:
    r = next((x for x in result["runs"] if x["measure"] == "held" and x["upstream"] == upstream
              and x["target"] == "proxy" and x.get("peak_open")), None)
    if not r:
        return ""
    per_thread = result.get("thread_rss_kib")
    return ("Measured: %.1f threads per open session (%d threads, %d open)%s. What would remove it: %s." % (
        r["threads_peak"] / float(r["peak_open"]), r["threads_peak"], r["peak_open"],
        "; a CPython thread blocked in recv() costs %.1f KiB of RSS by itself on this machine" % per_thread
        if per_thread else "", REMEDY_RSS))


def thread_rss_kib(n: int = 1000) -> Optional[float]:
    """RSS one thread costs while blocked in recv() (WORKER_STACK_BYTES stacks, a fresh interpreter):
    the floor under a thread-per-direction design's memory per session."""
    code = ("import socket, threading, proxy\n"
            "threading.stack_size(proxy.WORKER_STACK_BYTES)\n"
            "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])\n"
            "pairs = [socket.socketpair() for _ in range(%d)]\n"
            "before = rss()\n"
            "ts = [threading.Thread(target=a.recv, args=(1,)) for a, _ in pairs]\n"
            "[t.start() for t in ts]\n"
            "print((rss() - before) / %d.0)\n"
            "[b.send(b'x') for _, b in pairs]\n"
            "[t.join() for t in ts]\n" % (n, n))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
        return float(out.stdout.strip())
    except (subprocess.SubprocessError, ValueError):
        return None


def _n(x: Optional[float]) -> str:
    return "-" if x is None else ("%.0f" % x if abs(x) >= 10 else "%.1f" % x)


def _s(x: Optional[float]) -> str:
    return "-" if x is None else "%.3f s" % x


def write_section(path: str, section: str, subset: bool = False) -> None:
    """Replace the marked section of RESULTS.md (or append it), leaving every other section alone; a
    run of a subset of the measures has a section of its own."""
    if subset:
        section = section.replace(SECTION_START, SUBSET_START).replace(SECTION_END, SUBSET_END).replace(
            "## AuthProxy vs nginx vs direct,", "## AuthProxy vs the CPython floor, nginx and direct (a subset of the measures),")
        replace_marked_section(path, SUBSET_START, SUBSET_END, section)
    else:
        replace_marked_section(path, SECTION_START, SECTION_END, section)


def main(argv: Optional[List[str]] = None) -> int:
    global HELD_SESSIONS, HELD_STEP_S, PROXY_SWITCH_INTERVAL_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, short runs, 512 sessions only")
    parser.add_argument("--write", action="store_true", help="update the vs_nginx section of RESULTS.md")
    parser.add_argument("--results", default=DEFAULT_RESULTS)
    parser.add_argument("--json", default=None, help="also write the raw runs as JSON here")
    parser.add_argument("--measures", default=",".join(MEASURES),
                        help="comma-separated subset of %s (default: all)" % ",".join(MEASURES))
    parser.add_argument("--held-sessions", type=int, default=HELD_SESSIONS,
                        help="sessions the held measure opens at once (%d)" % HELD_SESSIONS)
    parser.add_argument("--held-step-s", type=float, default=HELD_STEP_S,
                        help="each held session's one step, seconds (%g)" % HELD_STEP_S)
    parser.add_argument("--proxy-switch-interval", type=float, default=None, metavar="S",
                        help="GIL switch interval of the proxy's process (default: Python's, as in a trainer)")
    args = parser.parse_args(argv)
    HELD_SESSIONS, HELD_STEP_S = args.held_sessions, args.held_step_s
    PROXY_SWITCH_INTERVAL_S = args.proxy_switch_interval
    measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    unknown = sorted(set(measures) - set(MEASURES))
    if unknown:
        parser.error("unknown measure(s) %s; choose from %s" % (", ".join(unknown), ",".join(MEASURES)))
    result = run(args.quick, lambda line: print(line, flush=True), measures)
    command = "python benchmarks/vs_nginx.py" + (" --quick" if args.quick else "") + (" --write" if args.write else "") + (
        " --measures " + ",".join(measures) if tuple(measures) != MEASURES else "") + "".join(
        " %s %g" % (flag, value) for flag, value, default in (
            ("--held-sessions", HELD_SESSIONS, parser.get_default("held_sessions")),
            ("--held-step-s", HELD_STEP_S, parser.get_default("held_step_s")),
            ("--proxy-switch-interval", PROXY_SWITCH_INTERVAL_S, None)) if value != default)
    if args.json:  # first: a report that fails to render must not lose the measures
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    section = render(result, command)
    print(section)
    if args.write:
        write_section(args.results, section, subset=tuple(measures) != MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
